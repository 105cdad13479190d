"""The one place keras-tpu reaches into Keras internals, each where no public API exists.

* ``compile_arguments``: the arguments a model was compiled with. Keras keeps
  them (``Trainer._compile_config``) but only exposes a *serialized* copy
  (``get_compile_config``), which would replace the model's optimizer by a
  fresh one and fails for unregistered custom losses.
* ``loss_reductions``: how each compiled loss reduces over the batch (the
  ``Loss`` objects built inside ``CompileLoss``), needed to mask padded rows
  exactly.
* ``losses_summed``: a loss reduced with ``"mean_with_sample_weight"`` divides
  each core's sum by that core's weight sum, which no sample weight can turn
  into the batch's weighted mean; the step sums instead (the ``reduction`` of
  the user's ``Loss`` objects, set for the duration of the step's trace) and
  divides through the sample weights.
* ``added_losses_transformed``: Keras sums each loss added in ``call``
  (``Trainer._aggregate_additional_loss``); a loss added per row (a vector,
  as keras.io's CTC layers add) summed on each core must count each core's
  sum, not the cores' mean.
* ``keras_masks``, ``with_keras_masks`` and ``without_keras_masks``: the
  masks Keras attaches to a layer's outputs (``backend.get_keras_mask``; a JAX
  array carries it as an attribute) reach the loss, which counts the valid
  positions of the rows it is given, padding rows' included, and the
  evaluation's metrics; outputs mapped over the cores come back without them.
* ``losses_not_per_row``: which compiled losses give no value per row (a
  custom loss function that returns the batch's mean, say), whose padding
  rows no mask can keep out; Keras builds its ``Loss`` objects and the paths
  of the outputs they score inside ``CompileLoss`` (``_flat_losses``).
* ``update_metrics``: the loss tracker (``Trainer._loss_tracker``) must be
  updated with the number of *real* rows of a padded batch (Keras'
  ``_update_metrics_variables`` uses the padded row count), and the compiled
  metrics must skip padding rows: ``CompileMetrics.update_state`` gives sample
  weights only to ``weighted_metrics``, so its per-output metric lists are
  updated here directly, the unweighted ones with the padding mask alone.
* ``legacy_h5``: the writer and reader of the tf.keras HDF5 weight layout
  (``keras.src.legacy.saving.legacy_h5_format``); public ``save_weights``
  only writes the Keras 3 ``.weights.h5`` layout.
* ``inference_kwargs`` and ``all_layers``: whether a model's ``call`` takes
  ``training`` (``Layer._call_has_training_arg``) and every nested layer
  (``Layer._flatten_layers``; ``Model.layers`` lists only the top level).
* ``auto_named``: whether a layer's name is the one Keras made up for it
  (``dense_7``): ``TPUEstimator`` renames those as TensorFlow numbers layers
  in a fresh graph and keeps names users gave. Keras' naming rule
  (``keras.src.utils.naming.to_snake_case``) has no public name.
* ``is_layer_graph``: whether a model is Keras' own functional or Sequential
  model, whose ``call`` only runs its layers (the ``Functional`` class is not
  exported; ``keras.Model(inputs, outputs)`` returns one).
* ``track_progress_line``: Keras' ``Progbar`` writes through
  ``keras.src.utils.io_utils.print_msg`` and leaves its line open between
  updates; keras_tpu's log records must start on a line of their own, and
  Keras has no public way to know whether the bar's line is open.
* ``give_back_state``: Keras' JAX trainer takes the values out of a model's
  variables for the duration of ``fit``/``evaluate``/``predict`` and puts them
  back from the last step's state; when the very first step fails there is no
  such state and the model is left without values. A TPU program refused
  before it runs (it would not fit the core's HBM) must not cost the model.
* ``deferred_variables_kept``: variables created in a
  ``StatelessScope(initialize_variables=False)`` join Keras' global list of
  deferred variables (``global_state``), which the next ``StatelessScope``
  initialises; :func:`keras_tpu._hbm.abstract_weights` builds models that must
  stay without values, so it restores the list.
* ``initialize_deferred_variables``: Keras initialises the variables created
  in a ``StatelessScope`` when the scope closes; ``TPUStrategy.run`` traces a
  replica function abstractly (an optimizer may create its slots on its first
  ``apply``) and must initialise them after the trace, with real values.
* ``watch_models``: ``TPUStrategy.scope()`` must know which models are
  created and compiled under it. Keras has no public hook for model
  creation; every model (functional, Sequential, subclassed) runs
  ``Trainer.__init__``.
* ``batch_statistics_of_rows``: a core holding real and padding rows (a
  partial last batch) must normalise with the batch statistics of its real
  rows alone, as the CPU's smaller batch does. ``BatchNormalization``
  computes them in ``_moments``, which takes a Keras mask per position but no
  weight per row, and no public API reaches it.
* ``batches_adapter``: a distributed dataset reaches Keras' ``fit``,
  ``evaluate`` and ``predict`` as its global batches, a new pass each epoch.
  Keras takes a ``DataAdapter`` in place of data (``get_data_adapter``
  returns it as it is), but exports neither that class nor its adapter of
  Python generators (``GeneratorDataAdapter``), whose iterators, specs and
  conversions the adapter here reuses: a generator is read once, so the
  generator function becomes one that starts a new pass.
* ``optimizers_apply``: a step written by the user (a custom ``train_step``,
  ``strategy.run``'s replica function) applies gradients itself; on a TPU its
  optimizer applies the cores' all-reduced gradients. Keras has no hook
  between an optimizer and its gradients; every path reaches
  ``Optimizer.apply`` (a public method, wrapped here with the other hooks).
"""

