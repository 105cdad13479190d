"""keras.io's U-Net-like segmentation model (examples/vision/oxford_pets_image_segmentation.py), scaled down: trained
on the TPU it differs from the CPU model only by BatchNormalization's per-core statistics.

Each core normalises its own rows with its own batch statistics, as a TPU does, so the TPU's step is not the CPU's
step on one big batch. It is the CPU's step on the mean of the cores' losses, each core's rows through the model in
training mode, with the moving statistics averaged over the cores: that reference must match the TPU to float32
roundoff, whatever runs the convolutions (keras-tpu's own kernels or XLA's), the transposed, separable (depthwise
and pointwise) and strided ones included. Roundoff then grows about 1.5x per step in such small-batch models (in a
larger version, the CPU reference itself started from weights perturbed by 1e-7 differed by 1e-3 after 20 steps, as
the TPU did), so two steps are compared. The conv biases that feed a BatchNormalization have a gradient of zero (the
normalization subtracts them again): their updates are roundoff (~1e-9) on every platform, and a per-weight relative
difference of those is meaningless (1.5-3.6 between any two runs).
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from tests.tpu_helpers import on_tpu

CORES, BATCH, LR = 8, 32, 0.5


def small_unet(seed=0):
    """The keras.io model's layer kinds at 16x16x3 and 3 classes: a strided Conv2D stem, one Xception-style block
    (SeparableConv2D + BatchNormalization twice, MaxPooling2D, a strided 1x1 Conv2D residual), one decoder block
    (Conv2DTranspose + BatchNormalization twice, UpSampling2D, an upsampled 1x1 Conv2D residual), a softmax head."""
    layers = keras.layers
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16, 16, 3))
    x = layers.Activation("relu")(layers.BatchNormalization()(layers.Conv2D(8, 3, strides=2, padding="same")(inputs)))
    previous = x
    x = layers.Activation("relu")(x)
    x = layers.SeparableConv2D(16, 3, padding="same")(x)
    x = layers.Activation("relu")(layers.BatchNormalization()(x))
    x = layers.BatchNormalization()(layers.SeparableConv2D(16, 3, padding="same")(x))
    x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
    x = previous = layers.add([x, layers.Conv2D(16, 1, strides=2, padding="same")(previous)])
    for filters in (8, 4):
        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.Activation("relu")(layers.BatchNormalization()(x))
        x = layers.BatchNormalization()(layers.Conv2DTranspose(filters, 3, padding="same")(x))
        x = layers.UpSampling2D(2)(x)
        residual = layers.Conv2D(filters, 1, padding="same")(layers.UpSampling2D(2)(previous))
        x = previous = layers.add([x, residual])
    model = keras.Model(inputs, layers.Conv2D(3, 3, activation="softmax", padding="same")(x))
    model.compile(keras.optimizers.SGD(LR), "sparse_categorical_crossentropy")
    return model


def per_core_sgd(model):
    """A TPU's SGD step, on the CPU: the gradient of the mean of the cores' losses, each core's rows normalised with
    their own statistics, and the moving statistics averaged over the cores. Returns ``step(x, y)``, which updates
    ``model``."""

    def core_loss(trainable, non_trainable, x, y):
        out, new_non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.mean(keras.losses.sparse_categorical_crossentropy(y, out)), new_non_trainable

    core_grad = jax.jit(jax.grad(core_loss, has_aux=True))

    def step(x, y):
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        grads, states = zip(*(core_grad(trainable, non_trainable, xs, ys)
                              for xs, ys in zip(np.split(x, CORES), np.split(y, CORES))))
        for variable, value, *per_core in zip(model.trainable_variables, trainable, *grads):
            variable.assign(value - LR * sum(per_core) / CORES)
        for variable, *per_core in zip(model.non_trainable_variables, *states):
            variable.assign(sum(per_core) / CORES)

    return step


def relative_difference(first, second, start):
    """|first - second| / |second - start| over all weights: the difference of two updates, relative to the update."""
    flat = lambda weights: np.concatenate([np.ravel(w - s) for w, s in zip(weights, start)])
    return np.linalg.norm(flat(first) - flat(second)) / np.linalg.norm(flat(second))


@pytest.mark.slow
def test_unet_trains_on_the_tpu_as_its_cores_batch_normalization_makes_it_on_the_cpu():
    rng = np.random.default_rng(0)
    steps = 2
    x = rng.standard_normal((steps * BATCH, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 3, (steps * BATCH, 16, 16, 1))
    cpu = small_unet()
    start = cpu.get_weights()
    reference, tpu_model = small_unet(), small_unet()
    reference.set_weights(start)
    tpu_model.set_weights(start)
    tpu = on_tpu(tpu_model, "highest")
    tpu.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    on_the_tpu = tpu.get_weights()
    step = per_core_sgd(reference)
    for rows in range(0, steps * BATCH, BATCH):
        step(x[rows:rows + BATCH], y[rows:rows + BATCH])
    per_core = reference.get_weights()
    cpu.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    one_batch = cpu.get_weights()

    # The TPU's updates (weights and moving statistics) are the per-core reference's, to float32 roundoff (5-6e-7 of
    # the update measured, 3e-7 at most in any weight, with keras-tpu's convolution kernels or with
    # KERAS_TPU_DIRECT_CONV=0); one big batch's statistics change them by 16%.
    assert relative_difference(on_the_tpu, per_core, start) < 5e-6
    for got, want in zip(on_the_tpu, per_core):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert relative_difference(one_batch, per_core, start) > 1e-2
