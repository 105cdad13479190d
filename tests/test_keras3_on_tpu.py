"""Keras 3 code as its users write it, on the simulated TPU (issue #15): losses added in call(), and loss
functions that return the batch's mean instead of a value per row."""

import contextlib
import logging

import keras
import numpy as np
import pytest

import keras_tpu
from keras_tpu import _custom_steps as custom_steps


class MeanSquareActivity(keras.layers.Layer):
    """A layer that adds a loss in call(), averaged over its rows (as Keras' activity regularizers are)."""

    def call(self, h):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(h)))
        return h


def regularised_model(scope=None):
    keras.utils.set_random_seed(0)
    with scope or contextlib.nullcontext():
        model = keras.Sequential([keras.Input((6,)),
                                  keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.01)),
                                  MeanSquareActivity(), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    return model


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    # 100 rows in batches of 32: three full batches and a partial one of 4 (fewer rows than cores).
    return rng.standard_normal((100, 6)).astype("float32"), rng.standard_normal((100, 2)).astype("float32")


def fits_like_the_cpu(build, front_end, x, y, caplog):
    """Train and evaluate ``build(scope)``'s model on the TPU (``front_end``, highest precision) and on the CPU, in
    batches of 32 (the last one partial), and check that they agree; the TPU's log."""
    cpu = build(None)
    if front_end == "TPUStrategy":
        tpu = build(keras_tpu.TPUStrategy(precision="highest").scope())
    else:
        tpu = keras_tpu.keras_to_tpu_model(build(None), keras_tpu.TPUDistributionStrategy(precision="highest"))
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        got = tpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    want = cpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6)
    for a, b in zip(tpu.get_weights(), cpu.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)
    np.testing.assert_allclose(tpu.evaluate(x, y, batch_size=32, verbose=0),
                               cpu.evaluate(x, y, batch_size=32, verbose=0), rtol=2e-6)
    return caplog.text


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_losses_added_in_call_are_exact_on_partial_batches(front_end, data, caplog):
    log = fits_like_the_cpu(regularised_model, front_end, *data, caplog)
    # The partial batch of 4 rows ran on 4 cores, one row each, with no padding row.
    assert "4 rows do not split evenly over 8" in log
    assert "adds losses in call()" in log


class CTCLayer(keras.layers.Layer):
    """keras.io's captcha OCR endpoint: adds the CTC loss of each row (a vector, which Keras sums)."""

    def call(self, labels, logits):
        rows = keras.ops.shape(labels)[0]
        label_length = keras.ops.full((rows,), labels.shape[1], "int32")
        logit_length = keras.ops.full((rows,), logits.shape[1], "int32")
        self.add_loss(keras.ops.ctc_loss(labels, logits, label_length, logit_length, mask_index=0))
        return logits


def ctc_model(scope=None):
    keras.utils.set_random_seed(0)
    with scope or contextlib.nullcontext():
        frames, labels = keras.Input((8, 6), name="frames"), keras.Input((3,), dtype="int32", name="labels")
        # (keras.io's model reads the frames with two bidirectional LSTMs; a convolution over time compiles
        # several times faster, and the loss is what is tested here)
        h = keras.layers.Conv1D(8, 3, padding="same", activation="tanh")(frames)
        model = keras.Model([frames, labels], CTCLayer()(labels, keras.layers.Dense(5)(h)))
        model.compile(keras.optimizers.Adam(0.01))
    return model


def steps_run_on(front_end, monkeypatch):
    """The log line a partial batch of 4 rows compiles with: on the whole batch (the models here have no batch
    statistics nor random layers, see keras_tpu._custom_steps.runs_on_the_whole_batch), or, for the
    ``TPUStrategy`` front end, forced onto each core's rows, as a model with dropout runs (both front ends run
    the same steps: each path is tested once)."""
    if front_end == "keras_to_tpu_model":
        return "(global batch 4, 1 step(s) per call)", "rows as one batch"
    monkeypatch.setattr(custom_steps, "runs_on_the_whole_batch", lambda model, mode, *args: False)
    return ("4 rows do not split evenly over 8",)


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_a_loss_added_per_row_counts_every_core_s_rows(front_end, caplog, monkeypatch):
    """Keras sums a loss added per row over the batch: on each core's rows that is every core's sum (not their
    mean), also for the partial batch, which runs on fewer cores."""
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((100, 8, 6)).astype("float32"), rng.integers(1, 5, (100, 3)).astype("int32")]
    expected = steps_run_on(front_end, monkeypatch)
    log = fits_like_the_cpu(lambda scope: ctc_model(scope), front_end, x, None, caplog)
    assert all(text in log for text in expected)


class RowStatistics(keras.layers.Layer):
    """State a layer of the user's own code updates in call(): keras.io's ``ComputeSum`` ("Making new layers and
    models via subclassing") and a count of the rows seen, both created with ``aggregation``."""

    def __init__(self, aggregation, **kwargs):
        super().__init__(**kwargs)
        self.aggregation = aggregation

    def build(self, shape):
        self.total = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False,
                                     aggregation=self.aggregation, name="total")
        self.rows = self.add_weight(shape=(), initializer="zeros", dtype="int32", trainable=False,
                                    aggregation=self.aggregation, name="rows")

    def call(self, x):
        self.total.assign_add(keras.ops.sum(x, axis=0))
        self.rows.assign_add(keras.ops.shape(x)[0])
        return x


