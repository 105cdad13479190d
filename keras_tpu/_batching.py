"""Feeding the cores: every batch is padded to one global batch size, with a mask.

A TPU program is compiled for fixed shapes, so keras-tpu pads every batch to
the same *global batch*: the largest batch seen in the loop (a ``fit``,
``evaluate`` or ``predict`` call), rounded up to a multiple of
the number of cores (a batch of 100 on 8 cores runs as 8 x 13 rows). Padding
rows carry a mask of 0, which keeps them out of the loss, gradients, metrics
and predictions. The last, partial batch of an epoch therefore reuses the same
compiled program (but for training a model with ``BatchNormalization``, whose
statistics over the real rows cost a program of their own, compiled once: see
``keras_tpu._programs.ProgramForm``). A padding row is a copy of the
batch's first row, not zeros: a row of zero token ids is entirely masked
(``Embedding(mask_zero=True)``, ``Masking``), and a mask-aware average over
it (``GlobalAveragePooling1D``) divides 0 by 0; a weight of 0 cannot keep
that NaN out of the loss or the gradients (0 times NaN), and a copy of a real
row computes what that row does.

Several steps per device call (``steps_per_execution``) are stacked along
axis 1, so that axis 0 is always the rows that are split over the cores. Only
the batches there are get stacked: a call with fewer batches left runs a
program of fewer steps, so steps without data cost nothing.
"""

import dataclasses
import math

import jax
import numpy as np
from keras import tree


def pad_to_global_batch(batch_size, num_cores):
    """The global batch size a batch of ``batch_size`` rows runs as: a multiple of ``num_cores``.

    Example:
        >>> pad_to_global_batch(100, 8), pad_to_global_batch(1024, 8)
        (104, 1024)
    """
    return math.ceil(batch_size / num_cores) * num_cores


def _rows(leaves):
    """The rows of a batch's arrays (its flattened leaves), which must agree."""
    if not leaves:
        raise ValueError("A batch has no arrays.")
    counts = {int(np.shape(leaf)[0]) for leaf in leaves}
    if len(counts) != 1:
        raise ValueError(f"All arrays of a batch must have the same number of rows; got {sorted(counts)}.")
    return counts.pop()


@dataclasses.dataclass
class StackedBatches:
    """Batches padded and stacked as ``(global_batch, steps, ...)`` arrays."""

    data: object            # the batches' (x, y, sample_weight) structure of stacked arrays
    mask: np.ndarray        # float32 (global_batch, steps): 1 for real rows
    real_rows: np.ndarray   # int32 (steps,): real rows of each step

    @property
    def steps(self):
        return int(self.mask.shape[1])

    @property
    def has_padding_rows(self):
        """Whether a step has fewer real rows than the global batch."""
        return int(self.real_rows.min()) < self.mask.shape[0]


class BatchStacker:
    """Pads and stacks the batches of one program (train, test or predict).

    Within a loop of Keras' (a ``fit``, ``evaluate`` or ``predict`` call, all
    its epochs), the global batch grows to the largest batch seen (which
    recompiles the program once, with a log line) and never shrinks, so
    partial batches run the program of the full ones (but see the module
    doc). A new loop (:meth:`new_loop`) sets it from its own first batches:
    a later ``fit`` at a smaller ``batch_size``, or a ``predict`` of a few
    rows, runs a program of its own size, as a TPU compiles one for each new
    shape, rather than padding its rows to an earlier loop's batch.

    Example:
        >>> stacker = BatchStacker(num_cores=8, steps=2)
        >>> stacked = stacker.stack([(np.ones((5, 3)), np.ones((5, 1)), None)])
        >>> stacked.mask.shape, stacked.real_rows.tolist()
        ((8, 1), [5])
    """

    def __init__(self, num_cores, steps):
        self.num_cores = num_cores
        self.steps = steps
        self.global_batch = 0
        self._in_loop = False  # whether the loop's first batches were stacked (see new_loop)
        self._masks = {}  # (global batch, rows of each step) -> (mask, real_rows): most steps share one

    def new_loop(self):
        """A new loop of Keras' begins: its first batches set the global batch anew.

        Example:
            >>> stacker = BatchStacker(num_cores=8, steps=1)
            >>> _ = stacker.stack([(np.ones((1024, 3)),)]); _ = stacker.stack([(np.ones((100, 3)),)])
            >>> stacker.global_batch        # the partial batch ran padded to the loop's 1024 rows
            1024
            >>> stacker.new_loop(); _ = stacker.stack([(np.ones((32, 3)),)])
            >>> stacker.global_batch
            32
        """
        self._in_loop = False

    def stack(self, batches):
        if not 1 <= len(batches) <= self.steps:
            raise ValueError(f"Expected 1 to {self.steps} batches; got {len(batches)}.")
        # One flatten per batch (JAX's C++ pytrees keep None as structure, not as a leaf): a small model's
        # step is ~0.5 ms, and Keras' tree functions cost ~10 us each.
        flat = [jax.tree.flatten(batch) for batch in batches]
        structure = flat[0][1]
        if any(treedef != structure for _, treedef in flat[1:]):
            raise ValueError("All batches of a program must have the same structure "
                             "(inputs, targets and sample weights).")
        rows = [_rows(leaves) for leaves, _ in flat]
        needed = pad_to_global_batch(max(rows), self.num_cores)
        self.global_batch = max(self.global_batch, needed) if self._in_loop else needed
        self._in_loop = True
        padded, steps = self.global_batch, len(batches)

        def stack_leaf(leaves):
            first = np.asarray(leaves[0])
            if steps == 1 and len(first) == padded:  # one full batch: a view with a steps axis, no copy
                return first[:, None]
            out = np.empty((padded, steps) + first.shape[1:], dtype=first.dtype)
            for step, leaf in enumerate(leaves):
                leaf = np.asarray(leaf)
                out[:len(leaf), step] = leaf
                # Padding rows: copies of the batch's first row (see module doc); zeros if it has none.
                out[len(leaf):, step] = leaf[:1] if len(leaf) else 0
            return out

        data = structure.unflatten([stack_leaf(leaves) for leaves in zip(*(leaves for leaves, _ in flat))])
        key = padded, tuple(rows)
        if key not in self._masks:  # built once per shape: a small model's step is ~0.5 ms in all
            if len(self._masks) >= 64:  # batches of ever new sizes (a generator's): keep the cache small
                self._masks.clear()
            mask = np.zeros((padded, steps), dtype=np.float32)
            for step, count in enumerate(rows):
                mask[:count, step] = 1.0
            mask.flags.writeable = False
            real_rows = np.asarray(rows, dtype=np.int32)
            real_rows.flags.writeable = False
            self._masks[key] = mask, real_rows
        mask, real_rows = self._masks[key]
        return StackedBatches(data, mask, real_rows)


