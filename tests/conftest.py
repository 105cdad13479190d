"""Test set-up: keras_tpu is imported first, as a notebook would (it makes Keras use JAX)."""

import os
import subprocess
import sys

import keras_tpu  # noqa: F401  (must precede keras / jax use)
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

