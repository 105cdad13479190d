"""Sequence models: losses per row and time step train, evaluate, predict and profile exactly on the TPU.

The padding mask of a partial batch follows the loss's shape: a padding row is
masked at every time step, and user sample weights may be per row or per row
and time step (Keras' "temporal" sample weights).
"""

import keras
import numpy as np
import pytest

import keras_tpu
from tests.tpu_helpers import assert_weights_close, on_tpu

VOCAB, STEPS = 12, 9


def char_lstm(seed=0):
    """The Shakespeare notebook's model, small: Embedding -> 2 x LSTM(return_sequences) -> TimeDistributed."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((STEPS,), dtype="int32", name="seed")
    h = keras.layers.Embedding(VOCAB, 8)(inputs)
    h = keras.layers.LSTM(16, return_sequences=True)(h)
    h = keras.layers.LSTM(16, return_sequences=True)(h)
    outputs = keras.layers.TimeDistributed(keras.layers.Dense(VOCAB, activation="softmax"))(h)
    model = keras.Model(inputs, outputs, name="char_lstm")
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model


def text_windows(rows, seed=0):
    """Windows of a repetitive character stream; the target is the next character at every step."""
    rng = np.random.default_rng(seed)
    stream = np.tile(np.arange(VOCAB), 4 * rows)
    starts = rng.integers(0, VOCAB, rows)
    x = np.stack([stream[s:s + STEPS] for s in starts]).astype("int32")
    y = np.stack([stream[s + 1:s + STEPS + 1] for s in starts])[..., None]  # (rows, steps, 1), as the notebook
    return x, y


def batches(x, y, batch_size, sample_weight=None):
    while True:  # an endless generator of batches, as the notebook's training generator
        for start in range(0, len(x), batch_size):
            part = slice(start, start + batch_size)
            yield (x[part], y[part]) if sample_weight is None else (x[part], y[part], sample_weight[part])


@pytest.mark.slow
def test_char_lstm_trains_from_a_generator_like_the_cpu_model():
    x, y = text_windows(100)  # batches of 24: 4 of them, the last one partial (4 rows)
    tpu, reference = on_tpu(char_lstm(), "highest"), char_lstm()
    got = tpu.fit(batches(x, y, 24), steps_per_epoch=5, epochs=2, verbose=0).history
    want = reference.fit(batches(x, y, 24), steps_per_epoch=5, epochs=2, verbose=0).history
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["sparse_categorical_accuracy"], want["sparse_categorical_accuracy"], rtol=1e-5)
    assert got["loss"][-1] < got["loss"][0]
    assert_weights_close(tpu.get_weights(), reference.get_weights(), atol=2e-5)
    # Evaluation and prediction with a partial last batch (100 = 3 x 30 + 10).
    assert tpu.evaluate(x, y, batch_size=30, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=30, verbose=0), rel=1e-5)
    predicted = tpu.predict(x, batch_size=30, verbose=0)
    assert predicted.shape == (100, STEPS, VOCAB)
    np.testing.assert_allclose(predicted, reference.predict(x, batch_size=30, verbose=0), atol=1e-5)


@pytest.mark.parametrize("weights", ["per_row", "per_step"])
def test_a_tagger_with_per_row_or_per_step_sample_weights(weights):
    """A per-token tagger (Keras' sample_weight_mode="temporal" style weights are 2-D)."""
    def tagger():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((STEPS,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 8)(inputs)
        h = keras.layers.Bidirectional(keras.layers.GRU(8, return_sequences=True))(h)
        model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
        model.compile("adam", "sparse_categorical_crossentropy", weighted_metrics=["sparse_categorical_accuracy"])
        return model

    x, _ = text_windows(60, seed=2)
    y = (x % 3)[..., None]
    rng = np.random.default_rng(3)
    # Per row: (rows, 1), which Keras broadcasts over the time steps (a (rows,) weight it refuses, on the CPU too).
    sample_weight = (rng.random((60, 1)) if weights == "per_row" else rng.random((60, STEPS)) > 0.3).astype("float32")
    tpu, reference = on_tpu(tagger(), "highest"), tagger()
    got = tpu.fit(x, y, sample_weight=sample_weight, batch_size=25, epochs=2, shuffle=False, verbose=0).history
    want = reference.fit(x, y, sample_weight=sample_weight, batch_size=25, epochs=2, shuffle=False,
                         verbose=0).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
    assert tpu.evaluate(x, y, sample_weight=sample_weight, batch_size=25, verbose=0) == pytest.approx(
        reference.evaluate(x, y, sample_weight=sample_weight, batch_size=25, verbose=0), rel=1e-5)


def test_mean_squared_error_per_time_step_under_tpu_strategy():
    def regressor():
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input((STEPS, 2)), keras.layers.SimpleRNN(6, return_sequences=True),
                                  keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
        return model

    rng = np.random.default_rng(5)
    x = rng.standard_normal((44, STEPS, 2)).astype("float32")
    y = np.cumsum(x, axis=1) * 0.1
    with keras_tpu.TPUStrategy(precision="highest").scope():
        model = regressor()
    reference = regressor()
    got = model.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0).history
    want = reference.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5)


