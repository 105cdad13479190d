"""TPUEstimator: model_fn/input_fn on the simulated TPU, checkpoints, resuming after a crash."""

import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_tpu
from keras_tpu import _checkpoints as checkpoints, _replicated_steps as replicated_steps
from keras_tpu import estimator as tpu_estimator
from tests.conftest import REPO


def dense_model_fn(features, labels, mode, params):
    logits = keras.layers.Dense(10)(keras.layers.Rescaling(1 / 255)(keras.layers.Flatten()(features)))
    if mode == tpu_estimator.ModeKeys.PREDICT:
        return tpu_estimator.TPUEstimatorSpec(mode, predictions={"class_ids": keras.ops.argmax(logits, axis=1)})
    loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    if mode == tpu_estimator.ModeKeys.EVAL:
        def metric_fn(labels, logits):
            accuracy = keras.metrics.SparseCategoricalAccuracy()
            accuracy.update_state(labels, logits)
            return {"accuracy": accuracy, "mean_logit": float(np.mean(logits))}
        return tpu_estimator.TPUEstimatorSpec(mode, loss=loss, eval_metrics=(metric_fn, [labels, logits]))
    optimizer = keras.optimizers.SGD(params.get("lr", 0.1))
    if params.get("cross_shard", True):
        optimizer = tpu_estimator.CrossShardOptimizer(optimizer, reduction=params.get("reduction", "mean"))
    return tpu_estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optimizer)


def mnist(split, rows=None):
    (x_train, y_train), (x_test, y_test) = keras_tpu.datasets.mnist.load_data()
    x, y = (x_train, y_train) if split == "train" else (x_test, y_test)
    return x[:rows].astype("float32"), y[:rows].astype("int32")


def make(model_dir, iterations=5, use_tpu=True, params=None, save_steps=None, batch=64, **estimator_kwargs):
    config = tpu_estimator.RunConfig(
        master="grpc://10.0.0.2:8470", model_dir=str(model_dir), save_checkpoints_steps=save_steps,
        tpu_config=tpu_estimator.TPUConfig(iterations_per_loop=iterations, num_shards=8), tf_random_seed=0)
    return tpu_estimator.TPUEstimator(model_fn=dense_model_fn, use_tpu=use_tpu, config=config, params=params,
                                      train_batch_size=batch, eval_batch_size=batch, predict_batch_size=batch,
                                      **estimator_kwargs)


@pytest.mark.slow
def test_the_mnist_example_trains_evaluates_and_predicts(tmp_path, capsys):
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        import mnist_tpu_estimator
    finally:
        sys.path.pop(0)
    results = mnist_tpu_estimator.main(["--model_dir", str(tmp_path), "--train_steps", "30", "--iterations", "10",
                                        "--batch_size", "128", "--learning_rate", "0.1", "--seed", "0"])
    assert results["global_step"] == 30 and results["accuracy"] > 0.5 and results["loss"] < 2.0  # chance: 0.1
    assert checkpoints.latest(str(tmp_path))[0] == 30
    assert capsys.readouterr().out.count("example ") == 10


def test_params_batch_size_is_per_core_and_whole_arrays_are_batched(tmp_path):
    seen = {}

    def input_fn(params):
        seen.update(params)
        return mnist("train", 512)

    estimator = make(tmp_path, params={"lr": 0.1})
    estimator.train(input_fn, max_steps=10)
    assert seen["batch_size"] == 8 and seen["lr"] == 0.1  # 64 global / 8 cores
    results = estimator.evaluate(lambda params: mnist("test", 1000))
    assert set(results) == {"loss", "accuracy", "mean_logit", "global_step"} and results["global_step"] == 10


