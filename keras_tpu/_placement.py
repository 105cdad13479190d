"""One placement path from a TPU address to TPU programs on a Keras model.

Every front end (``keras_to_tpu_model``, ``TPUStrategy``, ``TPUEstimator``)
makes the same decisions in the same order, here:

    resolver -> topology -> core layout -> MXU precision -> programs on the model

A :class:`Placement` resolves the (simulated) TPU, starts it with
:func:`keras_tpu._cluster.initialize_tpu_system`, picks the cores to use and
the MXU precision, and :meth:`Placement.install` gives a Keras model its TPU
programs: Keras' ``make_train_function``/``make_test_function``/
``make_predict_function`` return the replicated programs of
:class:`keras_tpu._replicated_steps.ReplicatedSteps`, so Keras' own ``fit``,
``evaluate`` and ``predict`` loops run on the TPU. (Keras 3's
``keras.distribution.Distribution`` plays the same role for its own
data-parallel layouts: one object the trainer asks for placement.)

A ``TPUStrategy`` model's ``fit``, ``evaluate`` and ``predict`` also take the
strategy's distributed datasets (``x``, and ``fit``'s ``validation_data``), as
TensorFlow's Keras does: :func:`distributed_datasets_as_batches` gives Keras
their global batches, and refuses the arguments TensorFlow refuses with them.
"""

import dataclasses
import inspect
import types

import jax
import keras

from keras_tpu import _keras_private, _validation as validation, _weights as weights
from keras_tpu._cluster import TPUClusterResolver, initialize_tpu_system
from keras_tpu._cores import CoreLayout
from keras_tpu._logging import logger
from keras_tpu._per_replica import DistributedDataset, DistributedIterator, GlobalBatches, PerReplica
from keras_tpu.mxu._numerics import canonical_precision
from keras_tpu._replicated_steps import ReplicatedSteps, program_rule

_INSTALLED = "_keras_tpu_installed"  # the model's __dict__ key for its Installation


