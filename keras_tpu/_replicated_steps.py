"""The distributed step builder: a compiled Keras model's steps as one replicated TPU program.

For each mode (train, test, predict) this builds one program that every core
runs on its share of the global batch, with every matrix product on the MXU.
The programs plug into Keras' own ``fit``/``evaluate``/``predict`` loops: they
take and return Keras' state lists (trainable, non-trainable, optimizer and
metric variables), so callbacks, the progress bar and ``History`` work as
usual.

What a train step does (TPU replication, as one device program per process;
see :mod:`keras_tpu._cores`):

1. Each core runs the forward pass on its rows with Keras'
   ``compute_loss_and_updates`` (the model's own loss, regularisers and
   ``compute_loss``), mapped over the cores with the weights shared.
2. The gradient of the mean of the cores' losses is taken once. Since
   gradients are linear, it *is* the mean of the per-core gradients (the
   TPU's all-reduce), computed as one contraction over all rows; only the
   order of the float32 sums differs, as between two all-reduce algorithms.
   The optimizer update then runs once, on one copy of the weights.
3. Padding rows (see :mod:`keras_tpu._batching`) get sample weight 0, and the
   real rows a weight chosen so that the mean over cores equals the loss of
   the real rows alone, as Keras computes it for the whole batch on the CPU:
   ``global_rows / real_rows`` for losses averaged over the batch
   (``sum_over_batch_size``), each core's valid positions over the real
   rows' where an output's Keras mask reaches its loss, ``cores`` for
   ``sum``; ``mean_with_sample_weight`` losses are summed and divided by the
   real rows' weight (see ``ReplicatedSteps._sample_weights``). The weights
   take the shape of the loss (one per row and time step for sequence
   outputs), so any output rank works.
4. **BatchNormalization** normalises each core's rows with that core's batch
   statistics (as on a real TPU); the moving statistics are then averaged
   over the cores, weighted by each core's real rows (a core holding only
   padding does not contribute).
5. **Dropout** and other seeded random layers draw a different stream on each
   core (the core index is folded into the seed); the seed state advances
   identically everywhere.
6. Metrics are computed on the whole global batch (the cores' rows in core
   order), so every Keras metric gets exactly what it gets on the CPU.

Test and predict steps map the same way over the cores (each core's rows
are its own batch, as a model with a fixed batch size expects); with the
weights shared, XLA still runs each layer as one product over all rows.

A program runs ``steps_per_execution`` steps per call. When fewer batches are
left (the end of an epoch, ``evaluate(steps=1)``), a program of just that many
steps runs instead (compiled once per count): inactive steps cost nothing.
"""

import collections
import contextlib
import functools
import itertools

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax import lax
from keras import tree

from keras_tpu import _hbm as hbm, _host as host, _keras_private, _rewrite as rewrite
from keras_tpu._logging import logger
from keras_tpu._cores import CoreLayout
from keras_tpu._custom_steps import (CustomSteps, couples_rows_in_training, custom_step_methods, random_in_training,
                                     rows_interact, runs_own_code, state_change_kinds, state_mapping)
from keras_tpu._programs import LOOPED, PaddedProgram, ProgramForm
from keras_tpu.mxu._numerics import canonical_precision
from keras_tpu.mxu._routing import mxu_rule
from keras_tpu._vector_unit import vector_unit_rule

# Golden-ratio stride separating the per-core random streams of a seed generator.
SEED_STRIDE = 0x9E3779B1


def _losses_summed(step):
    """A step method during whose trace the model's ``"mean_with_sample_weight"`` losses sum (see
    ``ReplicatedSteps._sample_weights``)."""
    @functools.wraps(step)
    def step_with_losses_summed(self, *args):
        with _keras_private.losses_summed(self.model):
            return step(self, *args)

    return step_with_losses_summed


def program_rule(precision, on_mxu=True):
    """The rewrite rule of TPU programs: matrix products on the MXU (unless ``on_mxu`` is False) and the
    vector unit's fast lowerings (:mod:`keras_tpu._vector_unit`)."""
    return rewrite.compose(mxu_rule(precision), vector_unit_rule()) if on_mxu else vector_unit_rule()


#: Keras layers whose output for a row depends on that row alone at inference (``training=False``), whatever the
#: rest of the batch: a model made of these computes the same on all of a device's rows at once as core by core.
_ROW_WISE_AT_INFERENCE = tuple(getattr(keras.layers, name) for name in (
    "InputLayer", "Dense", "Embedding", "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose",
    "Conv3DTranspose", "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D",
    "BatchNormalization", "LayerNormalization", "GroupNormalization", "UnitNormalization", "Dropout",
    "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "GaussianNoise", "GaussianDropout", "AlphaDropout",
    "ActivityRegularization", "MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "AveragePooling1D", "AveragePooling2D",
    "AveragePooling3D", "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D", "GlobalAveragePooling1D",
    "GlobalAveragePooling2D", "GlobalAveragePooling3D", "Flatten", "Reshape", "Permute", "RepeatVector", "Masking",
    "Activation", "ReLU", "LeakyReLU", "PReLU", "ELU", "Softmax", "Add", "Subtract", "Multiply", "Average",
    "Maximum", "Minimum", "Concatenate", "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D",
    "Cropping2D", "Cropping3D", "UpSampling1D", "UpSampling2D", "UpSampling3D", "Rescaling", "MultiHeadAttention",
    "Identity") if hasattr(keras.layers, name))
_RECURRENT = tuple(getattr(keras.layers, name) for name in ("LSTM", "GRU", "SimpleRNN"))


def rows_independent_at_inference(model):
    """Whether each row of ``model``'s inference output depends on that row alone (and the weights).

    True for Keras' functional and Sequential models with no fixed batch size
    made only of layers known to work row by row at inference (Dense,
    convolutions, BatchNormalization with its moving statistics, pooling,
    attention, non-stateful recurrent layers, ...); False for anything else,
    e.g. a subclassed model or custom layer, whose ``call`` could mix rows.

    Example:
        >>> rows_independent_at_inference(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
        True
    """
    if not _keras_private.is_layer_graph(model):
        return False
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return False
    if not inputs or any(tensor.shape[0] is not None for tensor in inputs):
        return False
    return all(_row_wise_at_inference(layer) for layer in model.layers)


def _refuse_overwritten_by_gradient(model):
    """Refuse a training step that runs core by core for a model whose layers overwrite variables with their
    "gradient" (``overwrite_with_gradient``: float8 training's running maxima and scales of the batch's values).
    The cores' values would be combined as gradients are, summed or averaged, not as the batch's maximum: the
    scales grew to 1e21 in a keras.io float8 recipe and its training stalled."""
    overwritten = [v.path for v in model.trainable_variables if getattr(v, "overwrite_with_gradient", False)]
    if overwritten:
        raise NotImplementedError(
            f"{model.name!r} has variables its layers overwrite with their gradient ({', '.join(overwritten[:3])}"
            f"{', ...' if len(overwritten) > 3 else ''}): float8 training's scaling state "
            f"(model.quantize(\"float8\")), a maximum over the batch's rows. This model trains core by core on "
            f"the simulated TPU, where those values would be combined as gradients are, not as the batch's "
            f"maximum. Train it without float8 and call model.quantize(\"float8\") afterwards (inference runs "
            f"exactly), or train it on one core "
            f"(keras_to_tpu_model(model, TPUDistributionStrategy(using_single_core=True))).")


