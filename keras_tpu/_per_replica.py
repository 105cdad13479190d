"""Per-replica values (one part per replica, as ``tf.distribute``'s ``PerReplica``) and the distributed datasets
and iterators that give them.

A :class:`PerReplica` holds its parts stacked on a leading replica axis. The
parts of a batch may hold different numbers of rows, as TensorFlow's
distributed datasets give them: a global batch that does not divide over the
replicas, or a partial last batch, leaves some replicas fewer rows and some
none (TensorFlow's "dummy batches of batch size 0"). Such a value is
*ragged*: its arrays are padded with zeros to the largest part, and
:attr:`PerReplica.rows` says how many rows of each part are real.
:func:`replica_row_counts` is TensorFlow's split of a global batch, and
:func:`join_replicas` joins an element's parts back into the global batch:
:class:`GlobalBatches` gives a distributed dataset to Keras' ``fit``,
``evaluate`` and ``predict`` as those global batches.
"""

import dataclasses
import enum
import itertools

import jax
import jax.numpy as jnp
import numpy as np


class PerReplica:
    """A value with one part per replica (core), stored stacked on a leading replica axis.

    ``rows``: for a ragged value, each replica's row count (axis 0 of each part of
    rank >= 1); the stacked arrays are padded to the largest. None when every part
    fills the stacked arrays.

    Example:
        >>> value = PerReplica(np.arange(8.0))
        >>> len(value.values), float(value.values[3])
        (8, 3.0)
        >>> ragged = PerReplica(np.ones((2, 3, 4)), rows=(3, 1))
        >>> [part.shape for part in ragged.values]
        [(3, 4), (1, 4)]
    """

    def __init__(self, stacked, rows=None):
        self.stacked = stacked
        self.rows = None if rows is None else tuple(int(r) for r in rows)

    @property
    def num_replicas(self):
        """How many parts (one per replica) the value has."""
        return int(jax.tree.leaves(self.stacked)[0].shape[0])

    @property
    def values(self):
        """The per-replica values, one pytree per replica (TensorFlow's ``PerReplica.values``), each with its
        real rows only."""
        return tuple(jax.tree.map(lambda a, i=i: self._part(a, i), self.stacked) for i in range(self.num_replicas))

    def _part(self, stacked, replica):
        part = stacked[replica]
        return part if self.rows is None or part.ndim == 0 else part[:self.rows[replica]]

    def __repr__(self):
        """Each replica's part, as TensorFlow prints a ``PerReplica`` (``PerReplica:{ 0: ..., 1: ... }``)."""
        def shown(a):
            return a if isinstance(a, jax.core.Tracer) else np.asarray(a)
        parts = ",\n".join(f"  {i}: {jax.tree.map(shown, part)!r}" for i, part in enumerate(self.values))
        return "PerReplica:{\n" + parts + "\n}"


# A JAX pytree: a PerReplica passes into and out of jax.jit (the port of @tf.function) as its stacked arrays; the
# row counts of a ragged one are static (a program per pattern of rows, as a TPU compiles per shape).
jax.tree_util.register_pytree_node(PerReplica, lambda value: ((value.stacked,), value.rows),
                                   lambda rows, children: PerReplica(children[0], rows))


def is_per_replica(value):
    return isinstance(value, PerReplica)


def has_per_replica(value):
    """Whether ``value`` (a pytree) holds a ``PerReplica`` anywhere."""
    return any(isinstance(leaf, PerReplica) for leaf in jax.tree.leaves(value, is_leaf=is_per_replica))


def replica_row_counts(rows, global_batch_size, num_replicas):
    """How TensorFlow's distributed dataset splits a batch of ``rows`` rows over ``num_replicas`` replicas,
    for a dataset batched by ``global_batch_size``.

    A full batch splits as evenly as it can: the first ``global_batch_size % num_replicas`` replicas get one
    row more (``tf.data.experimental.rebatch``'s batch sizes). A partial batch fills the replicas in that
    order, one replica's share after another, and leaves the rest none.

    Example:
        >>> replica_row_counts(64, 64, 8)
        [8, 8, 8, 8, 8, 8, 8, 8]
        >>> replica_row_counts(100, 100, 8)
        [13, 13, 13, 13, 12, 12, 12, 12]
        >>> replica_row_counts(44, 64, 8)
        [8, 8, 8, 8, 8, 4, 0, 0]
    """
    global_batch_size = max(global_batch_size, rows)  # (a batch larger than the first splits by its own size)
    floor, extra = divmod(global_batch_size, num_replicas)
    counts, left = [], rows
    for replica in range(num_replicas):
        share = min(floor + (replica < extra), left)
        counts.append(share)
        left -= share
    return counts


