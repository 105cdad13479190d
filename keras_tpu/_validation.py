"""Checks of what the user passed, made once per call on the host, before any TPU program runs.

Plain Keras answers several mistakes with silence or an error that says
nothing (``fit`` on empty arrays raises a bare ``StopIteration``, sparse labels
outside ``[0, classes)`` train to a loss of 0.0, ``batch_size=0`` trains).
keras_tpu checks them at its boundary, once per ``fit``/``evaluate``/
``predict`` call (never per step inside the compiled program), and raises an
exception that names the argument, the value and what to do.

* :func:`check_positive_integer`, :func:`check_batch_size`, :func:`check_steps`,
  :func:`check_epochs`, :func:`check_validation_split`: the numbers.
* :func:`check_not_empty`, :func:`check_same_rows`, :func:`check_input_shape`:
  the arrays (NumPy, JAX, lists and dicts of them).
* :func:`check_labels`: sparse labels against the model's number of classes,
  one-hot labels given to a sparse loss (and class indices to a categorical
  one), binary labels outside ``[0, 1]``. NumPy labels are checked whole; a
  generator or ``keras.utils.PyDataset`` on its first batch (:func:`peek_first_batch`).
* :func:`check_address`, :func:`check_worker_list`: TPU addresses and pod worker lists.
* :func:`validated_call`: runs a model's ``fit``/``evaluate``/``predict``
  (and ``*_on_batch``) after the checks; :mod:`keras_tpu._placement` installs
  it on every TPU model.

Example:
    >>> check_batch_size(1024)
    >>> check_batch_size(0)
    Traceback (most recent call last):
    ...
    ValueError: batch_size=0: the batch size must be a positive integer (rows per global batch, e.g. 1024 = 128 per core on 8 cores).
"""

import collections.abc
import contextlib
import functools
import inspect
import re
import threading

import numpy as np

# -- numbers --------------------------------------------------------------------------------------


