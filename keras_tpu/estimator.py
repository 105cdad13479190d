"""``TPUEstimator``: TensorFlow 1's ``model_fn``/``input_fn`` workflow on the simulated TPU.

.. code-block:: python

    from keras_tpu import estimator as tpu_estimator

    def model_fn(features, labels, mode, params):
        logits = keras.layers.Dense(10)(keras.layers.Flatten()(features))
        loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        optimizer = tpu_estimator.CrossShardOptimizer(keras.optimizers.SGD(0.01))
        return tpu_estimator.TPUEstimatorSpec(mode=mode, loss=loss, train_op=optimizer)

    estimator = tpu_estimator.TPUEstimator(
        model_fn=model_fn, config=tpu_estimator.RunConfig(model_dir="/tmp/mnist",
            tpu_config=tpu_estimator.TPUConfig(iterations_per_loop=50, num_shards=8)),
        train_batch_size=128, eval_batch_size=128)
    estimator.train(input_fn=train_input_fn, max_steps=1000)

``model_fn(features, labels, mode, params)`` builds the model with Keras
layers and ``keras.ops`` on symbolic inputs; the estimator turns that graph
into a Keras model and runs it with the same replicated TPU programs as
:func:`keras_tpu.keras_to_tpu_model` (:mod:`keras_tpu._replicated_steps`).
Each call of ``model_fn`` creates new layers, as TensorFlow 1 rebuilt its
graph per mode; the modes share weights through the checkpoints in
``model_dir``, matched in the order the layers create them.

``params``, as in TensorFlow 1.15: ``model_fn`` and ``input_fn`` get a copy of
the constructor's ``params`` with ``params["batch_size"]`` (the per-core batch
on the TPU, the global batch on the CPU) and, on the TPU,
``params["context"]``, a :class:`TPUContext` (``num_replicas``,
``num_hosts``, ...). ``model_fn`` also gets ``params["use_tpu"]``. The keys
``batch_size`` and ``context`` are reserved. ``input_fn`` and ``model_fn`` may
also take ``mode`` and ``config`` arguments.

Data: ``input_fn(params)`` returns either whole arrays ``(features,
labels)``, which the estimator batches at the global batch size (shuffled for
training, the last batch padded for evaluation and prediction), or an
iterable (generator, ``keras.utils.PyDataset``) of batches of
``params["batch_size"]`` rows, of which each step takes one per core (as
TensorFlow's ``PER_HOST_V2`` input pipeline). No more batches are taken from
the input than the steps run: ``evaluate(steps=1)`` takes one global batch,
and ``predict`` is a lazy generator, one device call of at most
``iterations_per_loop`` batches at a time, so it works on endless inputs.

Evaluation and prediction run the graph as a TPU does: on each core's batch
of ``params["batch_size"]`` rows, which is the static batch dimension of
``features`` and ``labels`` on the TPU (``features.shape[0]``, and a
``reshape`` to ``params["batch_size"]`` rows, work as in TensorFlow). The
evaluation loss is the mean over evaluation steps of each step's loss, as
TensorFlow's ``metrics.mean(loss)``: on the TPU the mean of the cores'
losses, each weighed by its real rows (TensorFlow's TPUEstimator reports
core 0's, the same for a loss that averages over the batch and noisier
otherwise). ``metric_fn`` is called once, on the concatenated metric tensors
of all real evaluation examples; those tensors keep the batch dimension (one
or more rows per example), and so do the predictions. The loss the optimizer
minimises, and the evaluation loss, add the weight regularizers of the layers
``model_fn`` creates (``kernel_regularizer=...``) to ``model_fn``'s loss, as
Keras does. A variable passed to an op with a symbolic input is read as the
graph runs; ``keras.ops`` on a variable alone (a tied embedding table
transposed in ``model_fn``) would run once, when the graph is built, and is
refused where its result is a weight's value or transpose. A partial last
batch is padded to whole cores' batches (on the CPU it runs at its own size)
and the padding is removed from the metric tensors and predictions; a core
that holds real and padding rows computes its loss over both (a TPU cannot
run a partial batch at all: TensorFlow's input functions use
``drop_remainder=True``), and a warning says so.

Checkpoints are ``model_dir/ckpt-<step>.npz`` files (:mod:`keras_tpu._checkpoints`);
:meth:`TPUEstimator.latest_checkpoint` returns the newest one's path, and
:meth:`TPUEstimator.get_variable_names` lists its variables by path, named as
TensorFlow names them in a fresh graph (``dense/kernel``, ``dense_1/bias``,
``sgd/iteration``, ``global_step``).

Hooks: ``train``, ``evaluate`` and ``predict`` take ``hooks``, objects with
TensorFlow's ``SessionRunHook`` methods (``begin``, ``after_create_session``,
``before_run``, ``after_run``, ``end``; all optional), called once per device
loop of ``iterations_per_loop`` steps, as TPUEstimator does. There is no
TensorFlow session, so the ``session`` arguments are ``None``, fetches that
``before_run`` requests are not run, and ``run_values.results`` holds the
loop's ``{"loss": ..., "global_step": ...}`` (training) or
``{"global_step": ...}``. ``run_context.request_stop()`` ends the loop after
the current device call. ``train``'s ``saving_listeners`` get
``begin``/``before_save``/``after_save``/``end`` around each checkpoint; an
``after_save`` returning True stops training.
"""

import collections
import dataclasses
import enum
import inspect
import itertools
import json
import math
import numbers
import os
import re
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import tree

from keras_tpu import _checkpoints as checkpoints, _keras_private, _validation as validation
from keras_tpu._logging import logger
from keras_tpu._cluster import TPUClusterResolver
from keras_tpu._placement import Placement
# TensorFlow's tf.estimator.train_and_evaluate and its specs and exporters, beside the estimator as users import them.
from keras_tpu._train_and_evaluate import (EvalSpec, Exporter, FinalExporter, LatestExporter, TrainSpec,
                                           train_and_evaluate)

__all__ = [
    "CheckpointSaverListener", "CrossShardOptimizer", "EstimatorSpec", "EvalSpec", "ExportSavedModelApiVersion",
    "Exporter", "FinalExporter", "InputPipelineConfig", "LatestExporter", "ModeKeys", "RunConfig",
    "SessionRunContext", "SessionRunHook", "SessionRunValues", "TPUConfig", "TPUContext", "TPUEstimator",
    "TPUEstimatorSpec", "TrainSpec", "WarmStartSettings", "train_and_evaluate", "variable_names",
]


class ModeKeys:
    """The three modes ``model_fn`` is called in (TensorFlow's ``tf.estimator.ModeKeys``).

    Example:
        >>> ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT
        ('train', 'eval', 'infer')
    """

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"


@dataclasses.dataclass
class TPUEstimatorSpec:
    """What ``model_fn`` returns (TensorFlow 1.15's ``TPUEstimatorSpec``, same argument order).

    Args:
        mode: the ``ModeKeys`` value ``model_fn`` was called with.
        predictions: a symbolic tensor or dict of them (PREDICT).
        loss: a scalar symbolic tensor (TRAIN and EVAL).
        train_op: the optimizer, a :class:`CrossShardOptimizer` (TRAIN).
        eval_metrics: ``(metric_fn, tensors)`` where ``tensors`` is a list or
            dict of symbolic tensors with one row per example (EVAL).
        export_outputs: accepted for compatibility.
        scaffold_fn, host_call: accepted for compatibility; not run (there is
            no TensorFlow graph to scaffold and no host summary loop).
        training_hooks, evaluation_hooks, prediction_hooks: hooks added to
            those given to ``train``, ``evaluate`` and ``predict``.

    Example:
        >>> loss = keras.ops.mean(keras.Input((4,)))   # in model_fn: a scalar of the symbolic graph
        >>> spec = TPUEstimatorSpec(ModeKeys.TRAIN, loss=loss, train_op=CrossShardOptimizer(keras.optimizers.SGD(0.01)))
        >>> spec.mode, spec.train_op.reduction
        ('train', 'mean')
    """

    # TensorFlow's fields, in its order
    mode: str
    predictions: object = None
    loss: object = None
    train_op: object = None
    eval_metrics: tuple = None
    export_outputs: object = None
    scaffold_fn: object = None
    host_call: object = None
    training_hooks: object = None
    evaluation_hooks: object = None
    prediction_hooks: object = None

    def as_estimator_spec(self):
        """The spec for a CPU run (TensorFlow converts to an ``EstimatorSpec``): this spec itself, which
        the estimator runs on the CPU as well (``use_tpu=False``, ``eval_on_tpu=False``)."""
        return self


@dataclasses.dataclass
class EstimatorSpec:
    """TensorFlow's ``tf.estimator.EstimatorSpec`` (same arguments, same order), which a ``model_fn`` may return
    to ``TPUEstimator`` as TensorFlow's TPU models do in PREDICT mode (tensorflow/tpu's ResNet); it runs as the
    :class:`TPUEstimatorSpec` of the same fields.

    ``eval_metric_ops`` (TensorFlow metric ops) are refused: return
    ``TPUEstimatorSpec(eval_metrics=(metric_fn, tensors))``. ``scaffold`` is
    not run (no TensorFlow graph); ``training_chief_hooks`` join the training
    hooks (one process trains).

    Example:
        >>> EstimatorSpec(ModeKeys.PREDICT, predictions={"classes": None}).as_tpu_estimator_spec().mode
        'infer'
    """

    mode: str
    predictions: object = None
    loss: object = None
    train_op: object = None
    eval_metric_ops: dict = None
    export_outputs: object = None
    training_chief_hooks: object = None
    training_hooks: object = None
    scaffold: object = None
    evaluation_hooks: object = None
    prediction_hooks: object = None

    def as_tpu_estimator_spec(self):
        """The :class:`TPUEstimatorSpec` this spec runs as."""
        if self.eval_metric_ops:
            raise ValueError("EstimatorSpec(eval_metric_ops=...) holds TensorFlow metric ops, which keras_tpu cannot "
                             "run: return TPUEstimatorSpec(eval_metrics=(metric_fn, tensors)) with the loss, "
                             "metric_fn computing the metrics from the tensors (Keras metrics or numpy).")
        if self.scaffold is not None:
            logger.warning("EstimatorSpec.scaffold is not run by keras_tpu (no TensorFlow graph).")
        return TPUEstimatorSpec(self.mode, predictions=self.predictions, loss=self.loss, train_op=self.train_op,
                                export_outputs=self.export_outputs,
                                training_hooks=list(self.training_chief_hooks or []) + list(self.training_hooks or []),
                                evaluation_hooks=self.evaluation_hooks, prediction_hooks=self.prediction_hooks)


