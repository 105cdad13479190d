"""Pytest set-up shared by the tests and the docstring examples (run with --doctest-modules)."""

import keras_tpu  # noqa: F401  (first: makes Keras use JAX)
import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    """Names the docstring examples use without importing them."""
    import jax
    import jax.numpy as jnp

    doctest_namespace.update(np=np, jax=jax, jnp=jnp, keras_tpu=keras_tpu)
