"""keras_to_tpu_model: training, evaluation and prediction match the CPU model."""

import logging

import keras
import numpy as np
import pytest

import keras_tpu
from tests.tpu_helpers import (assert_weights_close, classification_data, compiled_programs, on_tpu, small_classifier,
                               small_cnn, written_shapes)


def test_refuses_what_is_not_a_keras_model():
    with pytest.raises(TypeError, match="Keras model"):
        keras_tpu.keras_to_tpu_model(lambda x: x)
    with pytest.raises(TypeError, match="Keras model"):
        keras_tpu.keras_to_tpu_model(keras.layers.Dense(3))


def test_variable_length_inputs_compile_one_program_per_shape_and_warn_when_there_are_many(caplog):
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(tokens))
    model = keras.Model(tokens, keras.layers.Dense(1)(pooled))
    model.compile("sgd", "mse")
    tpu = keras_tpu.keras_to_tpu_model(model)
    rng = np.random.default_rng(0)
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        for length in (5, 7, 5):
            tpu.fit(rng.integers(0, 20, (16, length)), np.ones((16, 1)), batch_size=16, verbose=0)
    assert [m for m, *_ in compiled_programs(caplog)] == ["train", "train"]  # 5 and 7 steps; 5 again: cached
    assert "inputs (16, 7)" in caplog.text and "keras_tensor" not in caplog.text
    assert "different shapes" not in caplog.text
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        for length in range(8, 16):  # ten lengths in all: more than a handful
            tpu.fit(rng.integers(0, 20, (16, length)), np.ones((16, 1)), batch_size=16, verbose=0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "different shapes" in r.getMessage()]
    assert len(warnings) == 1 and "pad or bucket" in warnings[0].getMessage()
    assert "(the latest: (None, 14))" in warnings[0].getMessage()  # (any rows, as Keras writes shapes)


def test_models_with_their_own_steps_and_losses_convert_and_double_conversion_is_refused():
    class Custom(keras.Model):
        def train_step(self, state, data):
            raise AssertionError("runs only when trained")

    inputs = keras.Input((2,))
    custom = Custom(inputs=inputs, outputs=keras.layers.Dense(1)(inputs))
    custom.compile("sgd", "mse")
    with pytest.raises(AssertionError, match="runs only when trained"):  # the model's own step is what runs
        keras_tpu.keras_to_tpu_model(custom).fit(np.ones((8, 2)), np.ones((8, 1)), verbose=0)
    tpu = keras_tpu.keras_to_tpu_model(small_classifier())
    with pytest.raises(ValueError, match="already"):
        keras_tpu.keras_to_tpu_model(tpu)
    with pytest.raises(TypeError, match="TPUDistributionStrategy"):
        keras_tpu.keras_to_tpu_model(small_classifier(), strategy="tpu")


def test_keeps_the_cpu_models_compile_settings_and_attributes():
    def my_loss(y_true, y_pred):
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred)

    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    cpu = small_classifier(optimizer=optimizer, metrics=["sparse_categorical_accuracy",
                                                         keras.metrics.SparseTopKCategoricalAccuracy(k=2)])
    cpu.compile(optimizer=optimizer, loss=my_loss, metrics=["sparse_categorical_accuracy"],
                weighted_metrics=[keras.metrics.SparseTopKCategoricalAccuracy(k=2)])
    tpu = keras_tpu.keras_to_tpu_model(cpu)
    assert tpu.optimizer is optimizer and tpu.loss is my_loss
    assert tpu.layers == cpu.layers and tpu.inputs == cpu.inputs and tpu.outputs == cpu.outputs
    assert tpu.get_layer(cpu.layers[0].name) is cpu.layers[0]
    assert tpu.cpu_model is cpu and tpu.count_params() == cpu.count_params()
    x, y = classification_data()
    logs = tpu.fit(x, y, batch_size=32, epochs=1, verbose=0).history
    assert set(logs) == {"loss", "sparse_categorical_accuracy", "sparse_top_k_categorical_accuracy"}
    lines = []
    tpu.summary(print_fn=lines.append)
    assert any("TPU v2-8, 8 core(s)" in line for line in lines)


