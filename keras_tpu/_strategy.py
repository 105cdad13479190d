"""``TPUStrategy``: TensorFlow 2's way of putting Keras models on a TPU.

.. code-block:: python

    strategy = keras_tpu.TPUStrategy(keras_tpu.TPUClusterResolver())
    with strategy.scope():
        model = keras.Sequential([...])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=1024)          # runs on the simulated TPU

A model **created** under ``strategy.scope()`` trains, evaluates and predicts
on the TPU through its own ``fit``/``evaluate``/``predict`` (called inside or
outside the scope), with the same replicated programs as
:func:`keras_tpu.keras_to_tpu_model` (:mod:`keras_tpu._replicated_steps`). Its
variables are the TPU's weights: they live on the cores after training, and
Keras' own ``get_weights``/``save_weights`` read them from there. Models
created outside any scope are untouched CPU models.

For custom training loops, :meth:`TPUStrategy.run` runs a function once per
replica (core) on its shard of the data, :meth:`TPUStrategy.reduce` combines
the per-replica results, and :meth:`TPUStrategy.experimental_distribute_dataset`
splits global batches into per-replica shards.

Scopes do not nest, and a model must be created and compiled under the same
strategy's scope; both mistakes raise a clear error, as in TensorFlow.

The rest of TensorFlow 2's ``tf.distribute.TPUStrategy`` surface is here too,
with TensorFlow's meaning on the simulated cores:
:meth:`TPUStrategy.distribute_datasets_from_function` (``dataset_fn`` gets an
:class:`InputContext` and returns per-replica batches),
:meth:`TPUStrategy.experimental_distribute_values_from_function`,
:meth:`TPUStrategy.gather`, :meth:`TPUStrategy.experimental_local_results`,
:attr:`TPUStrategy.extended` (a :class:`TPUExtended`) and
:attr:`TPUStrategy.cluster_resolver`. Model parallelism (more than one core
per replica) is not simulated: a device assignment may choose fewer replicas,
one core each, and the logical-device helpers accept logical device 0 only.
"""

import contextlib
import enum
import itertools
import math
import threading
import types
import weakref

import jax
import jax.numpy as jnp
from jax import lax
import keras
import numpy as np
from keras import tree

from keras_tpu import _hbm as hbm, _host as host, _keras_private, _pod as pod, _rewrite as rewrite
from keras_tpu._cores import CORE_AXIS
from keras_tpu._custom_steps import gradients_summed_over_cores
from keras_tpu._per_replica import (DistributedDataset, InputReplicationMode, PerReplica, batches_in,
                                    has_per_replica, is_per_replica, reduce_over_replicas, replica_row_counts,
                                    split_rows, stack)
from keras_tpu._logging import logger
from keras_tpu._placement import Placement, installed_on
from keras_tpu._programs import compiling_in_background
from keras_tpu.mxu import _kernels as kernels

_active = threading.local()


class ReduceOp(enum.Enum):
    SUM = "SUM"
    MEAN = "MEAN"


class InputContext:
    """What ``distribute_datasets_from_function`` gives ``dataset_fn`` (``tf.distribute.InputContext``).

    Example:
        >>> context = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=8)
        >>> context.get_per_replica_batch_size(1024)
        128
    """

    def __init__(self, num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1):
        self._num_input_pipelines = int(num_input_pipelines)
        self._input_pipeline_id = int(input_pipeline_id)
        self._num_replicas_in_sync = int(num_replicas_in_sync)

    @property
    def num_input_pipelines(self):
        """How many input pipelines (``dataset_fn`` calls) there are: one per worker."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self):
        """This pipeline's index, in ``[0, num_input_pipelines)``: shard the data with it."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self):
        """How many replicas (cores) train in sync."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size):
        """``global_batch_size // num_replicas_in_sync``; an error if it does not divide evenly."""
        if global_batch_size % self._num_replicas_in_sync:
            raise ValueError(f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                             f"`num_replicas_in_sync` {self._num_replicas_in_sync!r}")
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self):
        return (f"InputContext(num_input_pipelines={self._num_input_pipelines}, input_pipeline_id="
                f"{self._input_pipeline_id}, num_replicas_in_sync={self._num_replicas_in_sync})")


class ValueContext:
    """What ``experimental_distribute_values_from_function`` gives ``value_fn`` (``tf.distribute.ValueContext``).

    Example:
        >>> values = TPUStrategy().experimental_distribute_values_from_function(
        ...     lambda context: context.replica_id_in_sync_group * 10.0)
        >>> [float(v) for v in values.values]
        [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0]
    """

    def __init__(self, replica_id_in_sync_group=0, num_replicas_in_sync=1):
        self._replica_id_in_sync_group = int(replica_id_in_sync_group)
        self._num_replicas_in_sync = int(num_replicas_in_sync)

    @property
    def replica_id_in_sync_group(self):
        """The replica (core) ``value_fn`` is called for, from 0."""
        return self._replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self):
        """How many replicas (cores) train in sync."""
        return self._num_replicas_in_sync

    def __repr__(self):
        return (f"ValueContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self._num_replicas_in_sync})")


class DeviceAssignment:
    """Which cores a :class:`TPUStrategy` uses (``tf.tpu.experimental.DeviceAssignment``, data parallel only).

    ``DeviceAssignment.build(topology, num_replicas=n)`` uses the first ``n``
    cores, one replica each. A ``computation_shape`` of more than one core
    (model parallelism) can be built, as in TensorFlow, but ``TPUStrategy``
    refuses it: the simulated cores each hold the whole model.

    Example:
        >>> assignment = DeviceAssignment.build(None, num_replicas=2)
        >>> assignment.num_replicas, assignment.num_cores_per_replica
        (2, 1)
    """

    def __init__(self, topology, num_replicas, num_cores_per_replica=1):
        self.topology = topology
        self.num_replicas = int(num_replicas)
        self.num_cores_per_replica = int(num_cores_per_replica)

    @classmethod
    def build(cls, topology, computation_shape=None, computation_stride=None, num_replicas=1):
        """TensorFlow's ``DeviceAssignment.build``: ``num_replicas`` replicas of ``prod(computation_shape)``
        cores each (``computation_stride`` is accepted: the simulated cores have no physical layout)."""
        cores_per_replica = int(np.prod(computation_shape)) if computation_shape is not None else 1
        if num_replicas < 1 or cores_per_replica < 1:
            raise ValueError(f"num_replicas and the computation shape must be positive; got num_replicas="
                             f"{num_replicas}, computation_shape={computation_shape}.")
        total = getattr(topology, "num_cores", None)
        if total is not None and num_replicas * cores_per_replica > total:
            raise ValueError(f"{num_replicas} replicas of {cores_per_replica} core(s) do not fit on the "
                             f"{total} cores of the TPU.")
        return cls(topology, num_replicas, cores_per_replica)

    def __repr__(self):
        return f"DeviceAssignment(num_replicas={self.num_replicas}, num_cores_per_replica={self.num_cores_per_replica})"