class Placement:
    """Where and how models run on the simulated TPU.

    Args:
        resolver: a :class:`keras_tpu.TPUClusterResolver` (default: the local
            simulated v2-8).
        precision: the MXU precision of the models' matrix products
            (``"default"``, ``"high"`` or ``"highest"``).
        num_cores: use only the first ``num_cores`` cores (default: all).
        on_mxu: False runs the same programs with float32 matrix products on
            one CPU core and does not start the TPU system (the CPU baseline
            of ``TPUEstimator(use_tpu=False)``).
        steps_per_execution: steps per device call for models whose
            ``compile`` does not set ``steps_per_execution``.
        owner: the API name used in error messages.

    Example:
        >>> placement = Placement(TPUClusterResolver("grpc://10.0.0.2:8470"))
        >>> placement.num_cores, placement.precision.name
        (8, 'DEFAULT')
    """

    def __init__(self, resolver=None, precision="default", num_cores=None, on_mxu=True, steps_per_execution=1,
                 owner="TPUStrategy"):
        if resolver is None:
            resolver = TPUClusterResolver()
        if not isinstance(resolver, TPUClusterResolver):
            raise TypeError(f"{owner} needs a keras_tpu.TPUClusterResolver; got {type(resolver).__name__}. "
                            f"Create one with keras_tpu.TPUClusterResolver(tpu) (tpu: the TPU's name or "
                            f"grpc:// address, or nothing for the local simulated TPU).")
        if isinstance(steps_per_execution, bool) or not isinstance(steps_per_execution, int) \
                or steps_per_execution < 1:
            raise ValueError(f"steps_per_execution must be a positive integer; got {steps_per_execution!r}.")
        self.resolver = resolver
        self.precision = canonical_precision(precision)
        self.on_mxu = bool(on_mxu)
        self.steps_per_execution = steps_per_execution
        self.owner = owner  # the front end: its default deployment for the step-time model (keras_tpu.profile)
        if on_mxu:
            self.topology = initialize_tpu_system(resolver)
            layout = self.topology.layout
        else:  # the CPU: one core, float32, no TPU system
            self.topology = None
            layout = CoreLayout(1)
        if num_cores is not None and num_cores != layout.num_cores:
            if isinstance(num_cores, bool) or not isinstance(num_cores, int) or num_cores < 1:
                raise ValueError(f"num_cores must be a positive integer; got {num_cores!r}.")
            if not self.on_mxu:
                raise ValueError("A CPU placement has one core.")
            layout = layout.sub_layout(num_cores)
        self.layout = layout

    @property
    def num_cores(self):
        return self.layout.num_cores

    @property
    def rule(self):
        """The rewrite rule of this placement's programs (see :func:`keras_tpu._replicated_steps.program_rule`)."""
        return program_rule(self.precision, self.on_mxu)

    @property
    def accelerator_type(self):
        return self.topology.accelerator_type if self.topology is not None else None

    def describe(self):
        """One line: the accelerator, cores, their host layout and the MXU precision."""
        if self.topology is None:
            return f"CPU, 1 core ({self.layout.describe()}), float32 matrix products"
        return (f"TPU {self.topology.accelerator_type}, {self.num_cores} core(s) ({self.layout.describe()}), "
                f"MXU precision {self.precision.name.lower()}")

    def steps_for(self, model):
        """The :class:`ReplicatedSteps` that run ``model`` on these cores (made once per model)."""
        installed = installed_on(model)
        if installed is not None and installed.placement is self:
            if installed.steps is None:
                installed.steps = self._steps(model, installed.user_model)
            return installed.steps
        return self._steps(model)

    def _steps(self, model, user_model=None):
        # The HBM of a CPU placement (on_mxu=False) is not checked: it has none.
        return ReplicatedSteps(model, self.layout, self.precision, on_mxu=self.on_mxu,
                               accelerator_type=self.accelerator_type, user_model=user_model)

    def install(self, model, user_model=None):
        """Give ``model`` this placement's TPU programs for Keras' ``fit``/``evaluate``/``predict``.

        ``user_model`` is the model whose methods the user wrote, when it is
        not ``model`` itself (``keras_to_tpu_model`` wraps the CPU model).
        Instance attributes shadow Keras' methods, so only this model changes.

        Example:
            >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])   # doctest: +SKIP
            >>> Placement().install(model)                                            # doctest: +SKIP
        """
        _keras_private.track_progress_line()  # our log lines must not land on the progress bar's line
        model.__dict__[_INSTALLED] = Installation(self, user_model or model)
        for name, method in _model_methods(self).items():
            model.__dict__[name] = types.MethodType(method, model)
        if user_model is None:  # (keras_to_tpu_model's wrapper does this in its own methods)
            for name, method in _FILE_METHODS.items():
                model.__dict__[name] = types.MethodType(method, model)

    def uninstall(self, model):
        """Undo :meth:`install`: ``model`` gets Keras' own methods back (its compiled programs are dropped)."""
        model.__dict__.pop(_INSTALLED, None)
        for name in list(_model_methods(self)) + list(_FILE_METHODS):
            model.__dict__.pop(name, None)

    def __repr__(self):
        return f"Placement({self.describe()})"


@dataclasses.dataclass
class Installation:
    """What :meth:`Placement.install` recorded on a model."""

    placement: Placement
    user_model: object          # the model the user built (the CPU model of keras_to_tpu_model)
    steps: ReplicatedSteps = None


def installed_on(model):
    """The :class:`Installation` of a model that runs on the TPU, or ``None`` for a CPU model.

    Example:
        >>> installed_on(keras.Sequential()) is None    # doctest: +SKIP
        True
    """
    return getattr(model, "__dict__", {}).get(_INSTALLED)