def _is_integer(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_positive_integer(value, argument, meaning, allow_none=True, call=None):
    """Raise ``ValueError`` (naming ``argument`` and ``value``) unless ``value`` is a positive integer.

    Example:
        >>> check_positive_integer(8, "steps", "steps per call")
        >>> check_positive_integer(None, "steps", "steps per call")
    """
    if value is None and allow_none:
        return
    if not _is_integer(value) or value < 1:
        # "fit(steps=0)", or "model.steps_per_execution=0" for an attribute
        where = f"{call}({argument}={value!r})" if call and not call.endswith(argument) else \
            f"{call or argument}={value!r}"
        kind = "an integer" if _is_integer(value) else f"a {type(value).__name__}"
        if _is_integer(value):
            raise ValueError(f"{where}: {argument} must be a positive integer ({meaning}); got {value}."
                             + (" Pass None to use the default." if allow_none else ""))
        raise ValueError(f"{where}: {argument} must be a positive integer ({meaning}), not {kind}."
                         + (" Pass None to use the default." if allow_none else ""))


def check_batch_size(batch_size, argument="batch_size", call=None):
    """A global batch size: ``None`` (Keras' default, 32) or a positive integer.

    Example:
        >>> check_batch_size(None); check_batch_size(128 * 8)
    """
    if batch_size is None:
        return
    if not _is_integer(batch_size) or batch_size < 1:
        where = f"{call}({argument}={batch_size!r})" if call else f"{argument}={batch_size!r}"
        raise ValueError(f"{where}: the batch size must be a positive integer (rows per global batch, e.g. "
                         f"1024 = 128 per core on 8 cores).")


def check_steps(steps, argument, call=None):
    """A number of steps: ``None`` (until the data ends) or a positive integer.

    Example:
        >>> check_steps(10, "steps_per_epoch")
    """
    check_positive_integer(steps, argument, "batches to run; None runs until the data ends", call=call)


def check_epochs(epochs, initial_epoch=0):
    """``fit``'s ``epochs`` (a positive integer) and ``initial_epoch`` (0 <= initial_epoch <= epochs).

    Example:
        >>> check_epochs(10, initial_epoch=4)
    """
    check_positive_integer(epochs, "epochs", "the epoch to train up to", allow_none=False, call="fit")
    if not _is_integer(initial_epoch) or initial_epoch < 0:
        raise ValueError(f"fit(initial_epoch={initial_epoch!r}): initial_epoch must be an integer >= 0 (the "
                         f"number of epochs already trained).")
    if initial_epoch > epochs:
        raise ValueError(f"fit(epochs={epochs}, initial_epoch={initial_epoch}): epochs is the epoch to train up to, "
                         f"not a count, so it must be at least initial_epoch. To train {epochs} more epochs pass "
                         f"epochs={initial_epoch + epochs}.")


def check_validation_split(validation_split):
    """``fit``'s ``validation_split``: a fraction in ``[0, 1)``.

    Example:
        >>> check_validation_split(0.1)
    """
    if isinstance(validation_split, bool) or not isinstance(validation_split, (int, float, np.floating, np.integer)) \
            or not 0 <= validation_split < 1:
        raise ValueError(f"fit(validation_split={validation_split!r}): validation_split is the fraction of the "
                         f"rows kept for validation, a number in [0, 1) such as 0.1.")


def check_validation_freq(validation_freq):
    """``fit``'s ``validation_freq``: a positive integer (every n epochs) or a list of epochs (1-based)."""
    if isinstance(validation_freq, collections.abc.Container) and not isinstance(validation_freq, (str, bytes)):
        if all(_is_integer(epoch) and epoch >= 1 for epoch in validation_freq):
            return
    elif _is_integer(validation_freq) and validation_freq >= 1:
        return
    raise ValueError(f"fit(validation_freq={validation_freq!r}): validation_freq must be a positive integer "
                     f"(validate every n epochs) or a list of epoch numbers counted from 1.")


def check_steps_per_execution(steps_per_execution, where="compile"):
    """``compile``'s ``steps_per_execution``: a positive integer (steps per TPU program call).

    Example:
        >>> check_steps_per_execution(50)
    """
    check_positive_integer(steps_per_execution, "steps_per_execution",
                           "training steps per TPU program call, e.g. 1 or 50", allow_none=False, call=where)


# -- arrays -----------------------------------------------------------------------------------------


def check_minimize_arguments(var_list, grad_loss):
    """``optimizer.minimize(loss, ...)`` of TensorFlow 1 (``keras_tpu.train``'s optimizers,
    ``CrossShardOptimizer``): the estimator trains every trainable weight on the spec's loss as it is."""
    if var_list is not None:
        raise ValueError("minimize(var_list=...): every trainable variable of model_fn's layers is trained. "
                         "Freeze layers with layer.trainable = False instead.")
    if grad_loss is not None:
        raise ValueError("minimize(grad_loss=...) is not supported: scale the loss in model_fn instead.")


def _is_array(value):
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type)


def _leaves(data):
    """The arrays of a (nested) tuple/list/dict of arrays; ``None`` if ``data`` is something else."""
    if _is_array(data):
        return [data]
    if isinstance(data, dict):
        parts = list(data.values())
    elif isinstance(data, (list, tuple)):
        parts = list(data)
    else:
        return None
    leaves = []
    for part in parts:
        if part is None:
            continue
        inner = _leaves(part)
        if inner is None:
            return None
        leaves += inner
    return leaves


def num_rows(data):
    """The number of rows (first dimension) of an array or nested structure of arrays; ``None`` if unknown.

    Example:
        >>> num_rows(np.zeros((5, 3))), num_rows({"a": np.zeros((5,))}), num_rows(iter([]))
        (5, 5, None)
    """
    leaves = _leaves(data)
    if not leaves:
        return None
    shape = tuple(leaves[0].shape)
    return shape[0] if shape else None


def _describe(data):
    leaves = _leaves(data) or []
    shapes = [tuple(leaf.shape) for leaf in leaves]
    return f"shape {shapes[0]}" if len(shapes) == 1 else f"shapes {shapes}"