class TPUExtended:
    """``strategy.extended`` (TensorFlow's ``TPUExtended``, a ``tf.distribute.StrategyExtended``).

    Example:
        >>> extended = TPUStrategy().extended
        >>> extended.num_hosts, extended.num_replicas_per_host, extended.worker_devices[1]
        (1, 8, '/job:worker/replica:0/task:0/device:TPU:1')
    """

    #: As TensorFlow's TPU strategy: a distributed dataset's partial last step gives the replicas without data
    #: batches of no rows.
    experimental_enable_get_next_as_optional = True
    #: As TensorFlow's TPU strategy: ``run`` runs each replica at its own rows (see ``_per_replica``).
    experimental_enable_dynamic_batch_size = True

    def __init__(self, strategy):
        self._strategy = strategy

    @property
    def steps_per_run(self):
        """Steps per device call for the strategy's Keras models (its ``steps_per_execution``)."""
        return self._strategy.steps_per_execution

    @property
    def num_replicas_in_sync(self):
        return self._strategy.num_replicas_in_sync

    @property
    def num_replicas_per_host(self):
        topology = self._strategy.topology
        return min(self._strategy.num_replicas_in_sync, topology.cores_per_worker)

    @property
    def num_hosts(self):
        return math.ceil(self._strategy.num_replicas_in_sync / self.num_replicas_per_host)

    @property
    def worker_devices(self):
        """The replicas' devices, TensorFlow's names: ``/job:worker/replica:0/task:<host>/device:TPU:<core>``."""
        job = self._strategy.cluster_resolver.job_name
        per_host = self.num_replicas_per_host
        return tuple(f"/job:{job}/replica:0/task:{core // per_host}/device:TPU:{core}"
                     for core in range(self._strategy.num_replicas_in_sync))

    @property
    def parameter_devices(self):
        """Where the variables live: on every replica's core (mirrored), as ``worker_devices``."""
        return self.worker_devices

    @property
    def experimental_require_static_shapes(self):
        return True

    @property
    def experimental_between_graph(self):
        return False

    @property
    def experimental_should_init(self):
        return True

    @property
    def should_checkpoint(self):
        """Whether this worker writes checkpoints: the first worker of a pod (every worker holds the weights)."""
        return pod.is_chief()

    @property
    def should_save_summary(self):
        return pod.is_chief()

    def reduce_to(self, reduce_op, value, destinations, options=None):
        """``strategy.reduce(reduce_op, value)``, the result on the host (``destinations`` and ``options``
        have no effect: there is one host memory)."""
        return self._strategy.reduce(reduce_op, value, axis=None)

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        """:meth:`reduce_to` of each ``(value, destinations)`` pair, as a list."""
        return [self.reduce_to(reduce_op, value, destinations, options) for value, destinations in
                value_destination_pairs]

    def update(self, var, fn, args=(), kwargs=None, group=True):
        """Run ``fn(var, *args, **kwargs)`` once: a variable of this strategy is one copy that every core
        reads, so updating it updates every replica. Returns ``fn``'s result."""
        return fn(var, *args, **(kwargs or {}))

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable):
        """A context manager with no effect: every variable of the strategy is on every core already."""
        yield

    @contextlib.contextmanager
    def experimental_logical_device(self, logical_device_id):
        """Ops inside run on logical device ``logical_device_id``, which must be 0 (one core per replica)."""
        self._strategy._check_logical_device(logical_device_id)
        yield

    def value_container(self, value):
        """The container of ``value``: the value itself (variables are not split into per-replica copies)."""
        return value

    def read_var(self, var):
        """The value of variable ``var`` (a Keras variable of this strategy), as TensorFlow's ``read_var``.

        Example:
            >>> float(TPUStrategy().extended.read_var(jnp.float32(2.0)))
            2.0
        """
        return var.value if hasattr(var, "value") else var

    def non_slot_devices(self, var_list):
        """Where non-slot variables live: the host of the first core (``/job:worker/replica:0/task:0/device:CPU:0``)."""
        return f"/job:{self._strategy.cluster_resolver.job_name}/replica:0/task:0/device:CPU:0"

    def update_non_slot(self, colocate_with, fn, args=(), kwargs=None, group=True):
        """Run ``fn(*args, **kwargs)`` once on the host (``colocate_with`` has no effect: one host memory)."""
        result = fn(*args, **(kwargs or {}))
        return result if group else (result,)

    def broadcast_to(self, tensor, destinations):
        """``tensor`` itself: every core reads the same host value (``destinations`` has no effect)."""
        return tensor

    def call_for_each_replica(self, fn, args=(), kwargs=None):
        """TensorFlow 1's name of :meth:`TPUStrategy.run` on the extended object."""
        return self._strategy.run(fn, args=args, kwargs=kwargs)

    def experimental_run_steps_on_iterator(self, fn, iterator, iterations=1, initial_loop_values=None):
        """Refused: TensorFlow 1's graph-mode step loop (``fn(ctx, inputs)`` with a ``MultiStepContext``) has no
        counterpart without graphs."""
        raise NotImplementedError(
            "extended.experimental_run_steps_on_iterator (TensorFlow 1's graph-mode loop) is not supported: call "
            "strategy.run(step_fn, args=(batch,)) for each batch of strategy.experimental_distribute_dataset(...) "
            "instead.")

    def experimental_make_numpy_dataset(self, numpy_input, session=None):
        """Refused: there is no ``tf.data``; :meth:`TPUStrategy.experimental_distribute_dataset` takes batches of
        NumPy arrays directly."""
        self._strategy.experimental_make_numpy_dataset(numpy_input, session)

    def variable_created_in_scope(self, v):
        """Whether variable ``v`` belongs to a model created under this strategy's scope."""
        return any(v is variable for model in list(self._strategy._models) for variable in model.variables)

    def __repr__(self):
        return f"TPUExtended({self._strategy!r})"


