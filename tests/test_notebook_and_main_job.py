"""The notebook runs as written; the README's main job runs; fewer JAX devices give the same training."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_the_cifar10_notebook_executes(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("KERAS_TPU_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = nbformat.read(os.path.join(REPO, "notebooks", "cifar10_tpu.ipynb"), as_version=4)
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "Test loss:" in text and "test accuracy:" in text
    assert "2/2 - " in text and "loss: " in text  # Keras' progress line, verbose=2 (2 steps of 1024)
    assert "TPU profile of" in text and "conv2d_1" in text and "Advice" in text
    images = [o for o in outputs if o.output_type in ("display_data", "execute_result")
              and "image/png" in o.get("data", {})]
    assert len(images) >= 3  # the training curve, the test image with its predicted class, the profile
    assert (tmp_path / "cifar10_model.h5").exists()


@pytest.mark.slow
def test_the_main_job_command(tmp_path):
    weights = tmp_path / "weights.h5"
    done = subprocess.run(
        [sys.executable, "-m", "keras_tpu", "cifar10", "--epochs", "1", "--train-images", "2048",
         "--weights", str(weights)], capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2/2" in done.stdout and "loss:" in done.stdout  # Keras' progress bar (2 steps of 1024 images)
    assert "Test accuracy:" in done.stdout
    assert "Copying TPU weights to the CPU" in done.stderr
    assert weights.exists()


def test_cli_help_and_unknown_commands():
    from keras_tpu.__main__ import main

    assert main(["--help"]) == 0
    assert main(["nonsense"]) == 2


@pytest.mark.slow
def test_training_is_the_same_when_jax_started_with_one_device():
    code = """
import sys, jax
if sys.argv[1] == "1":
    jax.numpy.ones(1).block_until_ready()          # JAX starts with a single CPU device
sys.path.insert(0, {repo!r})
import keras_tpu, numpy as np
from tests.tpu_helpers import classification_data, on_tpu, small_classifier
x, y = classification_data(200)
tpu = on_tpu(small_classifier(), "highest")
tpu.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
print("CPD", tpu.strategy.layout.cores_per_device)
np.save(sys.argv[2], np.concatenate([w.ravel() for w in tpu.get_weights()]))
""".format(repo=REPO)
    results = {}
    for devices in ("1", "8"):
        path = os.path.join(REPO, f".tmp-weights-{devices}.npy")
        try:
            done = subprocess.run([sys.executable, "-c", code, devices, path], capture_output=True, text=True,
                                  cwd=REPO, timeout=600)
            assert done.returncode == 0, done.stderr[-2000:]
            assert "CPD 8" in done.stdout  # one device holds the eight cores either way
            results[devices] = np.load(path)
        finally:
            if os.path.exists(path):
                os.remove(path)
    np.testing.assert_allclose(results["1"], results["8"], atol=1e-6)
