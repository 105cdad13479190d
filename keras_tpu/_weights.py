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
        # type(model)'s method: a TPU model's own save_weights is the one that called this
        _files.save_file(filepath, lambda tmp: type(model).save_weights(model, tmp, overwrite=True))
    else:
        _files.write_file(filepath, lambda f: f.write(_legacy_h5_bytes(model)))


def _legacy_h5_bytes(model):
    """The tf.keras HDF5 weights file, built in memory: a full disk then fails in Python's own
    ``write`` (a plain OSError) rather than inside HDF5, which is left in a bad state by it."""
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        _keras_private.legacy_h5.save_weights_to_hdf5_group(f, model)
    return buffer.getbuffer()


class DamagedFileError(OSError):
    """A weights or model file that cannot be read: truncated, overwritten or not that format at all."""


def load_weights(model, filepath, **kwargs):
    """Load weights from a ``.h5`` (tf.keras or Keras 3, weights-only or full model),
    ``.weights.h5`` or ``.keras`` file into ``model``.

    A damaged file raises :class:`DamagedFileError` naming it; the weights of
    another model raise ``ValueError`` naming the first layer that does not
    match (see :func:`check_loadable`).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> save_weights(model, "/tmp/example.h5"); load_weights(model, "/tmp/example.h5")
    """
    filepath = os.fspath(filepath)
    check_loadable(model, filepath, by_name=kwargs.get("by_name", False),
                   skip_mismatch=kwargs.get("skip_mismatch", False))
    model.load_weights(filepath, **kwargs)


def check_loadable(model, filepath, by_name=False, skip_mismatch=False):
    """Raise a clear error unless ``filepath`` is a readable weights file whose layers fit ``model``.

    * missing: ``FileNotFoundError``;
    * truncated, cut short or not HDF5/zip at all: :class:`DamagedFileError`, naming the file;
    * another model's weights (a layer with other shapes, more or fewer layers): ``ValueError``
      naming the first layer that does not match, unless ``skip_mismatch`` (Keras then loads
      what fits). ``by_name`` (``.h5`` only) matches layers by name, as Keras does.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> save_weights(model, "/tmp/example.weights.h5"); check_loadable(model, "/tmp/example.weights.h5")
    """
    filepath = os.fspath(filepath)
    if not os.path.exists(filepath):
        raise FileNotFoundError(f"No weights file at {filepath!r}.")
    if os.path.isdir(filepath):
        return  # Keras reports a directory itself
    if filepath.endswith(".keras"):
        with _open_keras_archive(filepath) as h5:
            if not skip_mismatch:
                _check_keras3_layout(model, h5, filepath)
        return
    if not filepath.endswith(LEGACY_SUFFIXES):
        return  # Keras names the formats it reads
    try:
        h5 = h5py.File(filepath, "r")
    except OSError as error:
        raise _damaged(filepath, error) from error
    with h5:
        if skip_mismatch:
            return
        legacy = h5["model_weights"] if "model_weights" in h5 else h5
        if "layer_names" in legacy.attrs:
            _check_legacy_layout(model, legacy, filepath, by_name)
        elif "layers" in h5 or "vars" in h5:
            _check_keras3_layout(model, h5, filepath)


def _damaged(filepath, error):
    reason = str(error).split("(", 1)[-1].rstrip(")") if "(" in str(error) else str(error)
    return DamagedFileError(
        f"Cannot load {filepath}: the file is damaged ({reason}). It is incomplete or not a weights file: "
        f"probably cut short while being copied or written by another program. Load an earlier copy or save "
        f"it again (keras_tpu's own saves never leave a partial file under the final name).")


class _open_keras_archive:
    """The ``model.weights.h5`` inside a ``.keras`` zip archive, opened in memory; damage is reported."""

    def __init__(self, filepath):
        self.filepath = filepath

    def __enter__(self):
        import zipfile

        try:
            with zipfile.ZipFile(self.filepath) as archive:
                broken = archive.testzip()  # reads every member and checks its CRC
                if broken is not None:
                    raise zipfile.BadZipFile(f"member {broken!r} fails its checksum")
                if "model.weights.h5" not in archive.namelist():
                    raise zipfile.BadZipFile("no model.weights.h5 inside")
                data = archive.read("model.weights.h5")
            self.h5 = h5py.File(io.BytesIO(data), "r")
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            raise _damaged(self.filepath, error) from error
        return self.h5

    def __exit__(self, *exc):
        self.h5.close()


def _ordinal(n):
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _shapes(shapes):
    return "[" + ", ".join(str(tuple(s)) for s in shapes) + "]"


