"""TPU profile: per-op MXU costs of a model's steps, named after its layers."""

import csv
import subprocess
import sys

import keras
import pytest

import keras_tpu
from keras_tpu.mxu import gemm_cost, scalesim_layer_cost
from tests.tpu_helpers import classification_data, on_tpu, small_classifier


def conv_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3), name="images")
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv")(inputs)
    h = keras.layers.MaxPooling2D(name="pool")(h)
    h = keras.layers.Flatten(name="flatten")(h)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax", name="classifier")(h), name="tiny")
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def mxu_rows(report, step):
    return [r for r in report.rows(step) if r["kind"] != "vector"]


def test_rows_name_layers_and_passes_with_per_core_shapes():
    report = keras_tpu.profile(conv_model(), batch_size=1024, dataset_size=50_000)
    forward = {(r["layer"], r["kind"]): r for r in mxu_rows(report, "inference")}
    conv = forward[("conv", "conv")]
    # Each of the 8 cores has 128 images: M = 128 x 16 x 16, K = 3 x 3 x 3, N = 32.
    assert (conv["m"], conv["k"], conv["n"]) == (128 * 16 * 16, 27, 32)
    assert (conv["padded_k"], conv["padded_n"]) == (128, 128)
    expected = gemm_cost(128 * 16 * 16, 27, 32)
    assert conv["cycles"] == expected.cycles and conv["utilization"] == pytest.approx(expected.utilization)
    # Its time: SCALE-Sim's cycles or its real operand bytes (whichever bounds it) plus one kernel launch.
    latency = keras_tpu._step_time.KERNEL_LATENCY_CYCLES / 700e6
    assert conv["time_s"] == pytest.approx(expected.timing("v2-8", hbm_bytes=conv["hbm_bytes"]).time_s + latency)
    assert conv["hbm_bytes"] < expected.hbm_bytes  # the input read once, not its im2col matrix
    assert conv["mxu_s"] + conv["memory_s"] == pytest.approx(conv["time_s"]) and conv["vector_s"] == 0
    dense = forward[("classifier", "dot")]
    assert (dense["m"], dense["k"], dense["n"]) == (128, 8 * 8 * 32, 10)
    train = mxu_rows(report, "train")
    assert {r["pass"] for r in train} == {"forward", "backward"}
    assert {r["layer"] for r in train} == {"conv", "classifier"}
    # Forward, input gradient and weight gradient: 3 ops per layer (the first conv's input needs none).
    assert len([r for r in train if r["layer"] == "classifier"]) == 3
    for row in train:
        assert {"layer", "pass", "m", "k", "n", "cycles", "utilization", "time_s"} <= set(row)
    # The device's time is every kernel's (MXU ops and vector work per layer and pass) plus the all-reduce.
    parts = report.parts("train")
    kernels = report.rows("train")
    assert {r["kind"] for r in kernels} == {"conv", "dot", "vector"}
    vector_layers = {r["layer"] for r in kernels if r["kind"] == "vector"}
    assert {"pool", "classifier"} <= vector_layers
    assert vector_layers - {"images", "conv", "pool", "flatten", "classifier"}  # the loss, the optimizer update
    assert report.device_time("train") == pytest.approx(sum(r["time_s"] for r in kernels) + parts.allreduce)
    assert report.step_time("train") == pytest.approx(max(parts.device, parts.input) + parts.host)
    assert report.mxu_time("train") < report.device_time("train")
    assert report.epoch_time("train") == pytest.approx(49 * report.step_time("train"))
    assert 0 < report.padding_waste("train") < 1 and 0 < report.utilization("train") < 1
    text = str(report)
    assert "train step" in text and "inference step" in text and "conv" in text and "classifier" in text
    assert "bound by" in text and "MXU-only lower bound" in text