def _load_weights(model, filepath, *args, **kwargs):
    """Keras' ``load_weights``, after :func:`keras_tpu._weights.check_loadable` (a damaged file, or
    another model's weights, get a message naming the file and the layer)."""
    weights.check_loadable(model, filepath, by_name=kwargs.get("by_name", False),
                           skip_mismatch=kwargs.get("skip_mismatch", False))
    return type(model).load_weights(model, filepath, *args, **kwargs)


def _save_weights(model, filepath, overwrite=True, **kwargs):
    """Keras' ``save_weights``, written atomically (:mod:`keras_tpu._files`): a save that is killed
    (``BackupAndRestore``, ``ModelCheckpoint``) or fails never leaves a torn file under the name.
    ``.h5`` writes tf.keras' layout, as ``keras_to_tpu_model`` models do."""
    if kwargs or not str(filepath).endswith((weights.KERAS3_SUFFIX,) + weights.LEGACY_SUFFIXES):
        return type(model).save_weights(model, filepath, overwrite=overwrite, **kwargs)  # Keras explains
    weights.save_weights(model, filepath, overwrite=overwrite)


def _save(model, filepath, overwrite=True, **kwargs):
    """Keras' ``save``, written atomically as :func:`_save_weights` is."""
    if not str(filepath).endswith((".keras",) + weights.LEGACY_SUFFIXES):
        return type(model).save(model, filepath, overwrite=overwrite, **kwargs)  # Keras explains
    weights.save_model(model, filepath, overwrite=overwrite, **kwargs)


def _export(model, filepath, format="tf_saved_model", **kwargs):
    """Keras' ``export`` of a model on the TPU: its inference function on the MXU, at the placement's precision,
    written with ``jax.export`` (:func:`keras_tpu.load_exported` loads it, no model code needed). Keras' default,
    a TensorFlow SavedModel, needs TensorFlow, which keras_tpu does not use; other formats are Keras' own."""
    if format != "tf_saved_model":
        return type(model).export(model, filepath, format=format, **kwargs)  # Keras explains
    from keras_tpu._export import export_model  # (``verbose``, ``input_signature``: no effect here)

    export_model(model, str(filepath), installed_on(model).placement.precision, pod_sync=True)
    logger.info("Exported the inference function of %r (MXU numerics) to %s with jax.export; "
                "keras_tpu.load_exported loads it.", model.name, filepath)
    return filepath


_FILE_METHODS = {"load_weights": _load_weights, "save_weights": _save_weights, "save": _save, "export": _export}


def _model_methods(placement):
    """The methods an installed model gets (instance attributes shadow Keras')."""
    def compile(model, *args, **kwargs):
        if "steps_per_execution" in kwargs:  # refused here, not as a bare range() error at the first fit
            validation.check_steps_per_execution(kwargs["steps_per_execution"])
        type(model).compile(model, *args, **kwargs)
        if "steps_per_execution" not in kwargs:  # the placement's default applies
            model.steps_per_execution = placement.steps_per_execution

    def steps_per_execution(model):
        # Also set directly (model.steps_per_execution = n): checked once per program, not per step.
        validation.check_steps_per_execution(model.steps_per_execution, where="model.steps_per_execution")
        return model.steps_per_execution

    def new_loop(function):
        # Keras asks for the function at the start of each fit, evaluate and predict call (and of each
        # train_on_batch): its batches set the global batch anew (see keras_tpu._batching.BatchStacker.new_loop).
        getattr(function, "new_loop", lambda: None)()

    def make_train_function(model, force=False):
        if model.train_function is None or force:
            model.train_function = placement.steps_for(model).train_function(steps_per_execution(model))
        else:
            new_loop(model.train_function)
        return model.train_function

    def make_test_function(model, force=False):
        if model.test_function is None or force:
            model.test_function = placement.steps_for(model).test_function(steps_per_execution(model))
        else:
            new_loop(model.test_function)
        return model.test_function

    def make_predict_function(model, force=False):
        if model.predict_function is None or force:
            model.predict_function = placement.steps_for(model).predict_function(steps_per_execution(model))
        else:
            new_loop(model.predict_function)
        return model.predict_function

    def checked(call):
        # The user's arguments are checked on the host once per call, then the model's own method runs.
        def method(model, *args, **kwargs):
            args, kwargs = distributed_datasets_as_batches(placement, model, call, args, kwargs)
            return validation.validated_call(model, call, args, kwargs)
        method.__name__ = call
        return method

    methods = {"compile": compile, "make_train_function": make_train_function,
               "make_test_function": make_test_function, "make_predict_function": make_predict_function}
    methods.update({call: checked(call) for call in validation.CHECKED_CALLS})
    return methods