import contextlib
import functools
import re
import threading

import jax
import keras
import numpy as np
from jax.extend import core as jex_core
from keras import StatelessScope
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
from keras.src.legacy.saving import legacy_h5_format as legacy_h5  # noqa: F401  (re-exported)
from keras.src.trainers.data_adapters.generator_data_adapter import GeneratorDataAdapter
from keras.src.trainers.trainer import Trainer

from keras_tpu._logging import logger


def compile_arguments(model):
    """The keyword arguments ``model.compile`` was called with, or ``None`` if it was not compiled."""
    config = getattr(model, "_compile_config", None)
    if not getattr(model, "compiled", False) or config is None:
        return None
    return dict(config.config)


def loss_reductions(model):
    """The reduction (e.g. ``"sum_over_batch_size"``) of each loss compiled into ``model``.

    Keras builds its ``CompileLoss`` on the first loss computed; before that
    the reductions come from the losses given to ``compile``: a ``Loss``
    object's own, ``"sum_over_batch_size"`` for a name or function (Keras
    wraps those in a ``LossFunctionWrapper`` with that reduction).
    """
    compiled = getattr(model, "_compile_loss", None)
    flat = getattr(compiled, "_flat_losses", None)
    if flat:
        return [_summed_losses.get(id(entry.loss), getattr(entry.loss, "reduction", None)) for entry in flat]
    user_losses = [loss for loss in keras.tree.flatten(getattr(compiled, "_user_loss", None)) if loss is not None]
    return [_summed_losses.get(id(loss), loss.reduction) if isinstance(loss, keras.losses.Loss)
            else "sum_over_batch_size" for loss in user_losses]


_summed_losses = {}  # id(loss) -> its own reduction, while losses_summed has it summing


@contextlib.contextmanager
def losses_summed(model, reduction="mean_with_sample_weight"):
    """Within the block, the compiled losses of ``model`` reduced with ``reduction`` sum their weighted values.

    Only ``Loss`` objects the user compiled can have such a reduction (Keras
    wraps names and functions with ``"sum_over_batch_size"``); Keras' compiled
    loss uses those same objects. :func:`loss_reductions` still reports their
    own reduction.

    Example:
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
        >>> model.compile(loss=loss)
        >>> with losses_summed(model):
        ...     loss.reduction, loss_reductions(model)
        ('sum', ['mean_with_sample_weight'])
        >>> loss.reduction
        'mean_with_sample_weight'
    """
    compiled = getattr(model, "_compile_loss", None)
    flat = getattr(compiled, "_flat_losses", None)
    losses = ([entry.loss for entry in flat] if flat else
              keras.tree.flatten(getattr(compiled, "_user_loss", None)))
    changed = [loss for loss in losses if isinstance(loss, keras.losses.Loss) and loss.reduction == reduction]
    for loss in changed:
        loss.reduction = "sum"
        _summed_losses[id(loss)] = reduction  # loss_reductions still reports it
    try:
        yield
    finally:
        for loss in changed:
            loss.reduction = reduction
            _summed_losses.pop(id(loss), None)


@contextlib.contextmanager
def added_losses_transformed(model, transform):
    """Within the block, each loss added to ``model`` (``add_loss``, regularizers) is aggregated as
    ``transform(loss, Keras' aggregate)``; ``loss`` is the value added, before Keras sums it.

    Example:
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.ActivityRegularization(l1=1.0)])
        >>> model.compile(loss="mse")
        >>> x = keras.ops.ones((4, 2))
        >>> y_pred = model(x)   # adds l1 * mean(sum |x|) = 2.0; the mse is 0
        >>> with added_losses_transformed(model, lambda added, total: total * 10):
        ...     float(model.compute_loss(x, x, y_pred))
        20.0
    """
    original = model._aggregate_additional_loss
    model.__dict__["_aggregate_additional_loss"] = lambda loss: transform(loss, original(loss))
    try:
        yield
    finally:
        model.__dict__.pop("_aggregate_additional_loss", None)


def keras_masks(outputs):
    """The Keras mask of each output in ``keras.tree.flatten(outputs)`` (``None`` where it has none)."""
    return [get_keras_mask(output) for output in keras.tree.flatten(outputs)]


def with_keras_masks(outputs, masks):
    """``outputs`` with the Keras mask of each (flattened) output set to ``masks``' (``None``: as it is), in
    place, as Keras' layers set them: a step that maps its cores returns new arrays, without their masks."""
    for output, mask in zip(keras.tree.flatten(outputs), masks):
        if mask is not None:
            set_keras_mask(output, mask.astype(bool))
    return outputs