def test_training_matches_the_cpu_model_with_partial_batches():
    x, y = classification_data(200)
    cpu, reference = small_classifier(), small_classifier()
    tpu = on_tpu(cpu, "highest")
    tpu_history = tpu.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0).history
    cpu_history = reference.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0).history
    for key in cpu_history:  # 200 = 3 x 64 + 8: every epoch ends with a partial batch
        np.testing.assert_allclose(tpu_history[key], cpu_history[key], rtol=2e-6)
    assert_weights_close(tpu.get_weights(), reference.get_weights(), atol=1e-6)


def test_default_bf16_training_stays_within_bf16_tolerance():
    x, y = classification_data(256)
    tpu, reference = on_tpu(small_classifier(), "default"), small_classifier()
    tpu_loss = tpu.fit(x, y, batch_size=128, epochs=2, shuffle=False, verbose=0).history["loss"]
    cpu_loss = reference.fit(x, y, batch_size=128, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(tpu_loss, cpu_loss, rtol=1e-2)
    assert tpu_loss != cpu_loss  # the MXU's bf16 products are really used
    assert_weights_close(tpu.get_weights(), reference.get_weights(), atol=1e-2)


def test_evaluate_and_predict_are_exact_with_any_batch_and_data_size():
    x, y = classification_data(203)
    weights = np.linspace(0.5, 2, 203).astype("float32")
    cpu = small_classifier()
    cpu.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["sparse_categorical_accuracy"],
                weighted_metrics=["sparse_categorical_accuracy"])
    tpu = on_tpu(cpu, "highest")
    for batch_size in (203, 64, 13, 1):
        got = tpu.evaluate(x, y, sample_weight=weights, batch_size=batch_size, verbose=0, return_dict=True)
        want = cpu.evaluate(x, y, sample_weight=weights, batch_size=batch_size, verbose=0, return_dict=True)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=2e-6), (batch_size, key)
    for rows in (1, 7, 64, 65, 203):
        predicted = tpu.predict(x[:rows], batch_size=64, verbose=0)
        assert predicted.shape == (rows, 3)
        np.testing.assert_allclose(predicted, cpu.predict(x[:rows], batch_size=64, verbose=0), atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
def test_evaluation_of_all_rows_at_once_is_exact_for_losses_averaged_or_summed(reduction):
    # A model whose rows do not interact evaluates all of a device's rows as one batch: the same loss as on
    # the CPU for every batch size, partial batches and sample weights included. A loss averaged over its sample
    # weights is the batch's weighted mean, not the mean of the cores' or devices' weighted means.
    x, y = classification_data(203)
    weights = np.linspace(0.5, 2, 203).astype("float32")
    cpu = small_classifier()
    cpu.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(reduction=reduction),
                weighted_metrics=["sparse_categorical_accuracy"])
    tpu = on_tpu(cpu, "highest")
    for batch_size in (203, 64, 13):
        got = tpu.evaluate(x, y, sample_weight=weights, batch_size=batch_size, verbose=0, return_dict=True)
        want = cpu.evaluate(x, y, sample_weight=weights, batch_size=batch_size, verbose=0, return_dict=True)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=2e-6), (batch_size, key)


@pytest.mark.parametrize("merged", [True, False])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
def test_training_all_rows_at_once_or_core_by_core_matches_the_cpu(monkeypatch, merged, reduction):
    # A model whose rows are independent in training runs a device's rows as one batch; core by core (as models
    # with BatchNormalization or dropout run) it must give the same: partial batches and sample weights included.
    from keras_tpu._replicated_steps import ReplicatedSteps

    decide = ReplicatedSteps._cores_merged
    chosen = []

    def forced(self, mode, *args):
        if mode != "train" or self.layout.cores_per_device == 1:  # (one core's step, traced for its HBM use)
            return decide(self, mode, *args)
        chosen.append(decide(self, mode, *args))
        return merged

    monkeypatch.setattr(ReplicatedSteps, "_cores_merged", forced)
    x, y = classification_data(200)
    weights = np.linspace(0.5, 2, 200).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(reduction=reduction)
    cpu, reference = small_classifier(), small_classifier()
    for model in (cpu, reference):
        model.compile(keras.optimizers.Adam(0.01), loss, weighted_metrics=["sparse_categorical_accuracy"])
    tpu = on_tpu(cpu, "highest")
    got = tpu.fit(x, y, sample_weight=weights, batch_size=64, epochs=2, shuffle=False, verbose=0).history
    want = reference.fit(x, y, sample_weight=weights, batch_size=64, epochs=2, shuffle=False, verbose=0).history
    assert chosen and all(chosen)   # left alone, this model trains all rows at once
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6)
    assert_weights_close(tpu.get_weights(), reference.get_weights(), atol=1e-6)