# TensorFlow 1's tf.losses.Reduction values for CrossShardOptimizer's reduction
_CROSS_SHARD_REDUCTIONS = {"mean": "mean", "sum": "sum", "weighted_mean": "mean", "weighted_sum": "sum"}


class CrossShardOptimizer:
    """Wraps a Keras optimizer so that each core's gradients are combined across all cores
    (TensorFlow 1's ``tf.tpu.CrossShardOptimizer``, same arguments).

    Args:
        opt: any ``keras.optimizers.Optimizer`` (also accepted as ``optimizer=``).
        reduction: ``"mean"`` (the default; TensorFlow's
            ``tf.losses.Reduction.MEAN``, ``"weighted_mean"``) averages the
            cores' gradients, ``"sum"`` (``"weighted_sum"``) adds them.
        name: the name :meth:`get_name` returns.
        group_assignment: must be ``None``: the gradients of all cores are
            combined (partial groups are refused).

    In ``model_fn``, return the optimizer, or ``optimizer.minimize(loss)`` as
    TensorFlow 1 code does, as ``TPUEstimatorSpec(train_op=...)``: the
    estimator computes the spec's loss's gradients on every core, combines
    them and applies them. Gradients are not symbolic here, so
    ``compute_gradients``/``apply_gradients`` are refused with that advice.

    Example:
        >>> CrossShardOptimizer(keras.optimizers.SGD(0.01)).reduction
        'mean'
    """

    GATE_NONE = 0
    GATE_OP = 1
    GATE_GRAPH = 2

    def __init__(self, opt=None, reduction="mean", name="CrossShardOptimizer", group_assignment=None, *,
                 optimizer=None):
        if opt is not None and optimizer is not None:
            raise TypeError("Pass the optimizer once: CrossShardOptimizer(opt) (TensorFlow's name) or optimizer=.")
        opt = optimizer if opt is None else opt
        if not isinstance(opt, keras.optimizers.Optimizer):
            raise TypeError(f"CrossShardOptimizer wraps a keras.optimizers.Optimizer; got {type(opt).__name__}.")
        if _CROSS_SHARD_REDUCTIONS.get(str(reduction).lower()) is None:
            raise ValueError(f"reduction must be 'mean' or 'sum'; got {reduction!r}.")
        if group_assignment is not None:
            raise ValueError("CrossShardOptimizer(group_assignment=...): keras_tpu combines the gradients of all "
                             "cores; partial replica groups are not simulated. Pass group_assignment=None.")
        self.optimizer = opt
        self.reduction = _CROSS_SHARD_REDUCTIONS[str(reduction).lower()]
        self._name = name

    def get_name(self):
        return self._name

    def variables(self):
        """The wrapped optimizer's variables (its iteration count and slots, once built)."""
        return list(self.optimizer.variables)

    def minimize(self, loss, global_step=None, var_list=None, gate_gradients=GATE_OP, aggregation_method=None,
                 colocate_gradients_with_ops=False, name=None, grad_loss=None):
        """The ``train_op`` for ``TPUEstimatorSpec``: this optimizer, which the estimator uses to minimize
        the spec's ``loss`` (pass the same one) and to count the global step. ``gate_gradients``,
        ``aggregation_method``, ``colocate_gradients_with_ops`` and ``name`` have no effect (graph
        options); ``var_list`` and ``grad_loss`` are refused."""
        validation.check_minimize_arguments(var_list, grad_loss)
        return self

    def _refuse(self, method):
        raise NotImplementedError(
            f"CrossShardOptimizer.{method}: gradients are not symbolic tensors in keras_tpu's model_fn. Return the "
            f"optimizer (or optimizer.minimize(loss)) as TPUEstimatorSpec(train_op=...): the estimator computes the "
            f"gradients on every core, combines them across cores and applies them.")

    def compute_gradients(self, loss, var_list=None, **kwargs):
        self._refuse("compute_gradients")

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        self._refuse("apply_gradients")

    def get_slot(self, *args, **kwargs):
        raise NotImplementedError("CrossShardOptimizer.get_slot: a Keras optimizer keeps its slots as variables; "
                                  "read them with .variables() (or .optimizer.variables).")

    def get_slot_names(self, *args, **kwargs):
        raise NotImplementedError("CrossShardOptimizer.get_slot_names: a Keras optimizer keeps its slots as "
                                  "variables; read their paths with [v.path for v in .variables()].")


class InputPipelineConfig:
    """TensorFlow's values for ``TPUConfig.per_host_input_for_training`` (accepted; the estimator
    always feeds as ``PER_HOST_V2``: ``input_fn`` runs once per host and gives per-core batches).

    Example:
        >>> TPUConfig(per_host_input_for_training=InputPipelineConfig.PER_HOST_V2).per_host_input_for_training
        3
    """

    PER_SHARD_V1 = 1
    PER_HOST_V1 = 2
    PER_HOST_V2 = 3
    BROADCAST = 4
    SLICED = 5


@dataclasses.dataclass
class TPUConfig:
    """TPU settings of a :class:`RunConfig` (TensorFlow's ``TPUConfig``, same arguments in its order).

    Args:
        iterations_per_loop: training steps per device call (a positive
            integer; TensorFlow's time strings such as ``"60s"`` are refused).
        num_shards: the number of cores (default: all).
        num_cores_per_replica: ``None`` or 1 (model parallelism is refused).
        per_host_input_for_training, eval_training_input_configuration: no
            effect: ``input_fn`` always gets ``params["batch_size"]`` per core
            and its batches are fed as ``PER_HOST_V2`` (see :class:`InputPipelineConfig`).
        tpu_job_name, initial_infeed_sleep_secs,
        experimental_host_call_every_n_steps,
        experimental_allow_per_host_v2_parallel_get_next,
        experimental_feed_hook: no effect (one simulated job, no infeed
            thread, no host call).
        input_partition_dims: must be ``None`` (spatial partitioning is model
            parallelism).

    Example:
        >>> TPUConfig(iterations_per_loop=100, num_shards=8).iterations_per_loop
        100
    """

    iterations_per_loop: int = 2
    num_shards: int = None
    num_cores_per_replica: int = None
    per_host_input_for_training: object = True
    tpu_job_name: str = None
    initial_infeed_sleep_secs: int = None
    input_partition_dims: object = None
    eval_training_input_configuration: int = InputPipelineConfig.PER_HOST_V1
    experimental_host_call_every_n_steps: int = 1
    experimental_allow_per_host_v2_parallel_get_next: bool = False
    experimental_feed_hook: object = None

    def __post_init__(self):
        steps = self.iterations_per_loop
        if isinstance(steps, str) or isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(f"iterations_per_loop must be a positive number of steps; got {steps!r} (a time such "
                             f"as '60s' is not supported: give the number of steps per device call).")
        if self.num_cores_per_replica not in (None, 1):
            raise ValueError(f"num_cores_per_replica={self.num_cores_per_replica} is model parallelism, which "
                             f"keras_tpu does not simulate: every core holds the whole model. Use None (or 1) and "
                             f"num_shards for the number of cores.")
        if self.input_partition_dims is not None:
            raise ValueError("input_partition_dims (spatial partitioning over the cores of a replica) needs model "
                             "parallelism, which keras_tpu does not simulate. Use None: each core gets whole "
                             "examples.")


_RUN_CONFIG_DISTRIBUTE = ("train_distribute", "eval_distribute", "experimental_distribute")


@dataclasses.dataclass
class RunConfig:
    """Where the estimator runs and keeps its checkpoints (TensorFlow's ``tf.estimator.tpu.RunConfig``).

    TensorFlow's arguments, in its order: ``tpu_config``, ``evaluation_master``,
    ``master``, ``cluster``, then (keyword only) those of ``tf.estimator.RunConfig``.

    Args:
        tpu_config: a :class:`TPUConfig` (default ``TPUConfig()``).
        evaluation_master: no effect (evaluation runs on the same simulated
            TPU); defaults to ``master``.
        master: the TPU's address (``"grpc://..."``); not with ``cluster``.
        cluster: a :class:`keras_tpu.TPUClusterResolver`.
        model_dir, tf_random_seed, save_checkpoints_steps, keep_checkpoint_max:
            as TensorFlow's.
        save_checkpoints_secs: save a checkpoint when this many seconds have
            passed since the last one (checked after each device call); not
            with ``save_checkpoints_steps``. With neither, every
            ``max(iterations_per_loop, 100)`` steps.
        save_summary_steps, session_config, keep_checkpoint_every_n_hours,
        log_step_count_steps, protocol, experimental_max_worker_delay_secs,
        session_creation_timeout_secs: no effect (no summaries, session, gRPC
            server or extra kept checkpoints; the loss and step are logged
            after every device call).
        train_distribute, eval_distribute, experimental_distribute, device_fn:
            must be ``None``: the estimator places the computation on the
            cores itself.

    Example:
        >>> config = RunConfig(model_dir="/tmp/mnist", tpu_config=TPUConfig(iterations_per_loop=50))
        >>> config.tpu_config.iterations_per_loop, config.replace(model_dir="/tmp/mnist_2").model_dir
        (50, '/tmp/mnist_2')
    """

    tpu_config: TPUConfig = None
    evaluation_master: str = None
    master: str = None
    cluster: TPUClusterResolver = None
    _: dataclasses.KW_ONLY
    model_dir: str = None
    tf_random_seed: int = None
    save_summary_steps: int = 100
    save_checkpoints_steps: int = None
    save_checkpoints_secs: float = None
    session_config: object = None
    keep_checkpoint_max: int = 5
    keep_checkpoint_every_n_hours: float = 10000
    log_step_count_steps: int = 100
    train_distribute: object = None
    device_fn: object = None
    protocol: str = None
    eval_distribute: object = None
    experimental_distribute: object = None
    experimental_max_worker_delay_secs: int = None
    session_creation_timeout_secs: int = 7200

    def __post_init__(self):
        if self.master is not None and self.cluster is not None:
            raise ValueError("Both master and cluster are set.")
        if self.save_checkpoints_steps is not None and self.save_checkpoints_secs is not None:
            raise ValueError("Can not provide both save_checkpoints_secs and save_checkpoints_steps.")
        for name in _RUN_CONFIG_DISTRIBUTE:
            if getattr(self, name) is not None:
                raise ValueError(f"RunConfig({name}=...): TPUEstimator distributes over the TPU's cores itself "
                                 f"(TPUConfig(num_shards=...) picks how many). Pass {name}=None; for a Keras model "
                                 f"with a strategy, use keras_tpu.TPUStrategy.")
        if self.device_fn is not None:
            raise ValueError("RunConfig(device_fn=...): the estimator places model_fn's computation on the TPU's "
                             "cores itself. Pass device_fn=None.")
        if self.tpu_config is None:
            self.tpu_config = TPUConfig()
        if self.evaluation_master is None:
            self.evaluation_master = self.master

    def replace(self, **kwargs):
        """A copy with some arguments changed (TensorFlow's ``RunConfig.replace``)."""
        unknown = set(kwargs) - {field.name for field in dataclasses.fields(self)} - {"_"}
        if unknown:
            raise ValueError(f"Replacing {sorted(unknown)} is not supported: RunConfig has no such argument.")
        return dataclasses.replace(self, **kwargs)

    # tf.estimator.RunConfig's cluster properties: one TPU worker job, the first worker is the chief

    @property
    def cluster_spec(self):
        from keras_tpu._cluster import ClusterSpec

        return self.cluster.cluster_spec() if self.cluster is not None else ClusterSpec({})

    @property
    def task_type(self):
        return "worker"

    @property
    def task_id(self):
        return jax.process_index()

    @property
    def global_id_in_cluster(self):
        return jax.process_index()

    @property
    def is_chief(self):
        return jax.process_index() == 0

    @property
    def num_worker_replicas(self):
        return jax.process_count()

    @property
    def num_ps_replicas(self):
        return 0

    @property
    def service(self):
        return None


