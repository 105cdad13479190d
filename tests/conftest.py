"""Test set-up: keras_tpu is imported first, as a notebook would (it makes Keras use JAX)."""

import os
import subprocess
import sys

# The tests' programs compile with LLVM at -O1 instead of keras-tpu's -O2 (XLA:CPU's default is -O3; keras-tpu keeps a
# level XLA_FLAGS sets, see keras_tpu.mxu._kernels.compiler_options): the suite spends most of its
# time compiling small programs, and -O1 compiles them faster (the suite took 15:25 here against 16:43) with the same
# results (LLVM reorders no float arithmetic at either level). The processes of run_python and of the pod and
# killed-save tests, which drop XLA_FLAGS, compile at keras-tpu's -O2 (see keras_tpu._host.quicker_code_generation).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=1".strip()

import keras_tpu  # noqa: E402,F401  (must precede keras / jax use)
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, env=None, timeout=600):
    """Run ``code`` in a fresh Python process; return the CompletedProcess (stdout+stderr text)."""
    full_env = dict(os.environ)
    full_env.pop("XLA_FLAGS", None)
    full_env.pop("KERAS_BACKEND", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=REPO)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# A made-up address: the TPU is simulated locally whatever the address.
COLAB_TPU_ADDR = "10.240.1.2:8470"


@pytest.fixture
def colab(monkeypatch, tmp_path):
    """What a Colab TPU runtime gives a notebook (tests/test_tf_notebooks.py, tests/test_tf_guides.py):
    ``COLAB_TPU_ADDR``, a fresh working directory, seeded RNGs."""
    monkeypatch.setenv("COLAB_TPU_ADDR", COLAB_TPU_ADDR)
    monkeypatch.chdir(tmp_path)
    import keras
    keras.utils.set_random_seed(0)  # the notebooks do not seed; the tests do, to be repeatable
    return tmp_path