def without_keras_masks(outputs):
    """``outputs`` as new arrays without Keras masks (multiplied by one, which XLA removes)."""
    return keras.tree.map_structure(lambda a: a * 1 if get_keras_mask(a) is not None else a, outputs)


def _compiled_losses(model, y, y_pred):
    """``(output index, loss, name, y_true, y_pred)`` for each loss compiled into ``model``: the index of the
    output it scores in ``keras.tree.flatten(y_pred)`` (``None`` if not found) and that output's targets and
    predictions. Empty where Keras has not built its ``CompileLoss`` yet (``fit`` builds it before the first
    step) or the targets do not match the outputs one for one."""
    compiled = getattr(model, "_compile_loss", None)
    flat = getattr(compiled, "_flat_losses", None)
    if not flat:
        return []
    y_true = y
    if keras.tree.is_nested(y_pred) and not keras.tree.is_nested(y) and len(keras.tree.flatten(y_pred)) == 1:
        y_true = [y]
    try:
        y_true = keras.tree.pack_sequence_as(y_pred, keras.tree.flatten(y_true))
    except (ValueError, TypeError):
        return []

    def at(path, tree):
        for key in path:
            tree = tree[key]
        return tree

    index = {tuple(path): i for i, (path, _) in enumerate(keras.tree.flatten_with_path(y_pred))}
    entries = []
    for path, loss, _, name in flat:
        try:
            entries.append((index.get(tuple(path)), loss, name, at(path, y_true), at(path, y_pred)))
        except (KeyError, IndexError, TypeError):
            continue
    return entries


def targets_for_loss(model, y, y_pred):
    """``y`` arranged as Keras' compiled loss arranges one target array for a model with several outputs of
    which one has a loss (``loss=[loss_fn, None]``, keras.io's miniature GPT): in the losses' structure, ``None``
    for the others; otherwise ``y`` as it is.

    Keras arranges it per batch, and first tries the target array as a list
    of targets, one row each: a batch of as many rows as outputs (each core's
    few rows) would be split so. The cores must get the whole batch's
    arrangement.

    Example:
        >>> inputs = keras.Input((3,))
        >>> model = keras.Model(inputs, [keras.layers.Dense(2)(inputs), keras.layers.Dense(4)(inputs)])
        >>> model.compile(loss=["mse", None])
        >>> y_pred = [jax.ShapeDtypeStruct((2, 2), "float32"), jax.ShapeDtypeStruct((2, 4), "float32")]
        >>> [None if t is None else t.shape for t in targets_for_loss(model, np.zeros((2, 2)), y_pred)]
        [(2, 2), None]
    """
    user_loss = getattr(getattr(model, "_compile_loss", None), "_user_loss", None)
    if y is None or user_loss is None or keras.tree.is_nested(y) or not keras.tree.is_nested(y_pred):
        return y
    flat_loss, outputs = keras.tree.flatten(user_loss), keras.tree.flatten(y_pred)
    with_loss = [i for i, loss in enumerate(flat_loss) if loss is not None]
    if len(outputs) < 2 or len(flat_loss) != len(outputs) or len(with_loss) != 1:
        return y
    arranged = [None] * len(flat_loss)
    arranged[with_loss[0]] = y
    return keras.tree.pack_sequence_as(user_loss, arranged)


def losses_not_per_row(model, y, y_pred):
    """Names of the compiled losses of ``model`` whose values have no leading axis of one value per row.

    ``y`` and ``y_pred`` are the batch's targets and the model's outputs
    (arrays or ``jax.ShapeDtypeStruct`` pytrees). Each loss's elementwise
    values (``Loss.call``, before its reduction and sample weights) are traced
    abstractly. Keras' own losses give one value per row (and position); a
    function the user compiled may return a scalar, such as the batch's mean.
    An empty list where the losses are not built yet or the targets do not
    match the outputs one for one (the caller keeps its default).

    Example:
        >>> model.compile(loss=lambda y, p: keras.ops.mean(keras.ops.square(y - p)))   # doctest: +SKIP
        >>> losses_not_per_row(model, y, y_pred)                                        # doctest: +SKIP
        ['<lambda>']
    """
    rows = keras.tree.flatten(y_pred)[0].shape[0]
    found = []
    for _, loss, name, y_t, y_p in _compiled_losses(model, y, y_pred):
        if not isinstance(loss, keras.losses.Loss):
            continue
        if overridden_methods(loss, ("__call__",)):
            # Keras reduces in Loss.__call__: a class that replaces it (keras.io's supervised contrastive loss)
            # returns its own reduction, whatever its call() gives, and may ignore the sample weight.
            found.append(getattr(loss, "name", None) or name or type(loss).__name__)
            continue
        try:
            values = jax.eval_shape(loss.call, y_t, y_p)
        except Exception:  # noqa: BLE001  (a loss that cannot be traced alone keeps the caller's default)
            continue
        shapes = [v.shape for v in jax.tree.leaves(values)]
        if not shapes or any(len(shape) == 0 or shape[0] != rows for shape in shapes):
            found.append(getattr(loss, "name", None) or name or type(loss).__name__)
    return found