def _check_legacy_layout(model, group, filepath, by_name):
    """tf.keras' HDF5 layout: layers (those with weights) in order, or by name with ``by_name``."""
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in group.attrs["layer_names"]]
    saved = {}
    for name in names:
        weight_names = [w.decode() if isinstance(w, bytes) else str(w)
                        for w in group[name].attrs.get("weight_names", [])]
        if weight_names:
            saved[name] = [tuple(group[name][w].shape) for w in weight_names]
    layers = [layer for layer in model.layers if layer.weights]
    wanted = [(layer.name, [tuple(w.shape) for w in layer.trainable_weights + layer.non_trainable_weights])
              for layer in layers]
    advice = ("It holds another model's weights: build the same architecture as the model that saved it, or pass "
              "skip_mismatch=True (with by_name=True) to load only the layers that match.")
    if by_name:
        for name, shapes in wanted:
            if name in saved and saved[name] != shapes:
                raise ValueError(f"Cannot load {filepath} into model {model.name!r}: layer {name!r} has weights of "
                                 f"shapes {_shapes(shapes)}, but the file's layer {name!r} has "
                                 f"{_shapes(saved[name])}. {advice}")
        return
    if len(saved) != len(wanted):
        raise ValueError(f"Cannot load {filepath} into model {model.name!r}: the model has {len(wanted)} layer(s) "
                         f"with weights ({', '.join(n for n, _ in wanted)}) but the file has {len(saved)} "
                         f"({', '.join(saved)}). {advice}")
    for position, ((name, shapes), (saved_name, saved_shapes)) in enumerate(zip(wanted, saved.items()), 1):
        if shapes != saved_shapes:
            raise ValueError(f"Cannot load {filepath} into model {model.name!r}: layer {name!r} (its "
                             f"{_ordinal(position)} layer with weights) has weights of shapes {_shapes(shapes)}, but "
                             f"the file's {_ordinal(position)} layer {saved_name!r} has {_shapes(saved_shapes)}. "
                             f"{advice}")


def _variables_by_path(h5):
    """``{path: shape}`` of every variable of a Keras 3 weights file, the optimizer's excepted (Keras loads
    those only if they fit, and a model compiled differently has other ones)."""
    found = {}

    def visit(name, item):
        if isinstance(item, h5py.Dataset) and not name.startswith("optimizer/"):
            found[name] = tuple(item.shape)

    h5.visititems(visit)
    return found


def _check_keras3_layout(model, h5, filepath):
    """Keras 3's layout names variables by the model's structure (``layers/dense_1/vars/0``): compare it
    with the layout of the model's own weights, written to a temporary file."""
    import tempfile

    import numpy as np

    with tempfile.TemporaryDirectory(prefix="keras-tpu-check-") as directory:
        own_path = os.path.join(directory, "model.weights.h5")
        try:
            model.save_weights(own_path)
        except Exception:  # e.g. a model not built yet: Keras' own loader reports what it finds
            return
        with h5py.File(own_path, "r") as own_file:
            own = _variables_by_path(own_file)
            saved = _variables_by_path(h5)
            advice = ("It holds another model's weights: build the same architecture as the model that saved it, "
                      "or pass skip_mismatch=True to load only what matches.")
            for path in sorted(set(own) | set(saved), key=lambda p: (p.rsplit("/vars/", 1)[0], p)):
                if own.get(path) == saved.get(path):
                    continue
                group = path.rsplit("/vars/", 1)[0]
                layer = _layer_of_group(model, own_file, group, np) if group + "/vars" in own_file else None
                which = f"layer {layer!r} (saved as {group!r})" if layer else repr(group)
                if path not in saved:
                    problem = f"the model's {which} has weights the file lacks"
                elif path not in own:
                    problem = f"the file has weights for {group!r}, which the model does not have"
                else:
                    own_shapes = [own[p] for p in sorted(own) if p.startswith(group + "/vars/")]
                    saved_shapes = [saved[p] for p in sorted(saved) if p.startswith(group + "/vars/")]
                    problem = (f"{which} has weights of shapes {_shapes(own_shapes)} in the model but "
                               f"{_shapes(saved_shapes)} in the file")
                raise ValueError(f"Cannot load {filepath} into model {model.name!r}: {problem}. {advice}")


def _layer_of_group(model, own_file, group, np):
    """The name of the model's layer whose weights the model's own file stores under ``group``
    (found by value: the file was just written from those variables)."""
    stored = own_file[group + "/vars"]
    values = [np.asarray(stored[str(i)]) for i in range(len(stored))]
    for layer in [model] + _keras_private.all_layers(model):
        weights_of = [np.asarray(w) for w in layer.weights]
        if len(weights_of) == len(values) and all(a.shape == b.shape and np.array_equal(a, b)
                                                  for a, b in zip(weights_of, values)):
            return layer.name
    return None


def save_model(model, filepath, overwrite=True, **kwargs):
    """``model.save(filepath)``, written atomically like :func:`save_weights`."""
    filepath = os.fspath(filepath)
    suffix = ".keras" if filepath.endswith(".keras") else os.path.splitext(filepath)[1]
    if suffix not in (".keras",) + LEGACY_SUFFIXES:
        raise ValueError(f"Save a whole model as 'name.keras' (or legacy 'name.h5'); got {filepath!r}.")
    _check_destination(filepath, overwrite)
    # chief writes; all wait. type(model)'s method: a TPU model's own save is the one that called this
    _files.save_file(filepath, lambda tmp: type(model).save(model, tmp, overwrite=True, **kwargs))
