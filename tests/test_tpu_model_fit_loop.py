"""Keras' fit loop drives the TPU program: data types, validation, callbacks, progress bar."""

import logging

import jax
import keras
import numpy as np
import pytest

import keras_tpu
from tests.tpu_helpers import assert_weights_close, classification_data, on_tpu, small_classifier


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


def test_pydataset_and_generators_train_as_on_the_cpu():
    x, y = classification_data(100)
    from_dataset, reference = on_tpu(small_classifier(), "highest"), small_classifier()
    from_dataset.fit(Batches(x, y, 32), epochs=1, shuffle=False, verbose=0)
    reference.fit(Batches(x, y, 32), epochs=1, shuffle=False, verbose=0)
    assert_weights_close(from_dataset.get_weights(), reference.get_weights(), atol=1e-6)

    def generator():
        while True:
            for i in range(0, 100, 32):
                yield x[i:i + 32], y[i:i + 32]

    from_generator, reference = on_tpu(small_classifier(), "highest"), small_classifier()
    from_generator.fit(generator(), steps_per_epoch=4, epochs=1, verbose=0)
    reference.fit(generator(), steps_per_epoch=4, epochs=1, verbose=0)
    assert_weights_close(from_generator.get_weights(), reference.get_weights(), atol=1e-6)
    scores = from_generator.evaluate(Batches(x, y, 32), verbose=0, return_dict=True)
    assert scores == pytest.approx(reference.evaluate(Batches(x, y, 32), verbose=0, return_dict=True), rel=1e-5)
    predictions = from_generator.predict(Batches(x, y, 32), verbose=0)
    np.testing.assert_allclose(predictions, reference.predict(x, verbose=0), atol=1e-6)


def test_validation_initial_epoch_steps_per_epoch_and_class_weights():
    x, y = classification_data(200)
    tpu, reference = on_tpu(small_classifier(), "highest"), small_classifier()
    kwargs = dict(batch_size=32, epochs=3, initial_epoch=1, validation_split=0.25, shuffle=False, verbose=0,
                  class_weight={0: 1.0, 1: 2.0, 2: 0.5})
    got, want = tpu.fit(x, y, **kwargs).history, reference.fit(x, y, **kwargs).history
    assert set(got) == {"loss", "sparse_categorical_accuracy", "val_loss", "val_sparse_categorical_accuracy"}
    assert len(got["loss"]) == 2  # epochs 1 and 2 only
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6)
    history = tpu.fit(x, y, batch_size=16, steps_per_epoch=3, epochs=2, validation_data=(x[:50], y[:50]),
                      verbose=0).history
    assert len(history["val_loss"]) == 2


def test_callbacks_history_early_stopping_checkpoint_and_custom(tmp_path):
    x, y = classification_data(128)

    class Counter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches, self.epochs = 0, 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1
            assert "loss" in logs

        def on_epoch_end(self, epoch, logs=None):
            self.epochs += 1

    counter = Counter()
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0, restore_best_weights=True)
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch{epoch}.weights.h5"), save_weights_only=True)
    tpu = on_tpu(small_classifier())
    history = tpu.fit(x, y, batch_size=32, epochs=10, verbose=0, callbacks=[counter, stopper, checkpoint])
    assert isinstance(history, keras.callbacks.History) and history.model is tpu
    assert counter.epochs == 2 and counter.batches == 8  # stopped after patience ran out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch1.weights.h5", "epoch2.weights.h5"]
    restored = small_classifier(seed=9)
    restored.load_weights(str(tmp_path / "epoch1.weights.h5"))
    assert_weights_close(restored.get_weights(), tpu.get_weights(), atol=0)  # best = epoch 1, restored


@pytest.mark.parametrize("verbose", [1, 2])
def test_progress_bar_is_keras_own(capsys, verbose):
    x, y = classification_data(96)
    tpu = on_tpu(small_classifier())
    tpu.fit(x, y, batch_size=32, epochs=2, verbose=verbose)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out and "loss:" in out and "3/3" in out
    tpu.evaluate(x, y, batch_size=32, verbose=verbose)
    assert "sparse_categorical_accuracy" in capsys.readouterr().out