class TPUStrategy:
    """Data-parallel training on the simulated TPU, like ``tf.distribute.TPUStrategy``.

    Args:
        tpu_cluster_resolver: a :class:`TPUClusterResolver` (default: the local v2-8).
        experimental_device_assignment: ``None`` (every core is a replica) or a
            :class:`DeviceAssignment` of one core per replica: the strategy
            then uses its first ``num_replicas`` cores. More cores per replica
            (model parallelism) is refused.
        experimental_spmd_xla_partitioning: accepted; without model parallelism
            there is nothing to partition (as in TensorFlow,
            :meth:`experimental_assign_to_logical_device` then raises).
        device_assignment: the name of ``experimental_device_assignment`` in
            TensorFlow 1.15 to 2.2 (``tf.distribute.experimental.TPUStrategy``).
        steps_per_run: TensorFlow 1.15's name of ``steps_per_execution``.
        steps_per_execution: steps per device call for models of this
            strategy that do not set ``steps_per_execution`` in ``compile``.
        precision: MXU precision (``"default"``, ``"high"``, ``"highest"``).

    Example:
        >>> strategy = TPUStrategy()
        >>> strategy.num_replicas_in_sync
        8
    """

    def __init__(self, tpu_cluster_resolver=None, experimental_device_assignment=None,
                 experimental_spmd_xla_partitioning=False, *, device_assignment=None, steps_per_run=None,
                 steps_per_execution=1, precision="default"):
        if device_assignment is not None and experimental_device_assignment is not None:
            raise ValueError("Pass experimental_device_assignment or its older name device_assignment, not both.")
        assignment = experimental_device_assignment if device_assignment is None else device_assignment
        if steps_per_run is not None:
            if steps_per_execution not in (1, steps_per_run):
                raise ValueError(f"steps_per_run={steps_per_run} is TensorFlow 1's name of steps_per_execution="
                                 f"{steps_per_execution}; pass only one of them.")
            steps_per_execution = steps_per_run
        self.placement = Placement(tpu_cluster_resolver, precision, num_cores=self._cores_of(assignment),
                                   steps_per_execution=steps_per_execution, owner="TPUStrategy")
        self._device_assignment = assignment
        self._spmd = bool(experimental_spmd_xla_partitioning)
        self._models = weakref.WeakSet()
        self._run_programs = {}
        self._extended = TPUExtended(self)

    @staticmethod
    def _cores_of(assignment):
        if assignment is None:
            return None
        replicas = getattr(assignment, "num_replicas", None)
        per_replica = getattr(assignment, "num_cores_per_replica", None)
        if replicas is None or per_replica is None:
            raise TypeError(f"experimental_device_assignment must be a keras_tpu.DeviceAssignment (or None); got "
                            f"{type(assignment).__name__}.")
        if per_replica != 1:
            raise ValueError(
                f"A device assignment of {per_replica} cores per replica is model parallelism, which keras_tpu "
                f"does not simulate: every core holds the whole model. Use experimental_device_assignment=None "
                f"(data parallel on all cores) or DeviceAssignment.build(topology, num_replicas=n) (the first n "
                f"cores, one replica each).")
        return replicas

    @property
    def resolver(self):
        """The :class:`TPUClusterResolver` of the TPU this strategy runs on."""
        return self.placement.resolver

    @property
    def cluster_resolver(self):
        """The :class:`TPUClusterResolver` of this strategy (the one given, or the default local one)."""
        return self.placement.resolver

    @property
    def extended(self):
        """The :class:`TPUExtended` of this strategy (``steps_per_run``, ``worker_devices``, ``reduce_to``, ...)."""
        return self._extended

    @property
    def topology(self):
        """The :class:`Topology` :func:`initialize_tpu_system` found."""
        return self.placement.topology

    @property
    def layout(self):
        """The :class:`CoreLayout`: where the cores live on this host."""
        return self.placement.layout

    @property
    def precision(self):
        """The MXU's precision for float32 products (``"default"``: one bf16 pass)."""
        return self.placement.precision

    @property
    def steps_per_execution(self):
        """Steps each compiled program runs per call (Keras' ``steps_per_execution``)."""
        return self.placement.steps_per_execution

    @property
    def num_replicas_in_sync(self):
        """The number of replicas (cores) in sync, over which a global batch is split: 8 on a v2-8."""
        return self.layout.num_cores

    @property
    def steps_per_run(self):
        """TensorFlow 1's ``TPUStrategy.steps_per_run``: the strategy's ``steps_per_execution``."""
        return self.placement.steps_per_execution

    # -- the scope ---------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self):
        """Models created (and compiled) inside run on this TPU."""
        current = getattr(_active, "strategy", None)
        if current is not None:
            raise RuntimeError(
                "A TPUStrategy scope is already active" + (" (this strategy's)" if current is self else "")
                + ": strategy scopes do not nest. Leave the first `with strategy.scope():` block first."
            )
        _active.strategy = self
        try:
            with _keras_private.watch_models(self._adopt, self._check_compiled):
                yield self
        finally:
            _active.strategy = None

    def _adopt(self, model):
        if getattr(_active, "strategy", None) is not self:
            return  # created in another thread, outside this thread's scope
        if installed_on(model) is not None:
            return  # already on a TPU (e.g. a model nested in another)
        self.placement.install(model)
        self._models.add(model)

    def _check_compiled(self, model):
        if getattr(_active, "strategy", None) is not self:
            return
        installed = installed_on(model)
        owner = None if installed is None else installed.placement
        if owner is None:
            raise ValueError(
                f"Model {model.name!r} was created outside `strategy.scope()` but compiled inside it. Create "
                f"the model inside the scope too (as with TensorFlow's TPUStrategy), or outside both to keep it "
                f"on the CPU."
            )
        if owner is not self.placement:
            raise ValueError(f"Model {model.name!r} belongs to another TPUStrategy; compile it under that "
                             f"strategy's scope.")

    # -- custom training loops -----------------------------------------------------------

    def experimental_distribute_dataset(self, dataset, options=None):
        """Split each global batch of ``dataset`` (an iterable of arrays, tuples or dicts) into
        per-replica shards: a :class:`DistributedDataset` of ``PerReplica`` batches.

        As TensorFlow splits them: the first batch's row count is the dataset's
        global batch size, and a batch of that size splits as evenly as it can
        (100 rows over 8 replicas: 13 rows on the first four, 12 on the rest).
        A partial last batch fills the replicas in order and leaves the rest
        none (44 rows where batches have 64: five replicas of 8, one of 4, two
        of 0): a ragged ``PerReplica`` (:mod:`keras_tpu._per_replica`), which
        :meth:`run` runs at each replica's own rows, as a TPU with
        TensorFlow's dynamic batch sizes does. ``options``
        (TensorFlow's ``tf.distribute.InputOptions``: prefetching and
        placement of the input) has no effect here.

        Example:
            >>> batches = [np.ones((16, 3))] * 2 + [np.ones((12, 3))]
            >>> [b.rows for b in TPUStrategy().experimental_distribute_dataset(batches)]
            [None, None, (2, 2, 2, 2, 2, 2, 0, 0)]
        """
        if getattr(options, "experimental_replication_mode", None) == InputReplicationMode.PER_REPLICA:
            raise ValueError("InputReplicationMode.PER_REPLICA is only supported in distribute_datasets_from_function "
                             "(as in TensorFlow): there dataset_fn is called once per replica.")
        replicas = self.num_replicas_in_sync
        one_shot = iter(dataset) is dataset  # a generator: its first pass consumes it (a tf.data dataset repeats)
        passes = []

        def shard(batch, number, global_batch_size):
            leaves = tree.flatten(batch)
            rows = {np.shape(a)[0] if np.ndim(a) else None for a in leaves}
            if len(rows) != 1 or None in rows:
                raise ValueError(
                    f"Global batch {number} of the dataset must be arrays with one number of rows (the batch's "
                    f"first axis) to split over {replicas} replicas; got shapes "
                    f"{[tuple(np.shape(a)) for a in leaves]}.")
            (rows,) = rows
            counts = replica_row_counts(rows, global_batch_size or rows, replicas)
            return split_rows(tree.map_structure(np.asarray, batch), counts), global_batch_size or rows

        batch_size = []  # the dataset's first batch's rows, as TensorFlow reads a dataset's batch size

        def batches():
            passes.append(0)
            for number, batch in enumerate(dataset, 1):
                passes[-1] = number
                value, global_batch_size = shard(batch, number, batch_size[0] if batch_size else None)
                batch_size[:] = [global_batch_size]
                yield value
            if one_shot and len(passes) > 1 and not passes[-1]:
                logger.warning(
                    "The dataset given to experimental_distribute_dataset is a one-shot iterator (a Python "
                    "generator) that an earlier pass consumed: this pass has no batches. Pass a list of batches, "
                    "or distribute a new generator for each epoch.")

        return DistributedDataset(batches, f"global batches split over {replicas} replicas", one_shot=one_shot,
                                  strategy=self, count_elements=lambda: batches_in(dataset))

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Per-replica batches from ``dataset_fn(input_context)``, as TensorFlow's.

        ``dataset_fn`` gets an :class:`InputContext` (``num_input_pipelines``,
        ``input_pipeline_id``, ``num_replicas_in_sync``,
        ``get_per_replica_batch_size(global_batch_size)``) and returns an
        iterable of batches that are already **per replica** (arrays, tuples
        or dicts). Each step takes one batch per replica of the pipeline's
        worker, in order, and gives them to the replicas as a ``PerReplica``.
        There is one input pipeline per worker; in a pod every process builds
        all pipelines (they hold the same data everywhere), so ``dataset_fn``
        is called once per worker in each process. Per-replica batches of
        different sizes (a partial last batch) make a ragged ``PerReplica``,
        and where a dataset ends in the middle of a step its replicas get
        batches of no rows, as TensorFlow's dummy batches; :meth:`run` runs
        each replica at its own rows. ``options`` (an :class:`InputOptions`):
        ``experimental_replication_mode=InputReplicationMode.PER_REPLICA``
        calls ``dataset_fn`` once per replica (its ``input_pipeline_id``),
        each dataset giving that replica's batches; the other options have no
        effect here.

        Example:
            >>> strategy = TPUStrategy()
            >>> def dataset_fn(context):
            ...     rows = context.get_per_replica_batch_size(32)
            ...     return [np.full((rows, 2), i, dtype=np.float32) for i in range(16)]
            >>> steps = list(strategy.distribute_datasets_from_function(dataset_fn))
            >>> len(steps), steps[1].values[0].shape, float(steps[1].values[0][0, 0])
            (2, (4, 2), 8.0)
        """
        replicas = self.num_replicas_in_sync
        per_replica = getattr(options, "experimental_replication_mode", None) == InputReplicationMode.PER_REPLICA
        pipelines = replicas if per_replica else self.extended.num_hosts
        per_pipeline = replicas // pipelines
        datasets = [dataset_fn(InputContext(pipelines, i, replicas)) for i in range(pipelines)]

        def steps():
            iterators = [iter(d) for d in datasets]
            while True:
                per_pipeline_parts = [list(itertools.islice(iterator, per_pipeline)) for iterator in iterators]
                real = [part for parts in per_pipeline_parts for part in parts]
                if not real:
                    return
                # A replica whose pipeline has run out gets a batch of no rows, as TensorFlow's dummy batches.
                empty = tree.map_structure(lambda a: np.zeros((0,) + np.shape(a)[1:], np.asarray(a).dtype)
                                           if np.ndim(a) else np.asarray(a), real[0])
                yield stack([part for parts in per_pipeline_parts
                             for part in parts + [empty] * (per_pipeline - len(parts))],
                            "The per-replica batches of dataset_fn")

        def count_steps():  # (a step takes per_pipeline batches of each pipeline, until the longest ends)
            counts = [batches_in(d) for d in datasets]
            return None if None in counts else max(-(-count // per_pipeline) for count in counts)

        return DistributedDataset(steps, f"per-replica batches of {getattr(dataset_fn, '__name__', 'dataset_fn')}",
                                  one_shot=any(iter(d) is d for d in datasets), strategy=self,
                                  count_elements=count_steps)

    def experimental_distribute_datasets_from_function(self, dataset_fn, options=None):
        """TensorFlow 2.0-2.3's name of :meth:`distribute_datasets_from_function` (deprecated there since 2.4)."""
        return self.distribute_datasets_from_function(dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn):
        """A ``PerReplica`` of ``value_fn(value_context)`` for each replica; ``value_context`` is a
        :class:`ValueContext` (``replica_id_in_sync_group``, ``num_replicas_in_sync``).

        Example:
            >>> strategy = TPUStrategy()
            >>> values = strategy.experimental_distribute_values_from_function(
            ...     lambda context: context.replica_id_in_sync_group * 10)
            >>> [int(v) for v in strategy.experimental_local_results(values)][:3]
            [0, 10, 20]
        """
        replicas = self.num_replicas_in_sync
        values = [value_fn(ValueContext(i, replicas)) for i in range(replicas)]
        values = [np.asarray(v) if isinstance(v, list) else v for v in values]  # a list is a tensor, as in TF
        return stack(values, "The values of value_fn")

    def run(self, fn, args=(), kwargs=None, options=None):
        """Run ``fn`` once per replica: ``PerReplica`` arguments give each replica its part,
        other array arguments are given whole to every replica. Returns ``fn``'s output
        structure with a ``PerReplica`` at each leaf.

        Matrix products in ``fn`` run on the MXU. Each function is compiled once
        per argument shapes; one defined anew on every step (a ``step_fn``
        inside a ported ``@tf.function``) runs the same program while it closes
        over the same objects. Arguments that are not ``PerReplica`` are given
        to every replica whole, so with none ``fn`` runs the same on each.
        A ragged ``PerReplica`` (a partial batch: replicas with fewer rows or
        none) gives each replica its own rows, as TensorFlow's dynamic batch
        sizes do on a TPU (the default of its ``RunOptions``); outputs whose
        rows follow the inputs' come back ragged. ``options`` has no effect.

        Example:
            >>> strategy = TPUStrategy()
            >>> data = next(iter(strategy.experimental_distribute_dataset([np.ones((16, 3))])))
            >>> sums = strategy.run(lambda x: x.sum(), args=(data,))
            >>> float(strategy.reduce("SUM", sums))
            48.0
        """
        kwargs = kwargs or {}
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_per_replica)
        kinds = tuple("replica" if isinstance(x, PerReplica) else
                      "array" if isinstance(x, (jax.Array, np.ndarray)) or np.isscalar(x) and not isinstance(x, str)
                      else "static" for x in leaves)
        static = tuple((i, x) for i, (x, k) in enumerate(zip(leaves, kinds)) if k == "static")
        replicated = [jnp.asarray(x) for x, k in zip(leaves, kinds) if k == "array"]
        per_replica = [x for x, k in zip(leaves, kinds) if k == "replica"]
        sharded = [self._rows_by_replica(x.stacked) for x in per_replica]
        rows = tuple(x.rows for x in per_replica)  # (a ragged argument's row counts: a program per pattern)
        key = (_replica_function_key(fn), treedef, kinds, tuple((i, repr(x)) for i, x in static), rows)
        program = self._run_programs.pop(key, None)
        if program is None:
            with host.collection_paused():  # (it traces fn: see host.collection_paused)
                program = _RunProgram(self, fn, treedef, kinds, dict(static), replicated, sharded, rows)
        self._run_programs[key] = program  # most recently used last
        while len(self._run_programs) > 64:
            self._run_programs.pop(next(iter(self._run_programs)))
        return program(replicated, sharded)

    def _rows_by_replica(self, stacked):
        return jax.tree.map(lambda a: jax.device_put(jnp.asarray(a), self.layout.batch_sharding()), stacked)

    def reduce(self, reduce_op, value, axis=None):
        """Combine a per-replica value: ``"SUM"`` or ``"MEAN"`` over replicas (and over ``axis``
        of each replica's value, if given). A plain value is the same on every replica; as in
        TensorFlow, it cannot be summed with ``axis=None`` (except 0).

        Example:
            >>> TPUStrategy().reduce("MEAN", PerReplica(np.arange(8.0)))
            Array(3.5, dtype=float32)
        """
        op = ReduceOp(reduce_op.upper() if isinstance(reduce_op, str) else reduce_op.value)

        def reduce_leaf(leaf):
            if not isinstance(leaf, PerReplica):  # the same value on every replica
                if axis is None and op is ReduceOp.SUM and not (np.isscalar(leaf) and leaf == 0):
                    # As TensorFlow's reduce_non_distributed_value: it cannot tell what such a sum would mean.
                    raise ValueError(f"A non-DistributedValues value {leaf!r} cannot be reduced with ReduceOp.SUM: "
                                     f"pass what strategy.run returned (a PerReplica), or use MEAN.")
                replicas = self.num_replicas_in_sync
                leaf = PerReplica(jnp.broadcast_to(leaf, (replicas,) + jnp.shape(leaf)))
            return reduce_over_replicas(leaf, op.value, axis)

        return jax.tree.map(reduce_leaf, value, is_leaf=is_per_replica)

    def gather(self, value, axis):
        """Concatenate the replicas' parts of ``value`` along ``axis`` on the host, as TensorFlow's.

        ``value`` is a ``PerReplica`` (or a structure of them); a plain array counts as the same
        value on every replica. Each part must have rank >= 1 and ``0 <= axis < rank``.

        Example:
            >>> strategy = TPUStrategy()
            >>> parts = strategy.experimental_distribute_values_from_function(lambda c: [[c.replica_id_in_sync_group]])
            >>> strategy.gather(parts, axis=0).ravel().tolist()
            [0, 1, 2, 3, 4, 5, 6, 7]
        """
        replicas = self.num_replicas_in_sync

        def concatenate(parts):
            rank = parts[0].ndim
            if rank == 0:
                raise ValueError("gather needs per-replica values of rank >= 1 (a scalar has no axis to "
                                 "concatenate along); use experimental_local_results or reduce for scalars.")
            if not -rank <= axis < rank:
                raise ValueError(f"axis {axis} is out of range for per-replica values of rank {rank}.")
            return jnp.concatenate(parts, axis=axis)

        def gather_leaf(leaf):
            if not isinstance(leaf, PerReplica):  # the same value on every replica
                leaf = PerReplica(jnp.broadcast_to(jnp.asarray(leaf), (replicas,) + jnp.shape(leaf)))
            parts = leaf.values  # (a ragged value's parts with their real rows only)
            return jax.tree.map(lambda *leaves: concatenate([jnp.asarray(a) for a in leaves]), *parts)

        return jax.tree.map(gather_leaf, value, is_leaf=is_per_replica)

    def experimental_local_results(self, value):
        """The per-replica parts of ``value`` as a tuple, one entry per replica of this worker (a 1-tuple
        for a plain value). A structure holding ``PerReplica`` leaves gives one such structure per replica."""
        if isinstance(value, PerReplica):
            return value.values
        if not has_per_replica(value):
            return (value,)
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
        replicas = self.num_replicas_in_sync
        per_leaf = [leaf.values if isinstance(leaf, PerReplica) else (leaf,) * replicas for leaf in leaves]
        return tuple(jax.tree.unflatten(treedef, [parts[i] for parts in per_leaf]) for i in range(replicas))

    def experimental_run_v2(self, fn, args=(), kwargs=None, options=None):
        """TensorFlow 1.15-2.1's name of :meth:`run`."""
        return self.run(fn, args=args, kwargs=kwargs, options=options)

    # -- TensorFlow 1.15's StrategyV1 methods (tf.compat.v1.distribute.experimental.TPUStrategy) ------------

    def unwrap(self, value):
        """TensorFlow 1's name of :meth:`experimental_local_results`."""
        return self.experimental_local_results(value)

    def make_dataset_iterator(self, dataset):
        """TensorFlow 1's iterator over a distributed dataset: ``iter(experimental_distribute_dataset(dataset))``
        (use ``next()`` on it, or pass it to :meth:`experimental_run`).

        Example:
            >>> iterator = TPUStrategy().make_dataset_iterator([np.ones((16, 3))])
            >>> next(iterator).num_replicas
            8
        """
        return iter(self.experimental_distribute_dataset(dataset))

    def experimental_run(self, fn, input_iterator=None):
        """TensorFlow 1's ``experimental_run``: :meth:`run` ``fn`` on the next per-replica batch of
        ``input_iterator`` (an iterator from :meth:`make_dataset_iterator`), or with no arguments."""
        args = () if input_iterator is None else (next(input_iterator),)
        return self.run(fn, args=args)

    def make_input_fn_iterator(self, input_fn, replication_mode=None):
        """Refused: TensorFlow 1's ``input_fn`` returns a ``tf.data`` pipeline per worker. Use
        :meth:`distribute_datasets_from_function`, whose ``dataset_fn`` gets the same :class:`InputContext`."""
        raise NotImplementedError(
            "make_input_fn_iterator (TensorFlow 1, tf.data input pipelines) is not supported: use "
            "iter(strategy.distribute_datasets_from_function(dataset_fn)), where dataset_fn(input_context) returns "
            "per-replica batches.")

    def experimental_make_numpy_dataset(self, numpy_input, session=None):
        """Refused: there is no ``tf.data``; :meth:`experimental_distribute_dataset` takes NumPy batches."""
        raise NotImplementedError(
            "experimental_make_numpy_dataset (a tf.data dataset) is not supported: pass a list or generator of "
            "NumPy global batches to strategy.experimental_distribute_dataset(...) instead.")

    def update_config_proto(self, config_proto):
        """``config_proto`` unchanged: there is no TensorFlow session to configure (no effect)."""
        return config_proto

    # -- logical devices (model parallelism: one logical device per replica here) ----------------

    def _check_logical_device(self, logical_device_id):
        if self._spmd:
            raise ValueError("experimental_assign_to_logical_device is not allowed with "
                             "experimental_spmd_xla_partitioning=True (as in TensorFlow); use "
                             "experimental_split_to_logical_devices or experimental_replicate_to_logical_devices.")
        if logical_device_id != 0:
            raise ValueError(f"logical_device_id {logical_device_id} is out of range: each replica has one logical "
                             f"device (0) here, as keras_tpu does not simulate model parallelism. Use 0, or leave "
                             f"the tensor unannotated.")

    def experimental_assign_to_logical_device(self, tensor, logical_device_id):
        """``tensor`` itself, on logical device ``logical_device_id`` (which must be 0: one core per replica)."""
        self._check_logical_device(logical_device_id)
        return tensor

    def experimental_split_to_logical_devices(self, tensor, partition_dimensions):
        """``tensor`` itself: with one logical device per replica, ``partition_dimensions`` (one entry per
        dimension of ``tensor``) must multiply to 1."""
        dims = list(partition_dimensions)
        if len(dims) != len(jnp.shape(tensor)):
            raise ValueError(f"partition_dimensions {dims} must have one entry per dimension of the tensor "
                             f"(rank {len(jnp.shape(tensor))}).")
        if int(np.prod(dims)) != 1:
            raise ValueError(f"partition_dimensions {dims} split the tensor over {int(np.prod(dims))} logical "
                             f"devices, but each replica has one here (keras_tpu does not simulate model "
                             f"parallelism). Use all ones, or do not split the tensor.")
        return tensor

    def experimental_replicate_to_logical_devices(self, tensor):
        """``tensor`` itself (every replica's single logical device has all of it)."""
        return tensor

    def __repr__(self):
        return f"TPUStrategy({self.topology.accelerator_type}, replicas={self.num_replicas_in_sync})"


