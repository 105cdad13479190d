"""TPUEstimator's TensorFlow 1.15 surface: constructor arguments, params, export_savedmodel, lazy predict,
evaluate/train arguments and hooks, checkpoints by path and variable names, warm starts, loop timing."""

import inspect
import itertools
import json
import logging
import os
import re
import time

import keras
import numpy as np
import pytest

import keras_tpu
from keras_tpu import estimator as tpu_estimator
from keras_tpu.estimator import ModeKeys, TPUEstimator, TPUEstimatorSpec
from tests.test_tpu_estimator import dense_model_fn, mnist
from tests.tpu_helpers import compiled_programs

TF_115_CONSTRUCTOR = ["model_fn", "model_dir", "config", "params", "use_tpu", "train_batch_size", "eval_batch_size",
                      "predict_batch_size", "batch_axis", "eval_on_tpu", "export_to_tpu", "export_to_cpu",
                      "warm_start_from", "embedding_config_spec", "export_saved_model_api_version"]


def metric_fn(labels, logits):
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    accuracy.update_state(labels, logits)
    return {"accuracy": accuracy}


def model_fn(features, labels, mode, params):
    """A two-layer MNIST classifier; records the params it gets in params["seen"] (a shared list)."""
    if "seen" in params:
        params["seen"].append((mode, {k: v for k, v in params.items() if k != "seen"}))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Rescaling(1 / 255)(keras.layers.Flatten()(features)))
    logits = keras.layers.Dense(10)(keras.layers.BatchNormalization()(hidden))
    if mode == ModeKeys.PREDICT:
        predictions = logits if params.get("array_predictions") else \
            {"class_ids": keras.ops.argmax(logits, axis=1), "logits": logits}
        return TPUEstimatorSpec(mode, predictions=predictions, prediction_hooks=params.get("spec_hooks"))
    loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    if mode == ModeKeys.EVAL:
        return TPUEstimatorSpec(mode, loss=loss, eval_metrics=(metric_fn, [labels, logits]),
                                evaluation_hooks=params.get("spec_hooks"))
    optimizer = tpu_estimator.CrossShardOptimizer(keras.optimizers.SGD(params.get("lr", 0.1), momentum=0.9))
    return TPUEstimatorSpec(mode, loss=loss, train_op=optimizer, training_hooks=params.get("spec_hooks"))


def run_config(model_dir, iterations=2, save_steps=None):
    return tpu_estimator.RunConfig(
        master="grpc://10.0.0.2:8470", model_dir=None if model_dir is None else str(model_dir),
        save_checkpoints_steps=save_steps, tf_random_seed=0,
        tpu_config=tpu_estimator.TPUConfig(iterations_per_loop=iterations, num_shards=8))


def make(model_dir, fn=model_fn, iterations=2, save_steps=None, batch=64, params=None, **kwargs):
    return TPUEstimator(model_fn=fn, config=run_config(model_dir, iterations, save_steps), params=params,
                        train_batch_size=batch, eval_batch_size=batch, predict_batch_size=batch, **kwargs)


def train_arrays(params):
    return mnist("train", 512)


class Recorder(tpu_estimator.SessionRunHook):
    """Records the hook calls; optionally requests a stop once the global step reaches ``stop_at``."""

    def __init__(self, stop_at=None, stop_after_runs=None):
        self.calls, self.results = [], []
        self.stop_at, self.stop_after_runs = stop_at, stop_after_runs

    def begin(self):
        self.calls.append("begin")

    def after_create_session(self, session, coord):
        self.calls.append("after_create_session")

    def before_run(self, run_context):
        self.calls.append("before_run")

    def after_run(self, run_context, run_values):
        self.calls.append("after_run")
        self.results.append(run_values.results)
        if (self.stop_at is not None and run_values.results["global_step"] >= self.stop_at) or \
                (self.stop_after_runs is not None and self.calls.count("after_run") >= self.stop_after_runs):
            run_context.request_stop()

    def end(self, session):
        self.calls.append("end")


# -- the constructor ---------------------------------------------------------------------------


