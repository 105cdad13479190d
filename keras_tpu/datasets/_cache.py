"""Where datasets are found and cached: the user's Keras cache directory."""

import os
import tempfile

import numpy as np

from keras_tpu import _files

BUNDLED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def keras_datasets_dir():
    """``$KERAS_HOME/datasets`` (``~/.keras/datasets`` by default), as Keras uses it."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "datasets")


def cache_path(name):
    """A file in keras-tpu's own corner of the Keras cache (falling back to the temp dir if read-only)."""
    directory = os.path.join(keras_datasets_dir(), "keras_tpu")
    try:
        os.makedirs(directory, exist_ok=True)
        if not os.access(directory, os.W_OK):
            raise PermissionError(directory)
    except OSError:
        directory = os.path.join(tempfile.gettempdir(), "keras_tpu_datasets")
        os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, name)


def load_or_build(path, build):
    """Load arrays saved at ``path``; otherwise ``build()`` them and save them atomically."""
    if os.path.exists(path):
        try:
            with np.load(path, allow_pickle=False) as saved:
                return {key: saved[key] for key in saved.files}
        except (OSError, ValueError):
            pass  # a damaged cache file is rebuilt below
    arrays = build()
    # Readers never see a half-written cache. The cache is per host and every pod worker
    # loads its data itself, so each process writes its own (pod_sync=False): no barrier.
    _files.write_file(path, lambda f: np.savez(f, **arrays), pod_sync=False)
    return arrays