def metrics_ignoring_sample_weight(model, y, y_pred):
    """Names of the compiled metrics of ``model`` whose state reads the batch but not its sample weight.

    ``y`` and ``y_pred`` are the batch's targets and the model's outputs
    (arrays or ``jax.ShapeDtypeStruct`` pytrees). Each metric's update is
    traced abstractly with the padding mask keras-tpu gives it as its
    sample weight (see :func:`update_metrics`); a state variable computed
    from the targets or outputs without that weight counts every row it is
    given, padding rows too (a user's ``update_state`` that sums errors and
    ignores ``sample_weight``), and so does one that adds a count of the
    rows taken from the batch's shape (its increment, traced at two row
    counts, changes with them). Keras' own metrics weigh every row. An empty
    list where the metrics are not built yet (the caller keeps its default).

    Example:
        >>> class TotalError(keras.metrics.Metric):                                     # doctest: +SKIP
        ...     def update_state(self, y_true, y_pred, sample_weight=None):
        ...         self.total.assign_add(keras.ops.sum(keras.ops.abs(y_true - y_pred)))
        >>> metrics_ignoring_sample_weight(model, y, y_pred)                            # doctest: +SKIP
        ['total_error']
    """
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is None or not compiled.built:
        return []
    try:
        flat_y, flat_pred = compiled._flatten_y(y), compiled._flatten_y(y_pred)
    except (ValueError, TypeError, KeyError):
        return []
    found = []
    for metrics in (compiled._flat_metrics, compiled._flat_weighted_metrics):
        for metric, y_t, y_p in zip(metrics, flat_y, flat_pred):
            for one in getattr(metric, "metrics", [metric]) if metric else ():  # (Keras' MetricsList)
                if _ignores_sample_weight(one, y_t, y_p):
                    found.append(one.name)
    return found


def _ignores_sample_weight(metric, y_true, y_pred):
    """Whether ``metric``'s update counts rows its sample weight (the padding mask, as :func:`update_metrics`
    gives it) leaves out: a state variable reads ``y_true`` or ``y_pred`` but not the weight, or adds a count of
    the rows taken from the batch's shape (its increment, computed from no input, changes with the rows)."""
    if getattr(metric, "_fn", None) is not None or not metric.variables:
        return False  # a metric function Keras wraps weighs its values (a whole-batch value is warned about)
    values = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in metric.variables]

    def traced(rows):
        abstract = [jax.ShapeDtypeStruct((rows,) + a.shape[1:], a.dtype) for a in (y_true, y_pred)]

        def update(values, y_true, y_pred, row_mask):
            weight = _padding_mask_for(metric, y_true, y_pred, row_mask)
            return metric.stateless_update_state(values, y_true, y_pred, sample_weight=weight)

        arguments = (values, *abstract, jax.ShapeDtypeStruct((rows,), "float32"))
        return jax.make_jaxpr(update)(*arguments), jax.tree.leaves(arguments)

    try:
        program, arguments = traced(y_pred.shape[0])
    except Exception:  # noqa: BLE001  (a metric that cannot be traced alone: its update in the step will say why)
        return False
    jaxpr = program.jaxpr
    reads_batch = _outputs_reached(jaxpr, jaxpr.invars[len(values):-1])
    reads_weight = _outputs_reached(jaxpr, jaxpr.invars[-1:])
    if any(batch and not weight for batch, weight in zip(reads_batch, reads_weight)):
        return True
    unread = [i for i, (batch, weight) in enumerate(zip(reads_batch, reads_weight)) if not (batch or weight)]
    if not unread:
        return False
    try:
        other, other_arguments = traced(y_pred.shape[0] + 1)
    except Exception:  # noqa: BLE001
        return False

    def increments(program, arguments):  # (from zeros: inputs these outputs do not read)
        outputs = jex_core.jaxpr_as_fun(program)(*[jax.numpy.zeros(a.shape, a.dtype) for a in arguments])
        return [np.asarray(outputs[i]) for i in unread]

    return any(not np.array_equal(a, b) for a, b in zip(increments(program, arguments),
                                                        increments(other, other_arguments)))


def _outputs_reached(jaxpr, sources):
    """For each output of ``jaxpr``, whether it is computed from any of the variables ``sources`` (an equation
    with a reached input reaches all its outputs: conservative for nested programs)."""
    reached = set(sources)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jex_core.Var) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return [isinstance(v, jex_core.Var) and v in reached for v in jaxpr.outvars]


