"""Weight files for models trained on the TPU.

* ``name.h5`` / ``name.hdf5``: the legacy tf.keras HDF5 layout (what TensorFlow's
  TPU notebooks wrote), loadable by plain Keras 3 ``load_weights`` and by
  tf.keras 2.x.
* ``name.weights.h5``: Keras 3's own weights format.

A file is written next to its destination under a temporary name, fsynced
and moved into place only when complete (see :mod:`keras_tpu._files`), so a
failed or killed save never damages an existing file. In a TPU pod only the
first worker writes, and every worker waits until the file is complete.
"""

import io
import os

import h5py

from keras_tpu import _files, _keras_private

LEGACY_SUFFIXES = (".h5", ".hdf5")
KERAS3_SUFFIX = ".weights.h5"


def _check_destination(filepath, overwrite):
    directory = os.path.dirname(os.path.abspath(filepath))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"Cannot save weights to {filepath!r}: the directory {directory!r} does not exist.")
    if os.path.exists(filepath) and not overwrite:
        raise FileExistsError(f"{filepath!r} already exists; pass overwrite=True to replace it.")
    return directory


def save_weights(model, filepath, overwrite=True):
    """Save ``model``'s weights atomically, in the format the file name asks for.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> save_weights(model, "/tmp/example.h5")          # tf.keras HDF5 layout
        >>> save_weights(model, "/tmp/example.weights.h5")  # Keras 3 layout
    """
    filepath = os.fspath(filepath)
    if filepath.endswith(KERAS3_SUFFIX):
        suffix = KERAS3_SUFFIX
    elif filepath.endswith(LEGACY_SUFFIXES):
        suffix = os.path.splitext(filepath)[1]
    else:
        raise ValueError(
            f"Cannot tell the weights format from {filepath!r}. Use a name ending in '.h5' (the tf.keras HDF5 "
            f"layout, loadable by Keras 3 and tf.keras) or '.weights.h5' (Keras 3's format)."
        )
    _check_destination(filepath, overwrite)
    if suffix == KERAS3_SUFFIX:  # chief writes; all wait
        _files.save_file(filepath, lambda tmp: model.save_weights(tmp, overwrite=True))
    else:
        _files.write_file(filepath, lambda f: f.write(_legacy_h5_bytes(model)))


def _legacy_h5_bytes(model):
    """The tf.keras HDF5 weights file, built in memory: a full disk then fails in Python's own
    ``write`` (a plain OSError) rather than inside HDF5, which is left in a bad state by it."""
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        _keras_private.legacy_h5.save_weights_to_hdf5_group(f, model)
    return buffer.getbuffer()


def load_weights(model, filepath, **kwargs):
    """Load weights from a ``.h5`` (tf.keras or Keras 3, weights-only or full model),
    ``.weights.h5`` or ``.keras`` file into ``model``.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> save_weights(model, "/tmp/example.h5"); load_weights(model, "/tmp/example.h5")
    """
    filepath = os.fspath(filepath)
    if not os.path.exists(filepath):
        raise FileNotFoundError(f"No weights file at {filepath!r}.")
    model.load_weights(filepath, **kwargs)


def save_model(model, filepath, overwrite=True, **kwargs):
    """``model.save(filepath)``, written atomically like :func:`save_weights`."""
    filepath = os.fspath(filepath)
    suffix = ".keras" if filepath.endswith(".keras") else os.path.splitext(filepath)[1]
    if suffix not in (".keras",) + LEGACY_SUFFIXES:
        raise ValueError(f"Save a whole model as 'name.keras' (or legacy 'name.h5'); got {filepath!r}.")
    _check_destination(filepath, overwrite)
    _files.save_file(filepath, lambda tmp: model.save(tmp, overwrite=True, **kwargs))  # chief writes; all wait