def test_profile_of_a_model_with_a_loss_per_time_step():
    report = keras_tpu.profile(char_lstm(), batch_size=64)
    layers = {row["layer"] for row in report.rows("train")}
    assert any(name.startswith("lstm") for name in layers) and any("time_distributed" in n for n in layers)
    assert report.step_time("train") > report.step_time("inference") > 0


def padded_token_rows(rows, length=10, real=7, vocab=40, seed=0):
    """Token rows padded with id 0 after ``real`` tokens, as a text pipeline pads them; binary labels."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, vocab, (rows, length)).astype("int32")
    x[:, real:] = 0
    return x, rng.integers(0, 2, (rows, 1)).astype("float32")


@pytest.mark.parametrize("masking", ["mask_zero", "Masking"])
def test_a_masked_average_trains_exactly_on_partial_batches(masking):
    """keras.io's text classifiers average masked tokens (GlobalAveragePooling1D after Embedding(mask_zero=True),
    or after Masking). A padding row of zero tokens is entirely masked and its average is 0/0: padding rows must
    not be such rows, or the loss and the weights turn into NaN."""
    x, y = padded_token_rows(100)
    if masking == "Masking":  # feature vectors, zero at the padded steps
        x = np.where(x[..., None] > 0, np.random.default_rng(1).standard_normal((100, 10, 4)), 0).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        if masking == "mask_zero":
            inputs = keras.Input((10,), dtype="int32")
            h = keras.layers.Embedding(40, 8, mask_zero=True)(inputs)
        else:
            inputs = keras.Input((10, 4))
            h = keras.layers.Masking(0.0)(inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(h))
        model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
        return model

    cpu, tpu = build(), on_tpu(build())
    # 100 rows in batches of 32: the last batch of 4 rows is padded to 32.
    np.testing.assert_allclose(tpu.evaluate(x, y, batch_size=32, verbose=0),
                               cpu.evaluate(x, y, batch_size=32, verbose=0), rtol=1e-6)
    got = tpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"]
    want = cpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert_weights_close(tpu.get_weights(), cpu.get_weights(), atol=1e-6)


def forcing_cores_merged(monkeypatch, merged):
    """Training programs run a device's rows as one batch (``merged``) or core by core, whatever the model."""
    from keras_tpu._replicated_steps import ReplicatedSteps

    decide = ReplicatedSteps._cores_merged

    def forced(self, mode, *args):
        if mode != "train" or self.layout.cores_per_device == 1:
            return decide(self, mode, *args)
        return merged

    monkeypatch.setattr(ReplicatedSteps, "_cores_merged", forced)


@pytest.mark.parametrize("merged", [True, False])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
def test_a_loss_masked_per_token_on_partial_batches(monkeypatch, merged, reduction):
    """A per-token loss under Embedding(mask_zero=True): Keras divides by the valid tokens of the rows it is
    given. Rows of different lengths put different counts on each core, and the padding rows (copies of the
    first row, see keras_tpu._batching) add theirs: the loss and the gradient must still be those of the real
    rows, for batches smaller than the program's global batch too, with and without sample weights."""
    forcing_cores_merged(monkeypatch, merged)
    rng = np.random.default_rng(0)
    x, _ = padded_token_rows(64, length=12, real=12, vocab=50)
    for row, length in enumerate(rng.integers(1, 13, 64)):
        x[row, length:] = 0
    y = rng.integers(0, 11, (64, 12)).astype("int32")
    weights = rng.uniform(0.2, 2.0, (64, 12)).astype("float32")  # per token (Keras' masked losses need that rank)

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((12,), dtype="int32")
        h = keras.layers.Embedding(50, 16, mask_zero=True)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(11, activation="softmax")(h))
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(reduction=reduction))
        return model

    cpu, tpu = build(), on_tpu(build())
    for batch_size in (64, 32, 24, 8):  # the program stays at the first call's global batch of 64
        np.testing.assert_allclose(tpu.evaluate(x, y, batch_size=batch_size, verbose=0),
                                   cpu.evaluate(x, y, batch_size=batch_size, verbose=0), rtol=1e-6)
        np.testing.assert_allclose(tpu.evaluate(x, y, sample_weight=weights, batch_size=batch_size, verbose=0),
                                   cpu.evaluate(x, y, sample_weight=weights, batch_size=batch_size, verbose=0),
                                   rtol=1e-6)
    got = tpu.fit(x, y, sample_weight=weights, batch_size=24, epochs=1, shuffle=False, verbose=0).history
    want = cpu.fit(x, y, sample_weight=weights, batch_size=24, epochs=1, shuffle=False, verbose=0).history
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    tpu.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
    cpu.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(tpu.get_weights(), cpu.get_weights(), atol=1e-6)