class ExportSavedModelApiVersion(enum.Enum):
    """TensorFlow's export API versions. Both export the same artifact here: V1 (TensorFlow
    rewrites ``model_fn`` for the TPU) and V2 (``model_fn`` does it, when ``params["use_tpu"]``)
    differ only in who places the computation, and keras-tpu places it either way.

    Example:
        >>> ExportSavedModelApiVersion.V2
        <ExportSavedModelApiVersion.V2: 2>
    """

    V1 = 1
    V2 = 2


@dataclasses.dataclass
class WarmStartSettings:
    """Which variables to initialise from another run's checkpoint (``tf.estimator.WarmStartSettings``).

    Args:
        ckpt_to_initialize_from: a model directory (its newest checkpoint is
            used) or a checkpoint file (``.../ckpt-<step>.npz``).
        vars_to_warm_start: a regular expression matched (``re.match``)
            against the names of the *trainable* variables (default
            ``".*"``: all of them), or a list of expressions matched against
            all model variables (moving statistics included), or ``None``
            (none).
        var_name_to_prev_var_name: ``{name: name in the checkpoint}`` for
            variables renamed since.
        var_name_to_vocab_info: not supported (vocabulary remapping).

    Example:
        >>> WarmStartSettings("/tmp/pretrained", vars_to_warm_start="dense.*").vars_to_warm_start
        'dense.*'
    """

    ckpt_to_initialize_from: str
    vars_to_warm_start: object = ".*"
    var_name_to_vocab_info: dict = None
    var_name_to_prev_var_name: dict = None

    def __post_init__(self):
        if self.var_name_to_vocab_info:
            raise ValueError("WarmStartSettings.var_name_to_vocab_info (vocabulary remapping) is not supported "
                             "by keras_tpu; remap the embedding rows yourself and warm-start the other variables.")


class SessionRunHook:
    """Base class of hooks (TensorFlow's ``tf.estimator.SessionRunHook``); every method is optional.

    Example:
        >>> class StopAtStep(SessionRunHook):
        ...     def after_run(self, run_context, run_values):
        ...         if run_values.results["global_step"] >= 1000:
        ...             run_context.request_stop()
        >>> estimator.train(train_input_fn, hooks=[StopAtStep()])  # doctest: +SKIP
    """

    def begin(self):
        pass

    def after_create_session(self, session, coord):
        pass

    def before_run(self, run_context):
        return None

    def after_run(self, run_context, run_values):
        pass

    def end(self, session):
        pass


class CheckpointSaverListener:
    """Base class of ``train``'s ``saving_listeners`` (TensorFlow's ``CheckpointSaverListener``).

    Example:
        >>> class LogSaves(CheckpointSaverListener):
        ...     def after_save(self, session, global_step_value):
        ...         print("saved step", global_step_value)
        >>> LogSaves().after_save(None, 1000)   # as train(..., saving_listeners=[LogSaves()]) calls it
        saved step 1000
    """

    def begin(self):
        pass

    def before_save(self, session, global_step_value):
        pass

    def after_save(self, session, global_step_value):
        pass

    def end(self, session, global_step_value):
        pass


class SessionRunContext:
    """What a hook's ``before_run``/``after_run`` get: ``request_stop()`` ends the loop.

    Example:
        >>> run_context = SessionRunContext()
        >>> run_context.request_stop()
        >>> run_context.stop_requested
        True
    """

    def __init__(self, original_args=None, session=None):
        self.original_args = original_args
        self.session = session
        self._stop_requested = False

    def request_stop(self):
        self._stop_requested = True

    @property
    def stop_requested(self):
        return self._stop_requested


SessionRunValues = collections.namedtuple("SessionRunValues", ["results", "options", "run_metadata"])
SessionRunValues.__doc__ = """What a hook's ``after_run`` gets (TensorFlow's ``SessionRunValues``): ``results`` holds
the device loop's ``{"loss": ..., "global_step": ...}`` (training) or ``{"global_step": ...}``.

Example:
    >>> run_values = SessionRunValues(results={"loss": 0.25, "global_step": 100}, options=None, run_metadata=None)
    >>> run_values.results["global_step"]
    100
"""


class _Hooks:
    """Calls the hooks' methods that exist, in order."""

    def __init__(self, hooks, what="hooks"):
        hooks = list(hooks or [])
        for hook in hooks:
            if isinstance(hook, (numbers.Number, str, bytes)):
                raise TypeError(f"{what} must be a list of SessionRunHook objects; got {hook!r}.")
        self.hooks = hooks

    def __call__(self, method, *args):
        return [getattr(hook, method)(*args) for hook in self.hooks if callable(getattr(hook, method, None))]