class _RecordingScope(keras.StatelessScope):
    """A ``StatelessScope`` that notes every Keras variable read or assigned inside it."""

    def __init__(self):
        # Variables created inside (an optimizer's slots on its first apply) are initialised after the
        # abstract trace, not inside it (their values would be tracers).
        super().__init__(initialize_variables=False)
        self.read, self.written = {}, {}

    def get_current_value(self, variable):
        self.read.setdefault(id(variable), variable)
        return super().get_current_value(variable)

    def add_update(self, update):
        self.written.setdefault(id(update[0]), update[0])
        super().add_update(update)


def _is_moving_statistic(variable):
    """Whether :func:`_combine_over_cores` averages ``variable`` over the cores that set it apart."""
    return (getattr(variable, "aggregation", "none") == "none" and not variable.trainable
            and jnp.issubdtype(variable.dtype, jnp.floating))


def _combine_over_cores(variable, old, per_core):
    """A variable's value after every core assigned its own: by the variable's Keras aggregation.

    A non-trainable float variable that the cores set apart (BatchNormalization's
    moving statistics, which Keras 3 aggregates as "none") is averaged, as
    TensorFlow reads its variables synchronised on read (``MEAN``); where the
    cores agree (an optimizer's slots, computed from the all-reduced gradients)
    it stays the cores' value exactly.
    """
    aggregation = getattr(variable, "aggregation", "none")
    if aggregation == "sum":  # metric states: each core's increment counts
        return old + jnp.sum(per_core - old, axis=0).astype(old.dtype)
    if aggregation == "mean":
        return jnp.mean(per_core, axis=0).astype(old.dtype)
    if _is_moving_statistic(variable):
        agree = jnp.all(per_core == per_core[0], axis=0)
        return jnp.where(agree, per_core[0], jnp.mean(per_core, axis=0).astype(old.dtype))
    return per_core[0]  # weights and counters: the same on every core