def same_shape_runs(batches):
    """``batches`` in runs of consecutive batches whose arrays have the same shapes but for their rows: each run
    stacks into one program's call (a generator's batches of different sequence lengths run one program per
    length).

    Example:
        >>> runs = same_shape_runs([(np.ones((4, 5)),), (np.ones((2, 5)),), (np.ones((4, 9)),)])
        >>> [len(run) for run in runs]
        [2, 1]
    """
    if len(batches) == 1:  # steps_per_execution=1: nothing to compare (a small model's step is ~0.5 ms)
        return [batches]
    runs, last = [], None
    for batch in batches:
        leaves, structure = jax.tree.flatten(batch)
        key = structure, tuple((np.shape(leaf)[1:], getattr(leaf, "dtype", None)) for leaf in leaves)
        if key == last:
            runs[-1].append(batch)
        else:
            runs.append([batch])
            last = key
    return runs


def unstack_outputs(outputs, stacked):
    """Predictions of stacked steps, ``(rows, steps, ...)`` arrays (``(rows, ...)`` for one step), back to one
    array per output, real rows only, in order.

    One step's outputs come back as they are when every row is real: a device array, which Keras' ``predict``
    collects and concatenates at its end, as it does its own; converting it here would wait for every step's
    program in turn and copy its outputs twice (keras.io's masked language model predicted at 1.4x plain
    Keras' time per batch).

    Example:
        >>> stacked = StackedBatches(None, np.ones((4, 2)), np.array([4, 3]))
        >>> unstack_outputs(np.arange(8).reshape(4, 2), stacked)
        array([0, 2, 4, 6, 1, 3, 5])
        >>> one_step = jax.numpy.ones((4, 3))
        >>> unstack_outputs(one_step, StackedBatches(None, np.ones((4, 1)), np.array([4]))) is one_step
        True
    """
    def unstack(leaf):
        if stacked.steps == 1:
            count = int(stacked.real_rows[0])
            return leaf if count == leaf.shape[0] else np.asarray(leaf)[:count]
        leaf = np.asarray(leaf)
        return np.concatenate([leaf[:count, step] for step, count in enumerate(stacked.real_rows)])
    return tree.map_structure(unstack, outputs)


def describe_input_shapes(x, rows=None):
    """The shapes of a batch's inputs as a log line shows them (``rows`` replaces the row count: a number, or
    ``"None"`` for shapes of any row count, as Keras' summaries write them).

    Example:
        >>> describe_input_shapes({"tokens": np.zeros((32, 12)), "ids": np.zeros((32,))})
        'ids (32,), tokens (32, 12)'
        >>> describe_input_shapes(np.zeros((100, 7)), rows=104), describe_input_shapes(np.zeros((100, 7)), "None")
        ('(104, 7)', '(None, 7)')
    """
    def shape(leaf):
        dims = tuple(np.shape(leaf))
        if rows is not None and dims:
            dims = (rows,) + dims[1:]
        return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"

    if isinstance(x, dict):
        return ", ".join(f"{key} {describe_input_shapes(x[key], rows)}" for key in sorted(x))
    return ", ".join(shape(leaf) for leaf in tree.flatten(x) if leaf is not None)