def test_iterables_of_per_core_batches(tmp_path):
    taken = []

    def per_core_batches(params):
        x, y = mnist("train", 800)
        def generator():
            for start in range(0, len(x) - params["batch_size"] + 1, params["batch_size"]):
                taken.append(start)
                yield x[start:start + params["batch_size"]], y[start:start + params["batch_size"]]
        return generator()

    estimator = make(tmp_path, iterations=3)
    estimator.train(per_core_batches, steps=6)
    assert len(taken) == 6 * 8  # one batch per core per step
    assert estimator.latest_checkpoint() == str(tmp_path / "ckpt-00000006.npz")  # a path, as in TF

    class EvalBatches(keras.utils.PyDataset):
        def __len__(self):
            return 13  # 13 per-core batches: the last global step is partial

        def __getitem__(self, i):
            x, y = mnist("test", 13 * 8)
            return x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]

    by_per_core_batches = estimator.evaluate(lambda params: EvalBatches())
    by_arrays = estimator.evaluate(lambda params: mnist("test", 13 * 8))
    assert by_per_core_batches == pytest.approx(by_arrays, rel=1e-6)


def test_padded_last_batch_gives_exact_evaluation_and_one_prediction_per_example(tmp_path):
    estimator = make(tmp_path, batch=64)
    estimator.train(lambda params: mnist("train", 512), max_steps=10)
    padded = estimator.evaluate(lambda params: mnist("test", 1000))  # 15 full batches and 40 rows
    small = make(tmp_path, batch=8).evaluate(lambda params: mnist("test", 1000))  # no padding at all
    assert {k: v for k, v in padded.items() if k != "loss"} == pytest.approx(
        {k: v for k, v in small.items() if k != "loss"}, rel=1e-5)
    # The loss is the mean of the 16 steps' losses, as TensorFlow's metrics.mean(loss), each step's over its real
    # rows: the last step's 40 rows (5 cores' batches) count as much as a full step's 64.
    x, y = mnist("test", 1000)
    full = estimator.evaluate(lambda params: (x[:960], y[:960]))
    last = estimator.evaluate(lambda params: (x[960:], y[960:]))
    assert padded["loss"] == pytest.approx((15 * full["loss"] + last["loss"]) / 16, rel=1e-5)
    assert small["loss"] == pytest.approx((960 * full["loss"] + 40 * last["loss"]) / 1000, rel=1e-5)
    predictions = list(estimator.predict(lambda params: mnist("test", 1000)[0]))
    assert len(predictions) == 1000 and set(predictions[0]) == {"class_ids"}
    accuracy = np.mean([p["class_ids"] for p in predictions] == mnist("test", 1000)[1])
    assert accuracy == pytest.approx(padded["accuracy"], abs=1e-6)


def test_cpu_and_tpu_runs_agree_within_bf16_tolerance(tmp_path):
    tpu = make(tmp_path / "tpu")
    cpu = make(tmp_path / "cpu", use_tpu=False)
    highest = make(tmp_path / "highest", precision="highest")  # keras-tpu's own argument: float32 products
    for estimator in (tpu, cpu, highest):
        estimator.train(lambda params: mnist("train", 512), max_steps=15)
    # 512 rows: whole batches (a padded core's evaluation loss includes its padding rows, on a TPU only).
    tpu_loss, cpu_loss, highest_loss = (estimator.evaluate(lambda params: mnist("test", 512))["loss"]
                                        for estimator in (tpu, cpu, highest))
    assert tpu_loss == pytest.approx(cpu_loss, rel=0.02) and abs(tpu_loss - cpu_loss) > 1e-4 * cpu_loss
    assert highest_loss == pytest.approx(cpu_loss, rel=1e-5)
    np.testing.assert_allclose(highest.get_variable_value("dense/kernel"), cpu.get_variable_value("dense/kernel"),
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="Unknown MXU precision"):
        make(tmp_path / "bad", precision="double")