def test_training_runs_all_rows_at_once_only_for_models_whose_rows_are_independent_in_training():
    from keras_tpu._cores import CoreLayout
    from keras_tpu._replicated_steps import ReplicatedSteps, rows_independent_in_training

    layers = keras.layers
    tokens = keras.Input((6,), dtype="int32")
    x = layers.Embedding(20, 8)(tokens)
    x = layers.LayerNormalization()(layers.Add()([x, layers.MultiHeadAttention(2, 4)(x, x)]))
    transformer = keras.Model(tokens, layers.Dense(2)(layers.LSTM(4)(x)))
    assert rows_independent_in_training(transformer)
    dense = lambda *middle: keras.Sequential([keras.Input((6,)), *middle, layers.Dense(2)])
    for model in (dense(layers.BatchNormalization()), dense(layers.Dropout(0.1)), dense(layers.GaussianNoise(0.1)),
                  dense(layers.Dense(4, activity_regularizer="l2")), dense(layers.ActivityRegularization(0.1)),
                  keras.Sequential([keras.Input((5, 2)), layers.LSTM(3, dropout=0.2)]),
                  keras.Model(tokens, layers.MultiHeadAttention(2, 4, dropout=0.1)(x, x))):
        assert not rows_independent_in_training(model), model.layers

    def merged(model, loss="mse", core_rows=64):
        model.compile("sgd", loss)
        steps = ReplicatedSteps(model, CoreLayout(8))
        shape, dtype = model.inputs[0].shape, model.inputs[0].dtype
        return steps._cores_merged("train", [v.value for v in model.trainable_variables],
                                   [v.value for v in model.non_trainable_variables],
                                   np.zeros((8 * core_rows,) + tuple(shape[1:]), dtype))

    assert merged(dense(layers.Dense(4))) and not merged(dense(layers.Dropout(0.1)))
    assert merged(dense(layers.Dense(4)), keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
    # Convolutions' gradients run faster at a core's batch: at 4 rows per core as at 64 they stay core by core.
    convnet = lambda: keras.Sequential([keras.Input((8, 8, 3)), layers.Conv2D(4, 3), layers.Flatten(),
                                        layers.Dense(2)])
    assert not merged(convnet()) and not merged(convnet(), core_rows=4)


def test_inference_runs_all_rows_at_once_only_for_models_whose_rows_do_not_interact():
    from keras_tpu._cores import CoreLayout
    from keras_tpu._replicated_steps import ReplicatedSteps, rows_independent_at_inference

    layers = keras.layers
    inputs = keras.Input((8, 8, 3))
    x = layers.MaxPooling2D()(layers.BatchNormalization()(layers.Conv2D(4, 3, padding="same")(inputs)))
    x = layers.Dropout(0.5)(layers.Flatten()(x))
    convnet = keras.Model(inputs, layers.Dense(3, activation="softmax")(x))
    tokens = keras.Input((5,), dtype="int32")
    recurrent = keras.Model(tokens, layers.Bidirectional(layers.LSTM(4))(layers.Embedding(10, 4)(tokens)))
    assert rows_independent_at_inference(convnet) and rows_independent_at_inference(recurrent)
    nested = keras.Sequential([keras.Input((8, 8, 3)), convnet])
    assert rows_independent_at_inference(nested)

    class Centered(layers.Layer):  # mixes rows: subtracts the batch mean
        def call(self, x):
            return x - keras.ops.mean(x, axis=0)

    custom = keras.Sequential([keras.Input((6,)), Centered(), layers.Dense(3)])
    fixed_batch = keras.Sequential([keras.Input((6,), batch_size=8), layers.Dense(3)])
    stateful = keras.Sequential([keras.Input((5, 2), batch_size=8), layers.LSTM(3, stateful=True)])

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    for model in (custom, fixed_batch, stateful, Subclassed()):
        assert not rows_independent_at_inference(model), model

    def state_and_rows(model):
        shape, dtype = model.inputs[0].shape, model.inputs[0].dtype
        return ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
                np.zeros((16,) + tuple(shape[1:]), dtype))

    def merged(model, loss):
        model.compile("sgd", loss)
        steps = ReplicatedSteps(model, CoreLayout(8))
        args = state_and_rows(model)
        return steps._cores_merged("test", *args), steps._cores_merged("predict", *args)

    assert merged(recurrent, "mse") == (True, True)
    # Every reduction is exact over the whole batch (see ReplicatedSteps._sample_weights).
    assert merged(recurrent, keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")) == (True, True)
    assert merged(custom, "mse") == (False, False)
    assert merged(convnet, "sparse_categorical_crossentropy") == (True, True)
    # Depthwise convolutions run faster at a core's batch: core by core.
    depthwise = keras.Sequential([keras.Input((8, 8, 4)), layers.DepthwiseConv2D(3), layers.Flatten(),
                                  layers.Dense(2)])
    assert merged(depthwise, "mse") == (False, False)


def test_a_layout_trial_keeps_the_faster_layout_and_merged_unless_looped_is_clearly_faster():
    from keras_tpu._programs import LOOPED, MERGED, LayoutTrial

    def chosen(merged, looped):
        trial, times, result = LayoutTrial(), {MERGED: iter(merged), LOOPED: iter(looped)}, None
        while result is None:
            layout = trial.layout()
            result = trial.record(layout, next(times[layout]))
        return result, trial

    assert LayoutTrial.SCHEDULE.count(MERGED) == 6 and LayoutTrial.SCHEDULE.count(LOOPED) == 6
    assert chosen([0.3, 0.29, 0.3, 0.31, 0.3, 0.3], [None, 0.2, 0.21, 0.2, 0.22, 0.2])[0] == LOOPED
    assert chosen([0.2, 0.21, 0.2, 0.2, 0.19, 0.2], [None, 0.3, 0.28, 0.3, 0.29, 0.3])[0] == MERGED
    # Within the margin: the default.
    assert chosen([0.2] * 6, [None, 0.198, 0.199, 0.197, 0.199, 0.198])[0] == MERGED
    # The best call counts: calls that another process slowed do not decide, however many.
    result, trial = chosen([0.5, 0.45, 0.2, 0.5, 0.6, 0.45], [None, 0.25, 0.25, 0.3, 0.25, 0.26])
    assert result == MERGED and trial.best == {MERGED: 0.2, LOOPED: 0.25}
    # A layout is judged on all its calls: looped's best comes on its last.
    assert chosen([0.3, 0.3, 0.3, 0.3, 0.3, 0.3], [None, 0.31, 0.32, 0.3, 0.31, 0.2])[0] == LOOPED
    # A step of a few milliseconds cannot be timed reliably: merged after its first run.
    result, trial = chosen([0.004], [])
    assert result == MERGED and trial.best[LOOPED] == float("inf")


def test_an_embedding_model_evaluates_with_its_lookup_summed_as_it_is_looked_up(monkeypatch):
    # Inference programs without windows keep their reductions out of YNNPACK (keras_tpu.mxu._kernels
    # .compiler_options): the looked-up rows are pooled as they are read, never written out.
    from keras_tpu._placement import installed_on
    from keras_tpu.mxu import _kernels as kernels

    monkeypatch.setattr(kernels, "host_class", lambda: "bf16")   # the host class these options were measured on
    keras.utils.set_random_seed(0)
    layers = keras.layers
    model = keras.Sequential([keras.Input((32,), dtype="int32"), layers.Embedding(1000, 64),
                              layers.GlobalAveragePooling1D(), layers.Dense(2, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 1000, (512, 32)).astype("int32"), rng.integers(0, 2, (512, 1))
    want = model.evaluate(x, y, batch_size=256, verbose=0)
    tpu = on_tpu(model, "highest")
    np.testing.assert_allclose(tpu.evaluate(x, y, batch_size=256, verbose=0), want, rtol=1e-5)
    (executable,) = installed_on(tpu).steps.last_programs["test"]._executables.values()
    written = written_shapes(executable.as_text())
    assert "f32[256,32,64]" not in written and "f32[256,1,32,64]" not in written
    assert "f32[256,64]" in written or "f32[256,1,64]" in written   # the pooled rows


@pytest.mark.parametrize("mode", ["predict", "fit"])
def test_a_convolutional_model_keeps_the_mxu_roundings_where_xla_fuses_its_layers(monkeypatch, mode):
    # XLA:CPU fuses a small CNN's forward pass (convolutions, ReLUs, poolings) into one YNNPACK kernel, and by default
    # may drop the bf16 rounding of each convolution's operands there as excess precision: the predictions came out
    # those of the float32 network. keras-tpu compiles every program with that rule off
    # (keras_tpu.mxu._kernels.compiler_options): its results are those of a reference program with no YNNPACK fusion.
    from keras_tpu.mxu import _kernels as kernels

    model = small_cnn()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 16, 16, 3)).astype("float32"), rng.integers(0, 10, (64,))
    initial = model.get_weights()

    def run(tpu):   # what a step changes: the predictions, or one training step's weight updates
        model.set_weights(initial)   # the TPU model trains the CPU model's own weights
        if mode == "fit":
            tpu.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
            return np.concatenate([(w - w0).ravel() for w, w0 in zip(tpu.get_weights(), initial)])
        return tpu.predict(x, batch_size=64, verbose=0)

    got = run(keras_tpu.keras_to_tpu_model(model))   # the default precision: one bf16 pass per product
    float32 = run(on_tpu(model, "highest"))
    # The reference: the same programs with no YNNPACK fusion (so nothing is fused with a reduction).
    compiler_options = kernels.compiler_options
    monkeypatch.setattr(kernels, "compiler_options", lambda *args, **kwargs: {
        **compiler_options(*args, **kwargs), "xla_cpu_experimental_ynn_fusion_type": ""})
    want = run(keras_tpu.keras_to_tpu_model(model))
    # Mean differences: float32 sums in another order may flip a rare rounding. With the roundings dropped, the
    # updates were 1.4% off on average, the predictions those of the float32 network.
    scale = np.max(np.abs(want))
    assert np.mean(np.abs(got - want)) / scale < 1e-5
    assert np.mean(np.abs(float32 - want)) / scale > 1e-4   # the bf16 rounding shows at this size


@pytest.mark.parametrize("faster", ["looped", "merged"])
def test_a_convolutional_model_evaluates_in_the_layout_it_timed_faster_with_the_same_results(monkeypatch, caplog,
                                                                                               faster):
    from keras_tpu._placement import installed_on
    from keras_tpu._programs import LOOPED, MERGED, LayoutTrial

    # Scripted times (the trial's real clock is the machine's, too noisy to test): the faster layout's runs
    # take 1 s per step, the other's 2 s.
    record = LayoutTrial.record
    monkeypatch.setattr(LayoutTrial, "record", lambda self, layout, seconds: record(
        self, layout, None if seconds is None else (1.0 if layout == faster else 2.0)))
    keras.utils.set_random_seed(0)
    layers = keras.layers
    model = keras.Sequential([keras.Input((8, 8, 3)), layers.Conv2D(24, 3, activation="relu"),
                              layers.BatchNormalization(), layers.Conv2D(20, 3, activation="relu"),
                              layers.GlobalAveragePooling2D(), layers.Dense(4, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((100, 8, 8, 3)).astype("float32"), rng.integers(0, 4, (100, 1))
    model.fit(x, y, batch_size=20, verbose=0)
    want = model.evaluate(x, y, batch_size=16, verbose=0)
    want_out = model.predict(x, batch_size=16, verbose=0)
    tpu = on_tpu(model, "highest")
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        # 7 batches of 16 (the last partial), twice: the first compiles the merged program, the next twelve are
        # the trial.
        first = tpu.evaluate(x, y, batch_size=16, verbose=0)
        again = tpu.evaluate(x, y, batch_size=16, verbose=0)
        out = tpu.predict(x, batch_size=16, verbose=0)
    steps = installed_on(tpu).steps
    assert steps.layout_choices == {"test", "predict"}
    assert steps.last_programs["test"]._cores_layout == (LOOPED if faster == "looped" else MERGED)
    modes = [(m, "cores in a loop" in r.getMessage()) for r in caplog.records
             for m in ("test", "predict") if r.getMessage().startswith(f"Compiled the TPU {m} program")]
    assert modes == [("test", False), ("test", True), ("predict", False), ("predict", True)]
    assert f"runs its cores {'in a loop' if faster == 'looped' else 'as one batch'}" in caplog.text
    # Every batch, in either layout, computes the CPU model's results.
    np.testing.assert_allclose(first, want, rtol=1e-5)
    np.testing.assert_allclose(again, want, rtol=1e-5)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    # A core's HBM is checked once per shape: not again for the trial's second layout, but for a new batch size in
    # the layout kept.
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiled the TPU test program")]
    assert ["HBM per core" in line for line in compiled] == [True, False]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        np.testing.assert_allclose(tpu.evaluate(x, y, batch_size=24, verbose=0),
                                   model.evaluate(x, y, batch_size=24, verbose=0), rtol=1e-5)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiled the TPU test program")]
    assert "global batch 24" in line and "HBM per core" in line and ("cores in a loop" in line) == (faster == "looped")


def test_a_model_with_convolutions_runs_its_cores_in_a_loop():
    from keras_tpu._cores import CoreLayout
    from keras_tpu._placement import installed_on
    from keras_tpu._replicated_steps import ReplicatedSteps

    def looped(*hidden):
        model = keras.Sequential([keras.Input((8, 8, 8)), *hidden, keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        steps = ReplicatedSteps(model, CoreLayout(8))
        return steps._cores_looped([v.value for v in model.trainable_variables],
                                   [v.value for v in model.non_trainable_variables], np.zeros((16, 8, 8, 8)))

    assert looped(keras.layers.Conv2D(4, 3)) and looped(keras.layers.DepthwiseConv2D(3))
    assert not looped(keras.layers.Dense(4)) and not looped(keras.layers.BatchNormalization())
    # Looped or vectorised, training gives the same weights: each core's BatchNormalization statistics and
    # dropout stream, partial batches included.
    x = np.random.default_rng(0).standard_normal((60, 8, 8, 2)).astype("float32")
    y = x.sum(axis=(1, 2, 3))[:, None]
    trained = []
    for loop in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8, 8, 2)), keras.layers.Conv2D(3, 3), keras.layers.BatchNormalization(),
                                  keras.layers.Dropout(0.3), keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
        tpu = on_tpu(model, "highest")
        installed = installed_on(tpu)
        steps = installed.placement.steps_for(tpu)  # made before any program, which then runs them
        steps.looped_cores = loop
        history = tpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
        assert installed.steps is steps and steps.last_programs["train"].builder is steps
        trained.append((tpu.get_weights(), history["loss"], tpu.predict(x, batch_size=32, verbose=0)))
    (vectorised, vectorised_loss, vectorised_out), (loop_weights, loop_loss, loop_out) = trained
    assert_weights_close(loop_weights, vectorised, atol=1e-5)
    np.testing.assert_allclose(loop_loss, vectorised_loss, rtol=1e-5)
    np.testing.assert_allclose(loop_out, vectorised_out, atol=1e-5)


def test_a_model_that_mixes_rows_is_evaluated_core_by_core():
    # Each core's rows are its own batch (as on a TPU): a layer that centres its batch sees 8 rows per core.
    class Centered(keras.layers.Layer):
        def call(self, x):
            return x - keras.ops.mean(x, axis=0)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), Centered(), keras.layers.Dense(3)])
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).standard_normal((64, 6)).astype("float32")
    predicted = on_tpu(model, "highest").predict(x, batch_size=64, verbose=0)
    per_core = np.concatenate([model.predict(x[i:i + 8], verbose=0) for i in range(0, 64, 8)])
    np.testing.assert_allclose(predicted, per_core, atol=1e-5)
    assert not np.allclose(predicted, model.predict(x, batch_size=64, verbose=0), atol=1e-3)