def _conv_bn_dropout_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.BatchNormalization(momentum=0.5)(inputs)
    h = keras.layers.Conv2D(4, 3, activation="relu")(h)
    h = keras.layers.Dropout(0.5)(keras.layers.Flatten()(h))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_batch_normalization_moving_statistics_skip_padding_cores():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((56, 6, 6, 2)) * 3 + 1).astype("float32")
    y = rng.integers(0, 3, (56, 1))
    tpu, reference = on_tpu(_conv_bn_dropout_model(), "highest"), _conv_bn_dropout_model()
    # 56 real rows padded to 64: cores 0-6 hold 8 real rows each, core 7 only padding.
    tpu.fit(x, y, batch_size=64, epochs=1, verbose=0)
    reference.fit(x, y, batch_size=64, epochs=1, verbose=0)
    bn, bn_reference = tpu.cpu_model.layers[1], reference.layers[1]
    # The mean of the seven real cores' batch means is the mean of the batch.
    np.testing.assert_allclose(bn.moving_mean.numpy(), bn_reference.moving_mean.numpy(), atol=1e-5)
    # Variances are per core (TPU semantics), so they are close but not identical.
    np.testing.assert_allclose(bn.moving_variance.numpy(), bn_reference.moving_variance.numpy(), rtol=0.1)


def _bn_classifier(conv, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4, 4, 2) if conv else (6,))
    h = keras.layers.BatchNormalization(momentum=0.0)(inputs)  # moving statistics = the last step's
    h = keras.layers.Conv2D(3, 3, activation="relu")(h) if conv else keras.layers.Dense(8, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(keras.layers.Flatten()(h)))
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    return model


@pytest.mark.parametrize("conv", [False, True], ids=["dense", "conv"])
def test_batch_normalization_statistics_leave_out_a_cores_padding_rows(conv):
    """60 rows on 8 cores of 8: core 7 holds 4 real rows and 4 padding rows, and normalises with the 4 real
    rows' statistics (the variables combine the cores' statistics weighted by their real rows)."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((60,) + ((4, 4, 2) if conv else (6,))) * 3 + 1).astype("float32")
    y = rng.integers(0, 3, (60,))
    tpu = on_tpu(_bn_classifier(conv), "highest")
    tpu.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    bn = next(layer for layer in tpu.cpu_model.layers if isinstance(layer, keras.layers.BatchNormalization))
    cores = [x[start:start + 8].reshape(-1, x.shape[-1]).astype("float64") for start in range(0, 60, 8)]
    rows = np.array([len(core) for core in cores], "float64") / np.prod(x.shape[1:-1])
    variance = sum(r * core.var(axis=0) for r, core in zip(rows, cores)) / rows.sum()
    np.testing.assert_allclose(bn.moving_mean.numpy(), x.reshape(-1, x.shape[-1]).mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), variance, rtol=1e-5)


def test_only_batches_with_padding_rows_run_batch_normalizations_weighted_statistics(caplog, monkeypatch):
    """Full batches run Keras' own statistics in a program without the weighted ones; the first batch with
    padding rows compiles the weighted program once, and later epochs reuse both."""
    from keras_tpu import _keras_private

    weighted = []
    original = _keras_private._weighted_moments
    monkeypatch.setattr(_keras_private, "_weighted_moments",
                        lambda *args: weighted.append(args[2].shape) or original(*args))
    caplog.set_level(logging.INFO, logger="keras_tpu")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((200, 6)) * 3 + 1).astype("float32")
    y = rng.integers(0, 3, (200,))
    tpu = on_tpu(_bn_classifier(conv=False), "highest")
    tpu.fit(x[:192], y[:192], batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert weighted == []  # traced for full batches only: Keras' statistics
    tpu.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)  # 3 full batches and one of 8 rows
    assert weighted == [(8, 6)]  # one core's rows, traced once
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiled the TPU train")]
    assert len(compiled) == 2 and "real rows" not in compiled[0] and "global batch 64, 8 real rows" in compiled[1]
    assert "for batches with padding rows (BatchNormalization over the real rows)" in compiled[1]
    # One core's HBM is estimated once per shape, whichever form of the program compiles first.
    assert "GiB HBM per core" in compiled[0] and "GiB HBM per core" not in compiled[1]


class _NormalizedWithMovingStatistics(keras.layers.Layer):
    """Calls its BatchNormalization in inference mode, in training too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.normalization = keras.layers.BatchNormalization()

    def call(self, x):
        return self.normalization(x, training=False)