def loss_forms(model, y, y_pred):
    """How each output's compiled loss reduces, traced abstractly: for each output in
    ``keras.tree.flatten(y_pred)``, ``(reduction, shape of its per-element values, whether Keras masks those
    values)`` or ``None`` (no loss, or one that cannot be traced alone); ``None`` where the losses are not
    built.

    ``y`` and ``y_pred`` are arrays or ``jax.ShapeDtypeStruct`` pytrees. A
    loss masks its values itself where it ignores some targets
    (``SparseCategoricalCrossentropy(ignore_class=0)``); the outputs' own Keras
    masks (``Embedding(mask_zero=True)``) are the model's, not the loss's.

    Example:
        >>> model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
        >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=0, reduction="sum"))
        >>> y, y_pred = jax.ShapeDtypeStruct((8, 1), "int32"), jax.ShapeDtypeStruct((8, 3), "float32")
        >>> _ = model.compute_loss(y=keras.ops.zeros((8, 1), "int32"), y_pred=keras.ops.zeros((8, 3)))  # built
        >>> loss_forms(model, y, y_pred)
        [('sum', (8,), True)]
    """
    entries = _compiled_losses(model, y, y_pred)
    if not entries:
        return None
    forms = [None] * len(keras.tree.flatten(y_pred))
    for i, loss, _, y_t, y_p in entries:
        if i is None or not isinstance(loss, keras.losses.Loss):
            continue
        masked = []

        def values(y_t, y_p, loss=loss, masked=masked):
            values = loss.call(y_t, y_p)
            masked.append(get_keras_mask(values) is not None)
            return values

        try:
            shape = jax.eval_shape(values, y_t, y_p)
        except Exception:  # noqa: BLE001  (a loss that cannot be traced alone: the caller's default)
            continue
        if hasattr(shape, "shape"):
            forms[i] = (_summed_losses.get(id(loss), loss.reduction), tuple(shape.shape), masked[0])
    return forms


def loss_masks(model, y, y_pred, forms):
    """The mask Keras' compiled loss applies to each output's per-element values (for each output in
    ``keras.tree.flatten(y_pred)``; ``None`` where there is none): the output's own Keras mask, and the mask
    the loss puts on its values (``ignore_class``), combined as ``Loss.__call__`` combines them.

    ``y_pred`` is the model's real outputs, with their masks; ``forms`` are
    their losses' (:func:`loss_forms`). Each loss that masks its values is
    computed again here for its mask (a comparison of the targets, which is
    all XLA keeps of it).
    """
    masks = [get_keras_mask(output) for output in keras.tree.flatten(y_pred)]
    forms = forms or []
    for i, loss, _, y_t, y_p in _compiled_losses(model, y, y_pred):
        if i is not None and i < len(forms) and forms[i] is not None and forms[i][2]:
            values_mask = get_keras_mask(loss.call(y_t, y_p))
            if values_mask is not None:
                masks[i] = values_mask if masks[i] is None else masks[i] & values_mask
    return masks


def per_output_loss_trackers(model):
    compiled = getattr(model, "_compile_loss", None)
    return bool(compiled is not None and compiled.metrics)


def update_metrics(model, metrics_values, loss, real_rows, x, y, y_pred, row_mask, sample_weight,
                   loss_sample_weight):
    """Update ``model``'s metrics statelessly, as Keras' train/test step does, for a padded batch.

    ``real_rows`` weighs the loss tracker (Keras uses the batch's row count).
    ``row_mask`` is 1 for real rows and 0 for padding; ``sample_weight`` is
    the user's sample weight times that mask. Multi-output models' per-output
    loss trackers are updated by re-evaluating the compiled loss with
    ``loss_sample_weight`` (which holds the outputs' Keras masks: the outputs
    are given without them). Returns ``(logs, new values)``.
    """
    mapping = list(zip(model.metrics_variables, metrics_values))
    with StatelessScope(state_mapping=mapping) as scope:
        model._loss_tracker.update_state(loss, sample_weight=real_rows)
        if per_output_loss_trackers(model):
            _update_per_output_loss_trackers(model, mapping, y, y_pred, loss_sample_weight, real_rows)
        if overridden_methods(model, ("compute_metrics",)):
            model.compute_metrics(x, y, y_pred, sample_weight)
        elif model._compile_metrics is not None:
            _update_compiled_metrics(model._compile_metrics, y, y_pred, row_mask, sample_weight)
        logs = model.get_metrics_result()
    new_values = []
    for variable, old in mapping:
        value = scope.get_current_value(variable)
        new_values.append(old if value is None else value)
    return logs, new_values


def _update_per_output_loss_trackers(model, mapping, y, y_pred, loss_sample_weight, real_rows):
    # CompileLoss updates each output's Mean tracker with the padded row count as its weight; its value
    # (the real rows' mean, thanks to loss_sample_weight) must count for the real rows only. A Mean's
    # state (total, count) is linear in that weight, so scaling the step's increment is exact.
    model._compile_loss(y, without_keras_masks(y_pred), loss_sample_weight)  # the weights hold the masks
    padded_rows = keras.tree.flatten(y_pred)[0].shape[0]
    old_values = {id(variable): value for variable, value in mapping}
    for tracker in model._compile_loss.metrics:
        for variable in tracker.variables:
            old = old_values[id(variable)]
            share = keras.ops.cast(real_rows, variable.dtype) / padded_rows
            variable.assign(old + (variable.value - old) * share)


def _update_compiled_metrics(compiled, y, y_pred, row_mask, sample_weight):
    # CompileMetrics.update_state, except that unweighted metrics still skip padding rows.
    if not compiled.built:
        compiled.build(y, y_pred)
    flat_y, flat_pred = compiled._flatten_y(y), compiled._flatten_y(y_pred)
    for metric, y_t, y_p in zip(compiled._flat_metrics, flat_y, flat_pred):
        for one in getattr(metric, "metrics", [metric]) if metric else ():  # (Keras' MetricsList of the output)
            one.update_state(y_t, y_p, sample_weight=_padding_mask_for(one, y_t, y_p, row_mask))
    weights = compiled._flatten_y(sample_weight)
    if len(weights) < len(flat_y):
        weights = [weights[0]] * len(flat_y)
    for metric, y_t, y_p, weight in zip(compiled._flat_weighted_metrics, flat_y, flat_pred, weights):
        if metric:
            metric.update_state(y_t, y_p, weight)