def rows_independent_in_training(model):
    """Whether each row's loss in a training step of ``model`` depends on that row alone (and the weights).

    :func:`rows_independent_at_inference`, and no layer that, in training,
    computes statistics over the batch (BatchNormalization), adds a loss on the
    batch's activations (an activity regularizer) or draws random numbers
    (dropout and noise layers, recurrent or attention dropout: each core
    draws its own). Such a model's per-core losses are its rows' losses, so its
    cores' rows may run as one batch.

    Example:
        >>> rows_independent_in_training(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
        True
        >>> rows_independent_in_training(keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5)]))
        False
    """
    if not rows_independent_at_inference(model):
        return False
    return not any(couples_rows_in_training(layer) or random_in_training(layer)
                   for layer in [model] + _keras_private.all_layers(model))


def _row_wise_at_inference(layer):
    kind = type(layer)
    if kind in _ROW_WISE_AT_INFERENCE:
        return True
    if kind in _RECURRENT:
        return not layer.stateful
    if kind is keras.layers.Bidirectional:
        return _row_wise_at_inference(layer.forward_layer) and _row_wise_at_inference(layer.backward_layer)
    if kind is keras.layers.TimeDistributed:
        return _row_wise_at_inference(layer.layer)
    return _keras_private.is_layer_graph(layer) and rows_independent_at_inference(layer)


def _abstract(tree):
    """``tree`` with every array as a ``jax.ShapeDtypeStruct`` of its shape and (JAX's) type."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), tree)


def _is_seed_state(variable):
    return variable.path.endswith("seed_generator_state") and "int" in str(variable.dtype)


def _own_state_updated(model, before, after):
    """The non-trainable variables that layers of the user's own code create with Keras' default aggregation
    and whose value ``after`` a forward pass (from a :class:`keras.StatelessScope`) is not the value ``before``
    it. Example: keras.io's ``ComputeSum`` layer."""
    own = {id(v) for layer in [model] + _keras_private.all_layers(model) if runs_own_code(layer)
           for v in _keras_private.own_non_trainable_variables(layer)}
    return [v for v, old in zip(model.non_trainable_variables, before)
            if id(v) in own and not _is_seed_state(v) and getattr(v, "aggregation", "none") in ("none", None)
            and after.get(id(v), old) is not old]


def loss_rank(output_shape):
    """The rank of a loss's per-element values for an output: one value per row and position.

    Keras losses reduce the last (class or feature) axis, so an output of
    shape ``(rows, time, classes)`` has per-element losses ``(rows, time)``.

    Example:
        >>> loss_rank((128, 10)), loss_rank((128, 100, 256)), loss_rank((128,))
        (1, 2, 1)
    """
    return max(1, len(output_shape) - 1)


def _weight_like(mask, rank):
    """A per-row mask ``(rows,)`` shaped ``(rows, 1, ...)`` to broadcast against values of ``rank``."""
    return mask.reshape(mask.shape + (1,) * (rank - 1))