def split_rows(batch, counts):
    """``batch`` (a pytree of arrays with a common number of rows) split into consecutive parts of ``counts``
    rows, one per replica: the batch's structure with a ``PerReplica`` at each leaf, as TensorFlow's
    distributed datasets give it (``features, labels = batch`` unpacks it). Ragged where the parts' rows differ.

    Example:
        >>> features, labels = split_rows((np.ones((3, 2)), np.arange(3)), [2, 1])
        >>> labels.rows, [part.tolist() for part in labels.values]
        ((2, 1), [[0, 1], [2]])
    """
    counts = [int(c) for c in counts]
    if len(set(counts)) == 1:  # (a view of the batch: no copy)
        return jax.tree.map(lambda a: PerReplica(np.asarray(a).reshape((len(counts), counts[0]) + np.shape(a)[1:])),
                            batch)
    starts = np.cumsum([0] + counts[:-1])
    return stack([jax.tree.map(lambda a, s=s, c=c: np.asarray(a)[s:s + c], batch)
                  for s, c in zip(starts, counts)], "The parts of a batch")


def _row_count(part, what):
    """The rows of one replica's part (axis 0 of its arrays of rank >= 1; they must agree)."""
    counts = {np.shape(leaf)[0] for leaf in jax.tree.leaves(part) if np.ndim(leaf) >= 1}
    if len(counts) > 1:
        raise ValueError(f"{what}: a replica's arrays have different numbers of rows ({sorted(counts)}); the "
                         f"arrays of one replica's part must share their first axis.")
    return counts.pop() if counts else None


def _stacked_leaf(leaves, rows, what):
    """One ``PerReplica`` of one leaf's per-replica parts: stacked, or padded with zeros to the most rows."""
    leaves = [np.asarray(leaf) for leaf in leaves]
    if len({leaf.ndim for leaf in leaves}) > 1 or len({leaf.shape[1:] for leaf in leaves}) > 1:
        raise ValueError(f"{what} must have the same shapes on every replica, apart from their number of rows; got "
                         f"{sorted({leaf.shape for leaf in leaves})}.")
    if leaves[0].ndim == 0 or len({leaf.shape[0] for leaf in leaves}) == 1:
        return PerReplica(np.stack(leaves))
    most = max(rows)
    return PerReplica(np.stack([np.pad(leaf, [(0, most - leaf.shape[0])] + [(0, 0)] * (leaf.ndim - 1))
                                for leaf in leaves]), rows)


def stack(parts, what):
    """Per-replica pytrees of one structure (one per replica) as that structure with a ``PerReplica`` at each
    leaf, as TensorFlow regroups them: stacked, or ragged where the parts' rows differ (each padded with zeros
    to the most rows).

    Example:
        >>> stack([np.ones((2, 3)), np.ones((1, 3))], "parts").rows
        (2, 1)
    """
    structures = {jax.tree.structure(part) for part in parts}
    if len(structures) > 1:
        raise ValueError(f"{what} must have the same structure on every replica; got {len(structures)} different "
                         f"ones.")
    rows = [_row_count(part, what) for part in parts]
    treedef = structures.pop()
    per_leaf = zip(*[jax.tree.leaves(part) for part in parts])
    return jax.tree.unflatten(treedef, [_stacked_leaf(leaves, rows, what) for leaves in per_leaf])


def real_rows_mask(value):
    """For a ragged ``PerReplica``: ``(replicas, most rows)`` booleans, True at each part's real rows."""
    return np.arange(jax.tree.leaves(value.stacked)[0].shape[1])[None, :] < np.asarray(value.rows)[:, None]


def reduce_over_replicas(value, op, axis):
    """``value`` (a ``PerReplica``) summed (``op`` "SUM") or averaged ("MEAN") over the replicas, and over
    ``axis`` of each part if given; a ragged value's padding rows count for nothing."""
    def combine(a):  # `a` is stacked on a leading replica axis
        a = jnp.asarray(a)
        axes = (0,) if axis is None else (0, (axis % (a.ndim - 1)) + 1)
        return jnp.sum(a, axis=axes) if op == "SUM" else jnp.mean(a, axis=axes)

    if value.rows is None:
        return jax.tree.map(combine, value.stacked)

    mask = real_rows_mask(value)

    def combine_real_rows(a):
        a = jnp.asarray(a)
        if a.ndim == 1:  # one value per replica (not rows)
            return combine(a)
        if axis is None or (axis % (a.ndim - 1)) != 0:
            raise ValueError(
                f"The replicas' parts have different numbers of rows ({list(value.rows)}), so they cannot be "
                f"combined element by element (axis={axis}); reduce over their rows with axis=0, or gather them.")
        real = mask.reshape(mask.shape + (1,) * (a.ndim - 2))
        total = jnp.sum(jnp.where(real, a, 0), axis=(0, 1))
        return total if op == "SUM" else total / max(int(sum(value.rows)), 1)

    return jax.tree.map(combine_real_rows, value.stacked)