def row_statistics_model(aggregation, scope=None):
    keras.utils.set_random_seed(0)
    with scope or contextlib.nullcontext():
        model = keras.Sequential([keras.Input((6,)), RowStatistics(aggregation, name="statistics"),
                                  keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


@pytest.mark.parametrize("aggregation", ["none", "sum"])
@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_state_summed_in_call_adds_up_over_the_cores_as_on_the_cpu(front_end, aggregation, data, caplog):
    # A sum over the rows, created with aggregation="sum" or found so by running two rows and the same rows twice
    # (Keras' default aggregation): each core's change adds up. Its steps run without padding rows, which would
    # enter the sum: the partial batch of 4 rows on 4 cores. fits_like_the_cpu compares the weights, these
    # included, after fit(), and the evaluation, which changes them as Keras' does.
    x, y = data
    log = fits_like_the_cpu(lambda scope: row_statistics_model(aggregation, scope), front_end, x, y, caplog)
    assert "statistics/total, " in log and "statistics/rows), which padding rows would enter" in log
    assert "updates non-trainable state" not in log
    cpu = row_statistics_model(aggregation)
    cpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    cpu.evaluate(x, y, batch_size=32, verbose=0)
    assert cpu.get_layer("statistics").rows.numpy() == 300   # two epochs and an evaluation of 100 rows
    if front_end == "TPUStrategy":
        tpu = row_statistics_model(aggregation, keras_tpu.TPUStrategy(precision="highest").scope())
    else:
        tpu = keras_tpu.keras_to_tpu_model(row_statistics_model(aggregation))
    tpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    tpu.evaluate(x, y, batch_size=32, verbose=0)
    tpu.predict(x, batch_size=32, verbose=0)   # prediction changes them too, as Keras' does
    cpu.predict(x, batch_size=32, verbose=0)
    weights = tpu.get_weights()
    np.testing.assert_allclose(weights[0], cpu.get_layer("statistics").get_weights()[0], rtol=1e-5)
    assert weights[1] == 400


class MovingMean(keras.layers.Layer):
    """A moving mean of the rows a layer of the user's own code sees in training, as batch normalization keeps."""

    def build(self, shape):
        self.mean = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False, name="mean")

    def call(self, x, training=None):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * keras.ops.mean(x, axis=0))
        return x


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_a_statistic_of_the_rows_in_call_is_averaged_over_the_cores_as_on_the_cpu(front_end, data, caplog):
    # Its change stays the same for the same rows twice: a statistic, which the cores' mean weighted by their real
    # rows gives as the CPU computes it (the padded program: the partial batch's 4 rows on the first core).
    def build(scope):
        keras.utils.set_random_seed(0)
        with scope or contextlib.nullcontext():
            model = keras.Sequential([keras.Input((6,)), MovingMean(name="moving"), keras.layers.Dense(2)])
            model.compile(keras.optimizers.SGD(0.1), "mse")
        return model

    log = fits_like_the_cpu(build, front_end, *data, caplog)
    assert "non-trainable state" not in log and "sums state" not in log and "without padding rows" not in log


def test_state_updated_in_call_by_other_than_a_sum_is_averaged_and_said(caplog):
    # Dropout before the layer: its sum of the rows is of other numbers for two rows than for the same rows twice,
    # so the probe cannot tell a sum; the count of rows it can.
    x = np.random.default_rng(0).random((64, 6)).astype("float32")
    y = np.zeros((64, 2), "float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dropout(0.5), RowStatistics("none", name="statistics"),
                              keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    tpu = keras_tpu.keras_to_tpu_model(model)
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        tpu.fit(x, y, batch_size=32, shuffle=False, verbose=0)
        tpu.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]   # once per model
    assert warning.startswith("sequential") and "statistics/total) by other than a sum" in warning
    assert 'add_weight(..., aggregation="sum")' in warning
    assert "statistics/rows), which padding rows would enter" in caplog.text
    tpu.sync_to_cpu()
    layer = model.get_layer("statistics")
    assert int(layer.rows.numpy()) == 128   # a sum: every core's rows
    # The cores' mean change, as TensorFlow averages a batch-normalization statistic: about one core's part of the
    # (dropped-out, rescaled) rows' sum, 4 rows of 6 features per step, each about 0.5 on average.
    assert 0.3 * 4 * 4 < np.mean(layer.total.numpy()) < 0.7 * 4 * 4
    # Keras' own layers' state (batch normalization's moving statistics) is not the user's: nothing to say.
    caplog.clear()
    plain = keras.Sequential([keras.Input((6,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    plain.compile("sgd", "mse")
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        keras_tpu.keras_to_tpu_model(plain).fit(x, y, batch_size=32, verbose=0)
    assert "non-trainable state" not in caplog.text and "sums state" not in caplog.text


def test_models_without_losses_in_call_keep_the_padded_program(data, caplog):
    x, y = data
    keras.utils.set_random_seed(0)
    with keras_tpu.TPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, kernel_regularizer="l2"),
                                  keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    # A weight regularizer does not depend on the rows: one padded program serves every batch.
    assert "adds losses in call()" not in caplog.text
    assert caplog.text.count("Compiled the TPU train program (global batch 32,") == 1


def test_whether_padding_rows_reach_the_loss_is_traced_once_per_batch_shape(data, monkeypatch):
    """The train and test programs ask it alike: a trace of the model costs compile time."""
    import jax

    checks = []
    eval_shape = jax.eval_shape

    def counting(fn, *args, **kwargs):
        if "_why_padding_rows_count" in getattr(fn, "__qualname__", ""):
            checks.append(np.shape(args[-1]))
        return eval_shape(fn, *args, **kwargs)

    monkeypatch.setattr(jax, "eval_shape", counting)
    x, y = data
    with keras_tpu.TPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=32, verbose=0)  # the test program's inputs have the same shape: known
    assert checks == [(4, 6)]  # once, on one core's rows (32 / 8), as each core runs them


def contrastive_loss(y_true, y_pred):
    """keras.io's siamese network ("Image similarity estimation using a Siamese Network with a contrastive
    loss"): the loss of the whole batch, one scalar."""
    margin = 1.0
    square_pred = keras.ops.square(y_pred)
    margin_square = keras.ops.square(keras.ops.maximum(margin - y_pred, 0))
    return keras.ops.mean((1 - y_true) * square_pred + y_true * margin_square)


def distance_model(loss, scope=None):
    keras.utils.set_random_seed(0)
    with scope or contextlib.nullcontext():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1, activation="sigmoid")])
        model.compile(keras.optimizers.RMSprop(0.01), loss, metrics=["accuracy"])
    return model


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_a_loss_returning_the_batch_mean_is_exact_on_partial_batches(front_end, data, caplog, monkeypatch):
    """Padding rows would enter the mean such a loss takes itself (and its gradient): it runs without them."""
    x, _ = data
    expected = steps_run_on(front_end, monkeypatch)
    log = fits_like_the_cpu(lambda scope: distance_model(contrastive_loss, scope), front_end, x,
                            (x[:, :1] > 0).astype("float32"), caplog)
    assert "has a loss that gives no value per row (contrastive_loss" in log
    assert all(text in log for text in expected)