def check_not_empty(data, argument, call):
    """Raise ``ValueError`` if ``data`` (arrays) has no rows.

    Example:
        >>> check_not_empty(np.zeros((4, 3)), "x", "fit")
    """
    rows = num_rows(data)
    if rows == 0:
        raise ValueError(f"{call}({argument}=...) has no rows ({argument} has {_describe(data)}): there is nothing "
                         f"to {_verb(call)}. Pass at least one example (check the slicing or filtering that "
                         f"made {argument}).")


def _verb(call):
    return {"fit": "train on", "train": "train on", "predict": "predict", "evaluate": "evaluate",
            "test": "evaluate"}.get(call.split("_")[0], "run")


def check_same_rows(call, **named):
    """Raise ``ValueError`` if the given arrays (``x=..., y=..., sample_weight=...``) differ in rows.

    Example:
        >>> check_same_rows("fit", x=np.zeros((4, 3)), y=np.zeros(4))
    """
    rows = {name: num_rows(value) for name, value in named.items() if value is not None}
    rows = {name: count for name, count in rows.items() if count is not None}
    if len(set(rows.values())) > 1:
        listed = ", ".join(f"{name} has {count}" for name, count in rows.items())
        raise ValueError(f"{call}(): the arrays must have one row per example, but {listed} rows. Pass the same "
                         f"examples in each (e.g. slice x and y with the same indices).")


def _model_tensors(model, which):
    """``model.inputs``/``model.outputs`` as a list of KerasTensors, or ``None`` when unknown
    (a subclassed or unbuilt model)."""
    try:
        tensors = getattr(model, which)
    except (AttributeError, ValueError):
        return None
    if not tensors:
        return None
    return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]


def _shape_fits(data_shape, model_shape):
    """Whether an array of ``data_shape`` feeds an input of ``model_shape`` (batch first, ``None`` = any).
    Keras adds or drops a trailing axis of size 1, so those fit too."""
    data_shape, model_shape = tuple(data_shape), tuple(model_shape)
    if len(data_shape) == len(model_shape) + 1 and data_shape[-1] == 1:
        data_shape = data_shape[:-1]
    elif len(data_shape) + 1 == len(model_shape) and model_shape[-1] == 1:
        model_shape = model_shape[:-1]
    if len(data_shape) != len(model_shape):
        return False
    return all(m is None or d == m for d, m in zip(data_shape[1:], model_shape[1:]))


def check_input_shape(model, x, argument, call):
    """Raise ``ValueError`` if an array ``x`` (or list of arrays) cannot feed the model's inputs.

    Only models with known inputs (functional, Sequential with an ``Input``) are checked.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> check_input_shape(model, np.zeros((2, 4)), "x", "fit")
    """
    inputs = _model_tensors(model, "inputs")
    if inputs is None:
        return
    if _is_array(x):
        arrays = [x]
    elif isinstance(x, (list, tuple)) and all(_is_array(a) for a in x):
        arrays = list(x)
    else:
        return  # dicts and other structures: Keras matches them by name and reports itself
    if len(arrays) != len(inputs):
        return
    for index, (array, tensor) in enumerate(zip(arrays, inputs)):
        model_shape = tuple(tensor.shape)
        if not _shape_fits(array.shape, model_shape):
            which = argument if len(inputs) == 1 else f"{argument}[{index}]"
            input_name = "input" if len(inputs) == 1 else f"input {index}"
            raise ValueError(f"{call}(): {which} has shape {tuple(array.shape)} but the model's {input_name} "
                             f"takes {model_shape} (None: any size). Reshape "
                             f"{which} to (rows,) + {model_shape[1:]}, or build the model for this data.")


# -- labels -----------------------------------------------------------------------------------------

_SPARSE = ("sparse_categorical_crossentropy",)
_CATEGORICAL = ("categorical_crossentropy", "categorical_focal_crossentropy")
_BINARY = ("binary_crossentropy", "binary_focal_crossentropy")