# -- distributed datasets in fit, evaluate and predict ------------------------------------------------------


def _distributed(value):
    """Whether ``value`` is a distributed dataset, an iterator over one, or holds per-replica values (an
    element's structure; containers of many items, such as lists of numbers, are not searched)."""
    if isinstance(value, (DistributedDataset, DistributedIterator, PerReplica)):
        return True
    if isinstance(value, (tuple, list, dict)) and len(value) <= 64:
        return any(_distributed(item) for item in (value.values() if isinstance(value, dict) else value))
    return False


def distributed_datasets_as_batches(placement, model, call, args, kwargs):
    """``(args, kwargs)`` of ``model.<call>(...)`` with each distributed dataset (``x``, ``fit``'s
    ``validation_data``) replaced by a Keras data adapter of its global batches: each element's per-replica
    parts joined in replica order (:class:`keras_tpu._per_replica.GlobalBatches`), a new pass each epoch. The
    model's programs split each batch over the cores again, so the model trains, evaluates and predicts as on
    the batches the dataset distributed, partial ones included.

    As in TensorFlow's Keras, ``y``, ``sample_weight``, ``validation_split`` and ``class_weight`` are refused
    with a distributed dataset (its elements hold the targets and weights), and ``shuffle`` has no effect (the
    dataset's order is kept). Unlike TensorFlow, whose distributed datasets had no length, ``steps_per_epoch``
    and ``steps`` are not required: without them a pass over the dataset is an epoch. ``batch_size`` (and
    ``validation_batch_size``) has no effect when it is the dataset's global batch, and is refused otherwise.
    Only the models of the strategy that distributed the dataset take it.

    Example:
        >>> with strategy.scope():                                                  # doctest: +SKIP
        ...     model = small_model()
        >>> model.fit(strategy.experimental_distribute_dataset(batches), epochs=2)  # doctest: +SKIP
    """
    if not any(_distributed(value) for value in (*args, *kwargs.values())):
        return args, kwargs
    try:
        bound = inspect.signature(getattr(type(model), call)).bind(model, *args, **kwargs)
    except TypeError:
        return args, kwargs  # Keras names the unexpected argument itself
    arguments = bound.arguments
    keras_call = call in ("fit", "evaluate", "predict")
    if keras_call and isinstance(arguments.get("x"), DistributedDataset):
        arguments["x"] = _batches_of(placement, model, call, arguments, "x")
    if call == "fit" and isinstance(arguments.get("validation_data"), DistributedDataset):
        arguments["validation_data"] = _batches_of(placement, model, call, arguments, "validation_data")
    for name, value in arguments.items():
        if name != "self" and _distributed(value):
            what = ("a distributed dataset" if isinstance(value, DistributedDataset) else
                    "an iterator over a distributed dataset" if isinstance(value, DistributedIterator) else
                    "a per-replica value")
            if keras_call:
                raise ValueError(
                    f"{call}({name}=...): {name} is {what}. {call}() takes a distributed dataset itself as x"
                    f"{' (or validation_data)' if call == 'fit' else ''}: "
                    f"model.{call}(strategy.experimental_distribute_dataset(batches)), not an iterator over one or "
                    f"its per-replica values. Pass the dataset, or run per-replica values with strategy.run in a "
                    f"custom loop.")
            raise ValueError(
                f"{call}({name}=...): {name} is {what}, and {call}() takes one global batch of arrays. Pass the "
                f"batch's arrays (model.{call}(x, y)), or give the distributed dataset to "
                f"{'fit' if call.startswith('train') else 'evaluate' if call.startswith('test') else 'predict'}().")
    return bound.args[1:], bound.kwargs