@pytest.mark.parametrize("how", ["frozen", "called with training=False"])
def test_batch_normalization_in_inference_mode_keeps_one_program_for_partial_batches(how, caplog):
    """A frozen base model (keras.io's transfer learning), or a layer that calls its BatchNormalization with
    ``training=False``, normalises with the moving statistics in training too: a partial batch runs the full
    batches' program (the first found from the layers, the second from the traced step)."""
    caplog.set_level(logging.INFO, logger="keras_tpu")
    keras.utils.set_random_seed(0)
    if how == "frozen":
        base = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization()])
        base.trainable = False
    else:
        base = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), _NormalizedWithMovingStatistics()])
    model = keras.Sequential([keras.Input((6,)), base, keras.layers.Dense(3, activation="softmax")])
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((200, 6)).astype("float32"), rng.integers(0, 3, (200,))
    tpu = on_tpu(model, "highest")
    tpu.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)  # 3 full batches and one of 8 rows
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiled the TPU train")]
    assert len(compiled) == 1 and "padding rows" not in compiled[0]
    bn = next(layer for layer in tpu.cpu_model._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization))
    np.testing.assert_array_equal(bn.moving_mean.numpy(), np.zeros(8))  # never updated: inference mode


def test_single_core_batch_normalization_on_a_partial_batch_equals_the_cpu():
    """With one core, a last batch of 13 rows padded to 16 normalises its 13 rows alone, as the CPU does."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((29, 6)) * 3 + 1).astype("float32")
    y = rng.integers(0, 3, (29,))
    tpu = on_tpu(_bn_classifier(conv=False), "highest", using_single_core=True)
    reference = _bn_classifier(conv=False)
    got = tpu.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    want = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(tpu.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_dropout_draws_a_different_mask_on_every_core():
    from keras_tpu._replicated_steps import ReplicatedSteps

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dropout(0.5)])
    model.compile(loss="mse")
    steps = ReplicatedSteps(model, keras_tpu.CoreLayout(8))
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def core_fn(x):
        core = steps.layout.core_index()
        seeds = steps._offset_seeds(non_trainable, core, +1)
        out, new_state = model.stateless_call(trainable, seeds, x, training=True)
        restored = steps._offset_seeds(new_state, core, -1)
        return out, restored[0]

    run = jax.jit(steps.layout.per_core(core_fn, (True,), (True, False)))
    out, seed_state = run(np.ones((16, 64), np.float32))
    masks = np.asarray(out)[::2] > 0  # first row of each core
    assert len({m.tobytes() for m in masks}) == 8
    assert 0.3 < masks.mean() < 0.7
    # Every core advanced the same seed state by one draw, so the replicas agree afterwards.
    np.testing.assert_array_equal(np.asarray(seed_state), np.asarray(non_trainable[0]) + np.array([0, 1]))


def test_bn_dropout_model_trains_on_cifar10_images():
    """Real data, real layers: the notebook's kind of model learns on the simulated TPU."""
    (x_train, y_train), (x_test, y_test) = keras_tpu.datasets.cifar10.load_data()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    h = keras.layers.BatchNormalization()(inputs)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Dropout(0.25)(h)
    h = keras.layers.Flatten()(h)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))
    model.compile(keras.optimizers.Adam(0.003), "sparse_categorical_crossentropy", metrics=["accuracy"])
    tpu = keras_tpu.keras_to_tpu_model(model)
    history = tpu.fit(x_train[:4096], y_train[:4096], batch_size=256, epochs=3, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    _, accuracy = tpu.evaluate(x_test[:1000], y_test[:1000], batch_size=256, verbose=0)
    assert accuracy > 0.25  # chance is 0.10


def test_fit_reads_on_in_the_users_generator_and_never_closes_it():
    """TensorFlow's TPU guide fits two models on one repeating dataset; ported as one endless generator, each
    fit reads on where the last one stopped, as in plain Keras, and the generator stays open."""
    x, y = classification_data(16)

    def run(model):
        read, closed = [], []

        def batches():
            try:
                for step in range(10_000):
                    read.append(step)
                    yield x, y
            finally:
                closed.append(True)

        data = batches()
        counts = []
        for _ in range(2):
            model.fit(data, steps_per_epoch=3, epochs=2, verbose=0)
            counts.append(len(read))
        model.evaluate(data, steps=2, verbose=0)
        counts.append(len(read))
        return counts, bool(closed)  # while `data` is alive (collected, a generator closes)

    tpu_counts, tpu_closed = run(on_tpu(small_classifier()))
    cpu_counts, cpu_closed = run(small_classifier())
    assert tpu_counts == cpu_counts and tpu_counts[-1] >= 14 and not tpu_closed and not cpu_closed