def _loss_kind(loss):
    """``("sparse" | "categorical" | "binary" | None, ignore_class, from_logits)`` of one compiled loss."""
    name = None
    config = {}
    if isinstance(loss, str):
        name = loss.lower()
    elif loss is not None:
        get_config = getattr(loss, "get_config", None)
        if callable(get_config):
            try:
                config = get_config() or {}
            except Exception:  # a custom loss whose config fails: not ours to judge
                config = {}
        name = getattr(loss, "fn", None) or loss
        name = getattr(name, "__name__", None) or type(name).__name__
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()  # SparseCategoricalCrossentropy -> sparse_...
    if name in _SPARSE:
        kind = "sparse"
    elif name in _CATEGORICAL:
        kind = "categorical"
    elif name in _BINARY:
        kind = "binary"
    else:
        kind = None
    return kind, config.get("ignore_class"), bool(config.get("from_logits", False))


def _losses_per_output(model, y):
    """``[(loss, output KerasTensor, labels, label name)]`` for the outputs whose labels can be paired."""
    loss = getattr(model, "loss", None)
    outputs = _model_tensors(model, "outputs")
    if loss is None or outputs is None or y is None:
        return []
    names = list(getattr(model, "output_names", None) or [])
    if len(outputs) == 1:
        single = loss[0] if isinstance(loss, (list, tuple)) and len(loss) == 1 else \
            next(iter(loss.values())) if isinstance(loss, dict) and len(loss) == 1 else loss
        labels = y[0] if isinstance(y, (list, tuple)) and len(y) == 1 else \
            next(iter(y.values())) if isinstance(y, dict) and len(y) == 1 else y
        return [(single, outputs[0], labels, "y")]
    pairs = []
    if isinstance(y, (list, tuple)) and len(y) == len(outputs):
        losses = list(loss) if isinstance(loss, (list, tuple)) else \
            [loss.get(n) for n in names] if isinstance(loss, dict) and len(names) == len(outputs) else [loss] * len(y)
        pairs = [(losses[i], outputs[i], y[i], f"y[{i}]") for i in range(len(outputs))]
    elif isinstance(y, dict) and len(names) == len(outputs):
        losses = [loss.get(n) for n in names] if isinstance(loss, dict) else \
            list(loss) if isinstance(loss, (list, tuple)) else [loss] * len(names)
        pairs = [(losses[i], outputs[i], y.get(n), f"y[{n!r}]") for i, n in enumerate(names) if n in y]
    return pairs


def _plain(value):
    """A NumPy scalar as the Python number it is (messages show ``7``, not ``np.int64(7)``)."""
    return value.item() if hasattr(value, "item") else value


def _first_bad(labels, bad):
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    return (index[0] if len(index) == 1 else index), _plain(labels[index])


