"""The vector unit's exact fast lowerings (keras_tpu._vector_unit): a sum over a few large leading rows, the
random bits of dropout."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from keras_tpu import _rewrite as rewrite
from keras_tpu._replicated_steps import program_rule
from keras_tpu.mxu import _kernels as kernels, mxu_rule
from keras_tpu._vector_unit import ROW_BY_ROW_MAX_ROWS, ROW_BY_ROW_MIN_ELEMENTS, leading_rows_sum, vector_unit_rule


def _sums(fun, *args):
    """The shapes of the sums (reduce_sum or a positional psum) in ``fun``'s program."""
    closed = jax.make_jaxpr(fun)(*args)
    found = rewrite.walk(closed, lambda e: e.primitive.name in ("reduce_sum", "psum"))
    return [tuple(o.eqn.invars[0].aval.shape) for o in found]


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_leading_rows_sum_is_the_sum(dtype):
    x = np.random.default_rng(0).integers(-1000, 1000, (2, 4, 3, 5)).astype(dtype)
    for count in (1, 2, 3):
        got = np.asarray(leading_rows_sum(jnp.asarray(x), count))
        np.testing.assert_array_equal(got, x.sum(axis=tuple(range(count))))   # integers: exact in float32 too


def test_the_cores_mean_of_large_per_core_values_is_added_row_by_row_and_equals_the_sum():
    # A model's own train_step: each core's gradient (vmapped), then their mean (a psum over the core axis). An
    # elementwise gradient: a product's gradient is folded into one product instead (see the next test).
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((128, 96)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 4, 128, 96)), jnp.float32)

    def cores_mean_gradient(w, x):
        core_grad = lambda x: jax.grad(lambda w: jnp.sum(jnp.tanh(x * w)))(w)
        return jax.vmap(lambda x: lax.pmean(core_grad(x), "cores"), axis_name="cores")(x)[0]

    assert (8, 128, 96) in _sums(cores_mean_gradient, w, x)     # one psum over the core axis
    routed = rewrite.transform(cores_mean_gradient, vector_unit_rule())
    assert (8, 128, 96) not in _sums(routed, w, x)
    np.testing.assert_allclose(jax.jit(routed)(w, x), cores_mean_gradient(w, x), rtol=1e-5, atol=1e-6)
    # What XLA runs: no reduction over the core axis (YNNPACK's, 7-90x slower).
    pattern = r"= f32\[(128,96|96,128)\]\{1,0\} reduce\("
    hlo = jax.jit(rewrite.transform(cores_mean_gradient, program_rule("highest"))).lower(w, x).compile().as_text()
    assert not re.search(pattern, hlo), "the per-core values are reduced in one op"
    assert re.search(pattern, jax.jit(cores_mean_gradient).lower(w, x).compile().as_text())   # what it looks for


def test_the_cores_mean_of_per_core_weight_gradients_is_one_product_over_all_rows():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((128, 96)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 4, 128)), jnp.float32)

    def cores_mean_gradient(w, x):
        core_grad = lambda x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        return jax.vmap(lambda x: lax.pmean(core_grad(x), "cores"), axis_name="cores")(x)[0]

    products = lambda closed: [o.eqn for o in rewrite.walk(closed, lambda e: e.primitive.name == "dot_general")]
    before = jax.make_jaxpr(cores_mean_gradient)(w, x)
    assert [e.params["dimension_numbers"][1] for e in products(before)
            if e.outvars[0].aval.shape == (8, 96, 128)] == [((0,), (0,))]     # one product per core
    assert (8, 128, 96) in _sums(cores_mean_gradient, w, x)     # (the product, transposed)
    after = jax.make_jaxpr(rewrite.transform(cores_mean_gradient, vector_unit_rule()))(w, x)
    weight_gradient = [e for e in products(after) if e.outvars[0].aval.shape == (96, 128)]
    assert len(weight_gradient) == 1 and weight_gradient[0].params["dimension_numbers"][1] == ((), ())
    # The core axis contracts first: the operands' contracting axes lead in order, so the product is the
    # plain weight-gradient layout on [cores x rows, features] matrices (kernels' table chooses its form).
    (lc, rc), _ = weight_gradient[0].params["dimension_numbers"]
    assert (tuple(lc), tuple(rc)) == ((0, 1), (0, 1))
    lhs, rhs = (v.aval for v in weight_gradient[0].invars)
    assert kernels.dot_layout(lhs.ndim, rhs.ndim, weight_gradient[0].params["dimension_numbers"]) == "lhs_transposed"
    assert (8, 128, 96) not in _sums(rewrite.transform(cores_mean_gradient, vector_unit_rule()), w, x)
    for precision in ("highest", "default"):
        routed = jax.jit(rewrite.transform(cores_mean_gradient, program_rule(precision)))
        want = jax.jit(rewrite.transform(cores_mean_gradient, mxu_rule(precision)))   # (also folded)
        if precision == "highest":     # (at "default" the products are of bf16-rounded operands)
            np.testing.assert_allclose(routed(w, x), cores_mean_gradient(w, x), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(routed(w, x), want(w, x), rtol=1e-5, atol=1e-5)


def test_a_weight_gradient_plus_its_regularizers_is_folded_into_one_product_plus_the_cores_count_times_it():
    # A TPUStrategy.run replica function with an L2-regularized kernel: each core's gradient is its rows' product
    # plus the regularizer's gradient, the same on every core (an unbatched value broadcast along the core axis).
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((128, 96)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 4, 128)), jnp.float32)

    def cores_sum_gradient(w, x):
        core_loss = lambda w, x: jnp.sum(jnp.tanh(x @ w)) + 1e-2 * jnp.sum(w ** 2)
        return jax.vmap(lambda x: lax.psum(jax.grad(core_loss)(w, x), "cores"), axis_name="cores")(x)[0]

    per_core = lambda closed: [o.eqn for o in rewrite.walk(closed, lambda e: any(
        v.aval.shape in ((8, 128, 96), (8, 96, 128)) for v in e.outvars))]
    before = jax.make_jaxpr(cores_sum_gradient)(w, x)
    assert (8, 128, 96) in _sums(cores_sum_gradient, w, x)
    assert {e.primitive.name for e in per_core(before)} >= {"dot_general", "add_any", "broadcast_in_dim"}
    routed = rewrite.transform(cores_sum_gradient, vector_unit_rule())
    after = jax.make_jaxpr(routed)(w, x)
    assert [e.primitive.name for e in per_core(after)] == ["broadcast_in_dim"]   # only the psum's result, per core
    products = [o.eqn for o in rewrite.walk(after, lambda e: e.primitive.name == "dot_general")]
    weight_gradient = [e for e in products if e.outvars[0].aval.shape in ((96, 128), (128, 96))]
    assert len(weight_gradient) == 1 and weight_gradient[0].params["dimension_numbers"][1] == ((), ())
    np.testing.assert_allclose(jax.jit(routed)(w, x), cores_sum_gradient(w, x), rtol=1e-5, atol=1e-5)
    # The regularizer's part is counted once per core: 8 * 2e-2 * w where the rows' product is zero.
    np.testing.assert_allclose(jax.jit(routed)(w, jnp.zeros_like(x)), 8 * 2e-2 * w, rtol=1e-6)


