"""TPU pods on JAX's multi-process runtime, and exported inference functions."""

import ast
import os
import signal
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import keras_tpu
from keras_tpu import _checkpoints as checkpoints
from tests.conftest import REPO
from tests.tpu_helpers import classification_data, on_tpu, small_classifier, small_cnn


def free_ports(count):
    """``count`` distinct free ports: each socket stays bound until all are chosen (the OS may hand a port just
    closed out again: two workers once got the same one)."""
    sockets = []
    try:
        for _ in range(count):
            sockets.append(socket.socket())
            sockets[-1].bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(code, workers, cores_per_worker, *args):
    addresses = ",".join(f"localhost:{port}" for port in free_ports(workers))
    processes = []
    for task in range(workers):
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
        env.update(KERAS_TPU_WORKERS=addresses, KERAS_TPU_TASK_INDEX=str(task),
                   KERAS_TPU_CORES_PER_WORKER=str(cores_per_worker), KERAS_TPU_HEARTBEAT_TIMEOUT="5")
        if workers == 1:
            env.pop("KERAS_TPU_WORKERS")
        processes.append(subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return processes


def finish(processes, timeout=600):
    results = []
    for p in processes:
        out, err = p.communicate(timeout=timeout)
        results.append((p.returncode, out, err))
    return results


TRAIN = """
import sys
sys.path.insert(0, {repo!r})
import keras_tpu, numpy as np, jax
from tests.tpu_helpers import classification_data, on_tpu, small_classifier
out = sys.argv[1]
x, y = classification_data(200)
tpu = on_tpu(small_classifier(), "default")
history = tpu.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0).history
tpu.save_weights(out + ".h5")
np.save(out + f"-weights-{{jax.process_index()}}.npy", np.concatenate([w.ravel() for w in tpu.get_weights()]))
np.save(out + f"-predictions-{{jax.process_index()}}.npy", tpu.predict(x[:37], batch_size=16, verbose=0))
# A convolutional model runs each device's cores in a loop, its BatchNormalization statistics combined over
# the cores in the loop and then over the devices.
import keras
keras.utils.set_random_seed(0)
conv = keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3), keras.layers.BatchNormalization(),
                         keras.layers.Flatten(), keras.layers.Dense(3, activation="softmax")])
conv.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
images = np.random.default_rng(1).standard_normal((200, 6, 6, 2)).astype("float32")
conv_tpu = on_tpu(conv, "highest")
conv_tpu.fit(images, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
np.save(out + f"-conv-{{jax.process_index()}}.npy", np.concatenate([w.ravel() for w in conv_tpu.get_weights()]))
strategy = keras_tpu.TPUStrategy()
with strategy.scope():
    model = small_classifier()
strategy_history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history
print("LOSS", history["loss"], "WORKERS", jax.process_count(), "CORES", tpu.strategy.num_cores)
print("STRATEGY", strategy_history["loss"], strategy.num_replicas_in_sync)
"""


@pytest.mark.slow
def test_two_workers_of_four_cores_train_like_one_process_of_eight(tmp_path):
    code = TRAIN.format(repo=REPO)
    pod = finish(launch(code, 2, 4, tmp_path / "pod"))
    single = finish(launch(code, 1, 8, tmp_path / "one"))
    for returncode, _, err in pod + single:
        assert returncode == 0, err[-3000:]
    assert "WORKERS 2 CORES 8" in pod[0][1] and "WORKERS 1 CORES 8" in single[0][1]
    losses = [ast.literal_eval(out.split("LOSS")[1].split("WORKERS")[0].strip()) for _, out, _ in pod + single]
    np.testing.assert_allclose(losses[0], losses[2], rtol=1e-3)
    assert losses[0] == losses[1]  # both workers log the same (global) loss
    strategy_losses = [ast.literal_eval(out.split("STRATEGY")[1].split("]")[0].strip() + "]")
                       for _, out, _ in pod + single]
    assert all(out.strip().endswith(" 8") for _, out, _ in pod + single)  # 8 replicas in sync
    np.testing.assert_allclose(strategy_losses[0], strategy_losses[2], rtol=1e-3)
    w0, w1 = (np.load(tmp_path / f"pod-weights-{i}.npy") for i in (0, 1))
    np.testing.assert_array_equal(w0, w1)  # identical weights on every worker
    np.testing.assert_allclose(w0, np.load(tmp_path / "one-weights-0.npy"), atol=2e-3)
    c0, c1 = (np.load(tmp_path / f"pod-conv-{i}.npy") for i in (0, 1))
    np.testing.assert_array_equal(c0, c1)
    np.testing.assert_allclose(c0, np.load(tmp_path / "one-conv-0.npy"), atol=1e-5)  # moving statistics included
    p0, p1 = (np.load(tmp_path / f"pod-predictions-{i}.npy") for i in (0, 1))
    assert p0.shape == (37, 3)
    np.testing.assert_array_equal(p0, p1)
    assert (tmp_path / "pod.h5").exists()  # written once, by the first worker


ESTIMATOR = """
import sys, time
sys.path.insert(0, {repo!r})
import keras_tpu
from tests.test_tpu_estimator import make, mnist
model_dir, slow = sys.argv[1], sys.argv[2] == "slow"
def input_fn(params):
    x, y = mnist("train", 1024)
    def batches():
        while True:
            for start in range(0, 1024, params["batch_size"]):
                if slow:
                    time.sleep(0.05)
                yield x[start:start + params["batch_size"]], y[start:start + params["batch_size"]]
    return batches()
print("STARTED", flush=True)
make(model_dir, iterations=2, save_steps=4).train(input_fn, max_steps=24)
print("DONE")
"""


@pytest.mark.slow
def test_a_dead_worker_stops_the_others_and_a_restart_resumes(tmp_path):
    code = ESTIMATOR.format(repo=REPO)
    first, second = launch(code, 2, 4, tmp_path, "slow")
    deadline = time.time() + 300
    while checkpoints.latest(str(tmp_path)) is None and time.time() < deadline:
        time.sleep(0.5)
    assert checkpoints.latest(str(tmp_path)) is not None, first.stderr.read()[-3000:] if first.poll() else ""
    second.send_signal(signal.SIGKILL)
    killed_at = time.time()
    out, err = first.communicate(timeout=120)
    assert first.returncode != 0 and time.time() - killed_at < 60  # stops, in bounded time, not hanging
    assert "DONE" not in out
    assert any(word in err for word in ("WorkerLostError", "worker", "task", "heartbeat")), err[-3000:]
    second.communicate()
    saved = checkpoints.latest(str(tmp_path))[0]
    assert 0 < saved < 24
    results = finish(launch(code, 2, 4, tmp_path, "fast"))
    for returncode, out, err in results:
        assert returncode == 0, err[-3000:]
        assert "DONE" in out
    assert f"Restored the checkpoint of step {saved}" in results[0][2]
    assert checkpoints.latest(str(tmp_path))[0] == 24


def test_export_runs_in_a_fresh_process_for_any_batch_size(tmp_path):
    x, y = classification_data(100)
    tpu = on_tpu(small_classifier(), "default")
    tpu.fit(x, y, batch_size=32, epochs=1, verbose=0)
    path = tpu.export(str(tmp_path / "exported"))
    expected = tpu.predict(x, verbose=0)
    np.save(tmp_path / "x.npy", x)
    code = f"""
import numpy as np
from keras_tpu._export import load_exported
predict = load_exported({path!r})
x = np.load({str(tmp_path / "x.npy")!r})
for rows in (1, 7, 100):
    np.save({str(tmp_path)!r} + f"/out-{{rows}}.npy", predict(x[:rows]))
print("INPUTS", predict.input_names)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    for rows in (1, 7, 100):
        np.testing.assert_allclose(np.load(tmp_path / f"out-{rows}.npy"), expected[:rows], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"shape \(batch, 6\)"):
        keras_tpu.load_exported(path)(np.ones((2, 5), np.float32))
    with pytest.raises(FileNotFoundError):
        keras_tpu.load_exported(str(tmp_path / "nothing"))


def test_an_exported_convolutional_model_keeps_the_mxu_roundings(tmp_path, monkeypatch):
    # The export is compiled where it is loaded: with XLA's default, which lets it drop a bf16 round trip fused with
    # a reduction, a small CNN's predictions came out those of the float32 network. load_exported compiles it with
    # keras-tpu's options.
    from keras_tpu.mxu import _kernels as kernels

    model = small_cnn()
    x = np.random.default_rng(0).standard_normal((64, 16, 16, 3)).astype("float32")
    tpu = keras_tpu.keras_to_tpu_model(model)
    want = tpu.predict(x, batch_size=64, verbose=0)
    float32 = model.predict(x, batch_size=64, verbose=0)
    path = tpu.export(str(tmp_path / "exported"))
    got = keras_tpu.load_exported(path)(x)
    scale = np.max(np.abs(want))
    assert np.mean(np.abs(got - want)) / scale < 1e-5
    assert np.mean(np.abs(float32 - want)) / scale > 1e-4   # the rounding shows at this size
    monkeypatch.setattr(kernels, "compiler_options", lambda *args, **kwargs: {})   # XLA's defaults: the check above can fail
    loaded = keras_tpu.load_exported(path)
    if "__ynn" not in loaded._predict.lower(loaded.trainable, loaded.non_trainable, x).compile().as_text():
        pytest.skip("XLA:CPU did not fuse the program into YNNPACK here")
    assert np.mean(np.abs(loaded(x) - want)) / scale > 1e-4


def test_a_tpu_strategy_models_export_and_a_loaded_export_under_strategy_run(tmp_path, caplog):
    """TF 2's save-and-load tutorial: a model built under TPUStrategy exports with Keras 3's ``model.export(path)``
    (a TensorFlow SavedModel there, keras_tpu's jax.export here), and the loaded function runs on each replica's
    rows inside strategy.run."""
    x, y = classification_data(64)
    strategy = keras_tpu.TPUStrategy()
    with strategy.scope():
        model = small_classifier()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    with caplog.at_level("INFO", logger="keras_tpu"):
        assert model.export(str(tmp_path / "exported")) == str(tmp_path / "exported")
    assert "keras_tpu.load_exported loads it" in caplog.text
    loaded = keras_tpu.load_exported(str(tmp_path / "exported"))
    want = model.predict(x, batch_size=32, verbose=0)
    np.testing.assert_allclose(loaded(x), want, rtol=1e-5, atol=1e-6)
    batch = next(iter(strategy.experimental_distribute_dataset([x[:44]])))  # 6, 6, 6, 6, 5, 5, 5, 5 rows
    got = strategy.gather(strategy.run(loaded, args=(batch,)), axis=0)
    np.testing.assert_allclose(got, want[:44], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="already runs on the TPU.*call its fit, evaluate, predict"):
        keras_tpu.keras_to_tpu_model(model)


def test_a_model_converted_without_compiling_gives_its_weights_and_exports(tmp_path):
    """keras_to_tpu_model of a model only to predict and export it: no optimizer to copy back."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])   # never compiled
    tpu = keras_tpu.keras_to_tpu_model(model)
    x = classification_data(16)[0]
    assert len(tpu.get_weights()) == len(model.get_weights()) and tpu.sync_to_cpu() is model
    tpu.save_weights(str(tmp_path / "w.weights.h5"))
    loaded = keras_tpu.load_exported(tpu.export(str(tmp_path / "exported")))
    np.testing.assert_allclose(loaded(x), tpu.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_estimator_export_saved_model(tmp_path):
    from tests.test_tpu_estimator import make, mnist

    estimator = make(tmp_path / "model")
    estimator.train(lambda params: mnist("train", 256), max_steps=4)
    path = estimator.export_saved_model(str(tmp_path / "export"), lambda: mnist("test", 1)[0])
    predict = keras_tpu.load_exported(path)
    x = mnist("test", 50)[0]
    exported = predict(x)["class_ids"]
    expected = np.array([p["class_ids"] for p in estimator.predict(lambda params: x)])
    np.testing.assert_array_equal(exported, expected)