def check_labels(model, y, call, argument="y", where=""):
    """Raise ``ValueError`` if the labels ``y`` cannot be right for the model's compiled loss.

    * a sparse loss (``sparse_categorical_crossentropy``): every label an integer in
      ``[0, classes)``, ``classes`` the last dimension of the model's output (Keras
      would train on the out-of-range labels and report a loss of 0.0), and not
      one-hot labels (one column per class);
    * a categorical loss: one-hot rows, not class indices;
    * a binary loss: labels in ``[0, 1]``.

    Only NumPy-like labels and models with known outputs are checked (host side, once).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> model.compile("sgd", "sparse_categorical_crossentropy")
        >>> check_labels(model, np.array([0, 2, 1]), "fit")
    """
    for loss, output, labels, name in _losses_per_output(model, y):
        if not _is_array(labels):
            continue
        kind, ignore_class, _ = _loss_kind(loss)
        if kind is None:
            continue
        name = name.replace("y", argument, 1)
        output_shape = tuple(output.shape)
        classes = output_shape[-1] if output_shape else None
        labels = np.asarray(labels)
        if labels.size == 0 or not (np.issubdtype(labels.dtype, np.number) or labels.dtype == np.bool_):
            continue
        loss_name = loss if isinstance(loss, str) else type(loss).__name__
        if kind == "sparse" and classes is not None:
            if labels.ndim == len(output_shape) and labels.shape[-1] == classes and classes > 1:
                raise ValueError(
                    f"{call}(){where}: {name} has shape {labels.shape}, one column per class (one-hot labels), but "
                    f"the loss {loss_name!r} takes class indices of shape {labels.shape[:-1]}. Pass "
                    f"{name}.argmax(axis=-1), or compile with loss='categorical_crossentropy'.")
            values = labels if ignore_class is None else labels[labels != ignore_class]
            if values.size == 0:
                continue
            if np.issubdtype(values.dtype, np.floating) and not np.all(np.isfinite(values) & (values == np.floor(values))):
                index, value = _first_bad(labels, ~(np.isfinite(labels) & (labels == np.floor(labels))))
                raise ValueError(
                    f"{call}(){where}: {name} holds {value!r} at index {index}, but the loss {loss_name!r} takes "
                    f"class indices (whole numbers in [0, {classes})). For probabilities per class use "
                    f"loss='categorical_crossentropy'.")
            low, high = _plain(values.min()), _plain(values.max())
            if low < 0 or high >= classes:
                out_of_range = (labels < 0) | (labels >= classes)
                if ignore_class is not None:
                    out_of_range &= labels != ignore_class
                index, value = _first_bad(labels, out_of_range)
                hint = (" (labels counted from 1? subtract 1)" if low >= 1 and high == classes else
                        " (use ignore_class=... in SparseCategoricalCrossentropy to skip a padding label)"
                        if low < 0 else "")
                raise ValueError(
                    f"{call}(){where}: {name} holds the label {value!r} at index {index}, but the model's output has "
                    f"{classes} classes, so labels must be in [0, {classes}) for {loss_name!r}; {name} ranges "
                    f"over [{low!r}, {high!r}]{hint}. Give the last layer as many units as there are classes, or "
                    f"fix the labels.")
        elif kind == "categorical" and classes is not None and classes > 1:
            if labels.ndim < len(output_shape) or labels.shape[-1] != classes:
                raise ValueError(
                    f"{call}(){where}: {name} has shape {labels.shape}, but the loss {loss_name!r} takes one-hot "
                    f"labels of shape (rows, {classes}) for the model's {classes} classes. Pass class indices with "
                    f"loss='sparse_categorical_crossentropy', or one-hot labels "
                    f"(keras.utils.to_categorical({name}, {classes})).")
        elif kind == "binary":
            low, high = _plain(labels.min()), _plain(labels.max())
            if low < 0 or high > 1:
                index, value = _first_bad(labels, (labels < 0) | (labels > 1))
                raise ValueError(
                    f"{call}(){where}: {name} holds {value!r} at index {index}, but the loss {loss_name!r} takes "
                    f"labels in [0, 1]; {name} ranges over [{low!r}, {high!r}]. For more than two classes use "
                    f"loss='sparse_categorical_crossentropy' with one output unit per class.")


# -- generators and PyDatasets: their first batch ------------------------------------------------------


def _is_py_dataset(data):
    try:
        import keras
    except ImportError:  # pragma: no cover - keras is a dependency
        return False
    return isinstance(data, keras.utils.PyDataset)


def _prepend(first, rest):
    """A generator yielding ``first`` then the rest of ``rest`` (Keras reads generators, not chains).

    The user's generator is read on, never closed: when Keras drops this one after ``fit``, the next
    ``fit`` on the same generator goes on from where this one stopped, as it does in plain Keras (``yield
    from`` would pass the close on to it).
    """
    yield first
    for batch in rest:
        yield batch