def test_every_tf_1_15_constructor_argument_is_accepted_or_refused_with_what_to_use(tmp_path):
    parameters = inspect.signature(TPUEstimator.__init__).parameters.values()
    # TensorFlow's arguments in TensorFlow's order; keras-tpu's own only by keyword.
    assert [p.name for p in parameters if p.kind != p.KEYWORD_ONLY][1:] == TF_115_CONSTRUCTOR
    assert [p.name for p in parameters if p.kind == p.KEYWORD_ONLY] == ["precision"]
    estimator = TPUEstimator(
        model_fn=model_fn, model_dir=str(tmp_path), config=run_config(tmp_path), params={"lr": 0.1}, use_tpu=True,
        train_batch_size=64, eval_batch_size=64, predict_batch_size=64, batch_axis=(0, 0), eval_on_tpu=True,
        export_to_tpu=False, export_to_cpu=True, warm_start_from=None, embedding_config_spec=None,
        export_saved_model_api_version=tpu_estimator.ExportSavedModelApiVersion.V2)
    assert estimator.model_dir == str(tmp_path) and estimator.params == {"lr": 0.1}
    with pytest.raises(ValueError, match="keras.layers.Embedding"):
        make(tmp_path, embedding_config_spec=object())
    with pytest.raises(ValueError, match="np.moveaxis"):
        make(tmp_path, batch_axis=(3, 0))  # an HWCN image tensor: not split on its first axis
    with pytest.raises(ValueError, match="ExportSavedModelApiVersion"):
        make(tmp_path, export_saved_model_api_version="V2")
    with pytest.raises(ValueError, match="reserved"):
        make(tmp_path, params={"batch_size": 32})
    with pytest.raises(ValueError, match="different values"):
        TPUEstimator(model_fn, model_dir=str(tmp_path / "a"), config=run_config(tmp_path / "b"), train_batch_size=64)
    with pytest.raises(TypeError, match="warm_start_from"):
        make(tmp_path, warm_start_from=3)
    temporary = make(None)  # neither model_dir nor config.model_dir: a temporary directory, as in TF
    assert os.path.isdir(temporary.model_dir)


# -- params --------------------------------------------------------------------------------------


def test_model_fn_and_input_fn_get_tensorflows_params_keys(tmp_path):
    seen, input_fn_calls = [], []

    def input_fn(params, mode):  # TensorFlow passes mode (and config) to input_fn when it asks for them
        input_fn_calls.append((mode, dict(params)))
        x, y = mnist("train" if mode == ModeKeys.TRAIN else "test", 128)
        return x if mode == ModeKeys.PREDICT else (x, y)

    estimator = TPUEstimator(model_fn, config=run_config(tmp_path), params={"lr": 0.1, "seen": seen},
                             train_batch_size=64, eval_batch_size=32, predict_batch_size=16)
    estimator.train(input_fn, steps=1)
    estimator.evaluate(input_fn, steps=1)
    assert len(list(estimator.predict(input_fn))) == 128
    per_core = {ModeKeys.TRAIN: 8, ModeKeys.EVAL: 4, ModeKeys.PREDICT: 2}  # global batch / 8 cores
    model_fn_calls = seen
    assert [mode for mode, _ in model_fn_calls] == [ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT]
    assert [mode for mode, _ in input_fn_calls] == [ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT]
    for mode, params in model_fn_calls:
        assert params["batch_size"] == per_core[mode] and params["use_tpu"] is True and params["lr"] == 0.1
        context = params["context"]
        assert (context.num_replicas, context.num_cores, context.num_hosts, context.num_of_replicas_per_host,
                context.current_host) == (8, 8, 1, 8, 0)
        assert context.device_assignment is None and context.device_for_replica(5)[1] == 5
        with pytest.raises(RuntimeError):
            context.current_input_fn_deployment()  # input_fn only, as in TF
    for mode, params in input_fn_calls:
        assert params["batch_size"] == per_core[mode] and "use_tpu" not in params  # TF: model_fn only
        assert params["context"].current_input_fn_deployment() == ("/job:worker/task:0/device:CPU:0", 0, 1, 8)
    assert estimator.params == {"lr": 0.1, "seen": seen}  # the user's params are copied, never changed