class TPUContext:
    """``params["context"]`` on the TPU: the replicas and hosts of this run (TensorFlow's ``TPUContext``).

    Example:
        >>> context = TPUContext(num_replicas=8, num_hosts=1, current_host=0, from_input_fn=True)
        >>> context.num_replicas, context.num_of_replicas_per_host, context.current_input_fn_deployment()
        (8, 8, ('/job:worker/task:0/device:CPU:0', 0, 1, 8))
    """

    def __init__(self, num_replicas, num_hosts, current_host, from_input_fn, job_name="worker"):
        self._num_replicas = int(num_replicas)
        self._num_hosts = int(num_hosts)
        self._current_host = int(current_host)
        self._from_input_fn = bool(from_input_fn)
        self._job_name = job_name or "worker"

    @property
    def num_replicas(self):
        """All replicas (cores) of the run."""
        return self._num_replicas

    num_cores = num_replicas

    @property
    def num_hosts(self):
        return self._num_hosts

    @property
    def current_host(self):
        """This host's (worker's) index."""
        return self._current_host

    @property
    def num_of_replicas_per_host(self):
        return self._num_replicas // self._num_hosts

    @property
    def device_assignment(self):
        """``None``: no model parallelism (every core holds the whole model)."""
        if self._from_input_fn:
            raise RuntimeError("This TPUContext instance must not be called from input_fn.")
        return None

    def _host_device(self, host):
        return f"/job:{self._job_name}/task:{host}/device:CPU:0"

    def current_input_fn_deployment(self):
        """``(host device, host index, input_fn calls in all, replicas fed per call)``:
        ``input_fn`` runs once per host and feeds that host's cores."""
        if not self._from_input_fn:
            raise RuntimeError("This TPUContext instance must not be called from model_fn.")
        return (self._host_device(self._current_host), self._current_host, self._num_hosts,
                self.num_of_replicas_per_host)

    def device_for_replica(self, replica_id):
        """``(host device, core ordinal on that host)`` of replica ``replica_id``."""
        if not 0 <= replica_id < self._num_replicas:
            raise ValueError(f"replica_id must be in [0, {self._num_replicas}); got {replica_id}.")
        per_host = self.num_of_replicas_per_host
        return self._host_device(replica_id // per_host), replica_id % per_host

    @property
    def tpu_host_placement_function(self):
        return lambda host_id=0: self._host_device(host_id)

    def __repr__(self):
        return f"TPUContext(num_replicas={self._num_replicas}, num_hosts={self._num_hosts})"


class _GraphModel(keras.Model):
    """The graph ``model_fn`` built, as a Keras model whose loss is one of its outputs.

    Each core runs the graph on its own batch, as a TPU does. In EVAL the
    loss (one number per core) is given to each of the core's rows, so that
    the outputs of all cores and batches are rows, which the replicated
    programs concatenate and from which padding rows are removed. A metric
    tensor with several rows per example (BERT's masked positions, flattened
    to ``batch * positions``) runs as ``(batch, positions, ...)`` and is
    flattened back (:attr:`flattened`), as TensorFlow concatenates the cores'
    tensors along their first axis.

    The loss the optimizer minimises adds the model's own losses (weight
    regularizers, ``add_loss``) to ``model_fn``'s, as Keras does; so does the
    EVAL loss, with the weight regularizers.
    """

    def __init__(self, graph, mode, loss_scale=1.0):
        super().__init__(name=f"{graph.name}_model")
        self.graph = graph
        self.mode = mode
        self.loss_scale = loss_scale
        self.flattened = set()  # EVAL outputs with several rows per example, run as (batch, rows, ...)
        self.built = True  # the functional graph holds every variable already

    def call(self, inputs, training=False):
        outputs = self.graph(inputs, training=training)
        if self.mode == ModeKeys.TRAIN:
            return outputs
        rows = tree.flatten(inputs)[0].shape[0]
        if rows is None:  # a symbolic call: nothing to arrange
            return outputs
        return {key: self._per_row(key, value, rows) for key, value in outputs.items()}

    def _per_row(self, key, value, rows):
        if self.mode == ModeKeys.EVAL and key == "loss":
            if keras.ops.ndim(value) != 0:
                raise ValueError(f"The EVAL loss of model_fn must be a scalar; got shape {tuple(value.shape)}.")
            regularization = [keras.ops.cast(v.regularizer(v), value.dtype) for v in self.graph.trainable_weights
                              if getattr(v, "regularizer", None) is not None]
            return keras.ops.broadcast_to(value + sum(regularization), (rows,))
        shape = tuple(value.shape)
        metric = key.startswith("metric/")
        if shape and metric and shape[0] % rows == 0 and shape[0] != rows:
            self.flattened.add(key)
            return keras.ops.reshape(value, (rows, shape[0] // rows) + shape[1:])
        if not shape or shape[0] != rows:
            what = f"eval_metrics tensor {key[len('metric/'):]!r}" if metric else f"prediction {key!r}"
            raise ValueError(
                f"The {what} has shape {shape}, but a core's batch has {rows} rows: "
                + ("a tensor outfed from a TPU keeps its batch dimension (TensorFlow refuses a scalar); keras-tpu "
                   "needs its first axis to be the batch or a multiple of it (several rows per example), to leave "
                   "out padding rows. Reduce over the batch in metric_fn instead." if metric else
                   "predictions keep the batch dimension, one row per example, as on a TPU."))
        return value

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = y_pred["loss"]
        added = [keras.ops.cast(keras.ops.sum(term), loss.dtype) for term in self.losses]
        return (loss + sum(added)) * self.loss_scale


def _accepted_arguments(fn):
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _call_model_fn(model_fn, features, labels, mode, params, config):
    accepted = _accepted_arguments(model_fn)
    kwargs = {name: value for name, value in (("mode", mode), ("params", params), ("config", config))
              if name in accepted}
    spec = model_fn(features, labels, **kwargs)
    if isinstance(spec, EstimatorSpec):
        spec = spec.as_tpu_estimator_spec()
    if not isinstance(spec, TPUEstimatorSpec):
        raise TypeError(f"model_fn must return a TPUEstimatorSpec (or an EstimatorSpec); got {type(spec).__name__}.")
    return spec


def _symbolic(example, name, batch_size=None):
    """Keras inputs shaped like one batch of ``example`` (an array or dict of arrays), of ``batch_size`` rows
    (``None``: any)."""
    def symbolic(array, name):
        array = np.asarray(array)
        return keras.Input(batch_shape=(batch_size,) + array.shape[1:], dtype=str(array.dtype), name=name)

    if isinstance(example, dict):
        return {key: symbolic(value, key) for key, value in example.items()}
    return symbolic(example, name)


def _refuse_variables_read_outside_layers(graph):
    """Refuse a graph holding the value of one of its weights (or its transpose) as a constant.

    A ``keras.ops`` call on a variable alone in ``model_fn`` (BERT's output
    layer multiplies by the transposed embedding table) runs once, when the
    graph is built: its result is a constant, which would neither train nor
    load from checkpoints. Passing the variable itself to an op that also
    takes a symbolic tensor is fine: the graph reads it when it runs.
    """
    constants = [(operation, argument) for operation in graph.operations
                 for node in getattr(operation, "_inbound_nodes", [])
                 for argument in tree.flatten((node.arguments.args, node.arguments.kwargs))
                 if not isinstance(argument, (keras.KerasTensor, keras.Variable)) and np.ndim(argument) > 0]
    for operation, argument in constants:  # few: only the weights of their shape are read
        shape = tuple(np.shape(argument))
        for variable in graph.trainable_variables:
            if len(shape) > 2 or shape not in (tuple(variable.shape), tuple(variable.shape)[::-1]):
                continue
            value, constant = np.asarray(variable.value), np.asarray(argument)
            if np.ptp(value) > 0 and any(  # (a constant initial value could match anything)
                    constant.shape == candidate.shape and np.array_equal(constant, candidate)
                    for candidate in (value, value.T)):
                raise ValueError(
                    f"model_fn computes {operation.name!r} from the value of the weight {variable.path!r} outside "
                    f"a layer (keras.ops on the variable alone, such as a transposed embedding table): that value "
                    f"is read once, when the graph is built, so it would neither train nor load from checkpoints. "
                    f"Pass the variable itself to an op with a symbolic input (keras.ops.matmul(x, layer.kernel)), "
                    f"or read it inside a layer's call.")


def _is_random_state(name):
    """Whether the variable at ``name`` (a path or checkpoint name) is a layer's random-number state."""
    return name.rsplit("/", 1)[-1].startswith("seed_generator_state")


def _graph_inputs(features, labels):
    """What the graph of ``model_fn`` takes: ``[features, labels]``, or ``[features]`` where ``input_fn`` gave
    no labels (as ``_build`` made its inputs)."""
    return [features] if labels is None else [features, labels]


def _padded(data, rows):
    """``data``'s arrays with ``rows`` rows: padding rows are copies of the first row, as
    :mod:`keras_tpu._batching` pads."""
    def pad(array):
        array = np.asarray(array)
        if len(array) == rows:
            return array
        return np.concatenate([array, np.repeat(array[:1], rows - len(array), axis=0)])

    return None if data is None else tree.map_structure(pad, data)


def _rows(data):
    return int(np.shape(tree.flatten(data)[0])[0])


def _take(data, index):
    return tree.map_structure(lambda a: np.asarray(a)[index], data)


def _base_name(name):
    return re.sub(r"_\d+$", "", name)


def variable_names(model):
    """Names of ``model``'s variables (trainable, non-trainable, then its optimizer's), by path.

    Keras numbers auto-named layers across the whole process (``dense_7``);
    TensorFlow 1 named them within each fresh graph (``dense``, ``dense_1``).
    The auto-named layers of each path are renamed that way, in order of
    first appearance, so that each call of ``model_fn`` gives the same names;
    a name the user gave (``block_3``) is kept, as TensorFlow keeps it.
    Optimizer variables are ``<optimizer>/<variable path>/<slot>`` (or
    ``<optimizer>/iteration``).

    Example:
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="hidden"), keras.layers.Dense(1)])
        >>> variable_names(model)
        ['sequential/hidden/kernel', 'sequential/hidden/bias', 'sequential/dense/kernel', 'sequential/dense/bias']
    """
    given = {layer.name for layer in _keras_private.all_layers(model) if not _keras_private.auto_named(layer)}
    renamed, counts, used = {name: name for name in given}, collections.Counter(), set(given)

    def rename(component):
        if component not in renamed:
            base = _base_name(component)
            while True:
                n = counts[base]
                counts[base] += 1
                candidate = base if n == 0 else f"{base}_{n}"
                if candidate not in used:
                    break
            used.add(candidate)
            renamed[component] = candidate
        return renamed[component]

    names, flat = [], {}
    for variable in list(model.trainable_variables) + list(model.non_trainable_variables):
        *scopes, leaf = variable.path.split("/")
        name = "/".join([rename(scope) for scope in scopes] + [leaf])
        names.append(name)
        flat[variable.path.replace("/", "_")] = name
    optimizer = getattr(model, "optimizer", None)
    for variable in (optimizer.variables if optimizer is not None else []):
        head, _, rest = variable.path.partition("/")
        reference = max((key for key in flat if rest.startswith(key + "_")), key=len, default=None)
        if reference is not None:
            rest = f"{flat[reference]}/{rest[len(reference) + 1:]}"
        names.append(f"{_base_name(head)}/{rest}" if rest else _base_name(head))
    return names


_CHECKPOINT_FILE = re.compile(r"ckpt-(\d+)(\.npz)?$")


def _read_checkpoint(path):
    """``(step, arrays, header)`` of the checkpoint at ``path``: a model directory (its newest
    checkpoint) or a checkpoint file; ``None`` if there is none."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return checkpoints.latest(path)
    if not path.endswith(".npz") and os.path.exists(path + ".npz"):
        path += ".npz"
    if not os.path.isfile(path):
        return None
    header, arrays = checkpoints.read_checkpoint(path)
    return header["step"], arrays, header


def _checkpoint_names(header, count):
    names = header.get("names")
    return list(names) if names and len(names) == count else [f"variable_{i}" for i in range(count)]


def _checkpoint_file(model_dir, step):
    return os.path.join(model_dir, f"ckpt-{int(step):08d}.npz")


def _warm_start_settings(value):
    if value is None or isinstance(value, WarmStartSettings):
        return value
    if isinstance(value, (str, os.PathLike)):
        return WarmStartSettings(os.fspath(value))
    if hasattr(value, "ckpt_to_initialize_from"):  # TensorFlow's own WarmStartSettings
        return WarmStartSettings(os.fspath(value.ckpt_to_initialize_from),
                                 getattr(value, "vars_to_warm_start", ".*"),
                                 getattr(value, "var_name_to_vocab_info", None),
                                 getattr(value, "var_name_to_prev_var_name", None))
    raise TypeError(f"warm_start_from must be a checkpoint path, a model directory or a WarmStartSettings; "
                    f"got {type(value).__name__}.")


def _warm_start_selection(pattern, names, trainable_count):
    """Indices of the variables ``vars_to_warm_start`` selects (TensorFlow's rules)."""
    if pattern is None:
        return []
    if isinstance(pattern, str):  # trainable variables only
        return [i for i in range(trainable_count) if re.match(pattern, names[i])]
    if isinstance(pattern, (list, tuple)) and all(isinstance(p, str) for p in pattern):
        return [i for i, name in enumerate(names) if any(re.match(p, name) for p in pattern)]
    raise TypeError(f"vars_to_warm_start must be a regular expression, a list of them or None; got {pattern!r}.")


def _whole_arrays(data):
    """``(features, labels)`` if ``input_fn`` returned whole arrays, else ``None`` (an iterable of batches)."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and not _is_iterable_source(data[0]):
        return data[0], data[1]
    if isinstance(data, (np.ndarray, dict)) or hasattr(data, "__array__"):
        return data, None
    return None


def _timestamped_dir(export_dir_base):
    stamp = int(time.time())
    while os.path.exists(os.path.join(export_dir_base, str(stamp))):
        stamp += 1
    return os.path.join(export_dir_base, str(stamp))


_RESERVED_PARAMS_KEYS = ("batch_size", "context")


class TPUEstimator:
    """Train, evaluate and predict a ``model_fn`` on the simulated TPU (TensorFlow 1.15's ``TPUEstimator``).

    Args:
        model_fn: ``model_fn(features, labels, mode, params)`` (``mode``,
            ``params`` and ``config`` optional) returning a
            :class:`TPUEstimatorSpec`.
        model_dir: where checkpoints go; ``config.model_dir`` if ``None`` (if
            both are given they must agree); a new temporary directory if
            neither is.
        config: a :class:`RunConfig`.
        params: a dict passed (copied) to ``model_fn`` and ``input_fn``, with
            ``batch_size``, ``use_tpu`` and ``context`` added (see the module
            docstring); ``batch_size`` and ``context`` are reserved keys.
        use_tpu: False runs the same program on the CPU, float32, one core,
            with the same global batch.
        train_batch_size, eval_batch_size, predict_batch_size: global batch
            sizes, multiples of the number of cores.
        batch_axis: TensorFlow's batch axis of each input tensor. Only the
            first axis is supported (``None`` or all zeros); move the batch
            axis first in ``input_fn`` (``np.moveaxis``).
        eval_on_tpu: False evaluates on the CPU in float32 (``model_fn`` sees
            ``params["use_tpu"]`` False and the global ``batch_size``).
        export_to_tpu: :meth:`export_saved_model` exports the TPU's numerics
            (the MXU's bfloat16 matrix products; ``model_fn`` is called with
            ``params["use_tpu"]`` True) when this and ``use_tpu`` are True,
            and float32 CPU numerics (``params["use_tpu"]`` False) otherwise.
        export_to_cpu: accepted: every export runs on the CPU
            (:func:`keras_tpu.load_exported`). One of ``export_to_cpu`` and
            ``export_to_tpu`` must be True.
        warm_start_from: a model directory, a checkpoint file or a
            :class:`WarmStartSettings`. Training that starts without a
            checkpoint in ``model_dir`` (and ``predict`` without one) first
            loads those variables from it, matched by name (global step 0).
        embedding_config_spec: must be ``None``: TPU embedding tables are not
            simulated; use ``keras.layers.Embedding`` in ``model_fn``.
        export_saved_model_api_version: :class:`ExportSavedModelApiVersion`
            ``V1`` (default) or ``V2``; both export the same artifact.
        precision: keras-tpu's own (TensorFlow had none): the MXU precision
            of ``model_fn``'s matrix products on the cores, as
            ``TPUDistributionStrategy``'s: ``"default"`` (one bfloat16 pass,
            a TPU's default), ``"high"`` or ``"highest"`` (float32 to within
            rounding: a run to compare with ``use_tpu=False``).

    Example:
        >>> def model_fn(features, labels, mode, params):
        ...     logits = keras.layers.Dense(10)(keras.layers.Flatten()(features))
        ...     loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        ...     return TPUEstimatorSpec(mode, loss=loss, train_op=CrossShardOptimizer(keras.optimizers.SGD(0.01)))
        >>> estimator = TPUEstimator(model_fn, config=RunConfig(model_dir="/tmp/mnist", tpu_config=TPUConfig(
        ...     iterations_per_loop=10)), train_batch_size=64)                                    # doctest: +SKIP
        >>> estimator.train(lambda params: (np.zeros((640, 28, 28), "float32"), np.zeros(640, "int32")),
        ...                 max_steps=100)                                                        # doctest: +SKIP
    """

    def __init__(self, model_fn=None, model_dir=None, config=None, params=None, use_tpu=True, train_batch_size=None,
                 eval_batch_size=None, predict_batch_size=None, batch_axis=None, eval_on_tpu=True,
                 export_to_tpu=True, export_to_cpu=True, warm_start_from=None, embedding_config_spec=None,
                 export_saved_model_api_version=ExportSavedModelApiVersion.V1, *, precision="default"):
        if not callable(model_fn):
            raise ValueError(f"TPUEstimator needs a model_fn (a function returning a TPUEstimatorSpec); "
                             f"got {model_fn!r}.")
        if params is not None and any(key in params for key in _RESERVED_PARAMS_KEYS):
            raise ValueError(f"{list(_RESERVED_PARAMS_KEYS)} are reserved keys but existed in params {params}.")
        if embedding_config_spec is not None:
            raise ValueError("TPUEstimator(embedding_config_spec=...): TPU embedding tables are not simulated by "
                             "keras_tpu. Use keras.layers.Embedding in model_fn (it runs on the cores like any "
                             "other layer) and pass embedding_config_spec=None.")
        if batch_axis is not None and any(axis != 0 for axis in tree.flatten(batch_axis)):
            raise ValueError(f"batch_axis={batch_axis!r}: keras_tpu splits every tensor over the cores along its "
                             f"first axis. Move the batch axis first in input_fn (np.moveaxis) and pass "
                             f"batch_axis=None.")
        if not isinstance(export_saved_model_api_version, ExportSavedModelApiVersion):
            raise ValueError(f"export_saved_model_api_version should be of type ExportSavedModelApiVersion; got "
                             f"{export_saved_model_api_version!r}.")
        self.model_fn = model_fn
        self.config = config or RunConfig()
        self.model_dir = self._resolve_model_dir(model_dir)
        self.params = dict(params or {})
        self.use_tpu = bool(use_tpu)
        self.eval_on_tpu = bool(eval_on_tpu)
        self.export_to_tpu = bool(export_to_tpu)
        self.export_to_cpu = bool(export_to_cpu)
        self.batch_axis = batch_axis
        self.export_saved_model_api_version = export_saved_model_api_version
        self.warm_start_from = _warm_start_settings(warm_start_from)
        tpu_config = self.config.tpu_config or TPUConfig()
        self.iterations_per_loop = int(tpu_config.iterations_per_loop)
        # One placement per way of running: the TPU's cores (num_shards of them) and the CPU (use_tpu=False,
        # or evaluation with eval_on_tpu=False).
        self._tpu = Placement(self.config.cluster or TPUClusterResolver(self.config.master), precision,
                              num_cores=tpu_config.num_shards, steps_per_execution=self.iterations_per_loop,
                              owner="TPUEstimator") if self.use_tpu else None
        self._cpu = None
        self._warned_partial_core = False  # see _fed_rows
        self._topology = self._tpu.topology if self._tpu is not None else None
        self._job_name = self._tpu.resolver.job_name if self._tpu is not None else "worker"
        for argument, size in (("train_batch_size", train_batch_size), ("eval_batch_size", eval_batch_size),
                               ("predict_batch_size", predict_batch_size)):
            validation.check_batch_size(size, argument, call="TPUEstimator")
        self.batch_sizes = {ModeKeys.TRAIN: train_batch_size, ModeKeys.EVAL: eval_batch_size,
                            ModeKeys.PREDICT: predict_batch_size or eval_batch_size}
        for mode, size in self.batch_sizes.items():
            if size is not None and size % self._cores(mode):
                raise ValueError(f"The {mode} batch size {size} must be a multiple of the {self._cores(mode)} "
                                 f"cores (TPUEstimator gives each core params['batch_size'] = global / cores).")

    # -- plumbing --------------------------------------------------------------------------

    def _resolve_model_dir(self, model_dir):
        configured = self.config.model_dir
        if model_dir and configured and os.path.abspath(os.fspath(model_dir)) != os.path.abspath(os.fspath(configured)):
            raise ValueError(f"model_dir are set both in constructor and RunConfig, but with different values. "
                             f"In constructor: {model_dir}, in RunConfig: {configured}.")
        model_dir = model_dir or configured
        if not model_dir:
            from keras_tpu import _pod as pod

            if pod.is_multi_worker():
                raise ValueError("A TPUEstimator in a pod needs a model_dir (argument or RunConfig) that every "
                                 "worker can read: the chief writes the checkpoints there.")
            model_dir = tempfile.mkdtemp(prefix="keras_tpu_estimator_")
            logger.warning("Using temporary folder as model directory: %s", model_dir)
        return os.fspath(model_dir)

    def _on_tpu(self, mode):
        """Whether ``mode`` runs on the TPU cores (else on the CPU, float32)."""
        return self.use_tpu and (mode != ModeKeys.EVAL or self.eval_on_tpu)

    def _placement(self, mode):
        if self._on_tpu(mode):
            return self._tpu
        if self._cpu is None:  # use_tpu=False, or eval_on_tpu=False: one CPU core, float32
            self._cpu = Placement(on_mxu=False, owner="TPUEstimator")
        return self._cpu

    @property
    def layout(self):
        """The cores training runs on."""
        return self._placement(ModeKeys.TRAIN).layout

    def _cores(self, mode):
        return self._placement(mode).num_cores

    def _global_batch(self, mode):
        size = self.batch_sizes[mode]
        if size is None:
            raise ValueError(f"Pass {mode}_batch_size to TPUEstimator to {mode}." if mode != ModeKeys.PREDICT
                             else "Pass predict_batch_size (or eval_batch_size) to TPUEstimator to predict.")
        return size

    def _batch_size_param(self, mode):
        """``params["batch_size"]``: per core on the TPU, the global batch on the CPU."""
        return self._global_batch(mode) // self._cores(mode) if self._on_tpu(mode) else self._global_batch(mode)

    def _context(self, mode, from_input_fn):
        if not self._on_tpu(mode):
            return None
        cores = self._cores(mode)
        hosts = self._topology.num_workers if self._topology is not None else 1
        if cores % hosts:
            hosts = 1
        return TPUContext(cores, hosts, jax.process_index() if hosts > 1 else 0, from_input_fn, self._job_name)

    def _input_params(self, mode):
        params = dict(self.params, batch_size=self._batch_size_param(mode))
        context = self._context(mode, from_input_fn=True)
        if context is not None:
            params["context"] = context
        return params

    def _model_params(self, mode, export=False):
        params = dict(self.params)
        if export:  # as TensorFlow: no batch size, use_tpu says which numerics the export gets
            params["use_tpu"] = self._export_on_tpu()
            return params
        params["batch_size"] = self._batch_size_param(mode)
        params["use_tpu"] = self._on_tpu(mode)
        context = self._context(mode, from_input_fn=False)
        if context is not None:
            params["context"] = context
        return params

    def _input(self, input_fn, mode):
        params = self._input_params(mode)
        accepted = _accepted_arguments(input_fn)
        kwargs = {name: value for name, value in (("params", params), ("mode", mode), ("config", self.config))
                  if name in accepted}
        if kwargs:
            data = input_fn(**kwargs)
        elif len(accepted) == 1:
            data = input_fn(params)
        else:
            data = input_fn()
        return data, params["batch_size"]

    def _batch_count(self, data, mode):
        """How many global batches evaluation or prediction gets from ``data`` (``None``: unknown)."""
        arrays = _whole_arrays(data)
        if arrays is not None:
            return math.ceil(_rows(arrays[0]) / self._global_batch(mode))
        if isinstance(data, keras.utils.PyDataset):
            return math.ceil(len(data) / self._cores(mode))
        return None

    def _batches(self, data, per_core_rows, mode):
        """Global batches of ``(features, labels)`` from what ``input_fn`` returned, made as they are taken."""
        global_batch = self._global_batch(mode)
        arrays = _whole_arrays(data)
        if arrays is None:
            yield from self._batches_from_iterable(data, per_core_rows, mode)
            return
        features, labels = arrays
        rows = _rows(features)
        if mode == ModeKeys.TRAIN:  # shuffled epochs, full batches only, as long as needed
            rng = np.random.default_rng(self.config.tf_random_seed)
            order = itertools.chain.from_iterable(rng.permutation(rows) for _ in itertools.count())
            while True:
                index = np.fromiter(itertools.islice(order, global_batch), dtype=np.int64, count=global_batch)
                yield _take(features, index), None if labels is None else _take(labels, index)
        else:
            for start in range(0, rows, global_batch):
                index = np.arange(start, min(start + global_batch, rows))
                yield _take(features, index), None if labels is None else _take(labels, index)

    def _batches_from_iterable(self, source, per_core_rows, mode):
        cores = self._cores(mode)
        if isinstance(source, keras.utils.PyDataset):
            indices = itertools.cycle(range(len(source))) if mode == ModeKeys.TRAIN else range(len(source))
            iterator = (source[i] for i in indices)
        else:
            iterator = iter(source)
        while True:
            parts = list(itertools.islice(iterator, cores))
            if not parts:
                return
            parts = [p if isinstance(p, (tuple, list)) and len(p) == 2 else (p, None) for p in parts]
            if mode == ModeKeys.TRAIN and (len(parts) < cores or any(_rows(f) != per_core_rows for f, _ in parts)):
                seen = sorted({_rows(f) for f, _ in parts})
                raise ValueError(f"Training batches from input_fn must have params['batch_size'] = {per_core_rows} "
                                 f"rows each (one per core per step) along axis 0; got {len(parts)} batch(es) of "
                                 f"{seen} rows. Drop the remainder (drop_remainder=True), and put the batch axis "
                                 f"first (a transposed input, such as ResNet's transpose_input, is not supported).")
            features = tree.map_structure(lambda *a: np.concatenate(a), *[f for f, _ in parts])
            labels = None if parts[0][1] is None else np.concatenate([np.asarray(l) for _, l in parts])
            yield features, labels

    def _build(self, mode, features, labels, export=False):
        # On the TPU each core's batch has params["batch_size"] rows, its static shape (TensorFlow's infeed
        # shapes); an export takes any batch, and the CPU the batches as they come.
        rows = None if export or not self._on_tpu(mode) else self._batch_size_param(mode)
        keras_features = _symbolic(features, "features", rows)
        keras_labels = None if labels is None else _symbolic(labels, "labels", rows)
        spec = _call_model_fn(self.model_fn, keras_features, keras_labels, mode, self._model_params(mode, export),
                              self.config)
        inputs = [keras_features] if keras_labels is None else [keras_features, keras_labels]
        if mode == ModeKeys.TRAIN:
            if spec.loss is None or spec.train_op is None:
                raise ValueError("In TRAIN mode model_fn must return a TPUEstimatorSpec with loss and train_op.")
            outputs = {"loss": spec.loss}
        elif mode == ModeKeys.EVAL:
            if spec.loss is None:
                raise ValueError("In EVAL mode model_fn must return a TPUEstimatorSpec with a loss.")
            outputs = {"loss": spec.loss}
            if spec.eval_metrics is not None:
                _, tensors = spec.eval_metrics
                items = tensors.items() if isinstance(tensors, dict) else enumerate(tensors)
                outputs.update({f"metric/{key}": tensor for key, tensor in items})
        else:
            if spec.predictions is None:
                raise ValueError("In PREDICT mode model_fn must return a TPUEstimatorSpec with predictions.")
            outputs = spec.predictions if isinstance(spec.predictions, dict) else {"predictions": spec.predictions}
        if spec.scaffold_fn is not None or spec.host_call is not None:
            logger.warning("TPUEstimatorSpec scaffold_fn and host_call are not run by keras_tpu (no TensorFlow "
                           "graph or summaries); use hooks for per-loop work.")
        graph = keras.Model(inputs=inputs, outputs=outputs, name=f"model_fn_{mode}")
        _refuse_variables_read_outside_layers(graph)
        return graph, spec

    def _graph_model(self, mode, features, labels):
        graph, spec = self._build(mode, features, labels)
        loss_scale = 1.0
        if mode == ModeKeys.TRAIN:
            optimizer = spec.train_op
            if isinstance(optimizer, CrossShardOptimizer):
                # Cores' gradients are averaged; summing them is averaging `cores` times the loss.
                loss_scale = float(self._cores(mode)) if optimizer.reduction == "sum" else 1.0
                optimizer = optimizer.optimizer
            elif self._on_tpu(mode):
                raise ValueError("With use_tpu=True, train_op must be a CrossShardOptimizer(optimizer) so that the "
                                 "cores' gradients are combined.")
            if not isinstance(optimizer, keras.optimizers.Optimizer):
                raise TypeError(f"train_op must be a Keras optimizer or CrossShardOptimizer; got {type(optimizer)}.")
        model = _GraphModel(graph, mode, loss_scale=loss_scale)
        model.compile(optimizer=optimizer if mode == ModeKeys.TRAIN else None, jit_compile=True)
        return model, spec

    def _steps(self, model, mode):
        return self._placement(mode).steps_for(model)

    # -- checkpoints -----------------------------------------------------------------------

    def _checkpoint(self, checkpoint_path=None):
        """``(step, arrays, header)`` of ``checkpoint_path`` (a checkpoint file or a directory), or of the
        newest checkpoint in ``model_dir``; ``None`` if ``model_dir`` has none."""
        if checkpoint_path is None:
            return checkpoints.latest(self.model_dir)
        found = _read_checkpoint(checkpoint_path)
        if found is None:
            raise ValueError(f"Could not find a checkpoint at {checkpoint_path}.")
        return found

    def _restore(self, model, with_optimizer, found=None):
        """Load a checkpoint (default: the newest in ``model_dir``) into ``model``; return its global step
        (None if there is none)."""
        found = checkpoints.latest(self.model_dir) if found is None else found
        if found is None:
            return None
        step, arrays, header = found
        model_variables = list(model.trainable_variables) + list(model.non_trainable_variables)
        saved = header.get("model_variables")
        names = _checkpoint_names(header, len(arrays))
        # A dropout layer's random-number state is a variable of the mode that has one (model_fn may leave dropout
        # out of EVAL and PREDICT, as BERT's does): match the weights, and the random states where both have them.
        weights = [v for v in model_variables if not _is_random_state(v.path)]
        saved_weights = [i for i in range(saved or 0) if not _is_random_state(names[i])]
        if saved is None or len(weights) != len(saved_weights):
            ours = [name for variable, name in zip(model_variables, variable_names(model))
                    if not _is_random_state(variable.path)]
            theirs = [names[i] for i in saved_weights]
            raise ValueError(
                f"The checkpoint in {self.model_dir} does not fit this model_fn ({model.mode}): it holds "
                f"{len(theirs)} weights, the model has {len(ours)}; only in the checkpoint: "
                f"{sorted(set(theirs) - set(ours))[:8]}, only in the model: {sorted(set(ours) - set(theirs))[:8]}.")
        pairs = list(zip(weights, saved_weights))
        random_states = [v for v in model_variables if _is_random_state(v.path)]
        saved_random_states = [i for i in range(saved) if _is_random_state(names[i])]
        if len(random_states) == len(saved_random_states):
            pairs += list(zip(random_states, saved_random_states))
        if with_optimizer:
            model.optimizer.build(model.trainable_variables)
            pairs += list(zip(model.optimizer.variables, range(saved, len(arrays))))
        for variable, index in pairs:
            value = arrays[index]
            if tuple(variable.shape) != tuple(value.shape):
                raise ValueError(f"The checkpoint in {self.model_dir} does not fit this model_fn: variable "
                                 f"{variable.path} has shape {tuple(variable.shape)}, the checkpoint {value.shape}.")
            variable.assign(value)
        return step

    def _warm_start(self, model):
        """Initialise the variables ``warm_start_from`` selects from its checkpoint, matched by name."""
        settings = self.warm_start_from
        if settings is None:
            return
        source_path = settings.ckpt_to_initialize_from
        found = _read_checkpoint(source_path)
        if found is None:
            raise ValueError(f"warm_start_from: no checkpoint at {source_path}.")
        _, arrays, header = found
        if not header.get("names"):
            raise ValueError(f"warm_start_from: the checkpoint at {source_path} has no variable names (an older "
                             f"keras_tpu wrote it); train it again, or copy it into model_dir to resume it.")
        source = dict(zip(header["names"], arrays))
        variables = list(model.trainable_variables) + list(model.non_trainable_variables)
        names = variable_names(model)[:len(variables)]
        selected = _warm_start_selection(settings.vars_to_warm_start, names, len(model.trainable_variables))
        previous = {i: (settings.var_name_to_prev_var_name or {}).get(names[i], names[i]) for i in selected}
        missing = [previous[i] for i in selected if previous[i] not in source]
        if missing:
            raise ValueError(f"warm_start_from: {missing} are not in the checkpoint at {source_path}, which holds "
                             f"{sorted(source)}. Narrow vars_to_warm_start or map names with "
                             f"var_name_to_prev_var_name.")
        for i in selected:
            value = source[previous[i]]
            if tuple(value.shape) != tuple(variables[i].shape):
                raise ValueError(f"warm_start_from: {names[i]} has shape {tuple(variables[i].shape)}, "
                                 f"{previous[i]} in {source_path} has {value.shape}.")
            variables[i].assign(value)
        logger.info("Warm-started %d variable(s) from %s.", len(selected), source_path)

    def _save(self, model, step):
        model_variables = list(model.trainable_variables) + list(model.non_trainable_variables)
        arrays = [np.asarray(v.value) for v in model_variables + list(model.optimizer.variables)]
        metadata = {"model_variables": len(model_variables), "names": variable_names(model)}
        path = checkpoints.save(self.model_dir, step, arrays, metadata, keep=self.config.keep_checkpoint_max)
        logger.info("Saving checkpoints for %d into %s.", step, path)

    def _save_with_listeners(self, model, state, step, listeners):
        """Write checkpoint ``step``; return whether a listener's ``after_save`` asked to stop."""
        self._assign(model, state)
        listeners("before_save", None, step)
        self._save(model, step)
        if any(listeners("after_save", None, step)):
            logger.info("A CheckpointSaverListener requested that training be stopped.")
            return True
        return False

    def _latest_step(self):
        found = checkpoints.latest(self.model_dir)
        return None if found is None else found[0]

    def latest_checkpoint(self):
        """The path of the newest checkpoint in ``model_dir`` (``.../ckpt-<step>.npz``), or ``None``."""
        step = self._latest_step()
        return None if step is None else _checkpoint_file(self.model_dir, step)

    def _checkpoint_or_raise(self):
        found = checkpoints.latest(self.model_dir)
        if found is None:
            raise ValueError(f"Could not find trained model in model_dir: {self.model_dir}.")
        return found

    def get_variable_names(self):
        """The names (paths) of the variables in the newest checkpoint, sorted, ``"global_step"`` included."""
        _, arrays, header = self._checkpoint_or_raise()
        return sorted(["global_step"] + _checkpoint_names(header, len(arrays)))

    def get_variable_value(self, name):
        """The value (a NumPy array) of variable ``name`` in the newest checkpoint."""
        step, arrays, header = self._checkpoint_or_raise()
        if name == "global_step":
            return np.int64(step)
        names = _checkpoint_names(header, len(arrays))
        if name not in names:
            raise ValueError(f"Variable {name!r} is not in the checkpoint of step {step} in {self.model_dir}; "
                             f"get_variable_names() lists its variables.")
        return arrays[names.index(name)]

    # -- export ----------------------------------------------------------------------------

    def _export_on_tpu(self):
        return self.use_tpu and self.export_to_tpu

    def export_saved_model(self, export_dir_base, serving_input_receiver_fn, assets_extra=None, as_text=False,
                           checkpoint_path=None, experimental_mode=ModeKeys.PREDICT):
        """Export the PREDICT graph with a checkpoint's weights (see :mod:`keras_tpu._export`).

        ``serving_input_receiver_fn()`` returns example features (an array or a
        dict of arrays, any batch size; or an object with a ``features``
        attribute, like TensorFlow's ``ServingInputReceiver``) giving the
        inputs' shapes and dtypes. Writes ``export_dir_base/<timestamp>`` and
        returns that path. ``checkpoint_path``: a checkpoint file or model
        directory (default: the newest checkpoint in ``model_dir``).
        ``assets_extra`` (``{destination: source file}``) is copied into the
        export's ``assets.extra`` directory. ``as_text`` is accepted (there
        is no protocol buffer to write). Only ``experimental_mode=PREDICT``.
        """
        from keras_tpu import _pod as pod
        from keras_tpu._export import export_model

        if not serving_input_receiver_fn:
            raise ValueError("An input_receiver_fn must be defined.")
        if experimental_mode != ModeKeys.PREDICT:
            raise ValueError(f"keras_tpu exports the PREDICT graph only; got experimental_mode={experimental_mode!r}. "
                             f"Train and evaluate with the estimator itself.")
        if not (self.export_to_cpu or self.export_to_tpu):
            raise ValueError("One of export_to_cpu and export_to_tpu must be true.")
        found = self._checkpoint(checkpoint_path)
        if found is None:
            raise ValueError(f"Could not find a trained model in {self.model_dir}: train first.")
        receiver = serving_input_receiver_fn()
        features = getattr(receiver, "features", receiver)
        graph, _ = self._build(ModeKeys.PREDICT, features, None, export=True)
        self._restore(_GraphModel(graph, ModeKeys.PREDICT), with_optimizer=False, found=found)
        path = _timestamped_dir(export_dir_base)
        if pod.is_chief():
            export_model(graph, path, "default" if self._export_on_tpu() else "highest")
            for destination, source in (assets_extra or {}).items():
                target = os.path.join(path, "assets.extra", destination)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(source, target)
        return path

    def experimental_export_all_saved_models(self, export_dir_base, input_receiver_fn_map, assets_extra=None,
                                             as_text=False, checkpoint_path=None):
        """TensorFlow's export of one graph per mode; keras_tpu exports the PREDICT graph only, so
        ``input_receiver_fn_map`` must be ``{ModeKeys.PREDICT: serving_input_receiver_fn}``. Returns the
        export's path, as :meth:`export_saved_model`."""
        modes = set(input_receiver_fn_map or {})
        if modes != {ModeKeys.PREDICT}:
            raise ValueError(f"keras_tpu exports the PREDICT graph only; got modes {sorted(modes)}. Pass "
                             f"{{ModeKeys.PREDICT: serving_input_receiver_fn}} (or call export_saved_model); train "
                             f"and evaluate with the estimator itself.")
        return self.export_saved_model(export_dir_base, input_receiver_fn_map[ModeKeys.PREDICT],
                                       assets_extra=assets_extra, as_text=as_text, checkpoint_path=checkpoint_path)

    def export_savedmodel(self, export_dir_base, serving_input_receiver_fn, assets_extra=None, as_text=False,
                          checkpoint_path=None, strip_default_attrs=False):
        """TensorFlow 1's name (and arguments) of :meth:`export_saved_model`; ``strip_default_attrs`` is
        accepted (there are no graph attributes to strip)."""
        return self.export_saved_model(export_dir_base, serving_input_receiver_fn, assets_extra=assets_extra,
                                       as_text=as_text, checkpoint_path=checkpoint_path)

    # -- the three modes -------------------------------------------------------------------

    def train(self, input_fn, hooks=None, steps=None, max_steps=None, saving_listeners=None):
        """Train for ``steps`` more steps or up to global step ``max_steps``, resuming from ``model_dir``.

        The arguments are TensorFlow's, in its order. With neither ``steps``
        nor ``max_steps``, training runs until an iterable ``input_fn`` ends
        (whole arrays repeat forever, so they need one of them). Runs
        ``iterations_per_loop`` steps per device call (fewer for the last),
        logs the loss and global step after each, calls ``hooks`` once per
        device call, and writes checkpoints to ``model_dir``, with
        ``saving_listeners`` around each. Returns the estimator.
        """
        if isinstance(hooks, numbers.Number):
            raise TypeError("TPUEstimator.train(input_fn, hooks, steps, max_steps, saving_listeners) takes hooks "
                            "second, as TensorFlow's does: pass steps=... or max_steps=... by keyword.")
        if steps is not None and max_steps is not None:
            raise ValueError("Can not provide both steps and max_steps.")
        for name, value in (("steps", steps), ("max_steps", max_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0):
                raise ValueError(f"Must specify {name} > 0, given: {value}")
        user_hooks, listeners = _Hooks(hooks), _Hooks(saving_listeners, "saving_listeners")
        saved_step = self._latest_step()
        if max_steps is not None and saved_step is not None and saved_step >= max_steps:
            logger.info("Skipping training: the checkpoint in %s is at step %d, max_steps is %d.",
                        self.model_dir, saved_step, max_steps)
            return self
        if self.config.tf_random_seed is not None:
            keras.utils.set_random_seed(self.config.tf_random_seed)
        data, per_core_rows = self._input(input_fn, ModeKeys.TRAIN)
        if steps is None and max_steps is None and _whole_arrays(data) is not None:
            raise ValueError("input_fn returned whole arrays, which training repeats (shuffled) for as long as it "
                             "runs: pass steps or max_steps, or return an iterable of batches to train until it ends.")
        batches = self._batches(data, per_core_rows, ModeKeys.TRAIN)
        first = next(batches, None)
        if first is None:
            raise ValueError("input_fn gave no data to train.")
        model, spec = self._graph_model(ModeKeys.TRAIN, *first)
        global_step = self._restore(model, with_optimizer=True)
        if global_step is not None:
            logger.info("Restored the checkpoint of step %d from %s.", global_step, self.model_dir)
        else:
            global_step = 0
            self._warm_start(model)
        target = global_step + steps if steps is not None else max_steps  # None: until the input ends
        hooks = _Hooks(user_hooks.hooks + list(spec.training_hooks or []))
        batches = itertools.chain([first], batches)
        model.optimizer.build(model.trainable_variables)
        model.optimizer.iterations.assign(global_step)
        loop_size = self.iterations_per_loop if target is None else min(self.iterations_per_loop, target - global_step)
        train_function = self._steps(model, ModeKeys.TRAIN).train_function(loop_size, graph_per_core=True)
        state = tuple([v.value for v in vs] for vs in (model.trainable_variables, model.non_trainable_variables,
                                                        model.optimizer.variables, model.metrics_variables))
        save_secs = self.config.save_checkpoints_secs
        save_every = self.config.save_checkpoints_steps or (None if save_secs else max(self.iterations_per_loop, 100))
        saved_at = time.monotonic()
        hooks("begin")
        listeners("begin")
        hooks("after_create_session", None, None)
        last_saved, stop, started = global_step, False, time.perf_counter()
        while not stop and (target is None or global_step < target):
            wanted = loop_size if target is None else min(loop_size, target - global_step)
            loop = list(itertools.islice(batches, wanted))  # no more than this device call runs
            if not loop:
                break  # the input ended
            run_context = SessionRunContext()
            hooks("before_run", run_context)
            metrics = [jnp.zeros_like(v) for v in state[3]]  # the loss logged is this loop's mean
            feed = iter([(_graph_inputs(*batch), None, None) for batch in loop])
            logs, state = train_function(state[:3] + (metrics,), feed)
            global_step += len(loop)
            loss = float(logs["loss"])  # waits for the device: the time below includes the device work
            now = time.perf_counter()
            logger.info("loss = %.6f, step = %d (%.3f sec)", loss, global_step, now - started)
            started = now
            hooks("after_run", run_context, SessionRunValues({"loss": loss, "global_step": global_step}, None, None))
            stop = run_context.stop_requested
            if (global_step - last_saved >= save_every) if save_every else (time.monotonic() - saved_at >= save_secs):
                stop = self._save_with_listeners(model, state, global_step, listeners) or stop
                last_saved, saved_at = global_step, time.monotonic()
        if global_step != last_saved:
            self._save_with_listeners(model, state, global_step, listeners)
        listeners("end", None, global_step)
        hooks("end", None)
        return self

    @staticmethod
    def _assign(model, state):
        for variables, values in zip((model.trainable_variables, model.non_trainable_variables,
                                      model.optimizer.variables), state):
            for variable, value in zip(variables, values):
                variable.assign(np.asarray(value))

    def _inference(self, mode, input_fn, steps, found, hooks):
        """Evaluation or prediction, one device call at a time.

        Yields ``(spec, global_step)`` first, then for each device call (at
        most ``iterations_per_loop`` global batches, and no more than
        ``steps`` in all) the list of its batches' outputs, one dict of
        arrays per batch, padding removed. Takes batches from the input only
        as they are run.
        """
        data, per_core_rows = self._input(input_fn, mode)
        count = self._batch_count(data, mode)
        batches = self._batches(data, per_core_rows, mode)
        if steps is not None:
            batches = itertools.islice(batches, steps)
            count = steps if count is None else min(count, steps)
        first = next(batches, None)
        if first is None:
            raise ValueError(f"input_fn gave no data to {mode}.")
        model, spec = self._graph_model(mode, first[0], first[1] if mode == ModeKeys.EVAL else None)
        if found is not None:
            global_step = self._restore(model, with_optimizer=False, found=found)
        else:
            global_step = None
            self._warm_start(model)
        loop_size = min(self.iterations_per_loop, count) if count else self.iterations_per_loop
        steps_of_model = self._steps(model, mode)
        functions = {}  # rows of the batches it runs -> predict function (see _fed_rows)
        state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])
        spec_hooks = spec.evaluation_hooks if mode == ModeKeys.EVAL else spec.prediction_hooks
        hooks = _Hooks(_Hooks(hooks).hooks + list(spec_hooks or []))
        hooks("begin")
        hooks("after_create_session", None, None)
        yield spec, global_step
        batches = itertools.chain([first], batches)
        while True:
            loop = list(itertools.islice(batches, loop_size))
            if not loop:
                break
            run_context = SessionRunContext()
            hooks("before_run", run_context)
            real = [_rows(f) for f, _ in loop]
            fed = [self._fed_rows(rows, mode) for rows in real]
            parts = []
            for rows, run in itertools.groupby(zip(fed, loop), key=lambda item: item[0]):
                feed = [(_graph_inputs(_padded(f, rows), _padded(l, rows) if mode == ModeKeys.EVAL else None), None,
                         None) for _, (f, l) in run]
                if rows not in functions:
                    functions[rows] = steps_of_model.predict_function(
                        loop_size, purpose="evaluation" if mode == ModeKeys.EVAL else "predict", graph_per_core=True)
                outputs, state = functions[rows](state, iter(feed))
                parts.append({key: np.asarray(value) for key, value in outputs.items()})
            outputs = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
            starts = np.cumsum([0] + fed[:-1])
            flat = lambda key, a: a.reshape((-1,) + a.shape[2:]) if key in model.flattened else a  # noqa: E731
            yield [{key: flat(key, value[start:start + rows]) for key, value in outputs.items()}
                   for start, rows in zip(starts, real)]
            hooks("after_run", run_context, SessionRunValues({"global_step": global_step}, None, None))
            if run_context.stop_requested:
                break
        hooks("end", None)

    def _fed_rows(self, rows, mode):
        """The rows a batch of ``rows`` real rows runs as: on the TPU the global batch, every core's batch of
        ``params["batch_size"]`` rows (the graph's static shape), padded; on the CPU its own rows, as
        TensorFlow's graph runs a partial last batch there."""
        if not self._on_tpu(mode):
            return rows
        global_batch, per_core = self._global_batch(mode), self._batch_size_param(mode)
        if rows % per_core and mode == ModeKeys.EVAL and not self._warned_partial_core:
            self._warned_partial_core = True
            logger.warning(
                "An evaluation batch of %d rows fills %d cores' batches of %d and %d rows of one more, padded with "
                "%d copies of its first row; that core's loss includes them (a TPU runs whole batches only: "
                "TensorFlow's input_fn uses drop_remainder=True). Evaluate a multiple of params['batch_size'] "
                "rows for an exact loss; metric tensors are exact either way.", rows, rows // per_core, per_core,
                rows % per_core, per_core - rows % per_core)
        return global_batch

    def evaluate(self, input_fn, steps=None, hooks=None, checkpoint_path=None, name=None):
        """Evaluate a checkpoint on ``steps`` global batches (all of the data if None).

        ``checkpoint_path``: a checkpoint file or model directory (default:
        the newest checkpoint in ``model_dir``). ``name`` names the
        evaluation (e.g. ``"training_data"``): its results are kept in
        ``model_dir/eval_<name>/results.json`` (``model_dir/eval`` without a
        name), by global step. Returns ``{"loss": ..., <metrics>...,
        "global_step": ...}``.
        """
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps <= 0):
            raise ValueError(f"Must specify steps > 0, given: {steps}")
        found = self._checkpoint(checkpoint_path)
        if found is None:
            raise ValueError(f"Could not find trained model in model_dir: {self.model_dir} (train first).")
        loops = self._inference(ModeKeys.EVAL, input_fn, steps, found, hooks)
        spec, global_step = next(loops)
        batches = [batch for loop in loops for batch in loop]
        outputs = {key: np.concatenate([batch[key] for batch in batches]) for key in batches[0]}
        # As TensorFlow's metrics.mean(loss): each evaluation step's loss counts once (its cores' mean, each core
        # weighed by its real rows; TensorFlow's TPUEstimator takes core 0's).
        results = {"loss": float(np.mean([np.mean(batch["loss"]) for batch in batches]))}
        if spec.eval_metrics is not None:
            metric_fn, tensors = spec.eval_metrics
            if isinstance(tensors, dict):
                values = metric_fn(**{key: outputs[f"metric/{key}"] for key in tensors})
            else:
                values = metric_fn(*[outputs[f"metric/{i}"] for i in range(len(tensors))])
            for metric, value in values.items():
                value = value.result() if isinstance(value, keras.metrics.Metric) else value
                results[metric] = float(np.asarray(value))
        results["global_step"] = global_step
        logger.info("Saving dict for global step %d: %s", global_step,
                    ", ".join(f"{k} = {v:.6g}" for k, v in results.items()))
        self._keep_eval_results(name, results)
        return results

    def eval_dir(self, name=None):
        """Where the results of evaluation ``name`` are kept (TensorFlow's ``Estimator.eval_dir``)."""
        return os.path.join(self.model_dir, "eval" if not name else f"eval_{name}")

    def _keep_eval_results(self, name, results):
        from keras_tpu import _files

        path = os.path.join(self.eval_dir(name), "results.json")
        try:
            with open(path) as f:
                kept = json.load(f)
        except (OSError, ValueError):
            kept = {}
        kept[str(results["global_step"])] = results
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _files.write_file(path, lambda f: json.dump(kept, f, indent=1), "w")

    def predict(self, input_fn, predict_keys=None, hooks=None, checkpoint_path=None, yield_single_examples=True):
        """Yield predictions as each device call completes (a lazy generator, as TensorFlow's).

        One dict per example (padding removed, the partial last batch
        included), or with ``yield_single_examples=False`` one dict of batch
        arrays per global batch; non-dict ``predictions`` yield arrays.
        ``predict_keys`` (a key or list of keys) keeps only those predictions.
        ``checkpoint_path``: a checkpoint file or model directory (default:
        the newest checkpoint in ``model_dir``; with none, the model predicts
        from its initial or warm-started weights, as TensorFlow does). Endless
        inputs work: at most ``iterations_per_loop`` global batches are taken
        ahead of what has been yielded.
        """
        found = self._checkpoint(checkpoint_path)
        if found is None:
            logger.info("Could not find trained model in model_dir: %s, running initialization to predict.",
                        self.model_dir)
        loops = self._inference(ModeKeys.PREDICT, input_fn, None, found, hooks)
        spec, _ = next(loops)
        single = not isinstance(spec.predictions, dict)
        if predict_keys:
            if single:
                raise ValueError("predict_keys argument is not valid in case of non-dict predictions.")
            keys = [predict_keys] if isinstance(predict_keys, str) else list(predict_keys)
            if not set(keys) & set(spec.predictions):
                raise ValueError(f"Expected to run at least one output from {list(spec.predictions)}, provided "
                                 f"{keys}.")
            keys = [key for key in spec.predictions if key in keys]
        for loop in loops:
            for batch in loop:
                if single:
                    value = batch["predictions"]
                    if yield_single_examples:
                        yield from value
                    else:
                        yield value
                    continue
                if predict_keys:
                    batch = {key: batch[key] for key in keys}
                if not yield_single_examples:
                    yield batch
                    continue
                lengths = {len(value) for value in batch.values()}
                if len(lengths) != 1:
                    raise ValueError(f"Batch length of predictions should be same. Lengths: "
                                     f"{ {key: len(value) for key, value in batch.items()} }.")
                for i in range(lengths.pop()):
                    yield {key: value[i] for key, value in batch.items()}


def _is_iterable_source(value):
    return isinstance(value, keras.utils.PyDataset) or inspect.isgenerator(value)