def test_partial_batches_never_recompile(caplog):
    caplog.set_level(logging.INFO, logger="keras_tpu")
    x, y = classification_data(200)
    tpu = on_tpu(small_classifier(), "default")
    tpu.fit(x, y, batch_size=64, epochs=2, verbose=0)
    tpu.evaluate(x, y, batch_size=64, verbose=0)
    tpu.predict(x[:150], batch_size=64, verbose=0)
    assert compiled_programs(caplog) == [("train", 64, 1), ("test", 64, 1), ("predict", 64, 1)]


def test_each_fit_evaluate_and_predict_call_runs_at_its_own_batch_size(caplog):
    """A later fit at a smaller batch_size, or a predict of a few rows, runs a program of its own size (as a TPU
    compiles one per new shape), not its rows padded to an earlier call's batch; a size seen before runs its
    program again, and within a call a partial batch still pads to the call's batch."""
    caplog.set_level(logging.INFO, logger="keras_tpu")
    x, y = classification_data(200)
    cpu, reference = small_classifier(), small_classifier()
    tpu = on_tpu(cpu, "highest")
    for model in (tpu, reference):
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)  # 64, 64, 64, 8 rows
        model.fit(x[:40], y[:40], batch_size=16, epochs=1, shuffle=False, verbose=0)  # 16, 16, 8
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(tpu.get_weights(), reference.get_weights(), atol=1e-5)
    tpu.predict(x, batch_size=64, verbose=0)
    np.testing.assert_allclose(tpu.predict(x[:3], verbose=0), reference.predict(x[:3], verbose=0), atol=1e-5)
    assert compiled_programs(caplog) == [("train", 64, 1), ("train", 16, 1), ("predict", 64, 1), ("predict", 8, 1)]