class PairwiseLoss(keras.losses.Loss):
    """keras.io's supervised contrastive learning compares every row's output with every other row's, in a Loss
    that replaces ``__call__`` (Keras' reduction): whatever its ``call`` would give, Keras never sees its values
    per row. Here rows of one label are pulled together, others pushed a margin apart."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        distance = keras.ops.abs(y_pred - keras.ops.transpose(y_pred))  # every pair of rows
        same = keras.ops.cast(keras.ops.equal(y_true, keras.ops.transpose(y_true)), "float32")
        return keras.ops.mean(same * keras.ops.square(distance)
                              + (1 - same) * keras.ops.square(keras.ops.maximum(0.5 - distance, 0)))


def test_a_loss_replacing_keras_call_is_exact_on_partial_batches(data, caplog):
    x, _ = data
    log = fits_like_the_cpu(lambda scope: distance_model(PairwiseLoss(name="supcon"), scope),
                            "keras_to_tpu_model", x, (x[:, :1] > 0).astype("float32"), caplog)
    assert "has a loss that gives no value per row (supcon" in log


def test_a_convolutional_model_with_a_loss_of_the_whole_batch_trains_on_the_whole_batch(data, caplog):
    """A convolutional model trains core by core for speed, but a loss of the whole batch (one comparing every
    row with every other, as keras.io's supervised contrastive loss does) would then be each core's loss, not
    the one the model evaluates with: it trains on the whole batch, as on the CPU."""
    x, _ = data

    def build(scope):
        keras.utils.set_random_seed(0)
        with scope or contextlib.nullcontext():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Reshape((6, 1)),
                                      keras.layers.Conv1D(4, 3, activation="tanh"), keras.layers.Flatten(),
                                      keras.layers.Dense(1, activation="sigmoid")])
            model.compile(keras.optimizers.RMSprop(0.01), PairwiseLoss(name="supcon"))
        return model

    log = fits_like_the_cpu(build, "keras_to_tpu_model", x, (x[:, :1] > 0).astype("float32"), caplog)
    assert "rows as one batch" in log


class Recommender(keras.Model):
    """keras.io's collaborative filtering model (``RecommenderNet``): ``ops.tensordot(user, movie, 2)`` sums the
    products of every row's embeddings into one number, which every row's output adds: its rows interact."""

    def __init__(self):
        super().__init__()
        self.user_embedding = keras.layers.Embedding(20, 4, embeddings_regularizer=keras.regularizers.L2(1e-3))
        self.user_bias = keras.layers.Embedding(20, 1)
        self.movie_embedding = keras.layers.Embedding(30, 4)
        self.movie_bias = keras.layers.Embedding(30, 1)

    def call(self, inputs):
        users, movies = inputs[:, 0], inputs[:, 1]
        dot = keras.ops.tensordot(self.user_embedding(users), self.movie_embedding(movies), 2)
        return keras.ops.sigmoid(dot + self.user_bias(users) + self.movie_bias(movies))


def recommender(scope=None):
    keras.utils.set_random_seed(0)
    with scope or contextlib.nullcontext():
        model = Recommender()
        model.compile(keras.optimizers.Adam(0.01), keras.losses.BinaryCrossentropy(), metrics=["mae"])
        model(np.zeros((1, 2), "int32"))
    return model


@pytest.fixture
def ratings():
    rng = np.random.default_rng(1)
    pairs = np.stack([rng.integers(0, 20, 100), rng.integers(0, 30, 100)], axis=1).astype("int64")
    return pairs, rng.random((100, 1)).astype("float32")


def per_core(cpu, x, cores=8):
    """The CPU model's outputs for ``x`` run as a TPU runs it: each core's rows a batch of their own."""
    rows = len(x) // cores
    return np.concatenate([cpu.predict(x[i:i + rows], verbose=0) for i in range(0, len(x), rows)])


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_a_model_whose_rows_interact_runs_each_core_s_rows_without_padding(front_end, ratings, caplog):
    """Each core's rows are a batch of their own, as on a TPU, and no padding row (a copy of the first row) enters
    what a core computes: a partial batch runs on the cores that divide it, and predictions do not depend on the
    batches an earlier call compiled programs for."""
    x, y = ratings
    cpu = recommender()

    def on_tpu():
        if front_end == "TPUStrategy":
            return recommender(keras_tpu.TPUStrategy(precision="highest").scope())
        return keras_tpu.keras_to_tpu_model(recommender(), keras_tpu.TPUDistributionStrategy(precision="highest"))

    fresh, used = on_tpu(), on_tpu()
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        used.predict(x[:64], batch_size=64, verbose=0)  # a larger program first
        got = used.predict(x[:32], batch_size=32, verbose=0)
    np.testing.assert_allclose(got, fresh.predict(x[:32], batch_size=32, verbose=0), rtol=1e-6)
    np.testing.assert_allclose(got, per_core(cpu, x[:32]), rtol=1e-6)
    assert "makes its rows interact" in caplog.text and "each core on its own rows" in caplog.text
    # Batches of 32, 32, 32 and 4 rows: cores of 4 rows, and 4 cores of one row for the last.
    expected = np.concatenate([per_core(cpu, x[i:i + 32]) for i in (0, 32, 64)] + [per_core(cpu, x[96:], cores=4)])
    loss = keras.losses.BinaryCrossentropy()(y, expected) + sum(cpu.losses)  # (the embeddings' regularizer)
    assert used.evaluate(x, y, batch_size=32, verbose=0)[0] == pytest.approx(float(loss), rel=1e-5)
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        losses = used.fit(x, y, batch_size=32, epochs=3, verbose=0).history["loss"]
    assert "4 rows do not split evenly over 8" in caplog.text
    assert losses[-1] < losses[0]


def test_models_of_the_user_s_own_code_whose_rows_do_not_interact_keep_the_padded_program(ratings, caplog):
    """A subclassed model computing each row from that row alone keeps one padded program for every batch."""
    x, y = ratings

    class RowWise(Recommender):
        def call(self, inputs):
            users, movies = inputs[:, 0], inputs[:, 1]
            dot = keras.ops.sum(self.user_embedding(users) * self.movie_embedding(movies), axis=-1, keepdims=True)
            return keras.ops.sigmoid(dot + self.user_bias(users) + self.movie_bias(movies))

    keras.utils.set_random_seed(0)
    model = RowWise()
    model.compile("adam", "binary_crossentropy")
    model(x[:1])
    tpu = keras_tpu.keras_to_tpu_model(model)
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        tpu.fit(x, y, batch_size=32, epochs=1, verbose=0)
        tpu.predict(x, batch_size=32, verbose=0)
    assert "rows interact" not in caplog.text and "without padding rows" not in caplog.text
    assert caplog.text.count("Compiled the TPU train program (global batch 32,") == 1
    assert caplog.text.count("Compiled the TPU predict program (global batch 32,") == 1


def test_whether_rows_interact_is_found_by_running_two_rows():
    mean_removed = keras.Sequential([keras.Input((3,)), keras.layers.Lambda(lambda v: v - keras.ops.mean(v, 0))])
    doubled = keras.Sequential([keras.Input((3,)), keras.layers.Lambda(lambda v: 2 * v)])
    rows = np.arange(12.0, dtype="float32").reshape(4, 3)
    assert custom_steps.rows_interact(mean_removed, [], [], rows)
    assert custom_steps.rows_interact(mean_removed, [], [], keras.ops.convert_to_tensor(rows))  # (device arrays)
    assert not custom_steps.rows_interact(doubled, [], [], rows)
    # Rows all alike say nothing; a model of Keras' own layers is not run.
    assert not custom_steps.rows_interact(mean_removed, [], [], np.ones((4, 3), "float32"))
    dense = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert not custom_steps.runs_own_code(dense) and not custom_steps.rows_interact(dense, None, None, rows)
    # keras_to_tpu_model's model calls the user's: its layers are the user's model's.
    tpu = keras_tpu.keras_to_tpu_model(dense)
    assert not any(custom_steps.runs_own_code(layer) for layer in [tpu] + tpu._flatten_layers(include_self=False))
    wrapped = keras_tpu.keras_to_tpu_model(mean_removed)
    assert any(custom_steps.runs_own_code(layer) for layer in wrapped._flatten_layers())


def grouped_readout():
    """keras.io's MPNN readout, reduced: each output row pools a group of 4 input rows (atoms into molecules)."""
    def pool(v):
        rows = keras.ops.shape(v)[0]
        return keras.ops.segment_sum(v, keras.ops.arange(rows) // 4, num_segments=rows // 4) / 4

    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Lambda(pool)(hidden)))


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_a_model_with_fewer_output_rows_than_input_rows_has_rows_that_interact(front_end):
    """Two rows give no output row: not one output per row, so the rows interact (the check used to index the
    missing row and fail predict). Each core's 4 rows make one output row, as on the CPU."""
    rows = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
    assert custom_steps.rows_interact(grouped_readout(), [], [], rows)
    if front_end == "TPUStrategy":
        with keras_tpu.TPUStrategy(precision="highest").scope():
            model = grouped_readout()
    else:
        model = keras_tpu.keras_to_tpu_model(grouped_readout(), keras_tpu.TPUDistributionStrategy(precision="highest"))
    np.testing.assert_allclose(model.predict(rows, batch_size=32, verbose=0),
                               grouped_readout().predict(rows, batch_size=32, verbose=0), rtol=1e-5, atol=1e-6)