def _function_name(fn):
    """What a replica function is called, for messages: ``train_step``, or its class's name."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def _replica_function_key(fn):
    """What a replica function's compiled program is kept under: the function, or for a plain Python function
    its code and the objects it closes over and defaults to.

    TensorFlow's guides define ``step_fn`` inside a step function that ``@tf.function`` traces once; ported,
    that step function runs on every step and defines a new ``step_fn`` each time. One that reads the same
    objects (the model, the optimizer, the metrics) computes what the first did, so it runs the same program
    instead of compiling a new one per step. A program holds its first function, which keeps those objects
    (and so their ids) alive while the program is kept.
    """
    if not isinstance(fn, types.FunctionType):
        return fn  # bound methods compare by their function and object already
    try:
        closed_over = tuple(id(cell.cell_contents) for cell in fn.__closure__ or ())
    except ValueError:  # a cell not yet assigned
        return fn
    defaults = tuple(id(d) for d in fn.__defaults__ or ()) + tuple(
        (name, id(d)) for name, d in sorted((fn.__kwdefaults__ or {}).items()))
    return fn.__code__, id(fn.__globals__), closed_over, defaults


def _signature(*trees):
    """The shapes and dtypes of a program's arguments (what it is compiled for)."""
    return tuple((tuple(jnp.shape(a)), jnp.result_type(a)) for a in jax.tree.leaves(trees))