def test_on_the_cpu_params_hold_the_global_batch_and_eval_on_tpu_false_evaluates_there(tmp_path):
    seen = []
    on_cpu = make(tmp_path, use_tpu=False, params={"seen": seen})
    on_cpu.train(train_arrays, steps=2)
    (mode, params), = seen
    assert params["batch_size"] == 64 and params["use_tpu"] is False and "context" not in params
    cpu_eval = on_cpu.evaluate(lambda params: mnist("test", 256))

    seen.clear()
    tpu_training = make(tmp_path, eval_on_tpu=False, params={"seen": seen})  # the same checkpoint
    mixed = tpu_training.evaluate(lambda params: mnist("test", 256))
    (mode, params), = seen
    assert mode == ModeKeys.EVAL and params["use_tpu"] is False and params["batch_size"] == 64
    assert "context" not in params
    # float32 on the CPU: the MXU's bfloat16 products would differ far more than this
    # (tests/test_tpu_estimator.py::test_cpu_and_tpu_runs_agree_within_bf16_tolerance).
    assert mixed == pytest.approx(cpu_eval, rel=1e-6)


# -- export --------------------------------------------------------------------------------------


def test_export_savedmodel_is_tensorflow_1s_name_with_its_arguments(tmp_path):
    assert list(inspect.signature(TPUEstimator.export_savedmodel).parameters)[1:] == [
        "export_dir_base", "serving_input_receiver_fn", "assets_extra", "as_text", "checkpoint_path",
        "strip_default_attrs"]
    seen = []
    estimator = make(tmp_path / "model", save_steps=2, params={"seen": seen})
    estimator.train(train_arrays, max_steps=4)  # checkpoints of steps 2 and 4
    step_2 = str(tmp_path / "model" / "ckpt-00000002.npz")
    vocabulary = tmp_path / "vocab.txt"
    vocabulary.write_text("zero\none\n")
    seen.clear()
    path = estimator.export_savedmodel(str(tmp_path / "export"), lambda: mnist("test", 1)[0],
                                       assets_extra={"vocab.txt": str(vocabulary)}, as_text=True,
                                       checkpoint_path=step_2)
    assert (seen[0][0], seen[0][1]["use_tpu"], "batch_size" in seen[0][1]) == (ModeKeys.PREDICT, True, False)
    assert open(os.path.join(path, "assets.extra", "vocab.txt")).read() == "zero\none\n"
    x = mnist("test", 40)[0]
    exported = keras_tpu.load_exported(path)(x)["logits"]
    from_step_2 = np.stack([p["logits"] for p in estimator.predict(lambda params: x, checkpoint_path=step_2)])
    from_step_4 = np.stack([p["logits"] for p in estimator.predict(lambda params: x)])
    np.testing.assert_allclose(exported, from_step_2, rtol=1e-5, atol=1e-5)
    assert not np.allclose(exported, from_step_4, atol=1e-3)
    assert estimator.export_saved_model(str(tmp_path / "export"), lambda: x[:1]) != path  # a new directory

    seen.clear()  # export_to_tpu=False: only the CPU graph, float32, model_fn told use_tpu=False
    cpu_export = make(tmp_path / "model", export_to_tpu=False, params={"seen": seen}).export_savedmodel(
        str(tmp_path / "cpu_export"), lambda: x[:1])
    assert seen[0][1]["use_tpu"] is False
    with open(os.path.join(path, "meta.json")) as f, open(os.path.join(cpu_export, "meta.json")) as g:
        assert (json.load(f)["precision"], json.load(g)["precision"]) == ("default", "highest")
    with pytest.raises(ValueError, match="export_to_cpu and export_to_tpu"):
        make(tmp_path / "model", export_to_tpu=False, export_to_cpu=False).export_savedmodel(
            str(tmp_path / "none"), lambda: x[:1])


# -- predict ---------------------------------------------------------------------------------------