def peek_first_batch(data, argument, call):
    """``(data to pass on, first batch or None)`` of a generator or ``keras.utils.PyDataset``.

    A generator's first batch is taken and given back in front of the rest;
    a PyDataset's is read by index. Raises ``ValueError`` if there is none.

    Example:
        >>> data, batch = peek_first_batch((b for b in [(np.ones((2, 3)), np.zeros(2))]), "x", "fit")
        >>> batch[0].shape, len(list(data))
        ((2, 3), 1)
    """
    if _is_py_dataset(data):
        try:
            length = len(data)
        except (TypeError, NotImplementedError):
            length = None
        if length == 0:
            raise ValueError(f"{call}({argument}=...): the {type(data).__name__} has no batches (len() is 0). "
                             f"Check its __len__ and the data it reads.")
        if length is None and getattr(data, "num_batches", 1) is None:
            return data, None  # an endless PyDataset whose items may not be indexable from 0
        return data, data[0]
    if isinstance(data, collections.abc.Iterator):
        try:
            first = next(data)
        except StopIteration:
            raise ValueError(f"{call}({argument}=...): the generator is empty (it yielded no batch). Check that it "
                             f"is not exhausted by an earlier call: a generator can be read only once.") from None
        return _prepend(first, data), first
    return data, None


def _unpack_batch(batch):
    if isinstance(batch, tuple):
        return (tuple(batch) + (None, None))[:3]
    return batch, None, None


# -- the one entry point the placement calls ----------------------------------------------------------

#: The model methods :mod:`keras_tpu._placement` runs through :func:`validated_call`.
CHECKED_CALLS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")
_nesting = threading.local()


@contextlib.contextmanager
def _validated():
    """Calls made while a validated call runs (Keras' fit calls evaluate; a TPU model runs its CPU
    model's fit) are not checked again."""
    _nesting.depth = getattr(_nesting, "depth", 0) + 1
    try:
        yield
    finally:
        _nesting.depth -= 1


def check_call(model, call, arguments):
    """Check the arguments of ``model.<call>(...)`` (a dict by name); return them, with a generator's
    first batch put back in front if it was read.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> model.compile("sgd", "sparse_categorical_crossentropy")
        >>> check_call(model, "fit", {"x": np.zeros((0, 4)), "y": np.zeros(0)})
        Traceback (most recent call last):
        ...
        ValueError: fit(x=...) has no rows (x has shape (0, 4)): there is nothing to train on. Pass at least one example (check the slicing or filtering that made x).
    """
    arguments = dict(arguments)
    get = arguments.get
    base = call.split("_")[0] if call.endswith("_on_batch") else call
    # Keras reads it before any program is made (its data iterator steps by it): check it first.
    check_steps_per_execution(getattr(model, "steps_per_execution", 1), where="model.steps_per_execution")
    if call == "fit":
        check_batch_size(get("batch_size"), call=call)
        check_batch_size(get("validation_batch_size"), "validation_batch_size", call=call)
        check_epochs(get("epochs", 1), get("initial_epoch", 0))
        check_steps(get("steps_per_epoch"), "steps_per_epoch", call)
        check_steps(get("validation_steps"), "validation_steps", call)
        check_validation_split(get("validation_split", 0.0))
        check_validation_freq(get("validation_freq", 1))
    elif call in ("evaluate", "predict"):
        check_batch_size(get("batch_size"), call=call)
        check_steps(get("steps"), "steps", call)
    x, y = get("x"), get("y")
    if callable(x) and not hasattr(x, "__iter__") and not hasattr(x, "__getitem__"):
        return arguments  # TF 1's input function (KerasTPUModel resolves it)
    if x is not None and not _is_array(x) and _leaves(x) is None:
        peeked, batch = peek_first_batch(x, "x", call)
        arguments["x"] = peeked
        if batch is not None:
            batch_x, batch_y, _ = _unpack_batch(batch)
            check_not_empty(batch_x, "x", call + " (its first batch)")
            check_input_shape(model, batch_x, "the first batch's x", call)
            if base != "predict":
                check_labels(model, batch_y, call, "y", " (the first batch)")
        return arguments
    check_not_empty(x, "x", call)
    if base != "predict":
        check_same_rows(call, x=x, y=y, sample_weight=get("sample_weight"))
    check_input_shape(model, x, "x", call)
    if base != "predict":
        check_labels(model, y, call)
    validation_data = get("validation_data")
    if call == "fit" and isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        val_x, val_y = validation_data[0], validation_data[1]
        check_not_empty(val_x, "validation_data", call)
        check_same_rows(call, **{"validation_data[0]": val_x, "validation_data[1]": val_y})
        check_input_shape(model, val_x, "validation_data[0]", call)
        check_labels(model, val_y, call, "validation_data[1]")
    return arguments


