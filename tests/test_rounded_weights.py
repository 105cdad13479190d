"""Evaluation and prediction read bfloat16 copies of the weights, made once per state."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from jax import lax

from keras_tpu import _rounded_weights, mxu
from keras_tpu.mxu._numerics import round_to_bfloat16
from tests.tpu_helpers import (WithoutWeightCopies, classification_data, on_tpu, record_weight_copies,
                                small_classifier)


def _layer_and_head(state, x):
    (w, b, head), = state
    hidden = jnp.tanh(x @ w + b)
    return jnp.dot(hidden, head, precision=lax.Precision.HIGHEST), hidden


def test_default_precision_products_read_the_copies_and_everything_else_the_float32_weights():
    rng = np.random.default_rng(0)
    w, b, head = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((5, 4), (4,), (4, 3)))
    x = jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)
    state = ([w, b, head],)
    rounded = _rounded_weights.round_weights(state[0])
    assert [(a.shape, a.dtype) for a in rounded] == [((5, 4), jnp.bfloat16), ((4, 3), jnp.bfloat16)]

    reading = _rounded_weights.reading_rounded_weights(_layer_and_head)
    assert reading.read_weights(state, x) == [0]  # the head is multiplied at HIGHEST precision: no copy
    rounded = _rounded_weights.round_weights(state[0], [0])
    jaxpr = jax.make_jaxpr(reading)(state, rounded, x).jaxpr
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    # The default-precision product reads the bf16 copy of w; the HIGHEST one reads the float32 head;
    # the bias is float32 (a vector is never rounded).
    assert [str(v.aval.dtype) for v in dots[0].invars] == ["float32", "bfloat16"]
    assert [str(v.aval.dtype) for v in dots[1].invars] == ["float32", "float32"]
    assert all(str(v.aval.dtype) == "float32" for e in jaxpr.eqns if e.primitive.name == "add" for v in e.invars)

    # On the MXU the numbers are the ones of the float32 program: its products round to bf16 anyway.
    out, hidden = jax.jit(mxu.route(reading))(state, rounded, x)
    expected_out, expected_hidden = jax.jit(mxu.route(_layer_and_head))(state, x)
    np.testing.assert_allclose(hidden, expected_hidden, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out, expected_out, rtol=1e-6, atol=1e-6)
    # ... and not the ones of a float32 product: the rounding is really there.
    assert not np.allclose(hidden, jnp.tanh(jnp.dot(x, w, precision="highest") + b), rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        hidden, jnp.tanh(jnp.dot(round_to_bfloat16(x), round_to_bfloat16(w), precision="highest") + b),
        rtol=1e-6, atol=1e-6)


def test_a_high_precision_program_multiplies_the_float32_weights():
    w = jnp.full((3, 2), 1 / 3, jnp.float32)
    reading = _rounded_weights.reading_rounded_weights(lambda state, x: x @ state[0][0], precision="highest")
    assert reading.read_weights(([w],), jnp.ones((1, 3))) == []
    jaxpr = jax.make_jaxpr(reading)(([w],), [], jnp.ones((1, 3))).jaxpr
    (dot,) = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [str(v.aval.dtype) for v in dot.invars] == ["float32", "float32"]


def _count_roundings(monkeypatch):
    calls = []
    original = _rounded_weights.round_weights

    def counting(trainable, positions=None, dtypes=None):
        calls.append(len(jax.tree.leaves(trainable)))
        return original(trainable, positions, dtypes)

    monkeypatch.setattr(_rounded_weights, "round_weights", counting)
    return calls


def test_weights_are_rounded_once_per_fit_and_evaluation_and_the_model_weights_stay_float32(monkeypatch):
    calls = _count_roundings(monkeypatch)
    x, y = classification_data(200)
    model = small_classifier()
    tpu = on_tpu(model, "default")
    tpu.fit(x, y, batch_size=32, epochs=1, verbose=0)
    weights = [np.array(w) for w in tpu.get_weights()]
    # Training changes the weights every step: its first step reads copies made here, each later step those the
    # step before returned (rounded in the optimizer update), so the copies were made once for the whole fit.
    assert calls == [4]
    del calls[:]

    first = tpu.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)  # 7 steps
    again = tpu.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    predicted = tpu.predict(x, batch_size=32, verbose=0)
    # Once for the first evaluation's state; the second gets the state back as the first left it; predict
    # is its own program.
    assert calls == [4, 4]
    assert first == again
    for before, after in zip(weights, tpu.get_weights()):
        assert after.dtype == np.float32
        np.testing.assert_array_equal(after, before)

    # New weights (another fit, which rounds the weights evaluate() handed back once) are rounded again, and the
    # results follow them.
    tpu.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert len(calls) == 3
    later = tpu.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    assert len(calls) == 4 and later["loss"] != first["loss"]
    assert not np.allclose(tpu.predict(x, batch_size=32, verbose=0), predicted)
    assert len(calls) == 5


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_evaluation_matches_the_same_model_without_copies(monkeypatch, precision):
    x, y = classification_data(100)
    model = small_classifier()
    model.fit(x, y, batch_size=20, epochs=2, verbose=0)

    def run():
        tpu = on_tpu(keras.models.clone_model(model), precision)
        tpu.set_weights(model.get_weights())
        tpu.compile(loss="sparse_categorical_crossentropy", metrics=["sparse_categorical_accuracy"])
        return tpu.evaluate(x, y, batch_size=40, verbose=0), tpu.predict(x, batch_size=40, verbose=0)

    with_copies = run()
    # As before: the float32 weights, rounded by each product.
    monkeypatch.setattr(_rounded_weights, "reading_rounded_weights", WithoutWeightCopies)
    without = run()
    np.testing.assert_allclose(with_copies[0], without[0], rtol=1e-6)
    np.testing.assert_allclose(with_copies[1], without[1], rtol=1e-5, atol=1e-6)


def test_a_dot_reading_a_rounded_weight_runs_native_where_that_was_measured_faster(monkeypatch):
    from keras_tpu.mxu import _kernels as kernels

    monkeypatch.setattr(kernels, "host_class", lambda: "bf16")
    monkeypatch.setattr(kernels, "native_bf16_dots_here", lambda: True)   # a host whose native products are faster
    choose = lambda gemm, rounded: kernels.choose_form("dot", "forward", gemm, bf16_operand=rounded)
    # At batch 32 a float32 forward dot stays on round_f32; with the weight already in bf16 it goes native.
    assert [choose((1, 32, 784, 512), False), choose((1, 32, 784, 512), True)] == ["round_f32", "bf16"]
    # A 10-class head does not gain, nor does a weight gradient's layout.
    assert choose((1, 128, 1600, 10), True) == "round_f32"
    assert kernels.choose_form("dot", "lhs_transposed", (1, 32, 784, 512), bf16_operand=True) != "bf16"
    # A training step's input gradient multiplying the copy goes native at any shape (a head's too); on float32
    # weights it keeps the table's form at few rows.
    input_grad = lambda gemm, rounded: kernels.choose_form("dot", "rhs_transposed", gemm, bf16_operand=rounded)
    assert [input_grad((1, 32, 512, 784), False), input_grad((1, 32, 512, 784), True)] == ["round_f32", "bf16"]
    assert input_grad((1, 64, 10, 256), True) == "bf16"
    monkeypatch.setattr(kernels, "host_class", lambda: "no_bf16")
    assert choose((1, 32, 784, 512), True) == "round_f32"
    assert input_grad((1, 32, 512, 784), True) == "round_f32"
    # A bf16 host whose native products measured slower keeps round_f32 for copies too.
    monkeypatch.setattr(kernels, "host_class", lambda: "bf16")
    monkeypatch.setattr(kernels, "native_bf16_dots_here", lambda: False)
    assert choose((1, 32, 784, 512), True) == "round_f32"
    assert input_grad((1, 64, 10, 256), True) == "round_f32"


def test_only_weights_a_product_reads_get_a_copy():
    """An embedding table that is only looked up, and a convolution's kernel, get no bfloat16 copy."""
    rng = np.random.default_rng(0)
    table, kernel, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((50, 4), (3, 4, 4), (4, 2)))

    def lookup_conv_dense(state, ids):
        table, kernel, w = state[0]
        x = jnp.take(table, ids, axis=0)                      # (rows, 6, 4)
        x = lax.conv_general_dilated(x, kernel, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
        return jnp.mean(x, axis=1) @ w

    reading = _rounded_weights.reading_rounded_weights(lookup_conv_dense)
    ids = jnp.asarray(rng.integers(0, 50, (3, 6)), jnp.int32)
    state = ([table, kernel, w],)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (state, ids))
    assert reading.read_weights(*abstract) == [2]
    rounded = _rounded_weights.round_weights(state[0], [2])
    assert [(a.shape, a.dtype) for a in rounded] == [((4, 2), jnp.bfloat16)]
    got = jax.jit(mxu.route(reading))(state, rounded, ids)
    assert len(reading._traces) == 1  # the compile reused read_weights' abstract trace
    np.testing.assert_allclose(got, jax.jit(mxu.route(lookup_conv_dense))(state, ids), rtol=1e-6, atol=1e-6)