def test_predict_batches_keys_arrays_and_hooks(tmp_path):
    estimator = make(tmp_path, iterations=2)
    estimator.train(train_arrays, steps=2)
    x = mnist("test", 200)[0]  # batches of 64, 64, 64 and 8
    examples = list(estimator.predict(lambda params: x))
    batches = list(estimator.predict(lambda params: x, yield_single_examples=False))
    assert [len(batch["class_ids"]) for batch in batches] == [64, 64, 64, 8]
    assert all(set(batch) == {"class_ids", "logits"} and batch["logits"].shape[1:] == (10,) for batch in batches)
    np.testing.assert_array_equal(np.concatenate([b["logits"] for b in batches]),
                                  np.stack([e["logits"] for e in examples]))
    only_logits = list(estimator.predict(lambda params: x, predict_keys=["logits"], yield_single_examples=False))
    assert [set(batch) for batch in only_logits] == [{"logits"}] * 4
    assert set(next(estimator.predict(lambda params: x, predict_keys="class_ids"))) == {"class_ids"}
    with pytest.raises(ValueError, match="at least one output"):
        next(estimator.predict(lambda params: x, predict_keys=["probabilities"]))

    hook = Recorder()
    arrays = make(tmp_path, params={"array_predictions": True})  # predictions=logits, not a dict
    singles = list(arrays.predict(lambda params: x, hooks=[hook]))
    assert len(singles) == 200 and isinstance(singles[0], np.ndarray) and singles[0].shape == (10,)
    np.testing.assert_array_equal(np.stack(singles), np.stack([e["logits"] for e in examples]))
    assert [b.shape for b in arrays.predict(lambda params: x, yield_single_examples=False)][-1] == (8, 10)
    # One before_run/after_run per device call: 4 batches at 2 per call.
    assert hook.calls == ["begin", "after_create_session"] + ["before_run", "after_run"] * 2 + ["end"]


def test_predict_is_lazy_and_works_on_an_endless_input(tmp_path):
    estimator = make(tmp_path, iterations=5)  # 5 global batches of 64 (8 per-core batches of 8) per call
    estimator.train(train_arrays, steps=1)
    x = mnist("test", 64)[0]
    pulled = []

    def endless(params):  # like dataset.repeat(): never ends
        def batches():
            for i in itertools.count():
                if len(pulled) >= 400:
                    raise RuntimeError("predict took far more of the input than it yielded")
                pulled.append(i)
                yield x[(i % 8) * 8:(i % 8 + 1) * 8]
        return batches()

    predictions = estimator.predict(endless)
    first = list(itertools.islice(predictions, 100))
    assert len(first) == 100 and len(pulled) == 5 * 8  # one device call's worth of input, no more
    more = list(itertools.islice(predictions, 500))
    assert len(more) == 500 and len(pulled) == 2 * 5 * 8  # 600 rows = 10 global batches = 2 calls
    predictions.close()
    expected = [p["class_ids"] for p in estimator.predict(lambda params: x)]
    assert [p["class_ids"] for p in first[:64]] == expected and [p["class_ids"] for p in first[64:]] == expected[:36]


# -- evaluate --------------------------------------------------------------------------------------


def test_evaluate_steps_takes_and_runs_only_those_steps(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="keras_tpu")
    program_steps = lambda: [steps for mode, _, steps in compiled_programs(caplog) if mode == "evaluation"]
    estimator = make(tmp_path, iterations=234, batch=128)  # 234 steps: a 30,000-example epoch per call
    estimator.train(train_arrays, steps=1)
    x, y = mnist("test", 10_000)
    one_step = estimator.evaluate(lambda params: (x, y), steps=1)
    assert program_steps() == [1]  # a program of one step, not of iterations_per_loop stacked steps
    assert one_step == pytest.approx(estimator.evaluate(lambda params: (x[:128], y[:128])), rel=1e-6)

    pulled = []

    def per_core_batches(params):  # never ends: evaluate must take exactly `steps` global batches
        def batches():
            for i in itertools.count():
                pulled.append(i)
                yield x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]
        return batches()

    caplog.clear()
    three = make(tmp_path, iterations=2, batch=128).evaluate(per_core_batches, steps=3)
    assert len(pulled) == 3 * 8 and program_steps() == [2, 1]  # 2 + 1 steps, no idle step
    assert three == pytest.approx(estimator.evaluate(lambda params: (x[:384], y[:384])), rel=1e-6)


