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
:func:`keras_tpu.keras_to_tpu_model` (:mod:`keras_tpu.replicated_steps`). Its
variables are the TPU's weights: they live on the cores after training, and
Keras' own ``get_weights``/``save_weights`` read them from there. Models
created outside any scope are untouched CPU models.

For custom training loops, :meth:`TPUStrategy.run` runs a function once per
replica (core) on its shard of the data, :meth:`TPUStrategy.reduce` combines
the per-replica results, and :meth:`TPUStrategy.experimental_distribute_dataset`
splits global batches into per-replica shards.

Scopes do not nest, and a model must be created and compiled under the same
strategy's scope; both mistakes raise a clear error, as in TensorFlow.
"""

import contextlib
import enum
import threading
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from keras import tree

from keras_tpu import _keras_private, rewrite
from keras_tpu.placement import Placement, installed_on

_active = threading.local()


class ReduceOp(enum.Enum):
    SUM = "SUM"
    MEAN = "MEAN"


class PerReplica:
    """A value with one part per replica (core), stored stacked on a leading replica axis.

    Example:
        >>> value = PerReplica(np.arange(8.0))
        >>> len(value.values), float(value.values[3])
        (8, 3.0)
    """

    def __init__(self, stacked):
        self.stacked = stacked

    @property
    def num_replicas(self):
        return int(jax.tree.leaves(self.stacked)[0].shape[0])

    @property
    def values(self):
        """The per-replica values, one pytree per replica (TensorFlow's ``PerReplica.values``)."""
        return tuple(jax.tree.map(lambda a, i=i: a[i], self.stacked) for i in range(self.num_replicas))

    def __repr__(self):
        shapes = jax.tree.map(lambda a: tuple(a.shape[1:]), self.stacked)
        return f"PerReplica({self.num_replicas} replicas of {shapes})"


class TPUStrategy:
    """Data-parallel training on the simulated TPU, like ``tf.distribute.TPUStrategy``.

    Args:
        tpu_cluster_resolver: a :class:`TPUClusterResolver` (default: the local v2-8).
        steps_per_execution: steps per device call for models of this
            strategy that do not set ``steps_per_execution`` in ``compile``.
        precision: MXU precision (``"default"``, ``"high"``, ``"highest"``).

    Example:
        >>> strategy = TPUStrategy()
        >>> strategy.num_replicas_in_sync
        8
    """

    def __init__(self, tpu_cluster_resolver=None, steps_per_execution=1, precision="default"):
        self.placement = Placement(tpu_cluster_resolver, precision, steps_per_execution=steps_per_execution,
                                   owner="TPUStrategy")
        self._models = weakref.WeakSet()
        self._run_programs = {}

    @property
    def resolver(self):
        return self.placement.resolver

    @property
    def topology(self):
        return self.placement.topology

    @property
    def layout(self):
        return self.placement.layout

    @property
    def precision(self):
        return self.placement.precision

    @property
    def steps_per_execution(self):
        return self.placement.steps_per_execution

    @property
    def num_replicas_in_sync(self):
        return self.layout.num_cores

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

    def experimental_distribute_dataset(self, dataset):
        """Split each global batch of ``dataset`` (an iterable of arrays, tuples or dicts) into
        per-replica shards.

        The global batch size must be a multiple of :attr:`num_replicas_in_sync`.

        Example:
            >>> batches = [np.ones((16, 3))] * 2
            >>> [b.num_replicas for b in TPUStrategy().experimental_distribute_dataset(batches)]
            [8, 8]
        """
        replicas = self.num_replicas_in_sync
        for batch in dataset:
            def shard(a):
                a = np.asarray(a)
                if a.shape[0] % replicas:
                    raise ValueError(f"A global batch of {a.shape[0]} rows cannot be split evenly over "
                                     f"{replicas} replicas; use a batch size that is a multiple of {replicas}.")
                return a.reshape((replicas, a.shape[0] // replicas) + a.shape[1:])
            yield PerReplica(tree.map_structure(shard, batch))

    def run(self, fn, args=(), kwargs=None):
        """Run ``fn`` once per replica: ``PerReplica`` arguments give each replica its part,
        other array arguments are given whole to every replica. Returns ``fn``'s output
        structure with a ``PerReplica`` at each leaf.

        Matrix products in ``fn`` run on the MXU. Each function is compiled once
        per argument shapes, so pass the same function object on every step.

        Example:
            >>> strategy = TPUStrategy()
            >>> data = next(iter(strategy.experimental_distribute_dataset([np.ones((16, 3))])))
            >>> sums = strategy.run(lambda x: x.sum(), args=(data,))
            >>> float(strategy.reduce("SUM", sums))
            48.0
        """
        kwargs = kwargs or {}
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=lambda x: isinstance(x, PerReplica))
        kinds = tuple("replica" if isinstance(x, PerReplica) else
                      "array" if isinstance(x, (jax.Array, np.ndarray)) or np.isscalar(x) and not isinstance(x, str)
                      else "static" for x in leaves)
        static = tuple((i, x) for i, (x, k) in enumerate(zip(leaves, kinds)) if k == "static")
        key = (fn, treedef, kinds, tuple((i, repr(x)) for i, x in static))
        program = self._run_programs.pop(key, None) or self._run_program(fn, treedef, kinds, dict(static))
        self._run_programs[key] = program  # most recently used last
        while len(self._run_programs) > 64:
            self._run_programs.pop(next(iter(self._run_programs)))
        replicated = [jnp.asarray(x) for x, k in zip(leaves, kinds) if k == "array"]
        sharded = [self._rows_by_replica(x.stacked) for x, k in zip(leaves, kinds) if k == "replica"]
        return jax.tree.map(PerReplica, program(replicated, sharded))

    def _rows_by_replica(self, stacked):
        return jax.tree.map(lambda a: jax.device_put(jnp.asarray(a), self.layout.batch_sharding()), stacked)

    def _run_program(self, fn, treedef, kinds, static):
        def core_fn(replicated, sharded):
            replicated, sharded = iter(replicated), iter(sharded)
            leaves = []
            for i, kind in enumerate(kinds):
                if kind == "array":
                    leaves.append(next(replicated))
                elif kind == "replica":
                    leaves.append(jax.tree.map(lambda a: a[0], next(sharded)))  # this replica's part
                else:
                    leaves.append(static[i])
            args, kwargs = jax.tree.unflatten(treedef, leaves)
            return jax.tree.map(lambda a: jnp.asarray(a)[None], fn(*args, **kwargs))

        return jax.jit(self.layout.per_core(rewrite.transform(core_fn, self.placement.rule), (False, True), True))

    def reduce(self, reduce_op, value, axis=None):
        """Combine a per-replica value: ``"SUM"`` or ``"MEAN"`` over replicas (and over ``axis``
        of each replica's value, if given).

        Example:
            >>> TPUStrategy().reduce("MEAN", PerReplica(np.arange(8.0)))
            Array(3.5, dtype=float32)
        """
        op = ReduceOp(reduce_op.upper() if isinstance(reduce_op, str) else reduce_op.value)

        def combine(a):  # `a` is stacked on a leading replica axis
            a = jnp.asarray(a)
            axes = (0,) if axis is None else (0, (axis % (a.ndim - 1)) + 1)
            return jnp.sum(a, axis=axes) if op is ReduceOp.SUM else jnp.mean(a, axis=axes)

        def reduce_leaf(leaf):
            if isinstance(leaf, PerReplica):
                return jax.tree.map(combine, leaf.stacked)
            replicas = self.num_replicas_in_sync
            return combine(jnp.broadcast_to(leaf, (replicas,) + jnp.shape(leaf)))

        return jax.tree.map(reduce_leaf, value, is_leaf=lambda x: isinstance(x, PerReplica))

    def experimental_local_results(self, value):
        """The per-replica parts of ``value`` as a tuple (a 1-tuple for a plain value)."""
        return value.values if isinstance(value, PerReplica) else (value,)

    def __repr__(self):
        return f"TPUStrategy({self.topology.accelerator_type}, replicas={self.num_replicas_in_sync})"