def test_cross_shard_reductions_and_errors(tmp_path):
    summed = make(tmp_path / "sum", params={"lr": 0.01, "reduction": "sum"}, iterations=1)
    averaged = make(tmp_path / "mean", params={"lr": 0.08}, iterations=1)
    for estimator in (summed, averaged):
        estimator.train(lambda params: mnist("train", 64), steps=1)
    sum_weights = checkpoints.latest(str(tmp_path / "sum"))[1][0]
    mean_weights = checkpoints.latest(str(tmp_path / "mean"))[1][0]
    np.testing.assert_allclose(sum_weights, mean_weights, rtol=1e-4, atol=1e-6)  # 8 cores x 0.01 == 0.08
    with pytest.raises(ValueError, match="CrossShardOptimizer"):
        make(tmp_path / "plain", params={"cross_shard": False}).train(lambda params: mnist("train", 64), steps=1)
    with pytest.raises(ValueError, match="train first"):
        make(tmp_path / "empty").evaluate(lambda params: mnist("test", 64))
    with pytest.raises(ValueError, match="multiple of the 8 cores"):
        make(tmp_path / "odd", batch=100)
    with pytest.raises(ValueError, match="both steps and max_steps"):
        make(tmp_path / "x").train(lambda params: mnist("train", 64), steps=1, max_steps=1)
    with pytest.raises(ValueError, match="pass steps or max_steps"):  # whole arrays repeat forever
        make(tmp_path / "x").train(lambda params: mnist("train", 64))


def test_a_half_written_checkpoint_is_never_read(tmp_path):
    checkpoints.save(str(tmp_path), 10, [np.ones(3)])
    checkpoints.save(str(tmp_path), 20, [np.full(3, 2.0)])
    newest = tmp_path / "ckpt-00000020.npz"
    newest.write_bytes(newest.read_bytes()[:100])  # damaged after the fact
    (tmp_path / ".tmp-ckpt-00000030.npz").write_bytes(b"half")  # a crash mid-write
    step, arrays, _ = checkpoints.latest(str(tmp_path))
    assert step == 10 and arrays[0].tolist() == [1.0, 1.0, 1.0]


RESUMABLE = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import keras_tpu
from tests.test_tpu_estimator import make, mnist
model_dir, kill_after = sys.argv[1], int(sys.argv[2])
consumed = []
def input_fn(params):
    x, y = mnist("train", 512)
    def batches():
        while True:
            for start in range(0, 512, 8):
                consumed.append(start)
                if len(consumed) == kill_after * 8:
                    os.kill(os.getpid(), signal.SIGKILL)  # the process dies mid-training
                yield x[start:start + 8], y[start:start + 8]
    return batches()
