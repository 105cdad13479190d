"""Per-replica values: one part per replica (core), as ``tf.distribute``'s ``PerReplica``.

A :class:`PerReplica` holds its parts stacked on a leading replica axis. The
parts of a batch may hold different numbers of rows, as TensorFlow's
distributed datasets give them: a global batch that does not divide over the
replicas, or a partial last batch, leaves some replicas fewer rows and some
none (TensorFlow's "dummy batches of batch size 0"). Such a value is
*ragged*: its arrays are padded with zeros to the largest part, and
:attr:`PerReplica.rows` says how many rows of each part are real.
:func:`replica_row_counts` is TensorFlow's split of a global batch.
"""

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
        shapes = jax.tree.map(lambda a: tuple(a.shape[1:]), self.stacked)
        rows = "" if self.rows is None else f", rows {list(self.rows)}"
        return f"PerReplica({self.num_replicas} replicas of {shapes}{rows})"


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
    """A ``PerReplica`` of ``batch`` (a pytree of arrays with a common number of rows) split into consecutive
    parts of ``counts`` rows: stacked as they are where every part has the same rows, else ragged."""
    counts = [int(c) for c in counts]
    if len(set(counts)) == 1:
        return PerReplica(jax.tree.map(
            lambda a: np.asarray(a).reshape((len(counts), counts[0]) + np.shape(a)[1:]), batch))
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


def stack(parts, what):
    """One ``PerReplica`` from a list of per-replica pytrees of one structure: stacked, or ragged where the
    parts' rows differ (each padded with zeros to the most rows).

    Example:
        >>> stack([np.ones((2, 3)), np.ones((1, 3))], "parts").rows
        (2, 1)
    """
    structures = {jax.tree.structure(part) for part in parts}
    if len(structures) > 1:
        raise ValueError(f"{what} must have the same structure on every replica; got {len(structures)} different "
                         f"ones.")
    rows = [_row_count(part, what) for part in parts]
    if len(set(rows)) == 1:
        try:
            return PerReplica(jax.tree.map(lambda *leaves: np.stack([np.asarray(p) for p in leaves]), *parts))
        except ValueError as error:  # different shapes beyond the rows
            raise ValueError(f"{what} must have the same shapes on every replica, apart from their number of "
                             f"rows: {error}") from None
    most = max(rows)

    def padded(*leaves):
        leaves = [np.asarray(leaf) for leaf in leaves]
        if len({leaf.shape[1:] for leaf in leaves}) > 1 or len({leaf.ndim for leaf in leaves}) > 1:
            raise ValueError(f"{what} must have the same shapes on every replica apart from their number of rows; "
                             f"got {sorted({leaf.shape for leaf in leaves})}.")
        if leaves[0].ndim == 0:
            return np.stack(leaves)
        return np.stack([np.pad(leaf, [(0, most - leaf.shape[0])] + [(0, 0)] * (leaf.ndim - 1)) for leaf in leaves])

    return PerReplica(jax.tree.map(padded, *parts), rows)


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