@pytest.mark.slow
def test_evaluate_name_hooks_and_checkpoint_path(tmp_path):
    hook, spec_hook = Recorder(), Recorder()
    estimator = make(tmp_path, save_steps=2, params={"spec_hooks": [spec_hook]})
    estimator.train(train_arrays, max_steps=4)  # checkpoints of steps 2 and 4
    spec_hook.calls.clear()  # it was a training hook too
    data = lambda params: mnist("test", 200)  # 4 batches: 2 device calls
    latest = estimator.evaluate(data, hooks=[hook], name="test_data")
    assert latest["global_step"] == 4
    for recorder in (hook, spec_hook):  # the evaluate argument and TPUEstimatorSpec.evaluation_hooks
        assert recorder.calls == ["begin", "after_create_session"] + ["before_run", "after_run"] * 2 + ["end"]
    assert hook.results == [{"global_step": 4}] * 2
    with open(os.path.join(str(tmp_path), "eval_test_data", "results.json")) as f:
        assert json.load(f) == {"4": latest}
    assert estimator.eval_dir("test_data") == os.path.join(str(tmp_path), "eval_test_data")

    older = estimator.evaluate(data, checkpoint_path=str(tmp_path / "ckpt-00000002.npz"))
    assert older["global_step"] == 2 and older["loss"] != latest["loss"]
    assert estimator.evaluate(data, checkpoint_path=str(tmp_path)) == latest  # a directory: its newest
    with open(os.path.join(str(tmp_path), "eval", "results.json")) as f:
        assert set(json.load(f)) == {"2", "4"}
    with pytest.raises(ValueError, match="Could not find a checkpoint"):
        estimator.evaluate(data, checkpoint_path=str(tmp_path / "ckpt-00000003.npz"))

    stopped = estimator.evaluate(data, hooks=[Recorder(stop_after_runs=1)])  # stops after the first call
    assert stopped == pytest.approx(estimator.evaluate(data, steps=2), rel=1e-6)


# -- train -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_hooks_saving_listeners_and_tensorflows_argument_order(tmp_path):
    assert list(inspect.signature(TPUEstimator.train).parameters)[1:] == [
        "input_fn", "hooks", "steps", "max_steps", "saving_listeners"]

    class Listener(tpu_estimator.CheckpointSaverListener):
        def __init__(self, stop=False):
            self.calls, self.stop = [], stop

        def begin(self):
            self.calls.append("begin")

        def before_save(self, session, global_step_value):
            self.calls.append(("before_save", global_step_value))

        def after_save(self, session, global_step_value):
            self.calls.append(("after_save", global_step_value))
            return self.stop

        def end(self, session, global_step_value):
            self.calls.append(("end", global_step_value))

    hook, spec_hook, listener = Recorder(stop_at=6), Recorder(), Listener()
    estimator = make(tmp_path, iterations=2, save_steps=4, params={"spec_hooks": [spec_hook]})
    estimator.train(train_arrays, hooks=[hook], steps=100, saving_listeners=[listener])
    assert estimator.get_variable_value("global_step") == 6  # the hook stopped training at step 6
    assert hook.calls == ["begin", "after_create_session"] + ["before_run", "after_run"] * 3 + ["end"]
    assert spec_hook.calls == hook.calls  # TPUEstimatorSpec.training_hooks
    assert [r["global_step"] for r in hook.results] == [2, 4, 6]
    assert all(isinstance(r["loss"], float) and np.isfinite(r["loss"]) for r in hook.results)
    assert listener.calls == ["begin", ("before_save", 4), ("after_save", 4), ("before_save", 6),
                              ("after_save", 6), ("end", 6)]

    estimator.train(train_arrays, steps=100, saving_listeners=[Listener(stop=True)])  # stops at its first save
    assert estimator.get_variable_value("global_step") == 10
    with pytest.raises(TypeError, match="hooks"):
        estimator.train(train_arrays, 5)  # TF's second argument is hooks, not steps

    x, y = mnist("train", 5 * 64)

    def five_batches(params):  # an iterable that ends: with neither steps nor max_steps, train until it does
        return ((x[i:i + 8], y[i:i + 8]) for i in range(0, len(x), 8))

    estimator.train(five_batches)
    assert estimator.get_variable_value("global_step") == 15