make(model_dir, iterations=5, save_steps=10).train(input_fn, max_steps=40)
print("STEPS_RUN", len(consumed) // 8)
"""


@pytest.mark.slow
def test_a_killed_training_resumes_from_the_latest_checkpoint(tmp_path):
    script = RESUMABLE.format(repo=REPO)
    run = lambda kill_after: subprocess.run([sys.executable, "-c", script, str(tmp_path), str(kill_after)],
                                            capture_output=True, text=True, cwd=REPO, timeout=600)
    killed = run(kill_after=23)  # dies during step 23, after the checkpoint of step 20
    assert killed.returncode == -signal.SIGKILL
    assert checkpoints.latest(str(tmp_path))[0] == 20
    resumed = run(kill_after=10**9)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Restored the checkpoint of step 20" in resumed.stderr
    assert "STEPS_RUN 20" in resumed.stdout  # steps 21-40 only
    assert checkpoints.latest(str(tmp_path))[0] == 40
    again = run(kill_after=10**9)
    assert "Skipping training" in again.stderr and "STEPS_RUN 0" in again.stdout


def batch_loss_model_fn(features, labels, mode, params):
    """Losses that are not a mean over rows, written as TensorFlow's TPU models write them: a sum over the core's
    batch divided by ``params["batch_size"]`` (after a reshape to that batch), and BERT's pre-training weighted
    mean, ``sum(w * loss) / (sum(w) + 1e-5)`` over the batch."""
    assert features.shape[0] == params["batch_size"] or not params["use_tpu"]  # the core's static batch
    flat = keras.ops.reshape(features, (params["batch_size"] if params["use_tpu"] else -1, 28 * 28))
    logits = keras.layers.Dense(10)(keras.layers.Rescaling(1 / 255)(flat))
    if mode == tpu_estimator.ModeKeys.PREDICT:
        return tpu_estimator.TPUEstimatorSpec(mode, predictions={"logits": logits})
    xent = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    if params.get("weighted"):
        # a weight per example, as BERT's masked positions
        weights = keras.ops.cast(keras.ops.equal(keras.ops.mod(labels, 3), 0), "float32")
        loss = keras.ops.sum(weights * xent) / (keras.ops.sum(weights) + 1e-5)
    else:
        loss = keras.ops.sum(xent) / params["batch_size"]
    if mode == tpu_estimator.ModeKeys.EVAL:
        return tpu_estimator.TPUEstimatorSpec(mode, loss=loss, eval_metrics=(
            lambda xent: {"mean_xent": float(np.mean(xent))}, {"xent": xent}))
    optimizer = keras.optimizers.SGD(0.1)
    if params["use_tpu"]:
        optimizer = tpu_estimator.CrossShardOptimizer(optimizer)
    return tpu_estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optimizer)


@pytest.mark.parametrize("weighted", [False, True])
def test_evaluation_runs_each_cores_batch_so_batch_losses_are_tensorflows(tmp_path, weighted, monkeypatch):
    # The graph's rows interact (its loss is the batch's): on each core's rows, as TensorFlow's, never probed
    # (keras_tpu._custom_steps.rows_interact) and taken off the padded programs.
    probed = []
    monkeypatch.setattr(replicated_steps, "rows_interact", lambda *args: probed.append(args) or True)

    def estimator(use_tpu, batch=64):
        config = tpu_estimator.RunConfig(model_dir=str(tmp_path), tf_random_seed=0,
                                         tpu_config=tpu_estimator.TPUConfig(iterations_per_loop=4, num_shards=8))
        return tpu_estimator.TPUEstimator(model_fn=batch_loss_model_fn, use_tpu=use_tpu, config=config,
                                          params={"weighted": weighted}, train_batch_size=64, eval_batch_size=batch)

    on_tpu = estimator(use_tpu=True)
    on_tpu.train(lambda params: mnist("train", 256), max_steps=8)
    x, y = mnist("test", 512)
    tpu = on_tpu.evaluate(lambda params: (x, y))
    cpu = estimator(use_tpu=False, batch=8).evaluate(lambda params: (x, y))  # the same checkpoint, 8-row batches
    # The same batches of 8 on the CPU as each core's: TensorFlow's numbers, within the MXU's bfloat16 products.
    assert tpu["loss"] == pytest.approx(cpu["loss"], rel=0.02)
    assert tpu["mean_xent"] == pytest.approx(cpu["mean_xent"], rel=0.02)
    if not weighted:  # a sum over the batch over its rows: the mean loss of the examples
        assert tpu["loss"] == pytest.approx(tpu["mean_xent"], rel=1e-5)
    else:  # a weighted mean per batch is not the mean of the examples' losses (the per-example answer)
        assert abs(tpu["loss"] - tpu["mean_xent"]) > 0.05
    logits = np.stack([p["logits"] for p in on_tpu.predict(lambda params: x[:100])])  # 100 rows: padded
    assert logits.shape == (100, 10)

    # On the CPU a partial last batch runs at its own size (as TensorFlow's graph does), no padding in its loss:
    # batches of 64 and 36 rows.
    on_cpu = estimator(use_tpu=False)
    logits = np.stack([p["logits"] for p in on_cpu.predict(lambda params: x[:100])]).astype(np.float64)
    xent = np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(100), y[:100]]
    weights = (y[:100] % 3 == 0) if weighted else np.ones(100)
    per_batch = [np.sum(w * e) / (np.sum(w) + 1e-5) if weighted else np.sum(e) / 64
                 for w, e in ((weights[:64], xent[:64]), (weights[64:], xent[64:]))]
    expected = (per_batch[0] + per_batch[1]) / 2  # TensorFlow's metrics.mean(loss): one weight per batch
    assert on_cpu.evaluate(lambda params: (x[:100], y[:100]))["loss"] == pytest.approx(expected, rel=1e-5)
    assert not probed


def test_evaluation_tensors_keep_the_batch_and_a_partly_padded_core_is_named(tmp_path, caplog):
    def model_fn(features, labels, mode, params):
        logits = keras.layers.Dense(10)(keras.layers.Flatten()(features))
        loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        if mode == tpu_estimator.ModeKeys.EVAL:
            tensors = {"mean_logit": keras.ops.mean(logits)} if params.get("scalar") else {"logits": logits}
            return tpu_estimator.TPUEstimatorSpec(mode, loss=loss, eval_metrics=(lambda **t: {}, tensors))
        return tpu_estimator.TPUEstimatorSpec(mode, loss=loss,
                                              train_op=tpu_estimator.CrossShardOptimizer(keras.optimizers.SGD(0.1)))

    def estimator(params=None):
        config = tpu_estimator.RunConfig(model_dir=str(tmp_path),
                                         tpu_config=tpu_estimator.TPUConfig(iterations_per_loop=2, num_shards=8))
        return tpu_estimator.TPUEstimator(model_fn=model_fn, config=config, params=params, train_batch_size=64,
                                          eval_batch_size=64)

    estimator().train(lambda params: mnist("train", 64), steps=1)
    with pytest.raises(ValueError, match="'mean_logit' has shape \\(\\), but a core's batch has 8 rows: .*keeps its "
                                         "batch dimension"):
        estimator({"scalar": True}).evaluate(lambda params: mnist("test", 64))
    with caplog.at_level("INFO", logger="keras_tpu"):
        estimator().evaluate(lambda params: mnist("test", 64 + 21))  # cores of 8, 8 and 5 real rows
    assert "fills 2 cores' batches of 8 and 5 rows of one more, padded with 3 copies" in caplog.text
    # The program evaluates (a program of the predict kind, which returns the cores' tensors): the log says so.
    assert "Compiled the TPU evaluation program" in caplog.text and "TPU predict program" not in caplog.text


def test_train_and_evaluate_evaluates_each_new_checkpoint_and_exports(tmp_path, caplog):
    """tf.estimator.train_and_evaluate's local loop: an evaluation after each checkpoint (throttled), the last
    one always, exporters after each evaluation into model_dir/export/<name>."""
    estimator = make(tmp_path, iterations=2, save_steps=4)
    evaluated = []

    class CountEvaluations(tpu_estimator.SessionRunHook):
        def begin(self):
            evaluated.append(estimator.latest_checkpoint())

    serving = lambda: mnist("test", 1)[0]  # noqa: E731
    train_spec = tpu_estimator.TrainSpec(lambda params: mnist("train", 512), max_steps=10)
    eval_spec = tpu_estimator.EvalSpec(lambda params: mnist("test", 128), steps=None, throttle_secs=0,
                                       hooks=[CountEvaluations()],
                                       exporters=[tpu_estimator.LatestExporter("latest", serving, exports_to_keep=2),
                                                  tpu_estimator.FinalExporter("final", serving)])
    with caplog.at_level("INFO", logger="keras_tpu"):
        metrics, exports = tpu_estimator.train_and_evaluate(estimator, train_spec, eval_spec)
    assert "Start train and evaluate loop" in caplog.text
    # checkpoints at steps 4, 8 and 10 (the end), each evaluated once
    assert [os.path.basename(path) for path in evaluated] == [f"ckpt-{s:08d}.npz" for s in (4, 8, 10)]
    assert metrics["global_step"] == 10 and set(metrics) == {"loss", "accuracy", "mean_logit", "global_step"}
    assert metrics == pytest.approx(estimator.evaluate(lambda params: mnist("test", 128)))
    latest, final = exports
    assert os.path.dirname(latest) == str(tmp_path / "export" / "latest") and os.path.isdir(final)
    assert len(os.listdir(tmp_path / "export" / "latest")) == 2  # exports_to_keep
    assert len(os.listdir(tmp_path / "export" / "final")) == 1  # the last checkpoint's only
    x = mnist("test", 4)[0]
    np.testing.assert_array_equal(keras_tpu.load_exported(final)(x)["class_ids"],
                                  [p["class_ids"] for p in estimator.predict(lambda params: x)])

    # Throttled: checkpoints at 14, 18 and 22; after the first evaluation none until throttle_secs pass, but the
    # last checkpoint always.
    evaluated.clear()
    throttled = tpu_estimator.EvalSpec(lambda params: mnist("test", 64), steps=1, throttle_secs=3600,
                                       hooks=[CountEvaluations()])
    metrics, exports = tpu_estimator.train_and_evaluate(
        estimator, tpu_estimator.TrainSpec(lambda params: mnist("train", 512), max_steps=22), throttled)
    assert [os.path.basename(path) for path in evaluated] == ["ckpt-00000014.npz", "ckpt-00000022.npz"]
    assert metrics["global_step"] == 22 and exports == []
    # Nothing left to train: TensorFlow's (None, None).
    assert tpu_estimator.train_and_evaluate(
        estimator, tpu_estimator.TrainSpec(lambda params: mnist("train", 512), max_steps=22), throttled) == (None, None)
    with pytest.raises(TypeError, match="`eval_spec` must have type `EvalSpec`"):
        tpu_estimator.train_and_evaluate(estimator, train_spec, {"steps": 1})
    with pytest.raises(ValueError, match="unique names"):
        tpu_estimator.EvalSpec(lambda params: None, exporters=[tpu_estimator.FinalExporter("a", serving)] * 2)


def real_model_fn(features, labels, mode, params):
    """What TensorFlow's TPU models do in model_fn (tensorflow/tpu's ResNet, google-research's BERT): weight decay on
    the kernels, dropout in TRAIN only, labels inside the features dict (input_fn returns no labels), explicit layer
    names ending in digits, a metric tensor flattened to batch * positions, an EstimatorSpec in PREDICT."""
    labels = features.get("label") if labels is None else labels
    x = keras.layers.Rescaling(1 / 255)(keras.layers.Flatten()(features["image"]))
    if mode == tpu_estimator.ModeKeys.TRAIN and params.get("dropout"):
        x = keras.layers.Dropout(0.1)(x)
    regularizer = keras.regularizers.L2(params["wd"] / 2) if params["wd"] else None  # TF's wd * l2_loss(kernel)
    logits = keras.layers.Dense(10, use_bias=False, kernel_regularizer=regularizer, name="block_3")(x)
    if mode == tpu_estimator.ModeKeys.PREDICT:  # ResNet's model_fn returns an EstimatorSpec here
        return tpu_estimator.EstimatorSpec(mode, predictions={"logits": logits})
    xent = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    loss = keras.ops.mean(xent)
    if mode == tpu_estimator.ModeKeys.EVAL:
        positions = keras.ops.reshape(keras.ops.stack([xent, 2 * xent], axis=1), (-1,))  # (batch * 2,)
        def metric_fn(positions, xent):
            params["seen"].update(positions=np.asarray(positions), xent=np.asarray(xent))
            return {"mean_xent": float(np.mean(xent))}

        return tpu_estimator.TPUEstimatorSpec(mode, loss=loss, eval_metrics=(
            metric_fn, {"positions": positions, "xent": xent}))
    optimizer = keras.optimizers.SGD(0.5, weight_decay=params.get("sgd_decay"))
    return tpu_estimator.TPUEstimatorSpec(mode, loss=loss, train_op=tpu_estimator.CrossShardOptimizer(optimizer))


def test_tensorflow_tpu_model_fns_train_with_weight_decay_and_features_only_inputs(tmp_path):
    def estimator(directory, **params):
        config = tpu_estimator.RunConfig(model_dir=str(tmp_path / directory),
                                         tpu_config=tpu_estimator.TPUConfig(iterations_per_loop=1, num_shards=8))
        return tpu_estimator.TPUEstimator(model_fn=real_model_fn, config=config, params=params,
                                          train_batch_size=64, eval_batch_size=64, predict_batch_size=64)

    def features_only(rows):  # BERT's input_fn: one dict, the label among the features
        x, y = mnist("train", rows)
        return lambda params: {"image": x, "label": y}

    keras.utils.set_random_seed(0)
    decayed = estimator("l2", wd=0.2, dropout=False)
    decayed.train(features_only(64), max_steps=1)
    keras.utils.set_random_seed(0)
    decoupled = estimator("sgd", wd=0.0, sgd_decay=0.2, dropout=False)  # plain SGD: the same update
    decoupled.train(features_only(64), max_steps=1)
    kernel = decayed.get_variable_value("block_3/kernel")  # the name the user gave, as TensorFlow keeps it
    np.testing.assert_allclose(kernel, decoupled.get_variable_value("block_3/kernel"), rtol=1e-4, atol=1e-6)
    keras.utils.set_random_seed(0)
    undecayed = estimator("none", wd=0.0, dropout=True)  # dropout in TRAIN only
    undecayed.train(features_only(64), max_steps=1)
    assert np.abs(kernel - undecayed.get_variable_value("block_3/kernel")).max() > 1e-3
    # EVAL and PREDICT have no dropout layer (no random-number state) and read the TRAIN checkpoint.
    assert set(estimator("none", wd=0.0, seen={}).evaluate(features_only(64))) == {"loss", "mean_xent", "global_step"}
    logits = np.stack([p["logits"] for p in undecayed.predict(lambda params: {"image": mnist("test", 5)[0]})])
    assert logits.shape == (5, 10)

    # The EVAL loss adds the regularizer, as Keras does; the metric tensor of two positions per example comes back
    # flattened, padding left out.
    seen = {}
    results = estimator("l2", wd=0.2, seen=seen).evaluate(features_only(100))
    plain = estimator("l2", wd=0.0, seen={}).evaluate(features_only(100))  # the same checkpoint, no regularizer
    assert results["loss"] - plain["loss"] == pytest.approx(0.1 * np.sum(kernel.astype(np.float64) ** 2), rel=1e-4)
    positions, xent = seen["positions"], seen["xent"]
    assert positions.shape == (200,) and xent.shape == (100,)
    np.testing.assert_allclose(positions, np.stack([xent, 2 * xent], axis=1).reshape(-1), rtol=1e-6)


def test_a_weight_read_outside_a_layer_is_refused_and_a_variable_passed_to_an_op_trains(tmp_path):
    """BERT's output layer reuses the embedding table: keras.ops on the variable alone would run once, at graph
    building (a constant that never trains); the variable itself passed to an op with a symbolic input is read
    when the graph runs."""
    def model_fn(features, labels, mode, params):
        hidden = keras.layers.Dense(6, name="hidden")
        table = keras.layers.Dense(6, name="table")
        h = hidden(features)
        h = h + 0.0 * table(h)  # the table is a weight of the graph
        kernel = keras.ops.transpose(table.kernel) if params["transposed"] else table.kernel
        logits = keras.ops.matmul(h, kernel)
        loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        return tpu_estimator.TPUEstimatorSpec(
            mode, loss=loss, train_op=tpu_estimator.CrossShardOptimizer(keras.optimizers.SGD(0.5)))

    def estimator(transposed):
        config = tpu_estimator.RunConfig(model_dir=str(tmp_path / str(transposed)),
                                         tpu_config=tpu_estimator.TPUConfig(iterations_per_loop=1, num_shards=8))
        return tpu_estimator.TPUEstimator(model_fn=model_fn, config=config, params={"transposed": transposed},
                                          train_batch_size=64)

    x = np.random.default_rng(0).standard_normal((64, 4)).astype("float32")
    y = np.random.default_rng(1).integers(0, 6, 64).astype("int32")
    with pytest.raises(ValueError, match="'matmul' from the value of the weight 'table/kernel' outside a layer"):
        estimator(True).train(lambda params: (x, y), max_steps=1)
    direct = estimator(False)
    keras.utils.set_random_seed(0)
    direct.train(lambda params: (x, y), max_steps=1)
    first = direct.get_variable_value("table/kernel")
    direct.train(lambda params: (x, y), max_steps=2)
    assert np.abs(direct.get_variable_value("table/kernel") - first).max() > 1e-3  # it gets a gradient
