"""A model's own ``train_step``/``test_step``/``predict_step`` (Keras 3's JAX signature) on the TPU cores.

Keras' guide "Customizing what happens in fit() with JAX" writes steps as
``train_step(self, state, data) -> (logs, state)`` with
``optimizer.stateless_apply`` and ``metric.stateless_update_state``. VAEs, GANs,
distillation and contrastive learning are written this way. keras-tpu runs
them so:

* **On the whole batch where the cores' split changes nothing the model's
  layers compute** (no batch statistics or activity regularizers in
  training, no random layers, no convolutions to train, which run faster
  per core: :func:`runs_on_the_whole_batch`): the step runs
  once on all the cores' rows, as Keras runs it on the CPU, every matrix
  product on the MXU. The user's own arithmetic then sees the batch it was
  written for: a loss summed over the rows, a ``Sum`` metric, a statistic
  over pairs of rows.
* **Otherwise every core runs the user's step on its own rows**, with a
  TPU's semantics, as TensorFlow's ``TPUStrategy`` does (mapped over the
  core axis, the weights shared): BatchNormalization statistics, dropout
  streams and losses per core. So does Keras' own step for a model whose
  own code makes its rows interact (:func:`rows_interact`: keras.io's
  collaborative filtering sums a product over the batch), which a padded
  program would feed padding rows.
* **Gradients are averaged across the cores when an optimizer applies them**
  (each optimizer's ``stateless_apply`` sees the cross-core mean), so a GAN's
  two optimizers, or an update that a later part of the step reads, behave as
  on a TPU. Every core then holds the same weights; one copy is kept. (A loss
  summed over each core's rows thus trains with the cores' mean of their
  sums: 1/8 of the CPU's gradient on 8 cores.)
* **Metric states are combined across cores** (their per-core increments are
  summed: Keras' metric states are sums and counts), and the logs are the
  metrics' results on the combined states; other logged values are averaged
  over the cores. Moving statistics are averaged over the cores. A metric
  updated with one value per step (a scalar: keras.io's ``Mean`` loss
  trackers) counts steps, not rows: a step on fewer cores than the TPU has
  (see below) adds as much as a full step, as the step does on the CPU; a
  metric whose state is one sum (``Sum``) adds what the cores add.
* **A loss added per row** (``add_loss`` of a vector with one value per row,
  as keras.io's CTC layers add ``ctc_batch_cost``) is summed by Keras over
  the batch; each core's sum counts in full (times the cores the step runs
  on, whose mean the optimizer and the loss log take). A scalar added loss
  (a mean, as Keras' activity regularizers add) is averaged over the cores.
* **No padding row reaches the user's code**, which cannot know our masks: a
  batch whose rows do not split evenly over the cores (a partial last batch,
  or ``batch_size=100``) runs on the largest number of cores that divides it
  (100 rows: 5 cores of 20), with its own program, compiled once per shape
  (on the whole batch, each batch shape compiles once).

Steps run one per device call (:class:`UnpaddedProgram`, a
:class:`keras_tpu._programs.Program`: compiled, checked against a core's HBM
and fed bfloat16 weight copies as Keras' own steps are); ``steps_per_execution``
batches are fed per call of the function Keras asks for, as Keras' own JAX
trainer does.
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax import lax
from keras import tree

from keras_tpu import _hbm as hbm, _keras_private, _pod as pod
from keras_tpu._batching import describe_input_shapes
from keras_tpu._cores import CORE_AXIS, REPLICATED, same_arrays
from keras_tpu._logging import logger
from keras_tpu._programs import Program

STEP_METHODS = ("train_step", "test_step", "predict_step")


def custom_step_methods(model):
    """The Keras step methods ``model``'s own classes replace.

    Example:
        >>> custom_step_methods(keras.Sequential())   # doctest: +SKIP
        []
    """
    return _keras_private.overridden_methods(model, STEP_METHODS)


#: Layers whose training step couples the rows of a batch: batch statistics, a loss on the batch's activations.
_BATCH_DEPENDENT_IN_TRAINING = tuple(getattr(keras.layers, name) for name in (
    "BatchNormalization", "ActivityRegularization") if hasattr(keras.layers, name))

#: The attributes Keras' random layers name their rate by (dropout and noise layers, recurrent cells).
_RATE_NAMES = ("rate", "stddev", "dropout", "recurrent_dropout")


def couples_rows_in_training(layer):
    """Whether ``layer``, in training, computes statistics over the batch (BatchNormalization) or adds a loss on
    the batch's activations (an activity regularizer): each TPU core then computes them on its own rows.

    Example:
        >>> couples_rows_in_training(keras.layers.BatchNormalization())
        True
        >>> couples_rows_in_training(keras.layers.Dense(2))
        False
    """
    return isinstance(layer, _BATCH_DEPENDENT_IN_TRAINING) or bool(getattr(layer, "activity_regularizer", None))


def random_in_training(layer):
    """Whether ``layer`` draws random numbers in training (dropout and noise layers, recurrent or attention
    dropout): each TPU core draws its own.

    Keras' dropout and noise layers draw nothing at rate (stddev) 0, as
    MultiHeadAttention's inner Dropout and recurrent layers' cells do by
    default; Keras' layers name their randomness so.

    Example:
        >>> random_in_training(keras.layers.Dropout(0.5)), random_in_training(keras.layers.Dropout(0.0))
        (True, False)
    """
    return any(isinstance(value, (int, float)) and value > 0 for value in
               (getattr(layer, name, 0) for name in _RATE_NAMES))


def runs_on_the_whole_batch(model, mode, loss_couples_rows=False):
    """Whether ``model``'s own ``mode`` step (``"train"``, ``"test"`` or ``"predict"``) runs once on all the
    cores' rows as one batch, rather than on each core's rows.

    A TPU core's share of the batch changes what a model's layers compute only
    through batch statistics and activity regularizers in training (each core
    its own rows', see :func:`couples_rows_in_training`) and random numbers
    (each core its own stream): models with none of these run their own step
    on the whole batch, as Keras runs it on the CPU, so the user's code sees
    the batch it was written for. Where the split changes nothing the layers
    compute, it changed the user's own arithmetic: a loss summed over
    the rows came out as the cores' mean of their sums (1/8 of the CPU's
    gradient), a ``Sum`` metric of rows seen counted a partial step on 4
    cores twice, and a statistic over pairs of rows (keras.io DDIM's KID) was
    0/0 on cores of one row. The whole batch also runs faster: no core axis
    in every op, except for a model with convolutions, whose training step
    keeps each core's rows for speed (see ``_CONVOLUTIONS``) unless
    ``loss_couples_rows``: Keras' own step with a compiled loss that gives
    one value for the batch (keras.io's supervised contrastive loss compares
    every row with every other), which per core would be another loss than
    the one the model evaluates with. At inference
    only random draws matter, and Keras' own layers draw none then; a layer
    of the user's own that owns a seed generator may draw in any step.

    Example:
        >>> runs_on_the_whole_batch(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), "train")
        True
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5)])
        >>> runs_on_the_whole_batch(model, "train"), runs_on_the_whole_batch(model, "test")
        (False, True)
    """
    training = mode == "train"
    per_core_for_speed = () if loss_couples_rows else _CONVOLUTIONS
    return not any(training and (couples_rows_in_training(layer) or random_in_training(layer)
                                 or _draws_unnamed(layer) or isinstance(layer, per_core_for_speed))
                   or _draws_at_any_time(layer) for layer in [model] + _keras_private.all_layers(model))


#: Keras' convolution layers: a training step with one keeps each core's rows, whose convolution gradients XLA:CPU
#: runs much faster than the whole batch's (keras.io's DCGAN, batch 64: 148 images/s per core, 16 on the whole
#: batch, plain Keras 29).
_CONVOLUTIONS = tuple(getattr(keras.layers, name) for name in (
    "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose", "SeparableConv1D",
    "SeparableConv2D", "DepthwiseConv1D", "DepthwiseConv2D") if hasattr(keras.layers, name))


def _draws_unnamed(layer):
    # A layer with a seed generator and no rate to say it draws nothing: Keras' augmentation layers (RandomFlip,
    # RandomRotation, ...) draw in training. (Recurrent cells own a generator even at dropout 0: their rate says.)
    return bool(_keras_private.seed_generators(layer)) and not any(hasattr(layer, name) for name in _RATE_NAMES)


def _draws_at_any_time(layer):
    # A layer (or model) of the user's own with a seed generator may draw in any step (keras.io VAE's Sampling, a
    # GAN's latent vectors); Keras' own layers draw in training only, their rate named (see random_in_training).
    return bool(_keras_private.seed_generators(layer)) and type(layer).__module__.split(".")[0] != "keras"


#: XLA:CPU options of a program run once to look at its outputs (see rows_interact).
_QUICK_COMPILE = {"xla_backend_optimization_level": 0}


def runs_own_code(layer):
    """Whether ``layer`` (or model) runs code of the user's own in ``call``: a subclassed layer or model, or a
    ``Lambda`` layer's function. Keras' own layers compute each row from that row alone at inference; keras-tpu's
    models (``keras_to_tpu_model``'s) call the user's model, whose layers say.

    Example:
        >>> runs_own_code(keras.layers.Dense(2)), runs_own_code(keras.layers.Lambda(lambda x: x))
        (False, True)
    """
    return (isinstance(layer, keras.layers.Lambda)
            or type(layer).call.__module__.split(".")[0] not in ("keras", "keras_tpu"))


def state_mapping(model, trainable, non_trainable):
    """A :class:`keras.StatelessScope`'s ``state_mapping`` of ``model``'s variables to the values of a step's
    state (Keras' JAX trainer takes the values out of the variables during ``fit``)."""
    return list(zip(model.trainable_variables, trainable)) + list(zip(model.non_trainable_variables, non_trainable))


def rows_interact(model, trainable, non_trainable, x):
    """Whether a row of ``model``'s outputs at inference depends on the batch's other rows, found by running it
    on two rows of ``x`` (a batch of real inputs): the first row with another, and the first row with the
    padding row keras-tpu would add, a copy of it (:mod:`keras_tpu._batching`). Models of Keras' own layers
    are not run: their rows do not interact at inference.

    keras.io's collaborative filtering model sums ``ops.tensordot(user, movie, 2)``
    over the whole batch and adds it to every row: a padding row would enter
    that sum. Runs the float32 forward pass of a two-row batch on the host,
    once per input shape; a batch whose rows are all alike says nothing, and
    counts as rows that do not interact, as does a model that fails to run on
    two rows.

    Example:
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Lambda(lambda v: v - keras.ops.mean(v, 0))])
        >>> rows_interact(model, [], [], np.arange(6.0, dtype="float32").reshape(2, 3))
        True
    """
    if not any(runs_own_code(layer) for layer in [model] + _keras_private.all_layers(model)):
        return False
    leaves = [np.asarray(leaf) for leaf in tree.flatten(x)]
    other = next((row for row in range(1, len(leaves[0]))
                  if any(not np.array_equal(leaf[row], leaf[0]) for leaf in leaves)), None)
    if other is None:
        return False

    def forward(trainable, non_trainable, x):
        # (Not stateless_call, which passes `training` to a call() that may not take it.)
        with keras.StatelessScope(state_mapping=state_mapping(model, trainable, non_trainable)):
            return model(x, training=False)

    pair, padded = (tree.map_structure(lambda a: np.asarray(a)[rows], x) for rows in ([0, other], [0, 0]))
    try:
        # Both run one executable, compiled without LLVM's optimisations: half the compile time (keras.io's text
        # Transformer: 0.15 s against 0.25-0.30), and the same arithmetic for both.
        forward = jax.jit(forward).trace(trainable, non_trainable, pair).lower().compile(_QUICK_COMPILE)
        with_other, with_padding = forward(trainable, non_trainable, pair), forward(trainable, non_trainable, padded)
    except Exception as error:  # (a model written for one batch size, say: the probe then says nothing)
        logger.debug("%s did not run on two rows (%s: %s); taken as a model whose rows do not interact.",
                     model.name, type(error).__name__, error)
        return False
    outputs = list(zip(tree.flatten(with_other), tree.flatten(with_padding)))
    if any(np.ndim(a) == 0 or np.shape(a)[0] != 2 for a, _ in outputs):
        # Not one output row per input row (a readout that pools groups of rows, as keras.io's MPNN pools atoms
        # into molecules): each output depends on several rows, which the cores' split would regroup.
        logger.debug("%s returns outputs of shapes %s for 2 rows: taken as a model whose rows interact.",
                     model.name, [np.shape(a) for a, _ in outputs])
        return True
    return not all(np.array_equal(np.asarray(a)[0], np.asarray(b)[0], equal_nan=True) for a, b in outputs)


def state_change_kinds(model, trainable, non_trainable, x, variables):
    """How each of ``variables`` (non-trainable variables of ``model`` that its training forward pass changes)
    changes with the batch's rows, found by running that pass on the host on the first two rows of ``x`` (a
    batch of real inputs) and on the same rows twice: ``"sum"`` where the change doubles (keras.io's
    ``ComputeSum``, a count of the rows seen), ``"statistic"`` where it stays (a moving mean or variance),
    ``None`` where it does neither (a random layer draws other numbers for more rows) or the model fails to
    run on those rows.

    Example:
        >>> class Count(keras.layers.Layer):
        ...     def build(self, shape):
        ...         self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False)
        ...     def call(self, v):
        ...         self.seen.assign_add(keras.ops.sum(v))
        ...         return v
        >>> model = keras.Sequential([keras.Input((3,)), Count()])
        >>> state_change_kinds(model, [], [np.float32(0)], np.ones((4, 3), "float32"), model.non_trainable_variables)
        ['sum']
    """
    def forward(trainable, non_trainable, x):
        with keras.StatelessScope(state_mapping=state_mapping(model, trainable, non_trainable)) as scope:
            model(x, training=True)
        return [scope.get_current_value(v) for v in variables]

    rows = tree.map_structure(lambda a: np.asarray(a)[:2], x)
    twice = tree.map_structure(lambda a: np.concatenate([a, a]), rows)
    position = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
    before = [np.asarray(non_trainable[position[id(v)]], np.float64) for v in variables]
    try:
        changes = [[np.asarray(after, np.float64) - old for after, old in zip(
            jax.jit(forward).trace(trainable, non_trainable, batch).lower().compile(_QUICK_COMPILE)(
                trainable, non_trainable, batch), before)] for batch in (rows, twice)]
    except Exception as error:  # (a model written for one batch size, say: the probe then says nothing)
        logger.debug("%s did not run on two rows (%s: %s); its state taken as averaged.", model.name,
                     type(error).__name__, error)
        return [None] * len(variables)

    def kind(once, doubled):
        if np.allclose(doubled, once, rtol=1e-4, atol=0):
            return "statistic"
        return "sum" if np.allclose(doubled, 2 * once, rtol=1e-4, atol=0) else None

    return [kind(once, doubled) for once, doubled in zip(*changes)]


def cores_for_rows(rows, num_cores):
    """The most cores (at most ``num_cores``) over which ``rows`` split evenly.

    Example:
        >>> cores_for_rows(1024, 8), cores_for_rows(100, 8), cores_for_rows(97, 8)
        (8, 5, 1)
    """
    return max(c for c in range(1, num_cores + 1) if rows % c == 0)


@contextlib.contextmanager
def _shadowed(objects, method, wrap):
    """While active, each object's ``method`` is ``wrap(obj, original)`` (an instance attribute shadows the
    class's method, so only these objects change)."""
    patched = []
    for obj in objects:
        obj.__dict__[method] = wrap(obj, getattr(obj, method))
        patched.append(obj)
    try:
        yield
    finally:
        for obj in patched:
            obj.__dict__.pop(method, None)


def gradients_averaged_over_cores():
    """While tracing one core's step of a model's own ``train_step`` in this thread: every Keras optimizer
    applies the cores' mean gradients, as a TPU optimizer applies all-reduced ones. Keras 3's steps compute
    each core's loss as the mean over its rows; TensorFlow's Keras scaled it by ``1 / num_replicas`` and its
    optimizers summed the replicas' gradients: the same mean."""
    def core_mean(grads):
        return [None if g is None else lax.pmean(g, CORE_AXIS) for g in grads]

    return _keras_private.optimizers_apply(core_mean)


def gradients_summed_over_cores():
    """While tracing a ``TPUStrategy.run`` replica function in this thread: every Keras optimizer applies the
    sum of the cores' gradients, as TensorFlow's optimizers do in a replica context (their all-reduce sums).
    TensorFlow's custom training loops scale each replica's loss by ``1 / global batch``
    (``tf.nn.compute_average_loss``) for that sum to be the gradient of the global batch's mean."""
    def core_sum(grads):
        return [None if g is None else lax.psum(g, CORE_AXIS) for g in grads]

    return _keras_private.optimizers_apply(core_sum)


def _metric_results_recorded(model, recorded):
    """While tracing a core's step: note each value a metric's ``stateless_result`` returns, so that a log
    holding it under another key (keras.io's VAE logs its ``total_loss`` tracker as ``"loss"``) is combined
    across cores as that metric."""
    def wrap(metric, original):
        def result(metric_variables):
            value = original(metric_variables)
            recorded.append((value, metric.name))
            return value
        return result

    return _shadowed(model.metrics, "stateless_result", wrap)


def _metric_updates_recorded(model, scalar_updates):
    """While tracing a core's step: note, for each of the model's metrics the step updates, whether every
    update was one unweighted value (a scalar): ``scalar_updates[id(metric)]``.

    Such a metric (keras.io's ``loss_tracker = keras.metrics.Mean()`` of the step's loss) counts steps; one
    updated with a value per row (``MeanAbsoluteError(y, y_pred)``) or weighted by the rows (Keras' own
    loss tracker: the loss, weighted by the batch's row count) counts rows. ``stateless_update_state``
    calls ``update_state``, so both are seen.
    """
    def wrap(metric, original):
        def update_state(*args, **kwargs):
            weighted = len(args) > 1 or kwargs.get("sample_weight") is not None
            scalar = not weighted and all(jnp.ndim(a) == 0 for a in jax.tree.leaves((args, kwargs)))
            scalar_updates[id(metric)] = scalar_updates.get(id(metric), True) and scalar
            return original(*args, **kwargs)
        return update_state

    return _shadowed(model.metrics, "update_state", wrap)


def _rows(data):
    leaves = [leaf for leaf in tree.flatten(data) if leaf is not None]
    return int(jnp.shape(leaves[0])[0]) if leaves else 0


class CustomSteps:
    """The train, test and predict functions of a model with its own steps, for a core layout.

    Used by :class:`keras_tpu._replicated_steps.ReplicatedSteps` for the modes the model overrides.
    """

    def __init__(self, steps, loss_couples_rows=False, rows_interact=False, why=None):
        """``why``: why Keras' own steps run here, without padding rows (``None``: the model's own steps)."""
        self.builder = steps
        self.model = steps.model
        self.layout = steps.layout
        self.loss_couples_rows = loss_couples_rows  # (see runs_on_the_whole_batch)
        # A model whose own code makes its rows interact (rows_interact) runs each core's rows, as on a TPU.
        self.rows_interact = rows_interact
        if self.layout.num_devices > 1:
            what = (f"{type(self.model).__name__} has its own step methods, which keras_tpu runs" if why is None else
                    f"{self.model.name} {why}: its steps run without padding rows, which keras_tpu does")
            raise ValueError(f"{what} on the cores of one process; this TPU spans {self.layout.num_devices} worker "
                             f"processes. Train it on one worker.")
        self._whole_batch = {}  # mode -> whether its step runs on the whole batch

    def function(self, mode, steps_per_execution):
        program = UnpaddedProgram(mode, self, steps_per_execution)
        return program.run_for_outputs if mode == "predict" else program.run_for_logs

    # -- what the device runs for one step on `cores` cores -------------------------------

    def runs_on_the_whole_batch(self, mode):
        """Whether the model's ``mode`` step runs on all the cores' rows as one batch (see
        :func:`runs_on_the_whole_batch`): decided once per mode."""
        if mode not in self._whole_batch:
            self._whole_batch[mode] = not self.rows_interact and runs_on_the_whole_batch(self.model, mode,
                                                                                        self.loss_couples_rows)
        return self._whole_batch[mode]

    def device_step(self, mode, cores):
        model, builder = self.model, self.builder
        whole = self.runs_on_the_whole_batch(mode)

        def split(data):
            return jax.tree.map(lambda a: a.reshape((cores, a.shape[0] // cores) + a.shape[1:]), data)

        def step(state, data):
            core_ids = jnp.arange(cores, dtype=jnp.int32)
            if mode == "predict":
                trainable, non_trainable = state

                def core_predict(data, core_id):
                    # Keras 3's JAX predict_step returns (outputs, non-trainable variables), and Keras' predict
                    # keeps the state it returns (a layer's own sum of the rows it saw, say).
                    seeded = builder._offset_seeds(non_trainable, core_id, +1)
                    outputs, new_non_trainable = model.predict_step((trainable, seeded), data)
                    return outputs, builder._offset_seeds(list(new_non_trainable), core_id, -1)

                outputs, new_non_trainable = jax.vmap(core_predict, in_axes=(0, 0), axis_name=CORE_AXIS)(
                    split(data), core_ids)
                share = jnp.full((cores,), 1.0 / cores, jnp.float32)
                new_state = (trainable, builder._combine_non_trainable(non_trainable, new_non_trainable, share))
                return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), outputs), new_state

            non_trainable = state[1]
            metrics_values = state[-1]

            log_sources = {}  # log key -> the metric whose result it holds (found while tracing)
            scalar_updates = {}  # id(metric) -> whether the step updates it with one value (found while tracing)

            def core_step(data, core_id):
                seeded = builder._offset_seeds(non_trainable, core_id, +1)
                core_state = (state[0], seeded) + tuple(state[2:])
                recorded = []
                core_rows = _rows(data)

                def added_loss(added, total):  # one value per row: Keras' sum over the batch is the cores' sum
                    per_row = jnp.ndim(added) >= 1 and jnp.shape(added)[0] == core_rows
                    return total * cores if per_row else total

                with gradients_averaged_over_cores(), _metric_results_recorded(model, recorded), \
                        _metric_updates_recorded(model, scalar_updates), \
                        _keras_private.added_losses_transformed(model, added_loss):
                    logs, new_state = (model.train_step if mode == "train" else model.test_step)(core_state, data)
                for key, value in logs.items():
                    log_sources.update({key: name for result, name in recorded if result is value})
                new_state = tuple(new_state)
                new_state = (new_state[0], builder._offset_seeds(list(new_state[1]), core_id, -1)) + new_state[2:]
                return logs, new_state

            logs, new_state = jax.vmap(core_step, in_axes=(0, 0), axis_name=CORE_AXIS)(split(data), core_ids)
            share = jnp.full((cores,), 1.0 / cores, jnp.float32)
            combined_non_trainable = builder._combine_non_trainable(non_trainable, new_state[1], share)
            # A metric counting steps gets a full step's increment from a step on fewer cores: the cores' mean
            # increment times the TPU's cores (a step on all of them adds each core's: the same). A metric whose
            # state is one sum (Keras' Sum) adds what the cores add: its rows seen, say, are the batch's. A step
            # on the whole batch adds what it adds, as on the CPU.
            per_step = [self.layout.num_cores / cores
                        if scalar_updates.get(id(metric)) and len(metric.variables) > 1 and not whole else 1.0
                        for metric in model.metrics for _ in metric.variables]
            if len(per_step) != len(metrics_values):  # (not the model's metrics_variables: sum them as they are)
                per_step = [1.0] * len(metrics_values)
            combined_metrics = [
                (old + (jnp.sum(new - old, axis=0) * factor).astype(old.dtype) if factor != 1.0 else
                 old + jnp.sum(new - old, axis=0)) if jnp.issubdtype(new.dtype, jnp.number) else new[0]
                for old, new, factor in zip(metrics_values, new_state[-1], per_step)]
            # Replicated state (weights, optimizer slots) is the same on every core: keep one copy.
            out_state = (jax.tree.map(lambda a: a[0], new_state[0]), combined_non_trainable)
            if mode == "train":
                out_state += (jax.tree.map(lambda a: a[0], new_state[2]),)
            out_state += (combined_metrics,)
            results = _keras_private.metrics_result(model, combined_metrics)

            def combined_log(key, value):  # a metric's result on the combined state, else the cores' mean
                if isinstance(value, dict):
                    return {k: combined_log(k, v) for k, v in value.items()}
                if key in results:
                    return results[key]
                if log_sources.get(key) in results:
                    return results[log_sources[key]]
                return jnp.mean(jnp.asarray(value), axis=0)

            return {key: combined_log(key, value) for key, value in logs.items()}, out_state

        return step


class UnpaddedProgram(Program):
    """The programs of one mode of a model's own step (or of Keras' where padding rows would count): one step per
    call, on a batch's real rows only, in the form of the number of cores they split over (one program per number
    of cores and batch shape)."""

    ARGUMENT_SPECS = (REPLICATED, REPLICATED)  # (state, data): all on the cores' one device

    def __init__(self, mode, custom, steps_per_execution):
        super().__init__(mode, custom.builder, steps_per_execution)
        self.custom = custom

    def _device_step(self, cores):
        return self.custom.device_step(self.mode, cores)

    def _footprint(self, args, cores):
        """One TPU core's step: the model's step on the rows of the core with the most (the whole batch's rows
        would split over all the TPU's cores), with the whole state (each TPU core holds its own copy) and its
        products in float32 (a TPU keeps no bfloat16 copies)."""
        builder, model = self.builder, self.custom.model
        if builder.accelerator_type is None:
            return None
        state, _, data = args
        rows, whole = _rows(data), self.custom.runs_on_the_whole_batch(self.mode)
        core_rows = -(-rows // (self.layout.num_cores if whole else cores))
        abstract = lambda tree_, rows=None: jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((rows,) + a.shape[1:] if rows else a.shape, jnp.result_type(a)), tree_)

        def footprint(rows):
            return hbm.step_footprint(self.custom.device_step(self.mode, 1), (abstract(state), abstract(data, rows)),
                                      accelerator_type=builder.accelerator_type,
                                      argument_names=hbm.state_names(model, self.mode),
                                      argument_kinds=hbm.state_kinds(model, self.mode),
                                      label=f"{self.mode} step of {model.name!r}")

        if not whole or core_rows == rows:
            return footprint(core_rows)
        # The step runs on the whole batch here, so the user's code never sees a core's share; it may not take one
        # (keras.io's contrastive loss squeezes its labels, a scalar at one row). Keras' warnings about such a
        # share would be about a batch no program runs.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return footprint(core_rows)
        except Exception as error:  # noqa: BLE001 (any error of the user's code at a share it never runs at)
            logger.info("The HBM estimate of the %s step of %r counts the whole batch of %d rows, as it runs here: it "
                        "does not trace at one core's share of %d row(s) (%s: %s).", self.mode, model.name,
                        rows, core_rows, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
            return footprint(rows)

    def _log_compiled(self, args, cores, seconds, footprint):
        data = args[2]
        rows = _rows(data)
        x = keras.utils.unpack_x_y_sample_weight(data)[0] if isinstance(data, tuple) else data
        whose = "the model's own" if f"{self.mode}_step" in custom_step_methods(self.custom.model) else "Keras'"
        if self.custom.runs_on_the_whole_batch(self.mode):
            where = f"on the {self.layout.num_cores} cores' rows as one batch"
        else:
            where = f"on {cores} core(s)" + ("" if cores == self.layout.num_cores else
                                             f": {rows} rows do not split evenly over {self.layout.num_cores}")
        logger.info("Compiled the TPU %s program (global batch %d, 1 step(s) per call) in %.1f s (%s %s_step %s); "
                    "inputs %s%s.", self.mode, rows, seconds, whose, self.mode, where, describe_input_shapes(x),
                    "" if footprint is None else f"; {footprint.describe()}")
        self.builder.note_compiled_shape(self.mode, describe_input_shapes(x, rows="None"))

    def _state_on_cores(self, state, returned):
        """``state`` on the cores' device(s): as it is when it is what the last step ``returned``."""
        if returned:
            return state
        leaves = jax.tree.leaves(state)
        device = self.layout.replicated_sharding()
        if all(isinstance(a, jax.Array) and a.sharding.is_equivalent_to(device, a.ndim) for a in leaves):
            return state
        return jax.device_put(state, device)

    def _one_step(self, state, data):
        rows = _rows(data)
        if rows == 0:
            raise ValueError(f"A batch for {type(self.custom.model).__name__}.{self.mode}_step has no rows.")
        cores = 1 if self.custom.runs_on_the_whole_batch(self.mode) else cores_for_rows(rows, self.layout.num_cores)
        # Per-step overhead is most of a small model's step (~1 ms here): the state stays where the last step
        # left it, and the batch goes to the compiled program as host arrays, which its C++ call places by its
        # own input shardings (a device_put first cost 0.4 ms per step; jnp.asarray 2 ms per array).
        returned = same_arrays(jax.tree.leaves(state), self._last_state)
        batch_key = cores, tuple((a.shape, a.dtype) for a in jax.tree.leaves(data))
        args, executable, _ = self._prepared((self._state_on_cores(state, returned), data), cores, batch_key,
                                             returned)
        return self._run(executable, args)

    def _run_steps(self, state, iterator):
        outputs = []
        for _ in range(self.steps):
            try:
                data = next(iterator)
            except StopIteration:
                break
            if pod.is_multi_worker():
                raise ValueError("A model's own step methods run on one worker process.")
            output, state = self._one_step(state, data)
            outputs.append(output)
        if not outputs:
            raise StopIteration
        return outputs, state

    def run_for_logs(self, state, iterator):
        outputs, state = self._run_steps(state, iterator)
        return outputs[-1], state

    def run_for_outputs(self, state, iterator):
        outputs, state = self._run_steps(state, iterator)
        return tree.map_structure(lambda *parts: jnp.concatenate(parts), *outputs), state


__all__ = ["CustomSteps", "cores_for_rows", "couples_rows_in_training", "custom_step_methods",
           "gradients_summed_over_cores", "random_in_training", "rows_interact", "runs_on_the_whole_batch",
           "runs_own_code", "state_change_kinds", "state_mapping"]