def test_a_prediction_of_fewer_rows_than_cores_computes_only_its_rows(caplog):
    """A text generator's loop (keras.io's character LSTM: ``predict`` of one row at a time) runs the model on its
    real rows only, with the same results: a padding row would compute the first row's outputs again."""
    def generator():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5, 7)), keras.layers.LSTM(16),
                                  keras.layers.Dense(7, activation="softmax")])
        model.compile("adam", "categorical_crossentropy")
        return model

    caplog.set_level(logging.INFO, logger="keras_tpu")
    x = np.random.default_rng(0).random((8, 5, 7)).astype("float32")
    reference = generator()
    with keras_tpu.TPUStrategy(precision="highest").scope():
        under_strategy = generator()
    for tpu in (under_strategy, on_tpu(generator(), "highest")):
        full = tpu.predict(x, verbose=0)  # eight rows: every core's row is real
        for rows in (1, 1, 3):
            got = tpu.predict(x[:rows], verbose=0)
            np.testing.assert_allclose(got, full[:rows], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(got, reference.predict(x[:rows], verbose=0), atol=1e-5)
            np.testing.assert_allclose(tpu.predict_on_batch(x[:rows]), got, rtol=1e-6, atol=1e-7)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiled the TPU predict")]
    # Per front end: the 8-row program, then one program per count of real rows, each compiled once.
    assert [("computing its" in line, "its 1 real" in line, "its 3 real" in line) for line in compiled] == [
        (False, False, False), (True, True, False), (True, False, True)] * 2, compiled


def test_a_prediction_of_fewer_rows_than_cores_keeps_every_row_where_the_cores_stay_apart(caplog):
    """A grouped convolution keeps each core's rows apart (ReplicatedSteps._cores_merged): every row is computed."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 6, 4)), keras.layers.Conv2D(4, 3, groups=2), keras.layers.Flatten(),
                              keras.layers.Dense(3)])
    model.compile("sgd", "mse")
    caplog.set_level(logging.INFO, logger="keras_tpu")
    x = np.random.default_rng(0).standard_normal((3, 6, 6, 4)).astype("float32")
    np.testing.assert_allclose(on_tpu(model, "highest").predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=1e-5)
    assert "computing its" not in caplog.text and "Compiled the TPU predict program (global batch 8" in caplog.text


def test_a_batch_that_does_not_split_over_8_cores_is_padded(caplog):
    caplog.set_level(logging.INFO, logger="keras_tpu")
    x, y = classification_data(250)
    cpu, reference = small_classifier(), small_classifier()
    tpu = on_tpu(cpu, "highest")
    got = tpu.fit(x, y, batch_size=100, epochs=1, shuffle=False, verbose=0).history["loss"]
    want = reference.fit(x, y, batch_size=100, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert compiled_programs(caplog) == [("train", 104, 1)]  # 8 cores x 13 rows


def test_optimizer_state_survives_successive_fit_calls():
    x, y = classification_data(128)
    tpu, reference = on_tpu(small_classifier(), "highest"), small_classifier()
    for _ in range(2):
        tpu.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert int(tpu.optimizer.iterations.value) == 8
    assert_weights_close(tpu.get_weights(), reference.get_weights(), atol=1e-6)


def test_steps_per_execution_runs_several_steps_per_device_call(caplog):
    caplog.set_level(logging.INFO, logger="keras_tpu")
    x, y = classification_data(10 * 32)
    cpu = small_classifier(steps_per_execution=4)
    tpu, reference = on_tpu(cpu, "highest"), small_classifier()
    tpu.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    # 4 + 4 + 2: the last call runs a program of two steps (compiled once), not four with two idle.
    assert compiled_programs(caplog) == [("train", 32, 4), ("train", 32, 2)]
    assert_weights_close(tpu.get_weights(), reference.get_weights(), atol=1e-6)
    assert int(tpu.optimizer.iterations.value) == 10
    np.testing.assert_allclose(tpu.predict(x, batch_size=32, verbose=0), reference.predict(x, verbose=0), atol=1e-6)


def test_on_batch_methods():
    x, y = classification_data(40)
    tpu, reference = on_tpu(small_classifier(), "highest"), small_classifier()
    got = tpu.train_on_batch(x, y, return_dict=True)
    want = reference.train_on_batch(x, y, return_dict=True)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert tpu.test_on_batch(x, y) == pytest.approx(reference.test_on_batch(x, y), rel=1e-6)
    np.testing.assert_allclose(tpu.predict_on_batch(x[:5]), reference.predict_on_batch(x[:5]), atol=1e-6)


def test_single_core_strategy():
    x, y = classification_data(64)
    tpu, reference = on_tpu(small_classifier(), "highest", using_single_core=True), small_classifier()
    assert tpu.strategy.num_cores == 1
    tpu.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(tpu.get_weights(), reference.get_weights(), atol=1e-6)


def test_fit_history_answers_to_tf1_accuracy_names():
    """TF 1.x logged metrics=["accuracy"] as acc and val_acc; its notebooks plot history.history["acc"]."""
    x, y = classification_data(64)
    tpu = on_tpu(small_classifier(metrics=["accuracy"]))
    logs = tpu.fit(x, y, batch_size=16, epochs=2, validation_split=0.25, verbose=0).history
    assert logs["acc"] == logs["accuracy"] and logs.get("val_acc") == logs["val_accuracy"] and len(logs["acc"]) == 2
    assert "acc" in logs and "loss_acc" not in logs and sorted(logs) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    with pytest.raises(KeyError):
        logs["top_k_acc"]


def test_a_training_program_looping_over_the_cores_alone_compiles_without_loop_invariant_motion(monkeypatch):
    from keras_tpu.mxu import _kernels as kernels

    chosen = []
    options_of = kernels.compiler_options

    def recording(mode="train", program=None, hoist_loop_invariants=True):
        chosen.append((mode, hoist_loop_invariants))
        return options_of(mode, program, hoist_loop_invariants)

    monkeypatch.setattr(kernels, "compiler_options", recording)
    images, labels = np.random.default_rng(0).standard_normal((32, 16, 16, 3)).astype("float32"), np.zeros(32)
    # A CNN's training step loops over the cores: its invariants (rounded weights) fuse into the loop's ops.
    cnn = on_tpu(small_cnn(), precision="default")
    cnn.fit(images, labels, batch_size=16, verbose=0)
    cnn.evaluate(images, labels, batch_size=16, verbose=0)   # inference keeps the pass
    training = lambda: [hoists for mode, hoists in chosen if mode == "train"]
    assert training() == [False] and ("test", True) in chosen
    # A recurrence of the model's own keeps it: its weights' roundings stay out of every time step.
    layers = keras.layers
    sequences = keras.Sequential([keras.Input((16, 16, 3)), layers.Reshape((16, 48)), layers.Conv1D(8, 3),
                                  layers.LSTM(8), layers.Dense(2)])
    sequences.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    chosen.clear()
    on_tpu(sequences, precision="default").fit(images, labels, batch_size=16, verbose=0)
    assert training() == [True]