def test_evaluating_an_embedding_model_copies_its_dense_kernels_not_its_table(monkeypatch):
    copied = record_weight_copies(monkeypatch)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 1000, (64, 8)).astype(np.int32), rng.integers(0, 2, (64,))
    inputs = keras.Input((8,), dtype="int32")
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(1000, 8)(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(hidden))
    model.compile("adam", "sparse_categorical_crossentropy")
    tpu = on_tpu(model, "default")
    loss = tpu.evaluate(x, y, batch_size=32, verbose=0)
    assert copied == [[(8, 16), (16, 2)]]  # the two kernels the products read; no (1000, 8) table
    np.testing.assert_allclose(loss, model.evaluate(x, y, batch_size=32, verbose=0), rtol=1e-2)


def _dense(state, x):
    return jnp.tanh(x @ state[0][0])


@pytest.mark.parametrize("rows, native, max_bytes, expected", [
    (6, False, None, jnp.float32),          # few rows, float32 products: a float32 copy, never converted per call
    (300, False, None, jnp.float32),        # many rows: still no conversion per call
    (6, True, None, jnp.bfloat16),          # native bf16 products take the bfloat16 copy as it is
    (6, False, 0, jnp.bfloat16),            # float32 copies past FLOAT32_COPIES_MAX_BYTES: the smaller ones
    (300, False, "many", jnp.bfloat16),     # many rows past FLOAT32_COPIES_AT_MANY_ROWS_MAX_BYTES: the smaller ones
    (6, False, "many", jnp.float32),        # ... which bounds only the copies that many rows read
])
def test_a_copy_is_held_in_the_dtype_its_products_take(monkeypatch, rows, native, max_bytes, expected):
    from keras_tpu.mxu import _kernels as kernels

    if native:
        monkeypatch.setattr(kernels, "host_class", lambda: "bf16")
        monkeypatch.setattr(kernels, "native_bf16_dots_here", lambda: True)
    elif kernels.host_class() == "bf16" and kernels.native_bf16_dots_here():
        monkeypatch.setattr(kernels, "native_bf16_dots_here", lambda: False)
    if max_bytes == "many":
        monkeypatch.setattr(_rounded_weights, "FLOAT32_COPIES_AT_MANY_ROWS_MAX_BYTES", 784 * 512 * 4 - 1)
    elif max_bytes is not None:
        monkeypatch.setattr(_rounded_weights, "FLOAT32_COPIES_MAX_BYTES", max_bytes)
    w = jax.ShapeDtypeStruct((784, 512), jnp.float32)
    reading = _rounded_weights.reading_rounded_weights(_dense)
    assert reading.copies_to_make(([w],), jax.ShapeDtypeStruct((rows, 784), jnp.float32)) == (True, [0], [expected])


