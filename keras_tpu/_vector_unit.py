"""Vector-unit operations that XLA:CPU runs slowly, given exact faster lowerings.

A TPU core runs everything that is not a matrix product on its vector unit.
On the simulating CPU three such ops stand out:

* The gradient of max pooling, ``select_and_scatter_add``, which XLA:CPU
  executes element by element. For the common case of non-overlapping
  windows that tile the input (``MaxPooling2D`` with ``strides == pool_size``
  and "valid" padding on divisible sizes) the same result is a few fused
  elementwise ops: each window's gradient goes to the first element (in
  window order) equal to the window's maximum, exactly as XLA's ``select``
  picks it.
* A sum over a few leading rows of a large array, such as the cores' mean of
  per-core weight gradients in a model's own ``train_step`` (a ``psum`` over
  the core axis, ``(8, 784, 256) -> (784, 256)``). XLA:CPU hands such a
  reduction to YNNPACK (in every training program and every inference program
  with convolutions or poolings on this project's bf16 hosts, see
  :mod:`keras_tpu.mxu._kernels`), which runs it 7-90x slower than adding the
  rows one by one as a fused elementwise pass: 6.6-8.9 ms against 0.10 for
  ``(8, 784, 256)`` and ``(8, 262144)``, 1.3 against 0.04 for ``(4, 65536)``
  (best of 15 runs each; from 4096 kept elements up, 4 to 16 rows). Worse,
  XLA fuses the convolution that produces per-core kernel gradients into
  that reduction: a DCGAN's own ``train_step`` spent 1.8 s of its 2.2 s step
  in one such fusion and trains 2.8x faster with it added row by row. The
  float32 sum is the same up to the order of its additions, which XLA leaves
  unspecified anyway.
* The random bits of ``Dropout`` (JAX's Threefry-2x32 hash, 20 rounds of add,
  rotate and xor). On CPU JAX lowers the hash as a loop over its five groups of
  four rounds, to compile faster; each trip writes both words of every element
  out and copies them back (two copies of a 1M-element mask per trip). Unrolled,
  XLA computes the whole hash in one fused pass, written out once for every op
  that reads the bits: the CIFAR-10 CNN's three dropout masks took 57 of its
  900 ms per training step in the loops. The bits are the same, so are the
  masks: as in plain Keras.

:func:`vector_unit_rule` is a :mod:`keras_tpu._rewrite` rule that swaps in the
fast forms wherever they apply and leaves every other op alone.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import primitives as jex_primitives
from jax.extend.random import threefry2x32_p, threefry_prng_impl

from keras_tpu import _rewrite as rewrite


def _tiles_exactly(operand_shape, window_dimensions, window_strides, padding):
    return (tuple(window_dimensions) == tuple(window_strides)
            and all(tuple(p) == (0, 0) for p in padding)
            and all(size % window == 0 for size, window in zip(operand_shape, window_dimensions)))


def tiled_select_and_scatter_add(source, operand, *, select_prim, window_dimensions, window_strides, padding):
    """``select_and_scatter_add`` for windows that tile ``operand`` exactly (see module doc).

    Example:
        >>> x = jnp.array([[1., 3., 2., 2.]])
        >>> tiled_select_and_scatter_add(jnp.array([[10., 20.]]), x, select_prim=jax.lax.ge_p,
        ...                              window_dimensions=(1, 2), window_strides=(1, 2),
        ...                              padding=((0, 0), (0, 0))).tolist()
        [[0.0, 10.0, 20.0, 0.0]]
    """
    if not _tiles_exactly(operand.shape, window_dimensions, window_strides, padding):
        raise ValueError("tiled_select_and_scatter_add needs non-overlapping, unpadded windows that tile the input.")
    shape, window = operand.shape, tuple(window_dimensions)
    blocks = tuple(size // w for size, w in zip(shape, window))
    # Each position in the window (row-major order) is a strided slice of the operand, one element per window:
    # no transposes, so XLA fuses the whole gradient into one pass (the CIFAR-10 CNN's first pooling's gradient,
    # 128 x 32 x 32 x 32: 0.9 ms against 3.9 with the window's elements gathered on a last axis and put back).
    positions = list(itertools.product(*(range(w) for w in window)))
    phases = [lax.slice(operand, start, tuple(s + (b - 1) * w + 1 for s, b, w in zip(start, blocks, window)), window)
              for start in positions]
    if select_prim is lax.ge_p:
        pick = lax.max
    elif select_prim is lax.le_p:
        pick = lax.min
    else:
        raise ValueError(f"Unsupported selection {select_prim}.")
    target = functools.reduce(pick, phases)
    # The first element equal to the target wins, as XLA's select does.
    taken = jnp.zeros(blocks, dtype=bool)
    pieces = {}
    for start, phase in zip(positions, phases):
        hit = (phase == target) & ~taken
        pieces[start] = jnp.where(hit, source, jnp.zeros((), source.dtype))
        taken = taken | hit
    return _interleaved(pieces, window)


def _interleaved(pieces, window):
    """The array whose elements at ``start + window * i`` are ``pieces[start][i]`` (the inverse of slicing
    every window position), built one axis at a time by stacking next to it: no transposes."""
    for axis, w in enumerate(window):
        if w == 1:
            continue
        along = {}
        for start, piece in pieces.items():
            along.setdefault(start[:axis] + (0,) + start[axis + 1:], [None] * w)[start[axis]] = piece
        pieces = {}
        for start, parts in along.items():
            stacked = jnp.stack(parts, axis=axis + 1)
            pieces[start] = stacked.reshape(stacked.shape[:axis] + (-1,) + stacked.shape[axis + 2:])
    return pieces[(0,) * len(window)]


@functools.lru_cache(maxsize=256)
def _traced(source_shape, source_dtype, operand_shape, operand_dtype, frozen_params, mesh):
    # ``mesh``: the abstract mesh the trace runs under. A jaxpr traced inside a ``shard_map`` (the cores' layout
    # over the devices) carries its manual axes, which a program traced outside one must not be given.
    del mesh
    params = dict(frozen_params)
    return jax.make_jaxpr(functools.partial(tiled_select_and_scatter_add, **params))(
        jax.ShapeDtypeStruct(source_shape, source_dtype), jax.ShapeDtypeStruct(operand_shape, operand_dtype))


#: A sum over leading axes is added row by row when it sums this many rows at most...
ROW_BY_ROW_MAX_ROWS = 16
#: ...each of at least this many elements (below, YNNPACK's reduction is as fast or faster).
ROW_BY_ROW_MIN_ELEMENTS = 4096


def leading_rows_sum(x, count):
    """The sum of ``x`` over its first ``count`` axes, added one row at a time (see the module doc).

    Example:
        >>> leading_rows_sum(jnp.arange(12.0).reshape(2, 3, 2), 1).tolist()
        [[6.0, 8.0], [10.0, 12.0], [14.0, 16.0]]
    """
    rows = x.reshape((-1,) + x.shape[count:])
    total = rows[0]
    for i in range(1, rows.shape[0]):
        total = total + rows[i]
    return total


@functools.lru_cache(maxsize=256)
def _traced_rows_sum(shape, dtype, count, mesh):
    del mesh  # (a key only: see _traced)
    return jax.make_jaxpr(functools.partial(leading_rows_sum, count=count))(jax.ShapeDtypeStruct(shape, dtype))


def _sums_few_large_rows(eqn):
    """How many leading axes a ``reduce_sum`` or positional ``psum`` (a sum over a vmapped axis) adds
    row by row, or ``None``."""
    if eqn.primitive is jex_primitives.reduce_sum_p:
        axes = eqn.params["axes"]
    elif eqn.primitive is jex_primitives.psum_p and eqn.params.get("axis_index_groups") is None:
        axes = eqn.params["axes"]
        if not all(isinstance(a, int) for a in axes):
            return None   # a named (device or pod) axis: a collective, not a sum of rows
    else:
        return None
    if len(eqn.invars) != 1:
        return None
    aval = eqn.invars[0].aval
    count = len(axes)
    if not count or tuple(sorted(axes)) != tuple(range(count)) or count == aval.ndim:
        return None
    if not (jnp.issubdtype(aval.dtype, jnp.floating) or jnp.issubdtype(aval.dtype, jnp.integer)):
        return None
    rows, kept = int(np.prod(aval.shape[:count])), int(np.prod(aval.shape[count:]))
    if not (2 <= rows <= ROW_BY_ROW_MAX_ROWS and kept >= ROW_BY_ROW_MIN_ELEMENTS):
        return None
    return count


#: Threefry-2x32's rotations, alternating by group of four rounds (Salmon et al., "Parallel random numbers: as
#: easy as 1, 2, 3", SC 2011; JAX's ``threefry2x32`` primitive computes the same hash).
THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = np.uint32(0x1BD11BDA)


def threefry2x32(key1, key2, x1, x2):
    """The Threefry-2x32 hash of the counters ``(x1, x2)`` under the key ``(key1, key2)``, all 20 rounds
    unrolled (uint32 operands, broadcast to a common shape): the values of JAX's ``threefry2x32`` primitive.

    Example:
        >>> from jax.extend.random import threefry_2x32
        >>> counts = jnp.arange(4, dtype=jnp.uint32)
        >>> key = jnp.array([0, 42], jnp.uint32)
        >>> mine = jnp.concatenate(threefry2x32(key[0], key[1], counts[:2], counts[2:]))
        >>> bool((mine == threefry_2x32(key, counts)).all())
        True
    """
    shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in (key1, key2, x1, x2)))
    key1, key2, a, b = (jnp.broadcast_to(jnp.asarray(v, jnp.uint32), shape) for v in (key1, key2, x1, x2))
    keys = (key1, key2, key1 ^ key2 ^ _THREEFRY_PARITY)
    a, b = a + keys[0], b + keys[1]
    for group in range(5):
        for r in THREEFRY_ROTATIONS[group % 2]:
            a = a + b
            b = lax.shift_left(b, np.uint32(r)) | lax.shift_right_logical(b, np.uint32(32 - r))
            b = a ^ b
        a = a + keys[(group + 1) % 3]
        b = b + keys[(group + 2) % 3] + np.uint32(group + 1)
    return a, b


def _unrolled_hash_rule(eqn):
    if eqn.primitive is not threefry2x32_p:
        return None
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, jnp.uint32) for v in eqn.invars]
    return _as_closed_call(eqn, jax.make_jaxpr(threefry2x32)(*shapes))


@functools.lru_cache(maxsize=256)
def _traced_random_bits(key_shape, key_dtype, bit_width, shape, mesh, partitionable):
    """``random_bits`` of Threefry keys as JAX computes them, with the hash unrolled."""
    del mesh, partitionable  # (keys only: see _traced; JAX's counters depend on jax_threefry_partitionable)

    def bits(keys):
        one = functools.partial(threefry_prng_impl.random_bits, bit_width=bit_width, shape=shape)
        for _ in key_shape:   # random_bits of an array of keys: each key's bits
            one = jax.vmap(one)
        data = jax.random.key_data(keys)
        out = one(data)
        # Written out once: XLA would fuse the hash into each reader and compute it again in each (a dropout
        # mask read back by max pooling's gradient: again for every element of the pooling window; the CIFAR
        # CNN's backward fusion took 6.1 ms instead of 4.1). XLA:CPU drops optimization barriers before it
        # fuses, but does not copy an expensive op into several readers: the bits end in a division by one
        # (a one XLA cannot see, from the key; the bits stay the same).
        if not data.size or not out.size:
            return out
        unit = jnp.minimum(data.ravel()[0], np.uint32(0)).astype(out.dtype) + jnp.ones((), out.dtype)
        return lax.div(out, jnp.broadcast_to(unit, out.shape))

    closed = jax.make_jaxpr(bits)(jax.ShapeDtypeStruct(key_shape, key_dtype))
    return rewrite.rewrite_closed_jaxpr(closed, _unrolled_hash_rule)


def _is_threefry_key(aval):
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key) and \
        str(aval.dtype) == f"key<{threefry_prng_impl.tag}>"


def _as_closed_call(eqn, closed):
    outs = [v.aval for v in eqn.outvars]
    if len(closed.out_avals) != len(outs) or any(
            c.shape != o.shape or c.dtype != o.dtype for c, o in zip(closed.out_avals, outs)):
        return None
    return eqn.replace(primitive=jex_primitives.closed_call_p, params={"call_jaxpr": closed})


def vector_unit_rule():
    """A :mod:`keras_tpu._rewrite` rule replacing tiling ``select_and_scatter_add``, sums over a few
    large leading rows and the Threefry hash by their fast forms."""
    def rule(eqn):
        if eqn.primitive.name == "random_bits" and _is_threefry_key(eqn.invars[0].aval):
            key = eqn.invars[0].aval
            return _as_closed_call(eqn, _traced_random_bits(tuple(key.shape), key.dtype, eqn.params["bit_width"],
                                                            tuple(eqn.params["shape"]),
                                                            jax.sharding.get_abstract_mesh(),
                                                            jax.config.jax_threefry_partitionable))
        unrolled = _unrolled_hash_rule(eqn)   # (a program that hashes by itself)
        if unrolled is not None:
            return unrolled
        count = _sums_few_large_rows(eqn)
        if count is not None:
            aval = eqn.invars[0].aval
            return _as_closed_call(eqn, _traced_rows_sum(aval.shape, aval.dtype, count,
                                                         jax.sharding.get_abstract_mesh()))
        if eqn.primitive is not jex_primitives.select_and_scatter_add_p:
            return None
        params = eqn.params
        source, operand = (v.aval for v in eqn.invars)
        if not operand.size:  # (a replica with no rows: nothing to scatter)
            return None
        if params["select_prim"] not in (lax.ge_p, lax.le_p) or not _tiles_exactly(
                operand.shape, params["window_dimensions"], params["window_strides"], params["padding"]):
            return None
        frozen = tuple(sorted((k, tuple(map(tuple, v)) if k == "padding" else v) for k, v in params.items()))
        return _as_closed_call(eqn, _traced(source.shape, source.dtype, operand.shape, operand.dtype, frozen,
                                            jax.sharding.get_abstract_mesh()))
    return rule
