"""Pytest set-up shared by the tests and the docstring examples (run with --doctest-modules)."""

import os
import shutil
import tempfile

# One JAX compilation cache per test run, shared by both test processes and the notebooks, examples and pod
# workers the tests start: many tests compile a program another test compiled already (the CPU reference model
# of each variant of a parametrized test, one TPU program under both front ends), and XLA's compile is most of
# their time. The directory starts empty and goes at the end of the run, so a run never reads another run's
# programs; a cache of the user's own (JAX_COMPILATION_CACHE_DIR already set) is used and kept. A size limit
# makes JAX lock the directory (filelock) while it reads or writes an entry, so the two test processes never
# see each other's half-written entries. Set before keras_tpu imports JAX, which reads these at import.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="keras_tpu_tests_jax_cache_")
    os.environ["KERAS_TPU_TESTS_OWN_JAX_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]  # (workers inherit it)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(64 << 30))

# The tests and examples take keras-tpu's default kernel choices instead of timing them on this host
# (keras_tpu.mxu._host_speed): the same programs on every machine, and no timing beside the other test process,
# which would time them wrong. tests/test_mxu_host_speed.py measures with it unset; the kernels' own tests force
# each form.
os.environ["KERAS_TPU_HOST_SPEED"] = "defaults"

import keras_tpu  # noqa: E402  (first of the project: makes Keras use JAX)
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_unconfigure(config):
    """The run's own compilation cache goes when the run ends (in the process that made it, not a worker)."""
    if not hasattr(config, "workerinput") and os.environ.get("KERAS_TPU_TESTS_OWN_JAX_CACHE"):
        shutil.rmtree(os.environ.pop("KERAS_TPU_TESTS_OWN_JAX_CACHE"), ignore_errors=True)


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    """Names the docstring examples use without importing them."""
    import jax
    import jax.numpy as jnp

    doctest_namespace.update(np=np, jax=jax, jnp=jnp, keras_tpu=keras_tpu)