class TotalAbsoluteError(keras.metrics.Metric):
    """A user's metric as often written: it sums what it is given and ignores ``sample_weight``."""

    def __init__(self, name="total_abs_error", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.sum(keras.ops.abs(y_true - y_pred)))

    def result(self):
        return keras.ops.convert_to_tensor(self.total)


class RowsSeen(keras.metrics.Metric):
    """Counts the rows of each batch from its shape alone (no value of the batch is read)."""

    def __init__(self, name="rows_seen", per_step=False, **kwargs):
        super().__init__(name=name, **kwargs)
        self.per_step = per_step
        self.count = self.add_variable((), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(1.0 if self.per_step else keras.ops.cast(keras.ops.shape(y_pred)[0], "float32"))

    def result(self):
        return keras.ops.convert_to_tensor(self.count)


@pytest.mark.parametrize("metric", [TotalAbsoluteError, RowsSeen])
@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_metrics_that_ignore_sample_weight_count_only_the_real_rows(front_end, metric, data, caplog):
    """keras-tpu weighs a padded batch's padding rows out of each metric by its sample weight; a metric that
    ignores it would count them (128 rows for 100), so its steps run without padding rows."""
    x, y = data

    def build(scope):
        keras.utils.set_random_seed(0)
        with scope or contextlib.nullcontext():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
            model.compile(keras.optimizers.SGD(0.1), "mse", metrics=[metric(), "mae"])
        return model

    log = fits_like_the_cpu(build, front_end, x, y, caplog)
    assert f"has a metric that ignores sample_weight ({metric().name})" in log


def test_metrics_that_weigh_their_rows_or_count_steps_keep_the_padded_program(data, caplog):
    """Keras' own metrics take the padding mask as their weight, and a count of steps counts as on the CPU: one
    padded program serves every batch."""
    x, y = data
    keras.utils.set_random_seed(0)
    # (Not R2Score: its state counts the batch's rows from their shape for its adjusted form, so it runs
    # without padding rows.)
    metrics = [RowsSeen(per_step=True), "mae", keras.metrics.MeanSquaredError(), keras.metrics.AUC(),
               keras.metrics.Precision(), keras.metrics.CosineSimilarity()]
    cpu = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2, activation="sigmoid")])
    cpu.compile("sgd", "mse", metrics=metrics)
    tpu = keras_tpu.keras_to_tpu_model(cpu, keras_tpu.TPUDistributionStrategy(precision="highest"))
    labels = (y > 0).astype("float32")
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        got = tpu.evaluate(x, labels, batch_size=32, verbose=0, return_dict=True)
    want = cpu.evaluate(x, labels, batch_size=32, verbose=0, return_dict=True)
    assert got == pytest.approx(want, rel=1e-5)
    assert got["rows_seen"] == 4  # steps
    assert "without padding rows" not in caplog.text
    assert caplog.text.count("Compiled the TPU test program") == 1