def _replica_groups(rows, num_replicas):
    """The replicas grouped by their rows: ``[(replica indices, per argument its rows or None)]``, in order of
    each group's first replica. ``rows``: per per-replica argument, each replica's rows, or None (all alike)."""
    groups = {}
    for replica in range(num_replicas):
        groups.setdefault(tuple(None if r is None else r[replica] for r in rows), []).append(replica)
    return [(np.asarray(replicas), group_rows) for group_rows, replicas in groups.items()]


def _replicas_rows(stacked, replicas, rows):
    """The parts of a stacked per-replica argument for some ``replicas`` (indices), cut to their ``rows``."""
    def cut(a):
        contiguous = replicas[-1] - replicas[0] + 1 == len(replicas)
        a = a[replicas[0]:replicas[-1] + 1] if contiguous else a[replicas]
        return a if rows is None or a.ndim < 2 else a[:, :rows]
    return jax.tree.map(cut, stacked)


def _join_groups(group_outputs, groups, back_to_replicas, function_name):
    """The replica groups' outputs as one stacked output in replica order, and each leaf's rows per replica
    (None where every replica's part has the same shape). An output whose shape follows the rows (a row's
    prediction) is padded with zeros to the most rows; another difference in shape is an error."""
    treedef = jax.tree.structure(group_outputs[0])
    per_leaf = zip(*[jax.tree.leaves(outputs) for outputs in group_outputs])
    joined, leaf_rows = [], []
    for parts in per_leaf:
        shapes = [part.shape[1:] for part in parts]
        if len(set(shapes)) == 1:
            joined.append(jnp.concatenate(parts)[back_to_replicas])
            leaf_rows.append(None)
            continue
        if len({len(s) for s in shapes}) > 1 or not shapes[0] or len({s[1:] for s in shapes}) > 1:
            raise ValueError(f"The replica function {function_name!r} returned parts of shapes {shapes} on "
                             f"replicas with different numbers of rows; only a part's first axis may follow them.")
        most = max(s[0] for s in shapes)
        padded = [jnp.pad(part, [(0, 0), (0, most - part.shape[1])] + [(0, 0)] * (part.ndim - 2)) for part in parts]
        joined.append(jnp.concatenate(padded)[back_to_replicas])
        by_group = [np.full(len(replicas), part.shape[1]) for part, (replicas, _) in zip(parts, groups)]
        leaf_rows.append(tuple(int(r) for r in np.concatenate(by_group)[back_to_replicas]))
    return jax.tree.unflatten(treedef, joined), leaf_rows


