"""Part 5: every Keras 3 layer that multiplies runs on the MXU and matches plain Keras."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from jax import lax
from keras import layers

from keras_tpu import mxu, _rewrite as rewrite
from keras_tpu.mxu import mxu_conv_p, mxu_dot_general_p


def _model(input_shape, *stack, dtype="float32"):
    inputs = keras.Input(input_shape, dtype=dtype)
    x = inputs
    for layer in stack:
        x = layer(x)
    return keras.Model(inputs, x)


def _mha():
    inputs = keras.Input((6, 8))
    attention = layers.MultiHeadAttention(num_heads=2, key_dim=4)
    return keras.Model(inputs, layers.Dense(3)(attention(inputs, inputs)))


CASES = {
    "Dense": lambda: _model((16,), layers.Dense(8, activation="relu"), layers.Dense(4)),
    "EinsumDense": lambda: _model((5, 8), layers.EinsumDense("abc,cd->abd", output_shape=(5, 6), bias_axes="d"),
                                  layers.EinsumDense("abd,de->ae", output_shape=(3,))),
    "Conv1D": lambda: _model((10, 3), layers.Conv1D(4, 3, padding="same"),
                             layers.Conv1D(5, 3, strides=2, dilation_rate=1), layers.Conv1D(2, 2, dilation_rate=2)),
    "Conv2D": lambda: _model((9, 9, 4), layers.Conv2D(4, 3, strides=2, padding="same"),
                             layers.Conv2D(6, 2, groups=2), layers.Conv2D(3, 2, dilation_rate=2, padding="same")),
    "Conv3D": lambda: _model((5, 6, 5, 2), layers.Conv3D(3, 3, padding="same"), layers.Conv3D(2, 2, strides=2)),
    "DepthwiseConv2D": lambda: _model((8, 8, 4), layers.DepthwiseConv2D(3, depth_multiplier=2),
                                      layers.DepthwiseConv2D(2, strides=2, padding="same")),
    "SeparableConv2D": lambda: _model((8, 8, 4), layers.SeparableConv2D(6, 3, padding="same"),
                                      layers.SeparableConv2D(2, 3, strides=2)),
    "Conv2DTranspose": lambda: _model((5, 5, 3), layers.Conv2DTranspose(4, 3, strides=2),
                                      layers.Conv2DTranspose(2, 2, padding="same")),
    "Embedding": lambda: _model((6,), layers.Embedding(20, 8), layers.Flatten(), layers.Dense(3), dtype="int32"),
    "LSTM": lambda: _model((5, 3), layers.LSTM(8, return_sequences=True), layers.LSTM(4)),
    "GRU": lambda: _model((5, 3), layers.GRU(8)),
    "SimpleRNN": lambda: _model((5, 3), layers.SimpleRNN(8)),
    "MultiHeadAttention": _mha,
    "BatchNormalization": lambda: _model((6, 6, 3), layers.Conv2D(4, 3), layers.BatchNormalization(),
                                         layers.Flatten(), layers.Dense(2)),
    "LayerNormalization": lambda: _model((7, 8), layers.Dense(8), layers.LayerNormalization(), layers.Dense(2)),
}


def _inputs(model, rng):
    shape = (4,) + tuple(model.inputs[0].shape[1:])
    if model.inputs[0].dtype.startswith("int"):
        return jnp.asarray(rng.integers(0, 20, shape), jnp.int32)
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _loss_and_grads(model, x, weights):
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    float_input = jnp.issubdtype(x.dtype, jnp.floating)

    def loss(trainable, x):
        y, _ = model.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.sum(y * weights), y

    argnums = (0, 1) if float_input else 0
    (value, y), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(trainable, x)
    return y, jax.tree.leaves(grads)


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_runs_on_the_mxu_and_matches_plain_keras(name, rng):
    keras.utils.set_random_seed(0)
    model = CASES[name]()
    x = _inputs(model, rng)
    out_shape = jax.eval_shape(lambda x: model(x), x).shape
    weights = jnp.asarray(rng.standard_normal(out_shape), jnp.float32)
    plain = _loss_and_grads(model, x, weights)
    routed_fn = jax.jit(mxu.route(lambda x: _loss_and_grads(model, x, weights)))
    default = routed_fn(x)
    highest = jax.jit(mxu.route(lambda x: _loss_and_grads(model, x, weights), precision="highest"))(x)

    closed = jax.make_jaxpr(mxu.route(lambda x: _loss_and_grads(model, x, weights)))(x)
    plain_ops = rewrite.walk(closed, lambda e: e.primitive in (lax.dot_general_p, lax.conv_general_dilated_p)
                             and all(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in e.invars))
    mxu_ops = rewrite.walk(closed, lambda e: e.primitive in (mxu_dot_general_p, mxu_conv_p))
    assert not plain_ops, [str(o.eqn) for o in plain_ops]
    assert len(mxu_ops) >= 3  # forward, and backward for inputs and weights

    largest_rounding_effect = 0.0
    # Some gradients are exactly zero in theory (a bias before BatchNormalization, the key bias
    # of attention): judge every value against at least 1% of the largest one, not its own noise.
    overall = max(float(jnp.abs(ref).max()) for ref in jax.tree.leaves(plain))
    for ref, low, high in zip(jax.tree.leaves(plain), jax.tree.leaves(default), jax.tree.leaves(highest)):
        scale = max(float(jnp.abs(ref).max()), 1e-2 * overall)
        np.testing.assert_allclose(high, ref, rtol=2e-4, atol=2e-4 * scale)
        error = float(jnp.abs(low - ref).max()) / scale
        assert error < 4e-2, f"{name}: bf16 result off by {error:.3g} of its scale"
        largest_rounding_effect = max(largest_rounding_effect, error)
    assert largest_rounding_effect > 1e-4  # the default really multiplies in bfloat16