def test_cycle_counts_agree_with_scalesim(tmp_path):
    report = keras_tpu.profile(conv_model(), batch_size=64, num_cores=8)
    path = report.to_scalesim_topology(str(tmp_path / "tiny_gemm.csv"))
    with open(path) as f:
        rows = list(csv.reader(f))[1:]
    train = mxu_rows(report, "train")
    assert len(rows) == len(train)
    for (name, m, n, k, _), row in zip(rows, train):
        # Each row, run through SCALE-Sim's GEMM mode (M, N, K) on a 128x128 array with the op's
        # dataflow, takes exactly the op's cycles (one group, one bf16 pass, one execution here).
        assert row["groups"] == 1 and row["repeats"] == 1
        assert gemm_cost(int(m), int(k), int(n), dataflow=row["dataflow"]).cycles == row["cycles"]
        assert name.endswith(row["pass"]) and (int(m), int(k), int(n)) == (row["m"], row["k"], row["n"])
    # Weight gradients are mapped the cheapest way (never dearer than weight stationary); the rest stay "ws".
    for row in train:
        ws = gemm_cost(row["m"], row["k"], row["n"]).cycles
        assert row["cycles"] <= ws if row["weight_gradient"] else row["dataflow"] == "ws"
    assert any(r["weight_gradient"] and r["dataflow"] != "ws" for r in train)
    only_ws = report.to_scalesim_topology(str(tmp_path / "ws.csv"), dataflow="ws")
    with open(only_ws) as f:
        assert len(list(csv.reader(f))) - 1 == sum(r["dataflow"] == "ws" for r in train)
    # The forward convolution as a SCALE-Sim convolution layer: padding folded into the input size.
    conv = next(r for r in mxu_rows(report, "inference") if r["layer"] == "conv")
    per_image = keras_tpu.mxu.conv_cost((1, 16, 16, 3), (3, 3, 3, 32), padding="same")
    layer = per_image.scalesim_layer
    assert layer == [18, 18, 3, 3, 3, 32, 1, 1]
    assert scalesim_layer_cost(*layer).cycles == per_image.cycles
    assert (conv["m"] // (64 // 8), conv["k"], conv["n"]) == (per_image.m, per_image.k, per_image.n)


def test_advice_flags_small_batches_and_unaligned_features():
    report = keras_tpu.profile(conv_model(), batch_size=256)  # 32 per core
    advice = "\n".join(report.advice)
    assert "per-core batch is 32" in advice and "would cut the MXU time per example by" in advice
    assert "classifier: N = 10 (output features) uses 8% of the array's columns over its 1 fold(s)" in advice
    assert "conv: K = 27 (input features x kernel positions)" in advice and "not a multiple of 8" in advice
    aligned = keras.Sequential([keras.Input((128,)), keras.layers.Dense(256, name="wide")])
    aligned.compile("sgd", "mse")
    guide = [a for a in keras_tpu.profile(aligned, batch_size=1024).advice if "bound by" not in a]
    assert guide == []


def test_plot_and_tpu_model_profile(tmp_path):
    x, y = classification_data(256)
    tpu = on_tpu(small_classifier(), "default")
    tpu.fit(x, y, batch_size=128, epochs=1, verbose=0)
    report = tpu.profile()
    assert report.global_batch == 128 and report.accelerator_type == "v2-8"
    png = report.plot(str(tmp_path / "profile.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    v4 = tpu.profile(accelerator_type="v4-8")
    assert v4.mxu_time("train") < report.mxu_time("train")  # 4 MXUs per core, faster clock
    assert v4.device_time("train") < report.device_time("train")
    # keras_to_tpu_model's default deployment is a 2018 Colab TPU node fed NumPy over the network.
    assert report.deployment == "remote_client_input" and report.parts("train").host == pytest.approx(0.010)


def test_predicted_tpu_time_callback(capsys):
    x, y = classification_data(256)
    tpu = on_tpu(small_classifier(), "default")
    logger = keras_tpu.callbacks.PredictedTPUTime()
    tpu.fit(x, y, batch_size=64, epochs=2, verbose=1, callbacks=[logger])
    out = capsys.readouterr().out
    assert out.count("simulated on this CPU; predicted on a TPU v2-8") == 2 and "bound by" in out
    assert len(logger.predicted) == 2 and logger.predicted[0] == pytest.approx(4 * tpu.profile().step_time("train"), rel=1e-4)


@pytest.mark.slow
def test_profile_command_line(tmp_path):
    path = str(tmp_path / "tiny.keras")
    conv_model().save(path)
    done = subprocess.run([sys.executable, "-m", "keras_tpu", "profile", path, "--batch-size", "512",
                           "--dataset-size", "10000", "--plot", str(tmp_path / "p.png")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TPU profile of 'tiny'" in done.stdout and "classifier" in done.stdout and "an epoch of 10000" in done.stdout
    assert (tmp_path / "p.png").exists()
    weights_only = str(tmp_path / "w.weights.h5")
    conv_model().save_weights(weights_only)
    failed = subprocess.run([sys.executable, "-m", "keras_tpu", "profile", weights_only],
                            capture_output=True, text=True, timeout=600)
    assert failed.returncode != 0 and "Weights-only files hold no architecture" in failed.stderr


def test_the_profile_shows_the_steps_hbm_per_core_and_its_largest_buffers():
    report = keras_tpu.profile(conv_model(), batch_size=1024)
    assert report.hbm.fits and 0 < report.hbm.total_bytes < 8 * 2**30
    assert "GiB HBM per core (v2-8)" in str(report)
    buffers = report.hbm_buffers()
    assert buffers and buffers[0]["bytes"] >= buffers[-1]["bytes"]
    kinds = {b["kind"] for b in buffers}
    assert {"parameter", "optimizer slot"} <= kinds
    # Sixteen times the batch per core needs more activation memory, and says how much of the core it takes.
    bigger = keras_tpu.profile(conv_model(), batch_size=16 * 1024, advise=False)
    assert bigger.hbm.total_bytes > 4 * report.hbm.total_bytes