class ReplicatedSteps:
    """Builds the train, test and predict programs of a compiled Keras model for a core layout.

    Args:
        model: the compiled Keras model whose steps run on the cores.
        layout: a :class:`keras_tpu._cores.CoreLayout`.
        precision: the MXU's default precision for the model's matrix products.
        on_mxu: False runs the same programs with float32 matrix products
            (the CPU baseline of ``TPUEstimator(use_tpu=False)``).
        user_model: the model whose ``call`` ``model`` runs, when ``model``
            wraps it (``keras_to_tpu_model``'s CPU model); its layers decide
            how inference programs map the cores (see :meth:`_cores_merged`).

    Example:
        >>> steps = ReplicatedSteps(model, keras_tpu.CoreLayout(8), "default")   # doctest: +SKIP
        >>> model.train_function = steps.train_function(steps_per_execution=1)   # doctest: +SKIP
    """

    def __init__(self, model, layout, precision="default", on_mxu=True, looped_cores=None, accelerator_type=None,
                 user_model=None):
        # The model's own steps run as written (custom_steps); so do Keras' steps around a model's own
        # compute_loss/compute_metrics, which cannot know the padding rows of a partial batch.
        self.custom = custom_step_methods(model)
        if _keras_private.overridden_methods(model, ("compute_loss", "compute_metrics")):
            self.custom = sorted(set(self.custom) | {"train_step", "test_step"})
        self.looped_cores = looped_cores  # None: decided per model (see _cores_looped)
        self.user_model = user_model or model
        self._rows_independent = None  # rows merged at inference, decided on first use (see _cores_merged)
        self._rows_independent_in_training = None  # decided on the first training program (see _cores_merged)
        self.layout_choices = set()  # inference modes whose programs may run merged or looped (see _cores_merged)
        self._tracing_form = ProgramForm()  # the form of the step being traced (see tracing_form)
        self.computes_batch_statistics = False  # whether a traced training step did (see ProgramForm.padding_rows)
        self.trains_cores_in_a_loop = False  # whether a traced training step runs its cores in a loop (lax.scan)
        self._core_forwards = {}  # one core's forward pass per input shape (see _core_forward)
        self._shared_traces = {}  # pieces of a step traced once, replayed (see _traced_once)
        self._padding_rows_count = {}  # why padding rows would count (or ''), per batch shape
        self._rows_interact = {}  # whether the model's rows interact at inference (rows_interact), per input shape
        self._step_gradients = None  # a training step's gradients, while traced to be returned (see below)
        self.model = model
        self.layout = layout
        self.precision = canonical_precision(precision)
        self.on_mxu = on_mxu
        self.rule = program_rule(self.precision, on_mxu)
        self.last_programs = {}
        self.accelerator_type = accelerator_type  # whose HBM a compiled program must fit (None: not checked)
        self._compiled_shapes = collections.defaultdict(set)
        self._warned_shapes = set()
        # Non-trainable variables of the user's layers whose change is a sum over the rows, and those checked
        # (see _probe_own_state).
        self._state_sums_rows, self._probed_state = set(), set()

    #: More input shapes than this per mode gets a warning: each shape is a program compiled anew.
    MANY_SHAPES = 8

    def note_compiled_shape(self, mode, shapes):
        """Record that a ``mode`` program was compiled for inputs of ``shapes`` (rows aside); warn, once per mode,
        when there are more than :attr:`MANY_SHAPES` of them."""
        seen = self._compiled_shapes[mode]
        seen.add(shapes)
        if len(seen) > self.MANY_SHAPES and mode not in self._warned_shapes:
            self._warned_shapes.add(mode)
            logger.warning(
                "%s has compiled %d TPU %s programs for inputs of different shapes (the latest: %s). A TPU "
                "compiles a new XLA program for every new shape, and so does this simulator: pad or bucket "
                "variable-length data to a few lengths (e.g. pad each batch to a multiple of 32 time steps).",
                self.model.name, len(seen), mode, shapes)

    # -- functions for Keras' loops -------------------------------------------------

    def _refuse_stateful_layers(self):
        """A stateful RNN keeps a state of the batch size it was built with, which no core's share of the global
        batch has: say what to do instead of Keras' error from inside the layer."""
        stateful = [layer.name for layer in _keras_private.all_layers(self.user_model)
                    if getattr(layer, "stateful", False)]
        if stateful:
            raise ValueError(
                f"{self.user_model.name} has stateful RNN layers ({', '.join(stateful)}), which cannot run on the "
                f"TPU's cores: each core runs its share of the global batch ({self.layout.num_cores} shares), and "
                f"a stateful layer keeps its state at the batch size it was built with. Train the model with "
                f"stateful=False (as Cloud TPU's Shakespeare notebook does), save its weights, and load them into "
                f"the stateful model on the CPU for generation.")

    def train_function(self, steps_per_execution=1, graph_per_core=False):
        """``(state, iterator) -> (logs, state)``, for ``model.train_function``. ``graph_per_core``: the model is
        a ``TPUEstimator``'s graph, whose rows interact on each core as TensorFlow's do on a TPU core (its loss
        is the core's mean), so they are not probed (see :meth:`_why_padding_rows_count`)."""
        self._refuse_stateful_layers()
        if "train_step" in self.custom:
            return self._state_kept_on_error("train", CustomSteps(self).function("train", steps_per_execution))
        program = PaddedProgram("train", self, steps_per_execution, self._device_train_returning_gradients)
        return self._state_kept_on_error("train", self._unless_padding_rows_count(
            "train", steps_per_execution, program.run_for_logs, probe_rows=not graph_per_core), program)

    def test_function(self, steps_per_execution=1):
        """``(state, iterator) -> (logs, state)``, for ``model.test_function``."""
        self._refuse_stateful_layers()
        if "test_step" in self.custom:
            return self._state_kept_on_error("test", CustomSteps(self).function("test", steps_per_execution))
        program = PaddedProgram("test", self, steps_per_execution, self._device_test)
        return self._state_kept_on_error("test", self._unless_padding_rows_count("test", steps_per_execution,
                                                                                 program.run_for_logs), program)

    def _state_kept_on_error(self, mode, function, program=None):
        """``function`` (a step function of Keras' loops), which puts the ``state`` it was given back into the
        model's variables when it fails, unless its program already consumed it. Its ``new_loop()`` tells the
        :class:`keras_tpu._programs.PaddedProgram` it runs (``program``), if any, that a loop of Keras' begins
        (see :meth:`keras_tpu._batching.BatchStacker.new_loop`).

        Keras' JAX trainer takes the values out of the variables for the
        duration of ``fit``/``evaluate``/``predict`` and puts back the last
        step's state only when the loop ends: a step that fails (a user's
        metric that cannot trace, a program too large for the core's HBM, an
        interrupt) would leave the model without its trained weights.
        """
        def step_function(state, iterator):
            try:
                return function(state, iterator)
            except StopIteration:
                raise
            except BaseException:
                if not any(isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(state)):
                    _keras_private.give_back_state(self.model, mode, state)  # (donated to a program that ran: gone)
                raise

        step_function.new_loop = program.stacker.new_loop if program is not None else lambda: None
        return step_function

    def _unless_padding_rows_count(self, mode, steps_per_execution, padded_function, probe_rows=True):
        """``padded_function``, unless padding rows would count in the model's outputs, loss or metrics: its own
        code makes its rows interact, it adds losses in ``call`` (``add_loss``, activity regularisers), a
        compiled loss gives no value per row, or a compiled metric ignores its sample weight.

        A loss added in ``call`` is computed by the user's layer from every row
        it is given, and a loss function that returns the batch's mean (as
        keras.io's siamese network's contrastive loss does) averages whatever
        rows it gets, so no mask can keep padding rows out of either; nor out
        of a user's metric whose ``update_state`` ignores ``sample_weight``
        (the mask keras-tpu passes). Those
        models run Keras' own step on the cores without padding instead
        (:mod:`keras_tpu._custom_steps`: a batch that does not split evenly
        over the cores runs on the most cores that divide it), which is exact
        for losses averaged over the rows, as Keras' activity regularisers are
        (the cores' mean of their rows' means is the batch's), and for losses
        added per row, which Keras sums (each core's sum counts in full, see
        :mod:`keras_tpu._custom_steps`). A model whose own code makes its rows
        interact (keras.io's collaborative filtering sums a product over the
        batch) runs each core's rows, as on a TPU, but without the padding rows
        that would enter what a core computes. Decided on the first
        batch, whose shapes the checks trace (no compute, but for a model of
        the user's own code, which runs on two of its rows: see
        :func:`keras_tpu._custom_steps.rows_interact`).
        """
        chosen = []

        def function(state, iterator):
            if not chosen:
                try:
                    first = next(iterator)
                except StopIteration:
                    raise StopIteration from None
                iterator = itertools.chain([first], iterator)
                with host.collection_paused():  # (it traces the model: see host.collection_paused)
                    why, loss_couples_rows, interact = self._why_padding_rows_count(mode, state, first, probe_rows)
                if why:
                    custom = CustomSteps(self, loss_couples_rows, interact, why)
                    logger.info("%s %s: its %s steps run without padding rows, %s.", self.model.name, why, mode,
                                "on the whole batch" if custom.runs_on_the_whole_batch(mode) else
                                "each core on its own rows (a partial batch on the cores that divide it)")
                    chosen.append(custom.function(mode, steps_per_execution))
                else:
                    chosen.append(padded_function)
            return chosen[0](state, iterator)

        return function

    def _why_padding_rows_count(self, mode, state, batch, probe_rows=True):
        """``(why, loss_couples_rows, rows_interact)``: why padding rows of ``batch`` would count in the model's
        outputs, loss or metrics (see :meth:`_unless_padding_rows_count`), or ``""``; whether a compiled loss
        gives one value for the batch rather than one per row (its steps run on the whole batch, see
        :func:`keras_tpu._custom_steps.runs_on_the_whole_batch`); and whether the model's own code makes its
        rows interact (its steps run each core's rows, as on a TPU). Why: the
        model's own code makes a row's outputs depend on other rows
        (:func:`keras_tpu._custom_steps.rows_interact`, run once per input
        shape), a forward pass on it adds losses (weight regularisers
        excluded), a compiled loss gives no value per row
        (:func:`keras_tpu._keras_private.losses_not_per_row`), or a compiled
        metric's state reads the batch without its sample weight
        (:func:`keras_tpu._keras_private.metrics_ignoring_sample_weight`).

        The losses and metrics are traced abstractly on one core's rows, once per input shape, for the train and
        test programs alike; a predict program asks only whether rows interact.
        """
        x = keras.utils.unpack_x_y_sample_weight(batch)[0]
        shapes = jax.tree.structure(x), tuple((np.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(x))
        if probe_rows and shapes not in self._rows_interact:
            # A pod's workers cannot run a step without padding (keras_tpu._custom_steps): they keep the padded one.
            self._rows_interact[shapes] = self.layout.num_devices == 1 and rows_interact(
                self.model, list(state[0]), list(state[1]), x)
        if probe_rows and self._rows_interact[shapes]:
            return "makes its rows interact (a row's output depends on the batch's other rows)", False, True
        model, real_x = self.model, x
        if mode == "predict":
            return self._why_summed_state(), False, False
        # One core's rows, as each core runs them (a graph with a static per-core batch, TPUEstimator's, takes
        # no other).
        core_rows = -(-keras.tree.flatten(batch)[0].shape[0] // self.layout.num_cores)
        x, y, _ = keras.utils.unpack_x_y_sample_weight(jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((core_rows,) + a.shape[1:], jnp.result_type(a)), batch))
        key = (id(getattr(model, "_compile_loss", None)),  # (recompiled with other losses: checked again)
               jax.tree.structure((x, y)), tuple((a.shape, a.dtype) for a in jax.tree.leaves((x, y))))
        if key in self._padding_rows_count:
            return self._padding_rows_count[key] + (False,)
        added, averaged = [], []

        def forward(trainable, non_trainable, x):
            with keras.StatelessScope(state_mapping=state_mapping(model, trainable, non_trainable),
                                      collect_losses=True) as scope:
                before = [scope.get_current_value(v) for v in model.non_trainable_variables]
                outputs = model(x, training=True)
            added.append(len(scope.losses))
            averaged.extend(_own_state_updated(model, before, scope.state_mapping))
            return outputs

        y_pred = jax.eval_shape(forward, _abstract(list(state[0])), _abstract(list(state[1])), x)
        targets = None if y is None else _keras_private.targets_for_loss(model, y, y_pred)  # (the metrics' too)
        whole_batch = [] if y is None else _keras_private.losses_not_per_row(model, targets, y_pred)
        unweighted = [] if y is None else _keras_private.metrics_ignoring_sample_weight(model, targets, y_pred)
        self._probe_own_state([v for v in averaged if id(v) not in self._probed_state], state, real_x)
        why = ("adds losses in call() (add_loss or an activity regularizer)" if added[0] else
               self._why_summed_state() or (
               f"has a loss that gives no value per row ({', '.join(whole_batch)}: the batch's mean, say)"
               if whole_batch else
               f"has a metric that ignores sample_weight ({', '.join(unweighted)}), where the TPU weighs its "
               f"padding rows out" if unweighted else ""))
        self._padding_rows_count[key] = why, bool(whole_batch)
        return self._padding_rows_count[key] + (False,)

    def _summed_over_cores(self, variable):
        """Whether the cores' changes of a non-trainable ``variable`` add up, rather than average (a moving
        statistic): created with ``add_weight(aggregation="sum")``, or a sum over the rows by
        :func:`keras_tpu._custom_steps.state_change_kinds` (keras.io's ``ComputeSum``, a count of the rows seen)."""
        return getattr(variable, "aggregation", "none") == "sum" or id(variable) in self._state_sums_rows

    def _why_summed_state(self):
        """Why padding rows would count in the model's state (see :meth:`_summed_over_cores`), or ``""``."""
        summed = [v.path for v in self.model.non_trainable_variables if self._summed_over_cores(v)]
        return f"sums state over its rows ({', '.join(summed)}), which padding rows would enter" if summed else ""

    def _probe_own_state(self, variables, state, x):
        """Find which of ``variables`` (state that layers of the user's own code change in ``call`` with Keras'
        default aggregation) are sums over the rows (:func:`keras_tpu._custom_steps.state_change_kinds`); say,
        once per model, how the cores combine those that are neither a sum nor a statistic."""
        if not variables:
            return
        self._probed_state.update(id(v) for v in variables)
        kinds = state_change_kinds(self.model, list(state[0]), list(state[1]), x, variables) \
            if self.layout.num_devices == 1 else [None] * len(variables)
        self._state_sums_rows.update(id(v) for v, kind in zip(variables, kinds) if kind == "sum")
        unknown = [v.path for v, kind in zip(variables, kinds) if kind is None]
        if unknown:
            logger.warning(
                "%s updates non-trainable state in call() (%s) by other than a sum over the rows or a statistic of "
                "them. On the TPU's cores keras-tpu averages each core's change of it, weighted by the core's real "
                "rows (an integer takes the first core's value), as TensorFlow averages a batch-normalization "
                "statistic. If it is a sum (a random layer before it hides that), create it with "
                "add_weight(..., aggregation=\"sum\"): the cores' changes then add up, as on the CPU. evaluate() "
                "and predict() do not change such state.", self.model.name, ", ".join(unknown))

    def predict_function(self, steps_per_execution=1, purpose="predict", graph_per_core=False):
        """``(state, iterator) -> (outputs, state)``, for ``model.predict_function``. ``purpose`` names the
        program in the log (the estimator evaluates with a program of this kind: its outputs per row);
        ``graph_per_core`` as for :meth:`train_function` (a padded program)."""
        self._refuse_stateful_layers()
        if "predict_step" in self.custom:
            return self._state_kept_on_error("predict", CustomSteps(self).function("predict", steps_per_execution))
        program = PaddedProgram("predict", self, steps_per_execution, self._device_predict, purpose=purpose)
        if graph_per_core:
            return self._state_kept_on_error("predict", program.run_for_outputs, program)
        return self._state_kept_on_error("predict", self._unless_padding_rows_count(
            "predict", steps_per_execution, program.run_for_outputs), program)

    @property
    def global_batch(self):
        """The padded global batch of the last training program (None before ``fit``)."""
        program = self.last_programs.get("train")
        return program.stacker.global_batch if program else None

    def hbm_footprint(self, mode, args, form=ProgramForm()):
        """The per-core HBM one step of this mode's program needs on the accelerator (:mod:`keras_tpu._hbm`),
        or ``None`` when not checked (a CPU placement).

        ``args`` are the device program's arguments; one core's step is traced
        abstractly (nothing runs), with one core's rows and the whole replicated
        state, as each TPU core holds its own copy, in ``form`` (a
        :class:`keras_tpu._programs.ProgramForm`).
        """
        if self.accelerator_type is None:
            return None
        one_core = ReplicatedSteps(self.model, CoreLayout.abstract(1), self.precision, on_mxu=False,
                                   looped_cores=self.looped_cores)
        # A core's rows are the same here: share the forward pass already traced for them (ResNet-20: 0.2 s less).
        one_core._core_forwards = self._core_forwards
        one_core._shared_traces = self._shared_traces  # its core's gradient and the update: traced already
        one_core._tracing_form = form  # (the same trace of a core's gradient)
        device_fn = {"train": one_core._device_train, "test": one_core._device_test,
                     "predict": one_core._device_predict}[mode]
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
        return hbm.step_footprint(device_fn, hbm.one_core_arguments(abstract, self.layout.cores_per_device),
                                  accelerator_type=self.accelerator_type,
                                  argument_names=hbm.state_names(self.model, mode),
                                  argument_kinds=hbm.state_kinds(self.model, mode),
                                  label=f"{mode} step of {self.model.name!r}")

    # -- what one device runs: stacked steps ------------------------------------------

    @staticmethod
    def _scan_steps(step, state, data, mask, real_rows):
        """Run ``step`` for each stacked step (axis 1 of the arrays)."""
        per_step = tree.map_structure(lambda a: jnp.moveaxis(a, 1, 0), (data, mask), none_is_leaf=False)
        if mask.shape[1] == 1:
            batch, step_mask = tree.map_structure(lambda a: a[0], per_step, none_is_leaf=False)
            return step(state, batch, step_mask, real_rows[0])

        def body(state, inputs):
            (batch, step_mask), rows = inputs
            return step(state, batch, step_mask, rows), None

        return lax.scan(body, state, (per_step, real_rows))[0]

    def _device_train(self, state, data, mask, real_rows):
        state = self._scan_steps(self.train_step, state, data, mask, real_rows)
        return _keras_private.metrics_result(self.model, state[3]), state

    def _device_train_returning_gradients(self, state, data, mask, real_rows):
        """``_device_train``'s ``(logs, state)`` and the large gradients the optimizer applied (a single step's,
        of :attr:`RETURNED_GRADIENT_BYTES` or more; none where steps are scanned), for the host program to
        return and drop.

        The host's reason, not the TPU's (the HBM estimate traces ``_device_train``): XLA:CPU puts a program's
        temporaries in one block mapped afresh for each run, so every page of a large gradient faults in again at
        every step (the zoo's 100k x 64 embedding table: 25.6 MB); as an output each gradient gets a buffer of
        its own, which the host's allocator reuses from step to step (the embedding model's step 22.6-27 ->
        13-14 ms, plain Keras 23.7). The gradients come out of the one trace that sets the side list.
        """
        self._step_gradients = []
        try:
            logs, state = self._device_train(state, data, mask, real_rows)
            gradients = self._step_gradients
        finally:
            self._step_gradients = None
        large = [] if mask.shape[1] > 1 else [g for g in jax.tree.leaves(gradients[0])
                                              if g.size * g.dtype.itemsize >= self.RETURNED_GRADIENT_BYTES]
        return logs, state, large

    #: Gradients from this size are returned by a training program (see _device_train_returning_gradients); a
    #: thousand pages of 4 KiB faulted in per step and more.
    RETURNED_GRADIENT_BYTES = 4 << 20

    def _device_test(self, state, data, mask, real_rows):
        state = self._scan_steps(self.test_step, state, data, mask, real_rows)
        return _keras_private.metrics_result(self.model, state[2]), state

    def _device_predict(self, state, data, mask, real_rows):
        trainable, non_trainable = state
        kwargs = _keras_private.inference_kwargs(self.model)
        layout = self.layout

        def core_predict(x):
            return self.model.stateless_call(trainable, non_trainable, x, **kwargs)[0]

        real_rows = self._tracing_form.real_rows

        def predict(x):  # one step: every core predicts its rows
            if self._cores_merged("predict", trainable, non_trainable, x):
                if not real_rows:
                    return core_predict(x)
                # Only the real rows, and only their outputs come back (see
                # keras_tpu._programs.ProgramForm.real_rows): no padding row for the host to cut off, which would
                # wait for the program before Keras' own work after the call could run beside it.
                return core_predict(jax.tree.map(lambda a: a[:real_rows], x))
            looped = self._cores_looped(trainable, non_trainable, x)
            return layout.merge_cores(layout.map_cores(core_predict, in_axes=0, looped=looped)(layout.split_cores(x)))

        x_steps = tree.map_structure(lambda a: jnp.moveaxis(a, 1, 0),
                                     keras.utils.unpack_x_y_sample_weight(data)[0], none_is_leaf=False)
        outputs = lax.map(predict, x_steps)  # (steps, rows, ...)
        if jax.tree.leaves(x_steps)[0].shape[0] == 1:  # one step: its rows, as Keras' predict_step returns them
            return tree.map_structure(lambda a: a[0], outputs), state
        return tree.map_structure(lambda a: jnp.moveaxis(a, 0, 1), outputs), state

    # -- one step on one device -------------------------------------------------------

    def _cores_merged(self, mode, trainable, non_trainable, x):
        """Whether a ``"train"``, ``"test"`` or ``"predict"`` program runs all of a device's rows as one batch.

        At inference a model whose rows do not interact
        (:func:`rows_independent_at_inference`) computes the same on the cores'
        rows together as core by core, and XLA:CPU mostly runs it faster so:
        the README's CIFAR-10 CNN evaluates 1024 images in 128-154 ms so (plain
        Keras 148 ms) against 148-153 ms with its cores in a loop and 760 ms
        vectorised over the core axis (whose 5-D activations YNNPACK runs
        slowly); keras.io's MNIST convnet evaluated at 1.04x plain Keras so,
        0.86x looped; the embedding model 4.6 ms against 6 vectorised (plain
        4.3). With convolutions neither layout always wins, and no rule from
        the model's layers separated them: ResNet-20 evaluates faster looped
        (512 images in 166 ms against 208 merged, plain Keras 250-266), and
        so did the same network without batch normalization or residual adds;
        the CIFAR CNN (1024 images in 140 ms merged, 151 looped) and the MNIST
        convnet run faster merged. Such programs
        (``layout_choices``) are traced both ways and :class:`LayoutTrial`
        times them on the first batches. Depthwise
        convolutions (summed tap by tap, see :mod:`keras_tpu.mxu._kernels`)
        run faster at a core's batch: MobileNet evaluated 512 images in
        154-196 ms with its cores in a loop, 325 ms merged (89 ms looped since
        its pointwise convolutions run as products).
        A training step merges its cores' rows only where they are
        independent in training too (:func:`rows_independent_in_training`: no
        BatchNormalization, no dropout) and it has no convolutions; it then
        skips the core axis XLA would compile and run through every op: the
        zoo's Transformer trains at 256 ms per step against 267 (in-process
        A/B) and its first fit() is ready 0.2-0.3 s sooner (1.75-1.88 s less a
        step, against 2.02-2.07; plain Keras 1.40), the char LSTM's 0.1 s
        (1.18-1.22 against 1.28-1.30); the MLP and the embedding model train as
        fast either way.
        """
        if self.layout.cores_per_device == 1:
            return False
        if self._rows_independent is None:
            # A wrapper's own call (keras_to_tpu_model's) only runs the model it wraps.
            self._rows_independent = rows_independent_at_inference(self.user_model) and not any(
                groups > 1 for groups in self._convolution_groups(trainable, non_trainable, x))
        if not self._rows_independent:
            return False
        if mode == "train":
            if self._rows_independent_in_training is None:
                self._rows_independent_in_training = rows_independent_in_training(self.user_model)
            # Convolutions' gradients run faster at a core's batch (see _cores_looped): those stay core by core.
            return self._rows_independent_in_training and not self._cores_looped(trainable, non_trainable, x)
        if self.looped_cores is None and self._cores_looped(trainable, non_trainable, x):
            # Which runs faster depends on how XLA:CPU fuses the model's convolutions: measured (LayoutTrial).
            self.layout_choices.add(mode)
            return self._tracing_form.layout != LOOPED
        return True

    def merges_cores_at_inference(self, trainable, non_trainable, x):
        """Whether an inference program in the merged form runs a device's rows of one step's ``x`` as one batch
        (see :meth:`_cores_merged`); known without compiling (one core's forward pass is traced abstractly, once
        per input shape, as the program's compile then reuses it)."""
        with self.tracing_form(ProgramForm()):
            return self._cores_merged("predict", trainable, non_trainable, x)

    def padding_rows_may_matter(self, mode):
        """Whether ``mode``'s programs may take a form of their own for batches with padding rows (see
        :attr:`keras_tpu._programs.ProgramForm.padding_rows`): training programs of a model with a trainable
        ``BatchNormalization``. Whether one does is known once a step is traced
        (:attr:`computes_batch_statistics`)."""
        return mode == "train" and any(layer.trainable for layer in _keras_private.batch_normalizations(self.model))

    @contextlib.contextmanager
    def tracing_form(self, form):
        """Steps traced in the block take ``form`` (a :class:`keras_tpu._programs.ProgramForm`): inference
        programs run their cores ``LOOPED`` where they could also run them ``MERGED`` (see
        :meth:`_cores_merged`), training steps weigh batch statistics by the row mask for batches with padding
        rows or run Keras' own."""
        previous, self._tracing_form = self._tracing_form, form
        try:
            yield
        finally:
            self._tracing_form = previous

    def _core_forward(self, trainable, non_trainable, x):
        """What one core's forward pass on its rows of ``x`` produces and runs: ``(output shapes, convolution
        groups, masked outputs)``: the ``feature_group_count`` of each of its convolutions, and whether each
        output (flattened) carries a Keras mask.

        Traced abstractly once per input shape (nothing runs) and shared by
        the train and test programs: each trace of a large model costs a
        noticeable part of its compile time.
        """
        core_rows = jax.tree.map(lambda a: a[0], self.layout.split_cores(x))
        key = jax.tree.structure(core_rows), tuple((a.shape, a.dtype) for a in jax.tree.leaves(core_rows))
        if key not in self._core_forwards:
            kwargs = _keras_private.inference_kwargs(self.model)
            masked = []

            def forward():
                outputs = self.model.stateless_call(trainable, non_trainable, core_rows, **kwargs)[0]
                masked.extend(mask is not None for mask in _keras_private.keras_masks(outputs))
                return outputs

            forward, output_shapes = jax.make_jaxpr(forward, return_shape=True)()
            groups = tuple(found.eqn.params["feature_group_count"] for found in
                           rewrite.walk(forward, lambda e: e.primitive is lax.conv_general_dilated_p))
            # shapes only: no tracer outlives its trace
            self._core_forwards[key] = output_shapes, groups, tuple(masked)
        return self._core_forwards[key]

    def _traced_once(self, name, fn, *args):
        """``fn(*args)``, replayed from a jaxpr traced once per ``name`` and argument types.

        The per-core HBM estimate (:meth:`hbm_footprint`) traces one core's
        step while XLA compiles the program, and both hold the Python work of
        the same pieces: a core's forward and backward pass (in a training
        loop over the cores) and the optimizer's update. Traced once and
        replayed, ResNet-20's training estimate took 0.14 s of CPU beside
        XLA's compile instead of 1.1-1.2 s (the same bytes within 0.2%; the
        first fit was ready about as soon: XLA's compile, 2.6-2.8 s, is what it
        waits for). ``fn`` must read nothing traced but its arguments (a trace
        that captured a traced value is used once, not kept).
        """
        leaves, structure = jax.tree.flatten(args)
        key = name, structure, tuple(jax.typeof(a) for a in leaves)
        traced = self._shared_traces.get(key)
        if traced is None:
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
            traced = closed, jax.tree.structure(out_shape)
            if not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
                self._shared_traces[key] = traced
        closed, out_structure = traced
        return jax.tree.unflatten(out_structure, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves))

    def _convolution_groups(self, trainable, non_trainable, x):
        """The ``feature_group_count`` of each convolution of the forward pass on one core's rows."""
        return self._core_forward(trainable, non_trainable, x)[1]

    def _cores_looped(self, trainable, non_trainable, x):
        """Whether the device's cores run one after another in a loop (see ``CoreLayout.map_cores``), not
        vectorised over a core axis: for a model with convolutions.

        XLA:CPU runs a convolution's gradients faster at a core's batch than
        on all rows at once (as one batch, or vectorised over the cores, a
        batch-grouped convolution), and a loop compiles one copy of the
        core's step. Measured here (fresh processes; train step / evaluation
        step / first fit and evaluate less a step, benchmarks/zoo.py and
        benchmarks/users_code.py models), looped against what ran before:
        the README's CIFAR-10 CNN (batch 1024) 771 ms / 128 ms / 2.9 s against
        848-872 / 138 / 5.4 with its 8 cores unrolled in the program
        (vectorised: 1.39 s per step); ResNet-20 (batch 512) 711 / 275 / 4.7
        against 1022 / 270 / 4.6 vectorised (unrolled in 8: 1.21 s per step,
        12.6 s compile); MobileNet (batch 512) 965 / 196 / 5.7 against 1473 /
        341 / 6.0 vectorised (before its pointwise convolutions ran as
        products, see :func:`keras_tpu.mxu._kernels.conv_as_dot`); keras.io's
        MNIST convnet (batch 128, 16 rows per core) 4.0x plain Keras' training
        speed against 1.85x, and its Conv1D
        text classifier (batch 32, 4 rows per core) 1.31x against 1.06x. A
        training step differentiates each core's step inside the loop
        (``CoreLayout.value_and_grad_over_cores``): differentiating the loop
        instead kept every core's activations for a second, backward loop,
        which XLA allocated and zeroed each step (the CIFAR CNN: 1.06-1.15 s
        per step). Models without convolutions vectorise their cores (dense
        products, recurrences and attention gain from one large batch).
        """
        if self.looped_cores is not None:
            return self.looped_cores
        return bool(self._convolution_groups(trainable, non_trainable, x))

    def _output_shapes(self, trainable, non_trainable, x):
        """The shapes of the model's outputs for one core's rows of ``x`` (traced abstractly, no compute)."""
        return self._core_forward(trainable, non_trainable, x)[0]

    def _loss_reduction(self):
        """How the model's compiled losses reduce over a batch, for :meth:`_sample_weights`: ``"sum"``,
        ``"mean_with_sample_weight"``, or ``"sum_over_batch_size"`` (Keras' default, also for a mix)."""
        reductions = set(_keras_private.loss_reductions(self.model))
        if reductions and reductions <= {"sum"}:
            return "sum"
        if reductions == {"mean_with_sample_weight"}:
            return "mean_with_sample_weight"
        return "sum_over_batch_size"

    def _loss_forms(self, trainable, non_trainable, x, y):
        """How each output's loss reduces, for one core's rows (:func:`keras_tpu._keras_private.loss_forms`),
        traced abstractly once per batch shape; ``None`` where unknown (the losses are not built)."""
        if y is None:
            return None
        core_y = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.layout.split_cores(y))
        # (a recompiled model has a new CompileLoss, whose losses may reduce otherwise)
        key = "loss forms", id(getattr(self.model, "_compile_loss", None)), jax.tree.structure((x, core_y)), tuple(
            (a.shape, a.dtype) for a in jax.tree.leaves((x, core_y)))
        if key not in self._core_forwards:
            output_shapes = self._output_shapes(trainable, non_trainable, x)
            self._core_forwards[key] = _keras_private.loss_forms(self.model, core_y, output_shapes)
        return self._core_forwards[key]

    def _masks(self, trainable, non_trainable, x, y, forms):
        """``(output masks, loss masks)`` for this device's rows: each (flattened) output's Keras mask and the
        mask its loss applies (:func:`keras_tpu._keras_private.loss_masks`), as float32 (``None`` for an output
        without one); ``(None, None)`` when there are none.

        Each core's forward pass on its rows, traced again for the masks alone:
        XLA keeps only what they are computed from (usually a comparison of the
        inputs, ``Embedding(mask_zero=True)``'s or ``Masking``'s, or of the
        targets, ``ignore_class``'s).
        """
        if not any(self._core_forward(trainable, non_trainable, x)[2]) and not any(
                form is not None and form[2] for form in forms or ()):
            return None, None
        kwargs = _keras_private.inference_kwargs(self.model)
        as_float = lambda masks: [None if m is None else m.astype(jnp.float32) for m in masks]

        def core_masks(core_rows, core_y):
            outputs = self.model.stateless_call(trainable, non_trainable, core_rows, **kwargs)[0]
            loss_masks = _keras_private.loss_masks(self.model, core_y, outputs, forms) if core_y is not None else \
                _keras_private.keras_masks(outputs)
            return as_float(_keras_private.keras_masks(outputs)), as_float(loss_masks)

        layout = self.layout
        split = layout.split_cores
        return layout.merge_cores(layout.map_cores(core_masks, in_axes=0)(split(x), split(y)))

    def _sample_weights(self, mask, sample_weight, real_rows, output_shapes, units, forms=None, loss_masks=None):
        """Per-element weights for the loss (padding excluded, rescaled), the metrics (padding excluded) and
        the per-output loss trackers: ``(loss, metric, tracker)``.

        ``mask`` holds this device's rows (1 real, 0 padding). The loss is
        computed by ``units`` parts (cores in training, devices in
        evaluation), whose mean is reported and differentiated; the loss
        weights make that mean the loss of the real rows alone, as Keras
        computes it for the batch on the CPU. Each output's loss (``forms``,
        see :meth:`_loss_forms`; else the model's reductions together):

        * ``"sum"``: the user's weight times ``units``.
        * ``"sum_over_batch_size"``: Keras divides a part's weighted sum by the
          positions it counts (its rows' positions, padding rows' included, or
          the valid positions of the mask the loss applies, ``loss_masks``);
          the weight multiplies by ``units`` times that count over the count
          of the real rows.
        * ``"mean_with_sample_weight"``: summed within the step instead
          (:func:`keras_tpu._keras_private.losses_summed`: a part's weighted
          mean cannot be reweighted), and divided by the real rows' weight.

        The trackers re-evaluate the loss on the whole batch (one part)
        without Keras masks, so theirs hold the mask. Each weight has the
        shape of its output's per-element loss values (rows, and time steps of
        a sequence; rows alone for a loss averaged per image), so a padding row
        is masked at every position.
        """
        layout = self.layout
        model_reduction = self._loss_reduction()
        parts = units // layout.num_devices  # the parts on this device: its cores, or itself
        global_rows = mask.shape[0] * layout.num_devices
        real_rows = jnp.maximum(real_rows, 1).astype(jnp.float32)

        def form_of(shape, form):  # (reduction, rank of the per-element values, their positions per row)
            if form is None or not form[1] or not shape.shape or form[1][0] != shape.shape[0]:
                rank = loss_rank(shape.shape)  # (Keras' losses: the last axis reduced)
                return model_reduction, rank, float(np.prod(shape.shape[1:rank], dtype=np.int64))
            return form[0], len(form[1]), float(np.prod(form[1][1:], dtype=np.int64))

        def weigh(sw, shape, form, keras_mask):
            reduction, rank, positions = form_of(shape, form)
            user = None if sw is None else jnp.asarray(sw, jnp.float32)
            w = _weight_like(mask, rank) if user is None else user * _weight_like(mask, user.ndim)
            if keras_mask is not None and (keras_mask.ndim != rank or w.ndim > rank):
                keras_mask = None  # a mask Keras broadcasts its own way: counted as unmasked
            masked = w if keras_mask is None else w.reshape(w.shape + (1,) * (rank - w.ndim)) * keras_mask
            if reduction == "sum":
                return w * units, w, masked
            if reduction == "mean_with_sample_weight":
                if user is None:  # Keras divides by the positions it counts
                    total = real_rows * positions if keras_mask is None else layout.device_sum(jnp.sum(masked))
                else:
                    total = layout.device_sum(jnp.sum(masked))
                total = jnp.where(total == 0, 1.0, total)  # divide_no_nan, as Keras
                return w * (units / total), w, masked / total
            if keras_mask is None:  # every part counts rows x positions
                return w * (global_rows / real_rows), w, w * (global_rows / real_rows)
            real_valid = layout.device_sum(jnp.sum(keras_mask * _weight_like(mask, rank)))
            real_valid = jnp.where(real_valid == 0, 1.0, real_valid)
            part_valid = jnp.repeat(jnp.sum(keras_mask.reshape(parts, -1), axis=1), mask.shape[0] // parts)
            global_positions = global_rows * positions
            return (w * _weight_like(part_valid * (units / real_valid), w.ndim), w,
                    masked * (global_positions / real_valid))

        flat_shapes = tree.flatten(output_shapes)
        flat_forms = forms if forms is not None and len(forms) == len(flat_shapes) else [None] * len(flat_shapes)
        flat_masks = loss_masks if loss_masks is not None else [None] * len(flat_shapes)
        if sample_weight is not None and tree.is_nested(sample_weight):
            flat_sw = tree.flatten(sample_weight)
            triples = [weigh(*args) for args in zip(flat_sw, flat_shapes, flat_forms, flat_masks)]
            pack = lambda leaves: tree.pack_sequence_as(sample_weight, leaves)
        else:
            triples = [weigh(sample_weight, *args) for args in zip(flat_shapes, flat_forms, flat_masks)]
            # The weights differ only by reduction and rank, and for "mean_with_sample_weight" by positions per row.
            kinds = {(reduction, rank, reduction == "mean_with_sample_weight" and positions)
                     for reduction, rank, positions in map(form_of, flat_shapes, flat_forms)}
            if len(triples) == 1 or (len(kinds) == 1 and loss_masks is None):  # one weight fits every output
                return triples[0]
            pack = lambda leaves: tree.pack_sequence_as(output_shapes, leaves)
        return tuple(pack([t[i] for t in triples]) for i in range(3))

    def _offset_seeds(self, values, core_id, sign):
        out = list(values)
        for i, variable in enumerate(self.model.non_trainable_variables):
            if _is_seed_state(variable):
                offset = (core_id.astype(jnp.uint32) * jnp.uint32(SEED_STRIDE)).astype(values[i].dtype)
                out[i] = values[i].at[0].set(values[i][0] + offset if sign > 0 else values[i][0] - offset)
        return out

    def _core_shares(self, mask, real_rows):
        """Each of this device's cores' share of the step's real rows, ``(cores_per_device,)``."""
        return jnp.sum(self.layout.split_cores(mask), axis=1) / jnp.maximum(real_rows, 1).astype(jnp.float32)

    def _state_summed(self, count):
        """For each of the ``count`` non-trainable values of a step's state, whether the cores' changes add up
        (:meth:`_summed_over_cores`); none for a state that is not the model's variables'."""
        variables = self.model.non_trainable_variables
        return [self._summed_over_cores(v) for v in variables] if len(variables) == count else [False] * count

    def _add_core_share(self, before, combined, after, share):
        """One core's part of :meth:`_combine_non_trainable`, for a loop over the cores: ``combined`` (starting
        as ``before``) plus the core's change of state summed over the cores, or the core's share of its change
        of float state; other state is the same on every core.

        Carried through the loop, the moving statistics need no per-core copies stacked over the cores and
        reduced after it (two kernels per statistic, each compiled: ResNet-20 has 42).
        """
        return [c + (new - old) if summed else
                c + share.astype(new.dtype) * (new - old) if jnp.issubdtype(new.dtype, jnp.floating) else new
                for old, c, new, summed in zip(before, combined, after, self._state_summed(len(before)))]

    def _device_combined(self, before, combined):
        """The state combined on this device's cores (:meth:`_add_core_share`) summed over the devices."""
        if self.layout.num_devices == 1:
            return [c.astype(old.dtype) for old, c in zip(before, combined)]
        return [(old + self.layout.device_sum(c - old)).astype(old.dtype)
                if summed or jnp.issubdtype(c.dtype, jnp.floating) else c
                for old, c, summed in zip(before, combined, self._state_summed(len(before)))]

    def _combine_non_trainable(self, before, per_core_after, core_share):
        """Add up the cores' changes of state that sums over the rows (:meth:`_summed_over_cores`: an
        accumulator, a count of rows); average other float state (moving statistics) over the cores, weighted by
        each core's share of the real rows, as TensorFlow does on a TPU; other state (seeds, counters) is the
        same on every core."""
        combined = []
        for old, new, summed in zip(before, per_core_after, self._state_summed(len(before))):
            if summed:
                combined.append((old + self.layout.device_sum(jnp.sum(new - old, axis=0))).astype(old.dtype))
            elif jnp.issubdtype(new.dtype, jnp.floating):
                weight = core_share.astype(new.dtype).reshape((-1,) + (1,) * old.ndim)
                delta = self.layout.device_sum(jnp.sum(weight * (new - old), axis=0))
                combined.append((old + delta).astype(old.dtype))
            else:
                combined.append(new[0])
        return combined

    def _update_metrics(self, metrics_values, loss, real_rows, x, y, y_pred, mask, metric_weight, tracker_weight,
                        output_masks=None):
        """The metrics updated with the step's global batch (the devices' rows gathered); ``tracker_weight`` is
        the per-output loss trackers' (see :meth:`_sample_weights`). ``output_masks``: the outputs' Keras masks,
        which evaluation's metrics read (Keras' training step reads ``y_pred`` from the gradient's auxiliary
        outputs, which carry none)."""
        x, y, y_pred, mask, metric_weight, tracker_weight, output_masks = self.layout.device_gather(
            (x, y, y_pred, mask, metric_weight, tracker_weight, output_masks))
        if output_masks is not None:
            y_pred = _keras_private.with_keras_masks(y_pred, output_masks)
        _, new_values = _keras_private.update_metrics(self.model, metrics_values, loss, real_rows, x, y, y_pred,
                                                      mask, metric_weight, tracker_weight)
        return new_values

    @_losses_summed
    def train_step(self, state, batch, mask, real_rows):
        """One training step of this device's cores: ``state`` -> new ``state``.

        ``batch`` and ``mask`` hold this device's rows (its cores' rows in core order).
        """
        model, layout = self.model, self.layout
        trainable, non_trainable, optimizer_values, metrics_values = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        by_core = layout.split_cores
        output_shapes = self._output_shapes(trainable, non_trainable, x)
        targets = _keras_private.targets_for_loss(model, y, output_shapes)  # (y for the metrics)
        merged = self._cores_merged("train", trainable, non_trainable, x)  # one loss per device, not per core
        units = layout.num_devices if merged else layout.num_cores
        forms = self._loss_forms(trainable, non_trainable, x, targets)
        _, loss_masks = self._masks(trainable, non_trainable, x, targets, forms)
        loss_weight, metric_weight, tracker_weight = self._sample_weights(
            mask, sample_weight, real_rows, output_shapes, units, forms, loss_masks)

        def device_loss(trainable):  # the device's rows as one batch: no per-core state to keep apart
            loss, (unscaled, y_pred, new_non_trainable, _) = model.compute_loss_and_updates(
                trainable, non_trainable, metrics_values, x, targets, loss_weight, training=True,
                optimizer_variables=optimizer_values)
            return loss / units, (unscaled, y_pred, new_non_trainable)

        # Batch statistics over each core's real rows, as on the CPU (see ProgramForm.padding_rows).
        padding_rows = self._tracing_form.padding_rows

        def computed_batch_statistics():
            self.computes_batch_statistics = True

        def statistics(rows):
            return _keras_private.batch_statistics_of_rows(model, rows if padding_rows else None,
                                                           computed_batch_statistics)

        def core_loss(trainable, x, y, loss_weight, rows, core_id, non_trainable=non_trainable,
                      metrics_values=metrics_values, optimizer_values=optimizer_values):
            seeded = self._offset_seeds(non_trainable, core_id, +1)
            with statistics(rows):
                loss, (unscaled, y_pred, new_non_trainable, _) = model.compute_loss_and_updates(
                    trainable, seeded, metrics_values, x, y, loss_weight, training=True,
                    optimizer_variables=optimizer_values)
            return loss, (unscaled, y_pred, self._offset_seeds(new_non_trainable, core_id, -1))

        def mean_core_loss(trainable):
            losses, aux = layout.map_cores(core_loss, in_axes=(None, 0, 0, 0, 0, 0))(
                trainable, by_core(x), by_core(targets), by_core(loss_weight), by_core(mask),
                layout.local_core_ids())
            return jnp.sum(losses) / units, aux

        if not merged and layout.num_cores > 1:
            _refuse_overwritten_by_gradient(model)
        looped = not merged and self._cores_looped(trainable, non_trainable, x)
        self.trains_cores_in_a_loop = looped and layout.cores_per_device > 1  # (see value_and_grad_over_cores)
        if merged:
            (_, (unscaled, y_pred, new_non_trainable)), grads = jax.value_and_grad(device_loss, has_aux=True)(
                trainable)
        elif looped:  # each core's forward and backward pass in turn
            def core_loss_combining(trainable, combined, x, y, loss_weight, rows, core_id, share,
                                    replicated=(non_trainable, metrics_values, optimizer_values)):
                non_trainable, metrics_values, optimizer_values = replicated
                loss, (unscaled, y_pred, new_non_trainable) = core_loss(trainable, x, y, loss_weight, rows,
                                                                        core_id, non_trainable, metrics_values,
                                                                        optimizer_values)
                return loss, ((unscaled, y_pred), self._add_core_share(non_trainable, combined, new_non_trainable,
                                                                       share))

            def core_value_and_grad(trainable, combined, *core_args):  # the rest of the state passed, not captured
                name = "core gradient" if padding_rows else "core gradient, every row real"
                return self._traced_once(name, jax.value_and_grad(core_loss_combining, has_aux=True),
                                         trainable, combined, *core_args,
                                         (non_trainable, metrics_values, optimizer_values))

            (_, (unscaled, y_pred)), grads, combined = layout.value_and_grad_over_cores(
                core_loss_combining, trainable, by_core(x), by_core(targets), by_core(loss_weight), by_core(mask),
                layout.local_core_ids(), self._core_shares(mask, real_rows), has_aux=True, carry=list(non_trainable),
                value_and_grad=core_value_and_grad)
            new_non_trainable = self._device_combined(non_trainable, combined)
            grads = jax.tree.map(lambda g: g / units, grads)
        else:
            (_, (unscaled, y_pred, new_non_trainable)), grads = jax.value_and_grad(mean_core_loss, has_aux=True)(
                trainable)
        grads = layout.device_sum(grads)  # the all-reduce across devices (a pod's workers)
        if self._step_gradients is not None:
            self._step_gradients.append(grads)  # (see _device_train_returning_gradients)
        trainable, optimizer_values = self._traced_once("update", model.optimizer.stateless_apply, optimizer_values,
                                                        grads, trainable)
        if not merged:
            if not looped:  # the loop combined them core by core
                new_non_trainable = self._combine_non_trainable(non_trainable, new_non_trainable,
                                                                self._core_shares(mask, real_rows))
            y_pred = layout.merge_cores(y_pred)
        mean_loss = layout.device_sum(jnp.sum(unscaled)) / units
        metrics_values = self._update_metrics(metrics_values, mean_loss, real_rows, x, y,
                                              y_pred, mask, metric_weight, tracker_weight)
        return (trainable, new_non_trainable, optimizer_values, metrics_values)

    @_losses_summed
    def test_step(self, state, batch, mask, real_rows):
        """One evaluation step of this device's cores."""
        layout, model = self.layout, self.model
        trainable, non_trainable, metrics_values = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        output_shapes = self._output_shapes(trainable, non_trainable, x)
        targets = _keras_private.targets_for_loss(model, y, output_shapes)  # (y for the metrics)
        merged = self._cores_merged("test", trainable, non_trainable, x)  # one loss per device, not per core
        units = layout.num_devices if merged else layout.num_cores
        forms = self._loss_forms(trainable, non_trainable, x, targets)
        output_masks, loss_masks = self._masks(trainable, non_trainable, x, targets, forms)
        loss_weight, metric_weight, tracker_weight = self._sample_weights(
            mask, sample_weight, real_rows, output_shapes, units, forms, loss_masks)

        def core_loss(x, y, loss_weight):
            _, (unscaled, y_pred, _, _) = model.compute_loss_and_updates(
                trainable, non_trainable, metrics_values, x, y, loss_weight, training=False)
            return unscaled, y_pred

        if merged or layout.cores_per_device == 1:  # one core per device: its rows are the device's
            unscaled, y_pred = core_loss(x, targets, loss_weight)
        else:
            by_core = layout.split_cores
            unscaled, y_pred = layout.map_cores(core_loss, in_axes=0, looped=self._cores_looped(
                trainable, non_trainable, x))(by_core(x), by_core(targets), by_core(loss_weight))
            y_pred = layout.merge_cores(y_pred)
        mean_loss = layout.device_sum(jnp.sum(unscaled)) / units
        metrics_values = self._update_metrics(metrics_values, mean_loss, real_rows, x, y,
                                              y_pred, mask, metric_weight, tracker_weight, output_masks)
        return (trainable, non_trainable, metrics_values)