def test_only_sums_of_a_few_large_rows_are_rewritten():
    big = ROW_BY_ROW_MIN_ELEMENTS
    cases = {   # input shape, axes summed -> rewritten?
        ((8, big), (0,)): True,
        ((2, 4, big), (0, 1)): True,
        ((ROW_BY_ROW_MAX_ROWS + 1, big), (0,)): False,      # many rows: YNNPACK's reduction is fast
        ((8, big // 2), (0,)): False,                        # small rows: as fast either way
        ((big, 8), (1,)): False,                             # not leading axes
        ((8, big), (0, 1)): False,                           # a full reduction
        ((1, big), (0,)): False,
    }
    for (shape, axes), rewritten in cases.items():
        x = jnp.zeros(shape, jnp.float32)
        routed = rewrite.transform(lambda a: jnp.sum(a, axes), vector_unit_rule())
        assert (shape in _sums(routed, x)) is not rewritten, (shape, axes)
    # A sum over a named axis (a collective across devices or pod workers) is never a sum of rows.
    collective = jax.make_jaxpr(lambda a: lax.psum(a, "devices"), axis_env=[("devices", 8)])(jnp.zeros((8, big)))
    (eqn,) = collective.jaxpr.eqns
    assert eqn.primitive.name == "psum" and vector_unit_rule()(eqn) is None


@pytest.mark.parametrize("partitionable", [True, False])
@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16, jnp.uint32])
def test_random_bits_are_jaxs_own_with_the_hash_unrolled(partitionable, dtype):
    before = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", partitionable)
    try:
        key = jax.random.key(3)
        for fun, arg in ((lambda k: jax.random.bits(k, (5, 7), dtype), key),                         # one key
                         (jax.vmap(lambda k: jax.random.bits(k, (3, 33), dtype)), jax.random.split(key, 4)),
                         (lambda s: jax.random.bernoulli(s, 0.3, (100, 17)), jnp.array([7, 9], jnp.uint32)),
                         (lambda k: jax.random.bits(k, (0, 3), dtype), key),                         # no bits
                         (jax.vmap(lambda k: jax.random.bits(k, (2,), dtype)), jax.random.split(key, 0))):
            routed = rewrite.transform(fun, vector_unit_rule())
            np.testing.assert_array_equal(jax.jit(routed)(arg), jax.jit(fun)(arg))
            # JAX's CPU lowering of the hash is a loop over its rounds; the rewritten program has none.
            assert "while" in jax.jit(fun).lower(arg).as_text()
            assert "while" not in jax.jit(routed).lower(arg).as_text()
    finally:
        jax.config.update("jax_threefry_partitionable", before)


def test_a_keras_dropout_layer_drops_the_same_units_as_in_plain_keras():
    import keras

    layer = keras.layers.Dropout(0.4, seed=11)
    x = jnp.ones((64, 48))

    def dropped(x, seed_state):
        layer.seed_generator.state.assign(seed_state)   # stateless: the generator's state as an argument
        return layer(x, training=True)

    state = jnp.array(layer.seed_generator.state.value)
    want = jax.jit(dropped)(x, state)
    got = jax.jit(rewrite.transform(dropped, vector_unit_rule()))(x, state)
    np.testing.assert_array_equal(got, want)
    assert 0.3 < float(jnp.mean(got == 0)) < 0.5


def test_random_bits_are_hashed_once_however_many_ops_read_them():
    # Dropout's mask read by the forward pass and, through max pooling's gradient, once per window element in the
    # backward pass: fused into each reader, XLA would compute the 20 rounds again in each, for every element.
    def reads_twice(seed, x, y):
        keep = jax.random.bernoulli(seed, 0.5, x.shape)
        return jnp.where(keep, x, 0.0), jnp.repeat(jnp.repeat(jnp.where(keep, 1.0, 0.0), 2, 1), 2, 2) * y

    args = (jnp.array([1, 2], jnp.uint32), jnp.ones((4, 8, 8, 16)), jnp.ones((4, 16, 16, 16)))
    hlo = jax.jit(rewrite.transform(reads_twice, vector_unit_rule())).lower(*args).compile().as_text()
    assert hlo.count("constant(466688986)") == 1     # Threefry's key parity, 0x1BD11BDA: one hash in the program
