"""Weights of TPU models: lazy copies, the tf.keras HDF5 layout, Keras 3 files, atomic saves."""

import json
import logging
import os

import h5py
import keras
import numpy as np
import pytest

from keras_tpu import _keras_private
from tests.tpu_helpers import classification_data, on_tpu, small_classifier


def _trained_tpu_model(precision="default"):
    x, y = classification_data(96)
    tpu = on_tpu(small_classifier(), precision)
    tpu.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return tpu, x


def test_weights_stay_on_the_cores_until_copied_back(caplog):
    tpu, _ = _trained_tpu_model()
    layout = tpu.strategy.layout
    assert all(layout.holds(v.value) for v in tpu.cpu_model.variables)  # the TPU program's outputs
    logger = logging.getLogger("keras_tpu")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="keras_tpu"):
            cpu = tpu.sync_to_cpu()
    finally:
        logger.removeHandler(caplog.handler)
    assert "Copying TPU weights to the CPU" in caplog.text
    assert cpu is tpu.cpu_model
    assert not any(layout.holds(v.value) for v in cpu.variables + tpu.optimizer.variables)
    # The plain CPU model is usable on its own again.
    cpu.fit(*classification_data(32), batch_size=16, verbose=0)


def test_h5_weights_load_into_a_plain_keras_model(tmp_path):
    tpu, x = _trained_tpu_model()
    path = str(tmp_path / "model.h5")
    tpu.save_weights(path)
    with h5py.File(path, "r") as f:  # the tf.keras HDF5 weights layout
        names = [n.decode() if isinstance(n, bytes) else n for n in f.attrs["layer_names"]]
        assert {"backend", "keras_version"} <= set(f.attrs)
        for name in names:
            assert "weight_names" in f[name].attrs
    fresh = small_classifier(seed=7)
    fresh.load_weights(path)
    trained = tpu.sync_to_cpu()  # same weights; both predict in float32 on the CPU
    np.testing.assert_allclose(fresh.predict(x, verbose=0), trained.predict(x, verbose=0), atol=1e-6)


def test_keras3_weights_format_and_whole_model_files(tmp_path):
    tpu, x = _trained_tpu_model("highest")
    expected = tpu.predict(x, verbose=0)  # float32-accurate on the MXU: comparable with CPU predictions
    tpu.save_weights(str(tmp_path / "model.weights.h5"))
    fresh = small_classifier(seed=3)
    fresh.load_weights(str(tmp_path / "model.weights.h5"))
    np.testing.assert_allclose(fresh.predict(x, verbose=0), expected, atol=1e-6)
    tpu.save(str(tmp_path / "model.keras"))
    loaded = keras.models.load_model(str(tmp_path / "model.keras"))
    np.testing.assert_allclose(loaded.predict(x, verbose=0), expected, atol=1e-6)
    # load_weights reads a whole-model file too, into the TPU model.
    other = on_tpu(small_classifier(seed=5), "highest")
    other.load_weights(str(tmp_path / "model.keras"))
    np.testing.assert_allclose(other.predict(x, verbose=0), expected, atol=1e-6)
    with pytest.raises(ValueError, match=r"'\.h5'.*'\.weights\.h5'"):
        tpu.save_weights(str(tmp_path / "model.ckpt"))
    with pytest.raises(FileNotFoundError, match="No weights file"):
        tpu.load_weights(str(tmp_path / "missing.h5"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tpu.save_weights(str(tmp_path / "no" / "such" / "dir.h5"))


def _write_tf_keras_2_group(group, model):
    """Lay out weights exactly as tf.keras 2.x's save_weights_to_hdf5_group does."""
    group.attrs["backend"] = b"tensorflow"
    group.attrs["keras_version"] = b"2.15.0"
    group.attrs["layer_names"] = [layer.name.encode() for layer in model.layers]
    for layer in model.layers:
        layer_group = group.create_group(layer.name)
        names = [f"{layer.name}/{w.name}:0".encode() for w in layer.weights]
        layer_group.attrs["weight_names"] = names
        for name, weight in zip(names, layer.weights):
            layer_group.create_dataset(name.decode(), data=np.asarray(weight.value))


def test_loads_weights_written_by_tf_keras_2(tmp_path):
    source = small_classifier(seed=11)
    x, _ = classification_data(16)
    weights_only, whole_model = tmp_path / "tf2_weights.h5", tmp_path / "tf2_model.h5"
    with h5py.File(weights_only, "w") as f:
        _write_tf_keras_2_group(f, source)
    with h5py.File(whole_model, "w") as f:  # tf.keras model.save("x.h5"): weights under model_weights
        f.attrs["backend"] = b"tensorflow"
        f.attrs["keras_version"] = b"2.15.0"
        f.attrs["model_config"] = json.dumps({"class_name": "Sequential", "config": {}}).encode()
        _write_tf_keras_2_group(f.create_group("model_weights"), source)
    for path in (weights_only, whole_model):
        tpu = on_tpu(small_classifier(seed=12))
        tpu.load_weights(str(path))
        np.testing.assert_allclose(tpu.predict(x, verbose=0), source.predict(x, verbose=0), atol=1e-6)


def test_a_failed_save_leaves_the_previous_file_intact(tmp_path, monkeypatch):
    tpu, _ = _trained_tpu_model()
    path = tmp_path / "model.h5"
    tpu.save_weights(str(path))
    before = path.read_bytes()

    def broken_writer(f, model):
        f.create_group("half-written")
        raise OSError("disk full")

    monkeypatch.setattr(_keras_private.legacy_h5, "save_weights_to_hdf5_group", broken_writer)
    with pytest.raises(OSError, match="disk full"):
        tpu.save_weights(str(path))
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["model.h5"]  # no temporary file left behind
    with pytest.raises(FileExistsError):
        tpu.save_weights(str(path), overwrite=False)


def test_get_and_set_weights_move_weights_between_cpu_and_cores():
    tpu, x = _trained_tpu_model("highest")
    weights = tpu.get_weights()
    assert all(isinstance(w, np.ndarray) for w in weights)
    zeros = [np.zeros_like(w) for w in weights]
    tpu.set_weights(zeros)
    np.testing.assert_allclose(tpu.predict(x[:4], verbose=0), np.full((4, 3), 1 / 3), atol=1e-6)
    tpu.set_weights(weights)
    np.testing.assert_allclose(tpu.predict(x[:4], verbose=0), tpu.cpu_model.predict(x[:4], verbose=0), atol=1e-6)