class _RunProgram:
    """One compiled ``strategy.run(fn, ...)``: ``fn`` on every core, with the Keras state it reads and writes.

    TensorFlow's replica functions read and update variables: they call a model,
    update metrics and apply gradients with an optimizer. Here ``fn`` is traced
    once abstractly to find the Keras variables it reads and assigns; their
    values go into the program, each core runs ``fn`` under a ``StatelessScope``
    mapping them (optimizers applying the sum of the cores' gradients, as TensorFlow's do), and the new
    values are written back after the call, combined over the cores by each
    variable's aggregation (metrics summed; weights and slots, identical on every
    core, taken once). Before the program first runs for some argument shapes,
    one core's ``fn`` is checked against a core's HBM, as a TPU's compiler does
    (:meth:`_check_hbm`).
    """

    def __init__(self, strategy, fn, treedef, kinds, static, replicated, sharded, rows):
        self.fn, self.treedef, self.kinds, self.static = fn, treedef, kinds, static
        self.layout, self.accelerator_type = strategy.layout, strategy.placement.accelerator_type
        self._hbm_checked = set()  # the argument shapes whose per-core HBM was checked
        self._called = set()  # the argument shapes the program was called with (traced and compiled)
        abstract = lambda tree_: jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
                                               tree_)
        one_replica = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), abstract(x))
                       for x in sharded]
        recorded = []

        def discover(replicated, sharded):
            with _RecordingScope() as scope:
                self._call_fn(replicated, sharded)
            recorded.append(scope)

        jax.eval_shape(discover, abstract(replicated), one_replica)
        _keras_private.initialize_deferred_variables()
        scope = recorded[0]
        self.variables = list({**scope.read, **scope.written}.values())
        self.written = [v for v in self.variables if id(v) in scope.written]

        position = {id(v): i for i, v in enumerate(self.variables)}  # (Keras variables compare by value)
        written_positions = [position[id(v)] for v in self.written]

        def new_values_of(scope, values):
            return [jnp.asarray(values[i] if scope.get_current_value(v) is None else scope.get_current_value(v),
                                values[i].dtype) for v, i in zip(self.written, written_positions)]

        def core_fn(values, replicated, sharded):
            mapping = list(zip(self.variables, values))
            with gradients_summed_over_cores(), keras.StatelessScope(state_mapping=mapping) as scope:
                outputs = self._call_fn(replicated, [jax.tree.map(lambda a: a[0], x) for x in sharded])
            return (jax.tree.map(lambda a: jnp.asarray(a)[None], outputs),
                    [value[None] for value in new_values_of(scope, values)])

        self._core_fn = core_fn
        self._output_rows = {}  # a ragged program's outputs: each leaf's rows per replica (or None), per signature
        if any(r is not None for r in rows):
            if pod.is_multi_worker():
                raise ValueError(
                    f"strategy.run of {_function_name(fn)!r} got replicas with different numbers of rows "
                    f"({[list(r) for r in rows if r is not None]}), which a pod's processes do not run: use a global "
                    f"batch size that divides by the {self.layout.num_cores} replicas and batch with "
                    f"drop_remainder=True, or give every replica a batch of the same size.")
            program = self._ragged_program(strategy.placement.rule, rows, new_values_of, written_positions)
        else:
            per_core = strategy.layout.per_core(rewrite.transform(core_fn, strategy.placement.rule),
                                                (False, False, True), (True, True))

            def program(values, replicated, sharded):
                # The cores' new values (stacked, one per core) combined in the program, not by eager ops after it.
                outputs, per_core_values = per_core(values, replicated, sharded)
                return outputs, [_combine_over_cores(variable, values[i], stacked)
                                 for variable, i, stacked in zip(self.written, written_positions, per_core_values)]
        # The values always arrive placed on the cores, so that the written-back values (the program's outputs)
        # and the first call's (the variables' own) take one compiled program, not two.
        self.replicated = strategy.layout.replicated_sharding()
        # Called on its own, the program compiles with XLA:CPU's options for a training program (a replica function
        # may compute gradients), the MXU's bf16 rounding kept exact among them (see
        # keras_tpu.mxu._kernels.compiler_options). Inside the user's own jit, whose compile decides, JAX takes no
        # options for a nested one.
        # The MXU rule ran on one core's function, before it was mapped over the cores (so that a convolution of
        # each core's own operands, its weight gradient, is batched as the MXU's: one core after another). The
        # program as a whole is rewritten again for the fold of the cores' summed gradients into one product
        # over all rows (see keras_tpu._rewrite; nothing is left for the rule itself).
        program = rewrite.transform(program, strategy.placement.rule)
        self.program = jax.jit(program, compiler_options=kernels.compiler_options("train"))
        self.nested_program = jax.jit(program)

    def _ragged_program(self, rule, rows, new_values_of, written_positions):
        """The program for per-replica arguments whose replicas hold different numbers of rows (``rows``: per
        argument, each replica's rows, or None where they are all the same).

        A TPU runs such a step with dynamic shapes: each replica computes on its own rows. Here the replicas
        with the same rows form a group, mapped over its cores at its own shapes. A group's cores sum their
        gradients among themselves, and the sum over all replicas (the optimizer's all-reduce, which every
        group must see) is found by running the step again: the first run finds each group's sum of the
        gradients the first optimizer applies, the next applies their total and finds the second's (a GAN's
        second optimizer), and so on, until a run needs no sum it does not have. Each run repeats the work
        before the sum it finds; XLA computes such a repeat once (the same operations on the same values).
        """
        groups = _replica_groups(rows, self.layout.num_cores)
        back_to_replicas = np.argsort(np.concatenate([replicas for replicas, _ in groups]))
        with_rows = np.all([[r is None or r[replica] > 0 for r in rows] for replica in range(self.layout.num_cores)],
                           axis=1)

        def group_core_fn(values, replicated, sharded, totals):
            applied = []  # each optimizer's apply in this run: the group's summed gradients

            def combine(grads):
                applied.append([None if g is None else lax.psum(g, CORE_AXIS) for g in grads])
                return totals[len(applied) - 1] if len(applied) <= len(totals) else applied[-1]

            mapping = list(zip(self.variables, values))
            with _keras_private.optimizers_apply(combine), keras.StatelessScope(state_mapping=mapping) as scope:
                outputs = self._call_fn(replicated, sharded)
            missing = applied[len(totals)] if len(applied) > len(totals) else None
            return jax.tree.map(jnp.asarray, outputs), new_values_of(scope, values), missing

        group_step = jax.vmap(rewrite.transform(group_core_fn, rule), in_axes=(None, None, 0, None),
                              axis_name=CORE_AXIS)

        def program(values, replicated, sharded):
            per_group = [[_replicas_rows(x, replicas, r) for x, r in zip(sharded, group_rows)]
                         for replicas, group_rows in groups]
            totals = []
            while True:
                runs = [group_step(values, replicated, args, totals) for args in per_group]
                missing = [run[2] for run in runs]
                if all(m is None for m in missing):
                    break
                if any(m is None for m in missing) or len(totals) == 64:
                    raise ValueError(
                        f"The replica function {_function_name(self.fn)!r} applied gradients a different number "
                        f"of times on replicas with different numbers of rows; each replica must call its "
                        f"optimizers in the same order, as TensorFlow's all-reduce requires.")
                totals.append(jax.tree.map(lambda *sums: sum(s[0] for s in sums), *missing))
            outputs, output_rows = _join_groups([run[0] for run in runs], groups, back_to_replicas,
                                                _function_name(self.fn))
            self._output_rows[_signature(replicated, sharded)] = output_rows
            new_values = [jnp.concatenate([run[1][k] for run in runs])[back_to_replicas]
                          for k in range(len(self.written))]
            # A replica without rows computes no statistic (a batch normalization's mean of no rows is NaN): the
            # moving statistics are the mean of the replicas that have rows.
            new_values = [stacked[with_rows] if _is_moving_statistic(variable) and with_rows.any() else stacked
                          for variable, stacked in zip(self.written, new_values)]
            return outputs, [_combine_over_cores(variable, values[i], stacked)
                             for variable, i, stacked in zip(self.written, written_positions, new_values)]

        return program

    def _call_fn(self, replicated, sharded):
        replicated, sharded = iter(replicated), iter(sharded)
        leaves = [next(replicated) if kind == "array" else next(sharded) if kind == "replica" else self.static[i]
                  for i, kind in enumerate(self.kinds)]
        args, kwargs = jax.tree.unflatten(self.treedef, leaves)
        return self.fn(*args, **kwargs)

    def _check_hbm(self, values, replicated, sharded, signature):
        """Refuse, as a TPU's compiler does, a replica function whose step on one core would not fit the core's HBM
        (:mod:`keras_tpu._hbm`): one core's ``fn`` (products in float32: a TPU keeps no bfloat16 copies) is
        traced abstractly on the variables, the arguments every core gets whole, and one replica's share, once
        per argument shapes. The variables count as donated: TensorFlow updates them in place. Meanwhile the
        program compiles for these shapes in the background (its call then finds it compiled)."""
        if self.accelerator_type is None:  # a CPU placement has no HBM
            return
        leaves = jax.tree.leaves((values, replicated, sharded))
        if signature in self._hbm_checked:
            return
        compiling = None
        if not any(isinstance(a, jax.core.Tracer) for a in leaves):  # (under the user's jit, its compile decides)
            compiling = compiling_in_background(self.program.lower(values, replicated, sharded))
        shaped = lambda shape, a: jax.ShapeDtypeStruct(shape, jnp.result_type(a))
        abstract = lambda tree_: jax.tree.map(lambda a: shaped(jnp.shape(a), a), tree_)
        # A core's share of a per-replica argument: one replica's, (1, ...), under a core axis of one.
        one_core = [jax.tree.map(lambda a: shaped((1, 1) + jnp.shape(a)[1:], a), x) for x in sharded]
        core_step = jax.vmap(self._core_fn, in_axes=(None, None, 0), axis_name=CORE_AXIS, axis_size=1)
        names = [v.path for v in self.variables]
        kinds = ["parameter" if v.trainable else "variable" for v in self.variables]
        footprint = hbm.step_footprint(
            core_step, (abstract(values), abstract(replicated), one_core), accelerator_type=self.accelerator_type,
            argument_names=names, argument_kinds=kinds, label=f"replica function {_function_name(self.fn)!r}",
            axis_env=None if self.layout.num_devices == 1 else self.layout.axis_env())
        if compiling is not None:
            compiling.result()  # (a program that would not fit is not run: see below)
        footprint.check()  # (nothing ran: the variables keep their values)
        logger.info("strategy.run's replica function %r needs %s.", _function_name(self.fn), footprint.describe())
        self._hbm_checked.add(signature)

    def __call__(self, replicated, sharded):
        values = [v.value for v in self.variables]
        if not pod.is_multi_worker():  # (a pod's workers hold host values, which jit places as it always did)
            values = [value if getattr(value, "sharding", None) == self.replicated or
                      isinstance(value, jax.core.Tracer) else jax.device_put(value, self.replicated)
                      for value in values]
        signature = _signature(values, replicated, sharded)
        # (the first call for these shapes traces and compiles: see host.collection_paused)
        with contextlib.nullcontext() if signature in self._called else host.collection_paused():
            self._check_hbm(values, replicated, sharded, signature)
            try:
                outputs, combined = self.program(values, replicated, sharded)
            except ValueError as error:   # called while the user's own jit traces (JAX names the nested-jit rule)
                if "compiler_options" not in str(error):
                    raise
                outputs, combined = self.nested_program(values, replicated, sharded)
        self._called.add(signature)
        if self.written and any(isinstance(a, jax.core.Tracer) for a in combined):
            raise RuntimeError(
                "strategy.run was called inside a function JAX traces (jax.jit, the port of @tf.function), and its "
                f"replica function updates Keras variables ({', '.join(v.path for v in self.written[:3])}"
                f"{', ...' if len(self.written) > 3 else ''}): their new values would be traced values, lost after "
                "the trace. Call strategy.run outside jax.jit: it compiles its program once and runs it as one "
                "TPU program, as @tf.function does.")
        for variable, value in zip(self.written, combined):
            variable.assign(value)
        # (Only a ragged program records its outputs' rows: an even one's steps skip the lookup.)
        output_rows = self._output_rows.get(_signature(replicated, sharded)) if self._output_rows else None
        if output_rows is None:
            return jax.tree.map(PerReplica, outputs)
        leaves, treedef = jax.tree.flatten(outputs)
        return jax.tree.unflatten(treedef, [PerReplica(leaf, r) for leaf, r in zip(leaves, output_rows)])