def _batches_of(placement, model, call, arguments, name):
    """The Keras data adapter of the distributed dataset ``arguments[name]``, after the refusals of
    :func:`distributed_datasets_as_batches` and the checks ``fit`` makes of a generator's first batch."""
    dataset = arguments[name]
    strategy = dataset.strategy
    if strategy is None or getattr(strategy, "placement", None) is not placement:
        raise ValueError(
            f"{call}({name}=...): model {model.name!r} is not a model of the TPUStrategy that distributed this "
            f"dataset; as in TensorFlow, a distributed dataset feeds the models created under its strategy's "
            f"scope. Distribute the batches with the strategy whose scope created the model, or pass the batches "
            f"themselves (arrays, a generator or a keras.utils.PyDataset).")
    if name == "x":
        for refused, put in (("y", "(features, labels) batches"),
                             ("sample_weight", "(features, labels, sample_weights) batches")):
            if arguments.get(refused) is not None:
                raise ValueError(
                    f"{call}(x=<distributed dataset>, {refused}=...): {refused} is not supported when x is a "
                    f"distributed dataset (as in TensorFlow: the dataset's elements hold it). Distribute {put}, "
                    f"or pass arrays as x, y{' and sample_weight' if refused == 'sample_weight' else ''} instead.")
        if call == "fit" and arguments.get("validation_split") and arguments.get("validation_data") is None:
            raise ValueError(
                f"fit(validation_split={arguments['validation_split']!r}): a distributed dataset cannot be split (as "
                f"in TensorFlow, validation_split splits arrays only). Pass validation_data instead: a distributed "
                f"dataset of the validation batches (strategy.experimental_distribute_dataset(...)), or arrays "
                f"(x_val, y_val).")
        if call == "fit" and arguments.get("class_weight") is not None:
            raise ValueError(
                "fit(class_weight=...): class weights are not supported with a distributed dataset (TensorFlow's "
                "Keras maps them over a tf.data dataset, which a distributed dataset is not). Distribute "
                "(features, labels, sample_weights) batches, each row's sample weight its class's weight, or pass "
                "arrays as x and y with class_weight.")
    batches = GlobalBatches(dataset)
    first = batches.first()
    verb = {"fit": "train on", "evaluate": "evaluate", "predict": "predict"}[call]
    if first is None:
        raise ValueError(
            f"{call}({name}=...): the distributed dataset has no elements, so there is nothing to "
            f"{verb if name == 'x' else 'validate on'}. Distribute at least one batch (a generator that an earlier "
            f"pass read to its end has none left: distribute a new generator).")
    rows = int(jax.tree.leaves(first)[0].shape[0])
    size_argument = "batch_size" if name == "x" else "validation_batch_size"
    size = arguments.get(size_argument)
    if size is not None and size != rows:
        raise ValueError(
            f"{call}({size_argument}={size!r}): the distributed dataset is batched already (its first global batch "
            f"has {rows} rows, the replicas' parts joined), and {size_argument} does not batch it again. Leave "
            f"{size_argument} out, or batch the data by {size} rows before distributing it.")
    batch_x, batch_y, _ = keras.utils.unpack_x_y_sample_weight(first)
    where = "x" if name == "x" else "validation_data"
    validation.check_not_empty(batch_x, where, f"{call} (its first batch)")
    validation.check_input_shape(model, batch_x, f"the first batch's {'x' if name == 'x' else 'features'}"
                                 f"{'' if name == 'x' else ' (validation_data)'}", call)
    if call != "predict":
        validation.check_labels(model, batch_y, call, "y" if name == "x" else "validation labels",
                                " (the first batch)")
    return _keras_private.batches_adapter(batches.new_pass, first, batches.num_batches)