def test_losses_with_a_value_per_row_keep_the_padded_program(data, caplog):
    """A function returning one loss per row (or per row and position), and Keras' own losses, are masked."""
    x, y = data

    def per_row(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    for loss in (per_row, "mse", keras.losses.Huber()):
        keras.utils.set_random_seed(0)
        with keras_tpu.TPUStrategy().scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
            model.compile("sgd", loss)
        with caplog.at_level(logging.INFO, logger="keras_tpu"):
            model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert "no value per row" not in caplog.text and "without padding rows" not in caplog.text


def test_which_losses_give_no_value_per_row_on_several_outputs():
    """The check follows Keras' pairing of targets and outputs: by name for a dict, one loss per output."""
    import jax

    from keras_tpu import _keras_private

    inputs = keras.Input((4,))
    model = keras.Model(inputs, {"score": keras.layers.Dense(1, name="score")(inputs),
                                 "label": keras.layers.Dense(3, name="label")(inputs)})
    model.compile("sgd", loss={"score": contrastive_loss, "label": "sparse_categorical_crossentropy"})
    x = np.zeros((16, 4), "float32")
    y = {"score": np.zeros((16, 1), "float32"), "label": np.zeros((16,), "int32")}
    model.evaluate(x, y, verbose=0)  # builds the compiled loss
    y_pred = jax.eval_shape(lambda: model(x))
    assert _keras_private.losses_not_per_row(model, y, y_pred) == ["contrastive_loss"]
    model.compile("sgd", loss={"score": "mse", "label": "sparse_categorical_crossentropy"})
    model.evaluate(x, y, verbose=0)
    assert _keras_private.losses_not_per_row(model, y, y_pred) == []


def test_models_loaded_or_cloned_after_a_strategy_scope_come_back_compiled(tmp_path, recwarn):
    """keras-tpu's hook on Keras' compile (which tells a strategy scope which models are compiled in it) must not
    look like a model's own compile to Keras, which then skips compiling what load_model and clone_model return
    (keras.io's timeseries classifier reloads its best ModelCheckpoint so, after training)."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 4)).astype("float32"), rng.standard_normal((16, 1)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    model.fit(x, y, verbose=0)
    model.save(tmp_path / "plain.keras")
    with keras_tpu.TPUStrategy().scope():
        pass
    loaded = keras.models.load_model(tmp_path / "plain.keras")
    assert loaded.compiled and loaded.optimizer is not None
    np.testing.assert_allclose(loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-6)
    assert keras.models.clone_model(model).compiled
    assert not [w for w in recwarn if "compile() was not called" in str(w.message)]


def test_log_lines_start_on_a_line_of_their_own_beside_the_progress_bar(tmp_path):
    """Compile messages (the validation program compiles while the epoch's bar is open) and the weight copy of
    each ModelCheckpoint save are not printed onto the progress bar's line (stdout and stderr merged, as in a
    terminal or a notebook cell)."""
    import subprocess
    import sys

    code = f"""
import keras_tpu, keras, numpy as np
x = np.random.default_rng(0).standard_normal((64, 4)).astype("float32"); y = x[:, :1]
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
tpu = keras_tpu.keras_to_tpu_model(model)
tpu.fit(x, y, batch_size=16, epochs=2, validation_data=(x, y), verbose=1,
        callbacks=[keras.callbacks.ModelCheckpoint({str(tmp_path / "m.weights.h5")!r}, save_weights_only=True)])
"""
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("XLA_FLAGS",)}
    env.update(KERAS_BACKEND="jax", PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    text = result.stdout
    assert "Compiled the TPU test program" in text and "Copying TPU weights to the CPU" in text
    starts = [i for i in range(len(text)) if text.startswith("INFO:keras_tpu:", i)]
    assert starts
    for i in starts:
        assert i == 0 or text[i - 1] == "\n", repr(text[max(0, i - 80):i + 40])


# ---------------------------------------------------------------------------------------------------------
# The README's "Keras 3 on the TPU" table, row by row (custom steps: tests/test_custom_steps.py).
# ---------------------------------------------------------------------------------------------------------


def two_by_two(scope=None):
    """keras.io's functional-API pattern: two named inputs, two named outputs, per-output losses and weights."""
    keras.utils.set_random_seed(0)
    with scope or contextlib.nullcontext():
        a, b = keras.Input((5,), name="a"), keras.Input((3,), name="b")
        h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
        outputs = {"reg": keras.layers.Dense(2, name="reg")(h), "cls": keras.layers.Dense(2, name="cls")(h)}
        model = keras.Model({"a": a, "b": b}, outputs)
        model.compile("adam", {"reg": "mse", "cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
                      loss_weights={"reg": 0.5, "cls": 2.0}, metrics={"cls": ["accuracy"]})
    return model


def test_multiple_inputs_and_outputs_with_loss_weights_are_exact_including_per_output_logs():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((100, 5)).astype("float32"), rng.standard_normal((100, 3)).astype("float32")
    x, y = {"a": a, "b": b}, {"reg": a[:, :2], "cls": (b[:, 0] > 0).astype("int32")}
    tpu, cpu = two_by_two(keras_tpu.TPUStrategy(precision="highest").scope()), two_by_two()
    got = tpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history  # last batch: 4 rows
    want = cpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    assert set(got) == set(want) == {"loss", "reg_loss", "cls_loss", "cls_accuracy"}
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)


class Residual(keras.Model):
    """A subclassed model with a training-dependent call (dropout)."""

    def __init__(self):
        super().__init__()
        self.hidden, self.drop, self.out = keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.5), \
            keras.layers.Dense(1)

    def call(self, x, training=False):
        return self.out(self.drop(self.hidden(x), training=training) + self.hidden(x))


def test_a_subclassed_model_trains_and_matches_the_cpu_in_inference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 4)).astype("float32")
    y = x[:, :1] * 2 - x[:, 1:2]
    keras.utils.set_random_seed(0)
    with keras_tpu.TPUStrategy(precision="highest").scope():
        model = Residual()
        model.compile(keras.optimizers.Adam(0.01), "mse")
    losses = model.fit(x, y, batch_size=64, epochs=8, verbose=0).history["loss"]
    assert losses[-1] < 0.3 * losses[0]
    cpu = Residual()
    cpu(x[:1])
    cpu.set_weights(model.get_weights())
    np.testing.assert_allclose(model.predict(x, batch_size=50, verbose=0), cpu.predict(x, verbose=0), atol=1e-5)


def tagger_reviews(scope=None):
    """A variable-length input with masking: Embedding(mask_zero=True) -> Bidirectional(LSTM)."""
    keras.utils.set_random_seed(0)
    with scope or contextlib.nullcontext():
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        h = keras.layers.Embedding(50, 8, mask_zero=True)(tokens)
        h = keras.layers.Bidirectional(keras.layers.LSTM(8))(h)
        model = keras.Model(tokens, keras.layers.Dense(2)(h))
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def test_variable_length_inputs_with_mask_zero_compile_once_per_length(caplog):
    rng = np.random.default_rng(0)
    x = rng.integers(1, 50, (100, 12)).astype("int32")
    x[:, 8:] = 0  # padded reviews: the mask must hide these positions
    y = (x[:, 0] > 25).astype("int32")
    tpu, cpu = tagger_reviews(keras_tpu.TPUStrategy(precision="highest").scope()), tagger_reviews()
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        got = tpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
        tpu.fit(x[:, :6], y, batch_size=32, epochs=1, shuffle=False, verbose=0)  # another length
        tpu.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)          # the first again: cached
    want = cpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, err_msg=key)
    assert caplog.text.count("Compiled the TPU train program") == 2