def _padding_mask_for(metric, y_true, y_pred, row_mask):
    """The padding rows' mask as ``metric``'s sample weight: one weight per value it averages, or ``None`` for a
    metric function that gives one value for the whole batch (no row to mask).

    A metric wrapping a function (``MeanMetricWrapper``: ``metrics=[psnr]``)
    averages the values the function returns, traced here for their shape (per
    row and position, per image, or one per batch); other metrics take a
    weight per row and position of the output, broadcast in full (IoU metrics
    flatten it to the flattened targets' length), as integers for a metric
    that counts in integers (IoU's confusion matrix).
    """
    rows = row_mask.shape[0]
    rank = max(1, len(y_pred.shape) - 1)
    shape = tuple(y_pred.shape[:rank])
    if getattr(metric, "_fn", None) is not None:
        abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (y_true, y_pred)]
        try:
            values = jax.eval_shape(functools.partial(metric._fn, **metric._fn_kwargs), *abstract)
        except Exception:  # noqa: BLE001  (a function that cannot be traced alone: its update will say why)
            values = None
        if values is not None and hasattr(values, "shape"):
            if len(values.shape) == 0 or values.shape[0] != rows:
                _warn_batch_metric(metric)
                return None
            shape = tuple(values.shape)
    weight = keras.ops.broadcast_to(row_mask.reshape((rows,) + (1,) * (len(shape) - 1)), shape)
    return keras.ops.cast(weight, metric.dtype if "int" in str(getattr(metric, "dtype", "")) else weight.dtype)


_warned_batch_metrics = set()


def _warn_batch_metric(metric):
    if metric.name not in _warned_batch_metrics:
        _warned_batch_metrics.add(metric.name)
        logger.warning(
            "The metric %r gives one value for the whole batch, not one per row: on a batch the TPU pads (a partial "
            "last batch, or a batch size that does not split evenly over the cores) its value also covers the "
            "padding rows (copies of the batch's first row). Return one value per row (reduce over the other axes "
            "only) for a value exact on every batch.", metric.name)


def overridden_methods(model, names):
    """Which of the methods ``names`` of a Keras object (a model, a loss) its own (non-Keras) classes replace."""
    return [name for name in names
            if any(name in vars(cls) for cls in type(model).__mro__
                   if not cls.__module__.startswith(("keras.", "keras_tpu.")))]


def metrics_result(model, metrics_values):
    """``model.get_metrics_result()`` computed from the given metric variable values."""
    with StatelessScope(state_mapping=list(zip(model.metrics_variables, metrics_values))):
        return model.get_metrics_result()


# Keras has no hooks for "a model was created", "a model was compiled" or "an optimizer applies gradients",
# so three methods of Keras' classes are wrapped, once per process, by dispatchers that call the handlers the
# *current thread* registered (none: the original method alone). Handlers are per thread, so a strategy scope
# or a core's trace in one thread never touches another thread's models, and nothing is ever unpatched (a
# thread leaving its context cannot undo another's).
_thread_hooks = threading.local()
_hooks_lock = threading.Lock()
_hooks_installed = False


def _handlers(kind):
    return getattr(_thread_hooks, kind, ())


def _install_hooks():
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        original_init, original_compile = Trainer.__init__, Trainer.compile
        original_apply = keras.optimizers.Optimizer.apply

        @functools.wraps(original_init)
        def init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            for on_created in _handlers("created"):
                on_created(self)

        @functools.wraps(original_compile)
        def compile(self, *args, **kwargs):
            original_compile(self, *args, **kwargs)
            for on_compiled in _handlers("compiled"):
                on_compiled(self)

        @functools.wraps(original_apply)
        def apply(self, grads, trainable_variables=None):
            for transform in _handlers("gradients"):
                grads = transform(grads)
            return original_apply(self, grads, trainable_variables)

        # On Trainer itself, where Model inherits it from: Keras' compile_from_config (load_model, clone_model)
        # skips a compile it takes for the user's own (``cls.compile != Trainer.compile``), and a loaded model
        # would come back uncompiled.
        Trainer.__init__, Trainer.compile, keras.optimizers.Optimizer.apply = init, compile, apply
        _hooks_installed = True


@contextlib.contextmanager
def _thread_handler(kind, handler):
    _install_hooks()
    previous = _handlers(kind)
    setattr(_thread_hooks, kind, previous + (handler,))
    try:
        yield
    finally:
        setattr(_thread_hooks, kind, previous)


@contextlib.contextmanager
def watch_models(on_created, on_compiled):
    """While active in this thread, call ``on_created(model)`` after every Keras model this thread
    constructs and ``on_compiled(model)`` after every ``model.compile`` it runs."""
    with _thread_handler("created", on_created), _thread_handler("compiled", on_compiled):
        yield