@functools.lru_cache(maxsize=None)
def _signature_and_defaults(method):
    """``method``'s signature and its parameters' defaults, found once per method: ``inspect.signature`` cost
    ~0.1 ms per call, a sixth of keras.io's character generator's ``predict_on_batch`` of one row."""
    signature = inspect.signature(method)
    return signature, {name: p.default for name, p in signature.parameters.items()
                       if p.default is not inspect.Parameter.empty}


def validated_call(model, call, args, kwargs):
    """Run ``type(model).<call>(model, *args, **kwargs)`` after :func:`check_call` (once per call:
    calls nested inside it are not checked again).

    Example:
        >>> validated_call(model, "fit", (x, y), {"batch_size": 1024})   # doctest: +SKIP
    """
    method = getattr(type(model), call)
    if getattr(_nesting, "depth", 0):
        return method(model, *args, **kwargs)
    signature, defaults = _signature_and_defaults(method)
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError:
        return method(model, *args, **kwargs)  # Keras names the unexpected argument itself
    values = {**defaults, **bound.arguments, **bound.arguments.get("kwargs", {})}
    checked = check_call(model, call, values)
    if "x" in bound.arguments and checked.get("x") is not values.get("x"):
        bound.arguments["x"] = checked["x"]  # a generator whose first batch was read
    callbacks = bound.arguments.get("callbacks")
    reporter = None
    if call == "fit" and callbacks:
        callbacks, reporter = _with_nan_reporter(callbacks)
        bound.arguments["callbacks"] = callbacks
    with _validated():
        try:
            result = method(*bound.args, **bound.kwargs)
        except RuntimeError as error:
            if reporter is not None and reporter.first is not None:
                error.add_note(reporter.describe())
            raise
    if reporter is not None and reporter.first is not None:
        from keras_tpu._logging import logger

        logger.warning("%s", reporter.describe())
    return result


# -- NaN and Inf in the loss: where it first appeared ------------------------------------------------


def _with_nan_reporter(callbacks):
    """When the user asks for ``keras.callbacks.TerminateOnNaN``, add a reporter of the epoch and batch
    where the loss first stopped being finite (it reads the loss Keras already gives the callbacks,
    so nothing more is copied from the TPU)."""
    import keras

    if not isinstance(callbacks, (list, tuple)):
        return callbacks, None
    callbacks = list(callbacks)
    positions = [i for i, c in enumerate(callbacks) if isinstance(c, keras.callbacks.TerminateOnNaN)]
    if not positions:
        return callbacks, None
    reporter = _non_finite_loss_reporter()
    return callbacks[:positions[0]] + [reporter] + callbacks[positions[0]:], reporter


def _non_finite_loss_reporter():
    """A Keras callback recording the first epoch and batch whose loss is NaN or infinite (made here,
    not at import: this module is imported before Keras by the pod's start-up)."""
    import keras

    class NonFiniteLossReporter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.first = None
            self._epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            loss = (logs or {}).get("loss")
            if self.first is None and loss is not None:
                value = np.asarray(loss, dtype=float).ravel()
                if value.size and not np.all(np.isfinite(value)):
                    self.first = (self._epoch, batch, float(value[0]))

        def describe(self):
            epoch, batch, loss = self.first
            epochs = (self.params or {}).get("epochs")
            return (f"keras_tpu: the training loss first became {loss} in epoch {epoch + 1}"
                    f"{f' of {epochs}' if epochs else ''} (as the progress bar counts), at batch {batch} of that "
                    f"epoch (counted from 0). Lower the learning rate, look for NaN/Inf in the data, or clip the "
                    f"gradients (e.g. optimizer clipnorm=1.0).")

    return NonFiniteLossReporter()