def test_the_logged_loop_time_includes_the_device_work(tmp_path, caplog, monkeypatch):
    class NotReady:  # a device result still being computed: float() waits for it
        def __init__(self, value, wait):
            self.value, self.wait = value, wait

        def __float__(self):
            time.sleep(self.wait)
            return float(self.value)

    from keras_tpu import _placement as placement

    class SlowDevice(placement.ReplicatedSteps):
        def train_function(self, steps_per_execution=1, **kwargs):
            run, calls = super().train_function(steps_per_execution, **kwargs), []

            def slow(state, iterator):
                logs, state = run(state, iterator)
                calls.append(1)
                return dict(logs, loss=NotReady(logs["loss"], 0.5 if len(calls) == 2 else 0.0)), state
            return slow

    monkeypatch.setattr(placement, "ReplicatedSteps", SlowDevice)
    import logging
    logger = logging.getLogger("keras_tpu")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="keras_tpu"):
            make(tmp_path, iterations=2).train(train_arrays, steps=4)
    finally:
        logger.removeHandler(caplog.handler)
    times = {int(step): float(sec) for step, sec in
             re.findall(r"loss = [-\d.]+, step = (\d+) \(([\d.]+) sec\)", caplog.text)}
    assert set(times) == {2, 4}
    assert times[4] >= 0.5  # the second loop's line waited for its own device work


# -- checkpoints -----------------------------------------------------------------------------------


def test_latest_checkpoint_is_a_path_and_variables_are_named_by_path(tmp_path):
    estimator = make(tmp_path)
    assert estimator.latest_checkpoint() is None
    with pytest.raises(ValueError, match="Could not find trained model"):
        estimator.get_variable_names()
    for _ in range(3):
        keras.layers.Dense(2)  # layers made elsewhere in the process do not change the names
    estimator.train(train_arrays, steps=2)
    assert estimator.latest_checkpoint() == str(tmp_path / "ckpt-00000002.npz")
    assert os.path.isfile(estimator.latest_checkpoint())
    names = estimator.get_variable_names()
    assert names == sorted(names)
    assert {"global_step", "dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias",
            "batch_normalization/gamma", "batch_normalization/moving_mean", "sgd/iteration",
            "sgd/dense/kernel/momentum"} <= set(names)
    kernel = estimator.get_variable_value("dense/kernel")
    assert kernel.shape == (784, 16) and estimator.get_variable_value("dense_1/kernel").shape == (16, 10)
    assert estimator.get_variable_value("global_step") == 2
    assert estimator.get_variable_value("sgd/iteration") == 2
    with pytest.raises(ValueError, match="get_variable_names"):
        estimator.get_variable_value("dense_2/kernel")
    estimator.evaluate(lambda params: mnist("test", 64))  # rebuilds the graph (new Keras layer names)
    estimator.train(train_arrays, steps=2)
    assert estimator.get_variable_names() == names
    assert not np.allclose(estimator.get_variable_value("dense/kernel"), kernel)


def test_warm_start_from_a_directory_a_file_or_settings(tmp_path):
    source = make(tmp_path / "source", fn=dense_model_fn)
    source.train(train_arrays, steps=3)
    kernel, bias = source.get_variable_value("dense/kernel"), source.get_variable_value("dense/bias")
    frozen = {"lr": 0.0}  # training with a zero learning rate keeps whatever the warm start loaded

    from_dir = make(tmp_path / "a", fn=dense_model_fn, params=frozen, warm_start_from=str(tmp_path / "source"))
    from_dir.train(train_arrays, steps=1)
    assert from_dir.get_variable_value("global_step") == 1  # the step is not warm-started
    np.testing.assert_array_equal(from_dir.get_variable_value("dense/kernel"), kernel)

    only_bias = make(tmp_path / "b", fn=dense_model_fn, params=frozen, warm_start_from=tpu_estimator.WarmStartSettings(
        source.latest_checkpoint(), vars_to_warm_start="dense/bias"))
    only_bias.train(train_arrays, steps=1)
    np.testing.assert_array_equal(only_bias.get_variable_value("dense/bias"), bias)
    assert not np.allclose(only_bias.get_variable_value("dense/kernel"), kernel)

    # predict with no checkpoint of its own runs from the warm-started weights
    x = mnist("test", 64)[0]
    predicting = make(tmp_path / "c", fn=dense_model_fn, warm_start_from=str(tmp_path / "source"))
    assert [p["class_ids"] for p in predicting.predict(lambda params: x)] == \
        [p["class_ids"] for p in source.predict(lambda params: x)]
    with pytest.raises(ValueError, match="no checkpoint"):
        make(tmp_path / "d", fn=dense_model_fn, warm_start_from=str(tmp_path / "nothing")).train(
            train_arrays, steps=1)