@contextlib.contextmanager
def optimizers_apply(transform):
    """While active in this thread, every Keras optimizer applies ``transform(grads)`` instead of
    ``grads``. ``Optimizer.apply`` is where ``apply_gradients``, ``stateless_apply`` (Keras' JAX
    ``train_step``) and a wrapping ``LossScaleOptimizer`` all arrive; nested optimizers apply ``transform``
    once each, so it must be idempotent (the cores' mean is)."""
    with _thread_handler("gradients", transform):
        yield


def inference_kwargs(model):
    """Keyword arguments that put ``model``'s call in inference mode."""
    return {"training": False} if model._call_has_training_arg else {}


def all_layers(model):
    """Every layer inside ``model``, nested ones included."""
    return list(model._flatten_layers(include_self=False))


def own_non_trainable_variables(layer):
    """The non-trainable variables ``layer`` creates itself (``add_weight``), not those of the layers inside it:
    Keras keeps them apart only in a private list.

    Example:
        >>> layer = keras.layers.BatchNormalization()
        >>> layer.build((None, 3))
        >>> [v.name for v in own_non_trainable_variables(layer)]
        ['moving_mean', 'moving_variance']
    """
    return list(getattr(layer, "_non_trainable_variables", []))


def batch_normalizations(model):
    """The ``BatchNormalization`` layers in ``model`` whose training statistics are Keras' own (``_moments`` not
    overridden): those :func:`batch_statistics_of_rows` computes over chosen rows."""
    return [layer for layer in all_layers(model) if isinstance(layer, keras.layers.BatchNormalization)
            and type(layer)._moments is keras.layers.BatchNormalization._moments]


@contextlib.contextmanager
def batch_statistics_of_rows(model, rows, computed=None):
    """Within the block, each ``BatchNormalization`` in ``model`` computes its training statistics over the
    rows where ``rows`` (one 0/1 value per row of the batch it normalises) is 1, or, with ``rows`` None, Keras'
    own statistics; ``computed()`` (if given) is called whenever a layer computes them.

    For batches with padding rows; keras-tpu traces its full batches with
    ``rows`` None, to learn whether any layer computes batch statistics at
    all (see ``keras_tpu._programs.ProgramForm``). A Keras mask the
    layer gets is applied as Keras applies it. A batch with no row counted
    keeps the statistics of all its rows (finite: its share of the moving
    statistics and of the loss is 0). Layers that override ``_moments`` keep
    their own (:func:`batch_normalizations`).

    Example:
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.BatchNormalization(epsilon=0.0)])
        >>> x = keras.ops.convert_to_tensor([[1.0], [3.0], [100.0]])
        >>> rows = keras.ops.convert_to_tensor([1.0, 1.0, 0.0])
        >>> with batch_statistics_of_rows(model, rows):
        ...     keras.ops.convert_to_numpy(model(x, training=True)[:2, 0]).tolist()   # mean 2, variance 1
        [-1.0, 1.0]
    """
    normalizations = batch_normalizations(model)
    for layer in normalizations:
        layer.__dict__["_moments"] = functools.partial(_moments_of_rows, layer, rows, computed)
    try:
        yield
    finally:
        for layer in normalizations:
            layer.__dict__.pop("_moments", None)


def _moments_of_rows(layer, rows, computed, inputs, mask):
    """``BatchNormalization._moments(inputs, mask)`` over the rows where ``rows`` is 1 (see
    :func:`batch_statistics_of_rows`)."""
    if computed is not None:
        computed()
    if rows is None:
        return keras.layers.BatchNormalization._moments(layer, inputs, mask)
    return _weighted_moments(layer, rows, inputs, mask)


def _weighted_moments(layer, rows, inputs, mask):
    ops = keras.ops
    counted = ops.cast(rows, inputs.dtype)
    counted = ops.where(ops.any(counted > 0), counted, ops.ones_like(counted))
    weights = ops.reshape(counted, (-1,) + (1,) * (len(inputs.shape) - 1))
    if mask is not None:  # Keras' masked moments: a mask per position, and epsilon in the denominator
        weights = weights * ops.expand_dims(ops.cast(mask, inputs.dtype), -1)
    weights = ops.broadcast_to(weights, ops.shape(inputs))
    axes = layer._reduction_axes
    count = ops.sum(weights, axes, keepdims=True)
    if mask is not None:
        count = count + keras.backend.epsilon()
    mean = ops.sum(weights * inputs, axes, keepdims=True) / count
    variance = ops.sum(weights * ops.square(inputs - mean), axes, keepdims=True) / count
    if mask is not None:
        return ops.squeeze(mean), ops.squeeze(variance)
    return ops.squeeze(mean, axes), ops.squeeze(variance, axes)


def seed_generators(layer):
    """The ``keras.random.SeedGenerator``s ``layer`` itself owns (not its sublayers'): Keras tracks them in a
    private list, and no public API names them."""
    return list(getattr(layer, "_seed_generators", ()))


def auto_named(layer):
    """Whether ``layer``'s name is the one Keras gives a layer created without a name (``dense``, ``dense_7``)."""
    from keras.src.utils.naming import to_snake_case  # Keras' naming rule has no public name

    return re.fullmatch(re.escape(to_snake_case(type(layer).__name__)) + r"(_\d+)?", layer.name) is not None