class InputReplicationMode(enum.Enum):
    """How ``distribute_datasets_from_function`` builds its input pipelines (``tf.distribute.InputReplicationMode``):
    one per worker (``PER_WORKER``, the default), or one per replica (``PER_REPLICA``)."""
    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass
class InputOptions:
    """``tf.distribute.InputOptions``: ``experimental_replication_mode`` chooses one input pipeline per worker or
    per replica in ``distribute_datasets_from_function``; the rest place and prefetch the input on a real TPU
    host and have no effect here (the batches are NumPy arrays in the host's memory already).

    Example:
        >>> InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA).experimental_fetch_to_device
        True
    """
    experimental_fetch_to_device: bool = True
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1


class OutOfRangeError(Exception):
    """A distributed iterator's ``get_next()`` after its last element (TensorFlow's ``tf.errors.OutOfRangeError``)."""


class OptionalValue:
    """What ``get_next_as_optional()`` returns (TensorFlow's ``tf.experimental.Optional``): a value, or none.

    Example:
        >>> OptionalValue(None, False).has_value()
        False
    """

    def __init__(self, value, present):
        self._value, self._present = value, present

    def has_value(self):
        """Whether there is a value."""
        return self._present

    def get_value(self):
        """The value; an error if there is none."""
        if not self._present:
            raise OutOfRangeError("The optional has no value: the distributed iterator had no more elements.")
        return self._value

    def __repr__(self):
        return f"OptionalValue({self._value!r})" if self._present else "OptionalValue(none)"


def element_spec_of(element):
    """An element's structure with one replica's part's shape and dtype at each ``PerReplica`` (for a ragged
    one, the part with the most rows)."""
    return jax.tree.map(lambda value: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                                   value.stacked), element, is_leaf=is_per_replica)


class DistributedIterator:
    """An iterator over a :class:`DistributedDataset` (``tf.distribute.DistributedIterator``): ``next()``,
    ``get_next()``, ``get_next_as_optional()`` and ``element_spec``.

    Example:
        >>> iterator = iter(DistributedDataset(lambda: iter([PerReplica(np.ones((8, 2)))]), "one batch"))
        >>> iterator.element_spec.shape, iterator.get_next().num_replicas, iterator.get_next_as_optional().has_value()
        ((2,), 8, False)
    """

    def __init__(self, iterator):
        self._iterator = iterator
        self._peeked = []

    def __iter__(self):
        return self

    def __next__(self):
        return self._peeked.pop() if self._peeked else next(self._iterator)

    def get_next(self):
        """The next element; :class:`OutOfRangeError` after the last, as TensorFlow's."""
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError("End of sequence: the distributed dataset has no more elements.") from None

    def get_next_as_optional(self):
        """The next element as an :class:`OptionalValue`, without an error after the last: TensorFlow's way to
        stop a loop at the end of the data (``while optional.has_value(): ...``)."""
        try:
            return OptionalValue(next(self), True)
        except StopIteration:
            return OptionalValue(None, False)

    @property
    def element_spec(self):
        """The next element's structure, with one replica's part's shape and dtype at each ``PerReplica``."""
        if not self._peeked:
            try:
                self._peeked.append(next(self._iterator))
            except StopIteration:
                raise OutOfRangeError("The distributed iterator has no more elements to describe.") from None
        return element_spec_of(self._peeked[0])


class DistributedDataset:
    """Per-replica batches (``PerReplica`` values), like ``tf.distribute.DistributedDataset``.

    Each ``iter()`` starts a new pass over the underlying data (if the data
    can be iterated again: a list or a ``keras.utils.PyDataset`` can, a
    generator cannot) and returns a :class:`DistributedIterator`.
    ``element_spec`` describes the first element: each ``PerReplica``'s part on
    one replica.
    """

    def __init__(self, make_iterator, description, one_shot=False, strategy=None, count_elements=None):
        self._make_iterator = make_iterator
        self._description = description
        self._one_shot = one_shot  # a generator: what element_spec reads must still be given to the next pass
        self._kept = []
        self._element_spec = None
        self.strategy = strategy  # the TPUStrategy that distributed it (whose models' fit takes it)
        self._count_elements = count_elements

    @property
    def one_shot(self):
        """Whether the dataset can be read only once (it distributes a Python generator): each pass goes on
        where the last stopped."""
        return self._one_shot

    def num_elements(self):
        """The elements a pass gives, where the underlying data says (``len()``, a ``keras.utils.PyDataset``'s
        ``num_batches``); ``None`` if it does not (a generator)."""
        return None if self._count_elements is None or self._one_shot else self._count_elements()

    def __iter__(self):
        kept, self._kept = self._kept, []
        return DistributedIterator(itertools.chain(kept, self._make_iterator()))

    @property
    def element_spec(self):
        """The first element's structure, with one replica's part's shape and dtype at each ``PerReplica``."""
        if self._element_spec is None:
            first = next(iter(self), None)
            if first is None:
                raise ValueError(f"The distributed dataset ({self._description}) has no elements to describe.")
            if self._one_shot:
                self._kept = [first]
            self._element_spec = element_spec_of(first)
        return self._element_spec

    def reduce(self, initial_state, reduce_func):
        """``reduce_func(state, element)`` folded over a pass of the dataset from ``initial_state``, as
        TensorFlow's ``DistributedDataset.reduce`` (call ``strategy.run`` inside ``reduce_func`` for per-replica
        work).

        Example:
            >>> dataset = DistributedDataset(lambda: iter([PerReplica(np.ones(8))] * 3), "three elements")
            >>> dataset.reduce(0.0, lambda state, element: state + float(element.stacked.sum()))
            24.0
        """
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    def __repr__(self):
        return f"DistributedDataset({self._description})"