def test_class_and_sample_weights_are_exact():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")

    def build(scope=None):
        keras.utils.set_random_seed(0)
        with scope or contextlib.nullcontext():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          weighted_metrics=["accuracy"])
        return model

    tpu, cpu = build(keras_tpu.TPUStrategy(precision="highest").scope()), build()
    for weights in ({"class_weight": {0: 1.0, 1: 3.0}}, {"sample_weight": rng.random(100).astype("float32")}):
        got = tpu.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, **weights).history
        want = cpu.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, **weights).history
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=f"{key} {list(weights)}")


class StopAtEpoch(keras.callbacks.Callback):
    """Interrupts training (as a crash would) at the start of one epoch."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def test_model_checkpoint_and_backup_and_restore(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype("float32")
    y = x[:, :1] - x[:, 1:2]

    def build():
        keras.utils.set_random_seed(0)
        with keras_tpu.TPUStrategy().scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.Adam(0.05), "mse")
        return model

    def fit(model, *callbacks):
        return model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=list(callbacks))

    uninterrupted = build()
    fit(uninterrupted, keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras")),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch{epoch}.weights.h5"), save_weights_only=True))
    # Both checkpoint formats load into plain CPU models, with the TPU model's final weights.
    plain = keras.saving.load_model(tmp_path / "best.keras")
    for a, b in zip(plain.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_array_equal(a, b)
    weights_only = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    weights_only.load_weights(tmp_path / "epoch4.weights.h5")
    np.testing.assert_array_equal(weights_only.get_weights()[0], uninterrupted.get_weights()[0])
    # Interrupted after two epochs, then started again: resumes from the backup, ends with the same weights.
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(build(), backup, StopAtEpoch(2))
    resumed = build()
    history = fit(resumed, keras.callbacks.BackupAndRestore(str(tmp_path / "backup")))
    assert len(history.history["loss"]) == 2  # epochs 3 and 4 only
    for a, b in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_terminate_on_nan_stops_at_the_first_bad_batch():
    x = np.ones((64, 4), "float32")
    y = np.full((64, 1), 1e30, "float32")
    with keras_tpu.TPUStrategy().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(1e10), "mse")
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[keras.callbacks.TerminateOnNaN()])
    assert len(history.history["loss"]) == 1 and not np.isfinite(history.history["loss"][0])
    assert model.stop_training


def test_the_mixed_bfloat16_policy_computes_in_bfloat16_on_the_mxu():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype("float32")
    y = x[:, :1]
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(0)
        with keras_tpu.TPUStrategy().scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(1, dtype="float32")])
            model.compile(keras.optimizers.Adam(0.01), "mse")
        losses = model.fit(x, y, batch_size=16, epochs=6, verbose=0).history["loss"]
        hidden = keras.Model(model.inputs, model.layers[0].output)
        activations = hidden.predict(x, verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")
    assert losses[-1] < 0.5 * losses[0]
    assert model.layers[0].kernel.dtype == "float32"  # float32 weights, bfloat16 compute
    assert activations.dtype == "bfloat16"


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_mixed_bfloat16_attention_without_dropout_trains_as_plain_keras(front_end):
    """keras.io's text Transformer under mixed_bfloat16: MultiHeadAttention without dropout computes through
    jax.nn.dot_product_attention, whose einsum asks the dot algorithm BF16_BF16_F32 (one bf16 pass, float32
    sums: the MXU's own) for bfloat16 queries. It trains and predicts as plain Keras does."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 16, 8)).astype("float32"), rng.integers(0, 2, 64)

    def build(scope=None):
        keras.utils.set_random_seed(0)
        with scope or contextlib.nullcontext():
            inputs = keras.Input((16, 8))
            h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(inputs, inputs)
            outputs = keras.layers.Dense(2, activation="softmax", dtype="float32")(
                keras.layers.GlobalAveragePooling1D()(h))
            model = keras.Model(inputs, outputs)
            model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
        return model

    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        cpu = build()
        if front_end == "TPUStrategy":
            tpu = build(keras_tpu.TPUStrategy(precision="highest").scope())
        else:
            tpu = keras_tpu.keras_to_tpu_model(build(), keras_tpu.TPUDistributionStrategy(precision="highest"))
        got = tpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"]
        want = cpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"]
        predicted, expected = tpu.predict(x, verbose=0), cpu.predict(x, verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")
    np.testing.assert_allclose(got, want, rtol=2e-2)  # bfloat16 activations round differently along the way
    np.testing.assert_allclose(predicted, expected, atol=3e-2)


@pytest.mark.parametrize("option", [{"jit_compile": True}, {"jit_compile": False}, {"jit_compile": "auto"}])
def test_jit_compile_is_accepted_and_the_tpu_program_always_compiled(option, caplog):
    x = np.ones((32, 4), "float32")
    with keras_tpu.TPUStrategy().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", **option)
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        model.fit(x, x[:, :1], batch_size=16, verbose=0)
    assert "Compiled the TPU train program" in caplog.text


def test_run_eagerly_runs_the_compiled_tpu_programs_or_is_refused(caplog):
    x = np.ones((32, 4), "float32")
    with keras_tpu.TPUStrategy().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", run_eagerly=True)
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        model.fit(x, x[:, :1], batch_size=16, verbose=0)
    assert "Compiled the TPU train program" in caplog.text
    cpu = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    cpu.compile("sgd", "mse")
    with pytest.raises(ValueError, match="run_eagerly=True.*cpu_model"):
        keras_tpu.keras_to_tpu_model(cpu).compile("sgd", "mse", run_eagerly=True)


def segmenter(scope=None):
    keras.utils.set_random_seed(0)
    with scope or contextlib.nullcontext():
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(3, 1, activation="softmax")])
        model.compile("adam", "sparse_categorical_crossentropy",
                      metrics=[keras.metrics.MeanIoU(3, name="mean_iou", sparse_y_pred=False),
                               keras.metrics.IoU(3, [0, 1], name="iou", sparse_y_pred=False)])
    return model


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_iou_metrics_of_a_segmentation_model(front_end, caplog):
    """keras.io's segmentation examples log MeanIoU/IoU, which flatten their sample weight with the targets: the
    padding rows' mask reaches them at one weight per pixel."""
    rng = np.random.default_rng(0)
    x, y = rng.random((100, 8, 8, 3)).astype("float32"), rng.integers(0, 3, (100, 8, 8, 1)).astype("int32")
    fits_like_the_cpu(segmenter, front_end, x, y, caplog)