# -- addresses ---------------------------------------------------------------------------------------

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def check_address(address, argument="tpu"):
    """Check one worker address ``host:port`` (``grpc://`` allowed); return it without the scheme.

    Example:
        >>> check_address("grpc://10.0.0.2:8470")
        '10.0.0.2:8470'
    """
    text = str(address).strip()
    scheme = _SCHEME.match(text)
    if scheme and scheme.group(1).lower() != "grpc":
        raise ValueError(f"{argument}={address!r}: a TPU is reached over gRPC; write the address as "
                         f"'grpc://host:port' (e.g. 'grpc://10.0.0.2:8470'), not {scheme.group(1)}://.")
    rest = text[scheme.end():] if scheme else text
    if not rest:
        raise ValueError(f"{argument}={address!r}: the address has no host. Write 'grpc://host:port' (e.g. "
                         f"'grpc://10.0.0.2:8470'), give a TPU name, or pass None for the local TPU.")
    if rest.startswith("["):  # [IPv6]:port
        host, _, port = rest[1:].partition("]")
        port = port[1:] if port.startswith(":") else None if not port else port
    else:
        host, colon, port = rest.rpartition(":")
        if not colon:
            host, port = rest, None
    if not host or any(c.isspace() or c in "/?#@" for c in host):
        raise ValueError(f"{argument}={address!r}: {host!r} is not a host name or IP address. Write "
                         f"'grpc://host:port' (e.g. 'grpc://10.0.0.2:8470').")
    if port is None or not port.isdigit() or not 1 <= int(port) <= 65535:
        got = "no port" if port is None else f"the port {port!r}"
        raise ValueError(f"{argument}={address!r}: the address has {got}; a worker address is 'host:port' with "
                         f"a port in 1..65535 (Cloud TPUs serve on 8470).")
    return rest


def check_worker_list(workers, argument="tpu"):
    """Check a pod's worker list (each ``host:port``, no duplicates, at least one); return the addresses.

    Example:
        >>> check_worker_list(["10.0.0.2:8470", "grpc://10.0.0.3:8470"])
        ['10.0.0.2:8470', '10.0.0.3:8470']
    """
    addresses = [check_address(w, f"{argument}[{i}]") for i, w in enumerate(workers)]
    if not addresses:
        raise ValueError(f"{argument}={workers!r} names no workers. List every worker's 'host:port' (the first is "
                         f"the coordinator), or pass None for the local TPU.")
    seen = {}
    for index, address in enumerate(addresses):
        if address in seen:
            raise ValueError(f"{argument}: the worker address {address!r} appears twice (workers {seen[address]} and "
                             f"{index}); every worker needs its own host:port.")
        seen[address] = index
    return addresses


def check_task_index(task_index, num_workers, argument="task_index"):
    """A pod worker's index: an integer in ``[0, num_workers)``; return it as ``int``.

    Example:
        >>> check_task_index("1", 2)
        1
    """
    try:
        value = int(str(task_index).strip())
    except ValueError:
        raise ValueError(f"{argument}={task_index!r}: the task index must be an integer (this worker's position "
                         f"in the worker list, from 0).") from None
    if not 0 <= value < max(1, num_workers):
        raise ValueError(f"{argument}={value} is out of range for {num_workers} worker(s): use 0 to "
                         f"{max(1, num_workers) - 1} (this worker's position in the worker list).")
    return value


def check_environment_integer(name, raw):
    """A positive integer from the environment variable ``name``.

    Example:
        >>> check_environment_integer("KERAS_TPU_HEARTBEAT_TIMEOUT", "10")
        10
    """
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = None
    if value is None or value < 1:
        raise ValueError(f"{name}={raw!r}: must be a positive integer. Unset it or set e.g. {name}=10.")
    return value