def batches_in(data):
    """How many batches iterating ``data`` gives, where it says: ``len()``, or a ``keras.utils.PyDataset``'s
    ``num_batches``; ``None`` if it does not say (a generator, an endless PyDataset).

    Example:
        >>> batches_in([np.ones((4, 2))] * 3), batches_in(iter([]))
        (3, None)
    """
    try:
        if isinstance(getattr(type(data), "num_batches", None), property):  # (a PyDataset: len() is optional)
            return data.num_batches
        return len(data)
    except (TypeError, NotImplementedError):
        return None


def join_replicas(element):
    """A distributed dataset's element (its batch's structure with a ``PerReplica`` at each leaf) as one global
    batch: each leaf's parts joined in replica order, each part's real rows only (a replica with no rows adds
    none). It undoes :func:`split_rows`.

    Example:
        >>> element = split_rows((np.arange(12.0).reshape(6, 2), np.arange(6)), [3, 2, 1, 0])
        >>> features, labels = join_replicas(element)
        >>> features.shape, labels.tolist()
        ((6, 2), [0, 1, 2, 3, 4, 5])
    """
    def join(value):
        if not is_per_replica(value):
            return value

        def joined(stacked):
            stacked = np.asarray(stacked)
            if stacked.ndim < 2:
                raise ValueError(
                    f"An element of the distributed dataset holds a scalar on each replica ({stacked.shape[0]} "
                    f"values): a scalar has no rows to join into the global batch that fit, evaluate and predict "
                    f"take. Give each array of a batch one value per row (axis 0), or read the dataset in a custom "
                    f"loop with strategy.run.")
            if value.rows is None:
                return stacked.reshape((-1,) + stacked.shape[2:])
            return np.concatenate([stacked[replica, :rows] for replica, rows in enumerate(value.rows)])

        return jax.tree.map(joined, value.stacked)

    return jax.tree.map(join, element, is_leaf=is_per_replica)


class GlobalBatches:
    """A :class:`DistributedDataset`'s elements as the global batches they split (:func:`join_replicas`): what
    Keras' ``fit``, ``evaluate`` and ``predict`` read from a distributed dataset, the replicas' parts joined
    in replica order, as one batch (the model's programs split it over the cores again).

    :meth:`new_pass` starts a pass over the dataset (one per epoch). A one-shot
    dataset (over a Python generator) is one stream: the first batch, once
    read by :meth:`first` (or by Keras' look at the first batch before the
    loop), is given again at the start of each pass until a pass reads past
    it.

    Example:
        >>> dataset = DistributedDataset(lambda: iter([split_rows(np.ones((6, 2)), [3, 3])] * 2), "two batches")
        >>> [batch.shape for batch in GlobalBatches(dataset).new_pass()]
        [(6, 2), (6, 2)]
    """

    def __init__(self, dataset):
        self.dataset = dataset
        self._first = []  # (a one-shot dataset) its first batch, read but not yet consumed by a pass

    def first(self):
        """The first global batch; ``None`` if the dataset has no elements."""
        if self._first:
            return self._first[0]
        element = next(iter(self.dataset), None)
        if element is None:
            return None
        batch = join_replicas(element)
        if self.dataset.one_shot:
            self._first = [batch]
        return batch

    def new_pass(self):
        """A generator of the global batches of a new pass over the dataset."""
        if self._first:
            yield self._first[0]
            self._first = []  # (runs when the batch after it is asked for: the pass has consumed the first)
        for element in self.dataset:
            yield join_replicas(element)

    @property
    def num_batches(self):
        """The batches of a pass, where the dataset says (:meth:`DistributedDataset.num_elements`), else None."""
        return self.dataset.num_elements()