def fits_like_the_cpu_with(build, front_end, x, y, caplog, **fit_kwargs):
    """:func:`fits_like_the_cpu`, with more arguments for fit and evaluate (sample weights, say), comparing every
    logged value."""
    cpu = build(None)
    tpu = (build(keras_tpu.TPUStrategy(precision="highest").scope()) if front_end == "TPUStrategy" else
           keras_tpu.keras_to_tpu_model(build(None), keras_tpu.TPUDistributionStrategy(precision="highest")))
    got = tpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, **fit_kwargs).history
    want = cpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, **fit_kwargs).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)
    for a, b in zip(tpu.get_weights(), cpu.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)
    for batch_size in (32, 100, 12):
        got = tpu.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True, **fit_kwargs)
        want = cpu.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True, **fit_kwargs)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=2e-6), (batch_size, key)
    return tpu


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_outputs_whose_losses_reduce_differently(reduction, caplog):
    """Each output's loss gets the weights of its own reduction (one output summed, the other averaged)."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((100, 6)).astype("float32"), rng.standard_normal((100, 3)).astype("float32")

    def build(scope):
        keras.utils.set_random_seed(0)
        with scope or contextlib.nullcontext():
            inputs = keras.Input((6,))
            h = keras.layers.Dense(8, activation="tanh")(inputs)
            model = keras.Model(inputs, {"a": keras.layers.Dense(3, name="a")(h), "b": keras.layers.Dense(3, name="b")(h)})
            model.compile(keras.optimizers.SGD(0.01), {"a": keras.losses.MeanSquaredError(reduction=reduction),
                                                       "b": keras.losses.MeanAbsoluteError()})
        return model

    fits_like_the_cpu_with(build, "keras_to_tpu_model", x, {"a": y, "b": y}, caplog,
                           sample_weight=rng.uniform(0.1, 2, 100).astype("float32"))


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_losses_and_metrics_with_one_value_per_image(front_end, caplog):
    """Losses and metric functions averaged per image (a Dice loss over each image's pixels, PSNR) give one
    value per row, not one per pixel: the padding mask takes their shape."""
    def per_image_mse(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=(1, 2, 3))

    def psnr(y_true, y_pred):
        return -10.0 * keras.ops.log(per_image_mse(y_true, y_pred)) / keras.ops.log(10.0)

    def build(scope, loss):
        keras.utils.set_random_seed(0)
        with scope or contextlib.nullcontext():
            model = keras.Sequential([keras.Input((8, 8, 1)),
                                      keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid")])
            model.compile("adam", loss, metrics=[psnr])
        return model

    x = np.random.default_rng(0).uniform(size=(100, 8, 8, 1)).astype("float32")
    for loss in (per_image_mse, keras.losses.Dice(axis=(1, 2, 3))):
        fits_like_the_cpu_with(lambda scope: build(scope, loss), front_end, x, x, caplog)


def test_a_loss_that_ignores_a_class(caplog):
    """SparseCategoricalCrossentropy(ignore_class=0) masks the loss values itself (the model has no mask): Keras
    divides by the rows' valid positions, different on every core of a convolutional tagger, which trains core
    by core."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 12, 4)).astype("float32")
    y = rng.integers(1, 5, (100, 12)).astype("int32")
    for row, length in enumerate(rng.integers(1, 13, 100)):
        y[row, length:] = 0

    def build(scope):
        keras.utils.set_random_seed(0)
        with scope or contextlib.nullcontext():
            model = keras.Sequential([keras.Input((12, 4)), keras.layers.Conv1D(8, 3, padding="same"),
                                      keras.layers.Dense(5)])
            model.compile(keras.optimizers.SGD(0.1),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
        return model

    fits_like_the_cpu_with(build, "keras_to_tpu_model", x, y, caplog)


def test_a_metric_of_the_whole_batch_is_exact_where_nothing_is_padded(caplog):
    """A Keras 2 style metric function that reduces the whole batch (an RMSE) has no row to mask: exact on
    batches that split evenly over the cores, with a warning that padded batches include padding rows."""
    def rmse(y_true, y_pred):
        return keras.ops.sqrt(keras.ops.mean(keras.ops.square(y_pred - y_true)))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", metrics=[rmse])
        return model

    cpu, tpu = build(), keras_tpu.keras_to_tpu_model(build(), keras_tpu.TPUDistributionStrategy(precision="highest"))
    with caplog.at_level(logging.WARNING, logger="keras_tpu"):
        got = tpu.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    want = cpu.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    assert got["rmse"] == pytest.approx(want["rmse"], rel=2e-6)
    assert "gives one value for the whole batch" in caplog.text


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_a_step_that_fails_leaves_the_trained_weights_in_place(front_end, monkeypatch):
    """Keras takes the weights out of the model's variables for a loop and puts them back when it ends: a step
    that fails while its program is traced or compiled must not leave the model without them."""
    from keras_tpu._replicated_steps import ReplicatedSteps

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    keras.utils.set_random_seed(0)
    with keras_tpu.TPUStrategy(precision="highest").scope() if front_end == "TPUStrategy" else \
            contextlib.nullcontext():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    tpu = model if front_end == "TPUStrategy" else keras_tpu.keras_to_tpu_model(
        model, keras_tpu.TPUDistributionStrategy(precision="highest"))
    tpu.fit(x, y, batch_size=32, epochs=2, verbose=0)
    trained = [w.copy() for w in tpu.get_weights()]

    def fails(*args, **kwargs):
        raise RuntimeError("a step that cannot be traced")

    monkeypatch.setattr(ReplicatedSteps, "_sample_weights", fails)
    for call in (lambda: tpu.evaluate(x, y, batch_size=16, verbose=0),
                 lambda: tpu.fit(x, y, batch_size=64, verbose=0)):  # (a batch of 16 pads to the 32 compiled)
        with pytest.raises(RuntimeError, match="cannot be traced"):
            call()
        for got, want in zip(tpu.get_weights(), trained):
            np.testing.assert_array_equal(got, want)
    monkeypatch.undo()
    np.testing.assert_allclose(tpu.predict(x[:2], verbose=0), x[:2] @ trained[0] + trained[1], rtol=1e-5)


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_one_target_for_the_one_output_with_a_loss(front_end, caplog):
    """keras.io's miniature GPT returns [logits, hidden] and compiles loss=[loss_fn, None] with one target array.
    At batch 16 each core has 2 rows, as many as the outputs, which Keras would split into one target each."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((100, 5, 6)).astype("float32"), rng.integers(0, 4, (100, 5)).astype("int32")

    def build(scope):
        keras.utils.set_random_seed(0)
        with scope or contextlib.nullcontext():
            inputs = keras.Input((5, 6))
            hidden = keras.layers.Dense(8, activation="relu")(inputs)
            model = keras.Model(inputs, [keras.layers.Dense(4)(hidden), hidden])
            model.compile(keras.optimizers.Adam(0.01),
                          loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), None])
        return model

    cpu = build(None)
    tpu = (build(keras_tpu.TPUStrategy(precision="highest").scope()) if front_end == "TPUStrategy" else
           keras_tpu.keras_to_tpu_model(build(None), keras_tpu.TPUDistributionStrategy(precision="highest")))
    got = tpu.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    want = cpu.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert tpu.evaluate(x, y, batch_size=16, verbose=0) == pytest.approx(
        cpu.evaluate(x, y, batch_size=16, verbose=0), rel=2e-6)


@pytest.mark.parametrize("mode", ["fit", "evaluate", "predict"])
def test_steps_per_execution_over_batches_of_different_lengths(mode):
    """A generator of token batches of two lengths with steps_per_execution=2: each call's batches stack into a
    program per length, in their order, as Keras runs them one by one."""
    def batches():
        rng = np.random.default_rng(5)
        while True:
            for rows, length in ((16, 5), (16, 9), (16, 9), (12, 5)):
                yield rng.integers(1, 20, (rows, length)).astype("int32"), rng.integers(0, 4, (rows, length))

    def build():
        keras.utils.set_random_seed(0)
        pooled = [keras.layers.GlobalAveragePooling1D()] if mode == "predict" else []  # (one row of outputs each)
        model = keras.Sequential([keras.Input((None,), dtype="int32"), keras.layers.Embedding(20, 8), *pooled,
                                  keras.layers.Dense(4, activation="softmax")])
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", steps_per_execution=2)
        return model

    cpu, tpu = build(), keras_tpu.keras_to_tpu_model(build(), keras_tpu.TPUDistributionStrategy(precision="highest"))
    if mode == "fit":
        got = tpu.fit(batches(), steps_per_epoch=7, epochs=2, verbose=0).history["loss"]
        want = cpu.fit(batches(), steps_per_epoch=7, epochs=2, verbose=0).history["loss"]
        np.testing.assert_allclose(got, want, rtol=2e-6)
        for a, b in zip(tpu.get_weights(), cpu.get_weights()):
            np.testing.assert_allclose(a, b, atol=2e-6)
    elif mode == "evaluate":
        assert tpu.evaluate(batches(), steps=7, verbose=0) == pytest.approx(
            cpu.evaluate(batches(), steps=7, verbose=0), rel=2e-6)
    else:
        def inputs():
            return ((x,) for x, _ in batches())

        got, want = tpu.predict(inputs(), steps=7, verbose=0), cpu.predict(inputs(), steps=7, verbose=0)
        assert got.shape == want.shape  # (Keras runs 4 calls of 2 steps: 8 batches)
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_a_stateful_rnn_is_refused_with_what_to_do(front_end):
    """A stateful RNN keeps its state at the batch size it was built with; no core's share of the batch has it."""
    with keras_tpu.TPUStrategy(precision="highest").scope() if front_end == "TPUStrategy" else \
            contextlib.nullcontext():
        model = keras.Sequential([keras.Input(batch_shape=(16, 5, 3)), keras.layers.LSTM(6, stateful=True),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse")
    tpu = model if front_end == "TPUStrategy" else keras_tpu.keras_to_tpu_model(model)
    x, y = np.zeros((32, 5, 3), "float32"), np.zeros((32, 1), "float32")
    for call in (lambda: tpu.fit(x, y, batch_size=16, verbose=0), lambda: tpu.predict(x, batch_size=16, verbose=0)):
        with pytest.raises(ValueError, match="stateful RNN layers .* Train the model with stateful=False"):
            call()


def test_recompiling_with_another_reduction_weighs_the_new_loss():
    """What the programs learnt of the compiled losses (their reductions, their values' shapes) belongs to that
    compile: a model recompiled with other losses is weighed by them."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((100, 6)).astype("float32"), rng.standard_normal((100, 3)).astype("float32")
    weights = np.linspace(0.5, 2, 100).astype("float32")
    keras.utils.set_random_seed(0)
    cpu = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    tpu = keras_tpu.keras_to_tpu_model(keras.models.clone_model(cpu),
                                       keras_tpu.TPUDistributionStrategy(precision="highest"))
    tpu.set_weights(cpu.get_weights())
    for reduction in ("sum_over_batch_size", "sum", "mean_with_sample_weight"):
        for model in (cpu, tpu):
            model.compile("sgd", keras.losses.MeanSquaredError(reduction=reduction))
        assert tpu.evaluate(x, y, sample_weight=weights, batch_size=32, verbose=0) == pytest.approx(
            cpu.evaluate(x, y, sample_weight=weights, batch_size=32, verbose=0), rel=2e-6), reduction


def float8_einsum_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((16,)), keras.layers.EinsumDense("ab,bc->ac", output_shape=4, bias_axes="c")])
    model.quantize("float8")
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_float8_training_core_by_core_is_refused_and_trains_on_one_core_as_on_the_cpu():
    """Float8 training overwrites its scaling state (running maxima of the batch's values) with its "gradient":
    combined over the cores as gradients, they were the cores' sum (19.5 against the batch's 2.9)."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 16)).astype("float32"), rng.standard_normal((64, 4)).astype("float32")
    with keras_tpu.TPUStrategy(precision="highest").scope():
        model = float8_einsum_model()
    with pytest.raises(NotImplementedError, match=r"overwrite with their gradient.*model.quantize\(\"float8\"\) "
                                                  r"afterwards.*using_single_core=True"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    cpu, single = float8_einsum_model(), float8_einsum_model()
    cpu.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    tpu = keras_tpu.keras_to_tpu_model(single, keras_tpu.TPUDistributionStrategy(using_single_core=True,
                                                                                  precision="highest"))
    tpu.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    tpu.sync_to_cpu()
    for a, b in zip(cpu.weights, single.weights):
        np.testing.assert_allclose(np.asarray(a, "float32"), np.asarray(b, "float32"), rtol=1e-5, atol=1e-6)