class PassThrough(keras.layers.Layer):
    """A custom layer that keeps the mask (keras.io's TransformerDecoder does): the model is no longer a graph of
    Keras' own row-wise layers, so its evaluation maps the cores one by one."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, x):
        return x


def test_masked_metrics_and_loss_of_a_model_evaluated_core_by_core():
    """keras.io's English-to-Spanish translator logs accuracy over a masked output. Evaluated core by core, the
    outputs come back without their Keras masks: the metrics must still skip the masked tokens, and the loss
    divide by the batch's valid tokens, not each core's."""
    rng = np.random.default_rng(2)
    x, _ = padded_token_rows(64, length=10, real=10, vocab=30)
    for row, length in enumerate(rng.integers(2, 11, 64)):
        x[row, length:] = 0
    y = rng.integers(0, 5, (64, 10)).astype("int32")

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((10,), dtype="int32")
        h = PassThrough()(keras.layers.Embedding(30, 8, mask_zero=True)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(5, activation="softmax")(h))
        model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    cpu, tpu = build(), on_tpu(build())
    for batch_size in (64, 32, 24):
        got = tpu.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
        want = cpu.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-6), (batch_size, key)
    got = tpu.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0, validation_data=(x, y)).history
    want = cpu.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0, validation_data=(x, y)).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    assert_weights_close(tpu.get_weights(), cpu.get_weights(), atol=1e-6)


def test_per_output_losses_of_a_masked_and_an_unmasked_output():
    """A two-output model, one output masked per token and one per row: each output's loss log and the total
    are the real rows' on a partial batch (the per-output trackers re-evaluate the loss on the whole batch)."""
    rng = np.random.default_rng(1)
    x, _ = padded_token_rows(40, length=8, real=8, vocab=30)
    for row, length in enumerate(rng.integers(1, 9, 40)):
        x[row, length:] = 0
    tags, label = rng.integers(0, 5, (40, 8)).astype("int32"), rng.integers(0, 2, (40, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,), dtype="int32")
        h = keras.layers.Embedding(30, 8, mask_zero=True)(inputs)
        tagged = keras.layers.Dense(5, activation="softmax", name="tags")(h)
        pooled = keras.layers.Dense(1, activation="sigmoid", name="label")(keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model(inputs, {"tags": tagged, "label": pooled})
        model.compile("adam", {"tags": "sparse_categorical_crossentropy", "label": "binary_crossentropy"})
        return model

    cpu, tpu = build(), on_tpu(build())
    targets = {"tags": tags, "label": label}
    for batch_size in (40, 16, 12):
        got = tpu.evaluate(x, targets, batch_size=batch_size, verbose=0, return_dict=True)
        want = cpu.evaluate(x, targets, batch_size=batch_size, verbose=0, return_dict=True)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-6), (batch_size, key)
    got = tpu.fit(x, targets, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    want = cpu.fit(x, targets, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    assert_weights_close(tpu.get_weights(), cpu.get_weights(), atol=1e-5)


def test_padding_rows_copy_the_batch_s_first_row():
    """Padding rows repeat a real row (never an all-masked row of zeros), with a mask of 0; a step without rows is
    zeros."""
    from keras_tpu._batching import BatchStacker

    tokens = np.array([[3, 4, 0], [5, 0, 0], [6, 7, 8]], dtype="int32")
    stacked = BatchStacker(num_cores=8, steps=2).stack([(tokens, np.ones(3)), (tokens[:0], np.ones(0))])
    x, y = stacked.data
    assert x.shape == (8, 2, 3) and y.shape == (8, 2)
    np.testing.assert_array_equal(x[:3, 0], tokens)
    np.testing.assert_array_equal(x[3:, 0], np.repeat(tokens[:1], 5, axis=0))
    assert not x[:, 1].any() and not y[:, 1].any()
    np.testing.assert_array_equal(stacked.mask[:, 0], [1, 1, 1, 0, 0, 0, 0, 0])
    assert not stacked.mask[:, 1].any()