def is_layer_graph(model):
    """Whether ``model`` is a functional or Sequential model of Keras' own classes (not a subclass: its ``call``
    runs exactly its layers)."""
    from keras.src.models.functional import Functional

    return type(model) in (Functional, keras.Sequential)



_tracked = []


def track_progress_line():
    """Keep :mod:`keras_tpu._logging` told whether Keras' progress bar left its line open (installed once).

    Wraps ``io_utils.print_msg``, which Keras' ``Progbar`` looks up on its module at every write;
    what is printed is unchanged.
    """
    from keras.src.utils import io_utils

    from keras_tpu._logging import note_progress_output

    if _tracked:
        return
    original = io_utils.print_msg

    @functools.wraps(original)
    def print_msg(message, line_break=True):
        original(message, line_break)
        note_progress_output(f"{message}\n" if line_break else str(message))

    io_utils.print_msg = print_msg
    _tracked.append(original)


def give_back_state(model, mode, state):
    """Put the values of a Keras loop's ``state`` (of ``mode``) back into ``model``'s variables."""
    groups = {"train": (model.trainable_variables, model.non_trainable_variables,
                        model.optimizer.variables if model.optimizer is not None else [], model.metrics_variables),
              "test": (model.trainable_variables, model.non_trainable_variables, model.metrics_variables),
              "predict": (model.trainable_variables, model.non_trainable_variables)}[mode]
    for variables, values in zip(groups, state):
        for variable, value in zip(variables, values):
            variable._value = value  # what Keras' jax_state_sync does


@contextlib.contextmanager
def deferred_variables_kept():
    """Restore Keras' list of deferred (not yet initialised) variables on exit."""
    from keras.src.backend.common import global_state

    deferred = list(global_state.get_global_attribute("uninitialized_variables", []) or [])
    try:
        yield
    finally:
        global_state.set_global_attribute("uninitialized_variables", deferred)


def initialize_deferred_variables():
    """Give every variable created in a ``StatelessScope(initialize_variables=False)`` its initial value.

    An optimizer's slots, built in a replica function's first step as TensorFlow's are, start at zeros: Keras'
    ``Zeros`` is ``jnp.zeros``, one XLA program compiled per slot shape (five, 0.2 s, before the TF guide's
    custom loop first ran). A constant initial value is made on the host instead and copied in, as Keras does
    with any array it is given; the other initializers run as Keras runs them.
    """
    from keras.src.backend.common import global_state
    from keras.src.backend.common.variables import initialize_all_variables

    pending = global_state.get_global_attribute("uninitialized_variables", []) or []
    for variable in pending:
        value = _constant_initial_value(variable)
        if value is not None and variable._value is None:
            variable._initialize(jax.device_put(value))  # (jnp.asarray compiles a program per shape)
            variable._initializer = None
    global_state.set_global_attribute("uninitialized_variables",
                                      [v for v in pending if v._initializer is not None])
    initialize_all_variables()


def _constant_initial_value(variable):
    """The initial value of ``variable`` as a NumPy array where its initializer is Keras' ``Zeros``, ``Ones`` or a
    scalar ``Constant`` (their own classes, not subclasses); else ``None``."""
    initializer = getattr(variable, "_initializer", None)
    if type(initializer) is keras.initializers.Zeros:
        fill = 0
    elif type(initializer) is keras.initializers.Ones:
        fill = 1
    elif type(initializer) is keras.initializers.Constant and np.ndim(initializer.value) == 0:
        fill = initializer.value
    else:
        return None
    return np.full(variable.shape, fill, dtype=jax.numpy.dtype(keras.backend.standardize_dtype(variable.dtype)))


class _PassesAdapter(GeneratorDataAdapter):
    """Keras' adapter of a Python generator's batches, for batches read again each epoch: ``new_pass()``
    returns a generator of one pass (``GeneratorDataAdapter`` calls its ``generator`` attribute for each
    iterator it makes). Keras' ``__init__`` is not run: it reads a generator's first batches to keep them."""

    def __init__(self, new_pass, first_batch, num_batches):
        self.generator = new_pass
        self._first_batches = [first_batch]  # (the specs of get_tf_dataset)
        self._output_signature = None
        self._num_batches = num_batches

    @property
    def num_batches(self):
        return self._num_batches


def batches_adapter(new_pass, first_batch, num_batches=None):
    """A Keras data adapter (what ``fit``/``evaluate``/``predict`` take as ``x``, and ``validation_data``) of
    the batches ``new_pass()`` gives, a new pass for each epoch; ``first_batch`` is the first pass's first
    batch, ``num_batches`` the batches of a pass (``None``: until the pass ends).

    Example:
        >>> adapter = batches_adapter(lambda: iter([(np.ones((2, 3)), np.zeros(2))]), (np.ones((2, 3)), np.zeros(2)))
        >>> [len(list(adapter.get_numpy_iterator())) for _ in range(2)]
        [1, 1]
    """
    return _PassesAdapter(new_pass, first_batch, num_batches)