def test_a_float32_copy_is_multiplied_as_it_is_and_gives_the_float32_programs_numbers():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)
    reading = _rounded_weights.reading_rounded_weights(_dense)
    _, positions, dtypes = reading.copies_to_make(([w],), x)
    assert dtypes == [jnp.float32]
    rounded = _rounded_weights.round_weights([w], positions, dtypes)
    assert rounded[0].dtype == jnp.float32
    np.testing.assert_array_equal(rounded[0], round_to_bfloat16(w))
    program = jax.jit(mxu.route(reading))
    np.testing.assert_allclose(program(([w],), rounded, x), jax.jit(mxu.route(_dense))(([w],), x), rtol=1e-6)
    # The product takes the copy's values as they are: handed the unrounded weight in its place, it multiplies
    # that (so no pass rounds the copy again per call), and rounds the other operand as ever.
    np.testing.assert_allclose(program(([w],), [w], x),
                               jnp.tanh(jnp.dot(round_to_bfloat16(x), w, precision="highest")), rtol=1e-6)
    assert not np.allclose(program(([w],), [w], x), program(([w],), rounded, x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("float32_copies", [True, False])
def test_training_on_copies_returned_by_each_step_matches_rounding_in_every_product(monkeypatch, float32_copies):
    """Each training step reads the copies the step before returned: the weights after several fits, with new
    weights set in between (stale copies would show), are those of rounding the weights in every product; with
    the copies in float32 (this host's float32 products, few rows) or in bfloat16."""
    if not float32_copies:
        monkeypatch.setattr(_rounded_weights, "FLOAT32_COPIES_MAX_BYTES", 0)
    made = []
    original = _rounded_weights.round_weights
    monkeypatch.setattr(_rounded_weights, "round_weights", lambda *args: made.append(original(*args)) or made[-1])
    x, y = classification_data(200)

    def train():
        model = small_classifier()
        tpu = on_tpu(model, "default")
        tpu.fit(x, y, batch_size=32, epochs=2, verbose=0)
        tpu.evaluate(x, y, batch_size=32, verbose=0)
        tpu.set_weights([w * 0.5 for w in tpu.get_weights()])   # not the weights the last step returned
        tpu.fit(x, y, batch_size=40, epochs=1, verbose=0)
        return tpu.get_weights()

    with_copies = train()
    assert made and {a.dtype for copies in made for a in copies} == {
        jnp.dtype(jnp.float32 if float32_copies else jnp.bfloat16)}

    monkeypatch.setattr(_rounded_weights, "reading_rounded_weights", WithoutWeightCopies)
    without = train()
    for a, b in zip(with_copies, without):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("float32_products", [True, False])
def test_training_with_many_rows_per_product_keeps_only_float32_copies(monkeypatch, float32_products):
    """From TRAINING_COPIES_BELOW_ROWS rows the products outweigh a pass over the weights: no bfloat16 copies,
    each product rounds its weight; float32 copies (a host whose products multiply float32) are still read, as
    they spare each product its pass. With fewer rows, copies either way."""
    from keras_tpu._rounded_weights import TRAINING_COPIES_BELOW_ROWS
    from keras_tpu.mxu import _kernels as kernels

    # Every product multiplies float32 operands on this host, or bfloat16 ones (the copies' dtype only).
    form = kernels.ROUND_F32 if float32_products else kernels.BF16
    monkeypatch.setattr(_rounded_weights, "dot_form", lambda *args, **kwargs: form)
    copied = record_weight_copies(monkeypatch)
    x, y = classification_data(2 * TRAINING_COPIES_BELOW_ROWS)
    tpu = on_tpu(small_classifier(), "default")
    tpu.fit(x, y, batch_size=TRAINING_COPIES_BELOW_ROWS, epochs=1, verbose=0)
    assert copied == ([[(6, 16), (16, 3)]] if float32_products else [[]])
    # A large model's float32 copies at many rows would cost more memory than they save time: none.
    monkeypatch.setattr(_rounded_weights, "FLOAT32_COPIES_AT_MANY_ROWS_MAX_BYTES", 6 * 16 * 4)
    tpu = on_tpu(small_classifier(), "default")
    tpu.fit(x, y, batch_size=TRAINING_COPIES_BELOW_ROWS, epochs=1, verbose=0)
    assert copied[-1] == []
    tpu = on_tpu(small_classifier(), "default")
    tpu.fit(x, y, batch_size=TRAINING_COPIES_BELOW_ROWS // 8, epochs=1, verbose=0)  # 32 rows: copies of both kernels
    assert copied[-1] == [(6, 16), (16, 3)]


def test_weights_rounded_on_the_host_equal_those_rounded_by_xla(monkeypatch):
    """Small sets of weights are rounded by NumPy (no program to compile): the same bits as XLA's rounding,
    ties to even, infinities, NaN and float32 subnormals included."""
    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32),
                           np.array([0x3F808000, 0x3F818000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001,
                                     0x807FFFFF, 0x7F7FFFFF], np.uint32)])
    weights = [jnp.asarray(bits[:4000].view(np.float32).reshape(40, 100)), jnp.asarray(bits[4000:].view(np.float32)
                                                                                        .reshape(2, 4))]
    on_host = _rounded_weights.round_weights(weights, [0, 1])
    monkeypatch.setattr(_rounded_weights, "HOST_ROUNDING_MAX_ELEMENTS", 0)
    by_xla = _rounded_weights.round_weights(weights, [0, 1])
    for a, b in zip(on_host, by_xla):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))  # NaN where NaN
        number = ~np.isnan(np.asarray(b, np.float32))
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16)[number], np.asarray(b).view(np.uint16)[number])
