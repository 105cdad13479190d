"""Vector-unit operations that XLA:CPU runs slowly, given exact faster lowerings.

A TPU core runs everything that is not a matrix product on its vector unit.
On the simulating CPU one such op stands out: the gradient of max pooling,
``select_and_scatter_add``, which XLA:CPU executes element by element. For the
common case of non-overlapping windows that tile the input (``MaxPooling2D``
with ``strides == pool_size`` and "valid" padding on divisible sizes) the
same result is a few fused elementwise ops: each window's gradient goes to
the first element (in window order) equal to the window's maximum, exactly
as XLA's ``select`` picks it.

:func:`vector_unit_rule` is a :mod:`keras_tpu._rewrite` rule that swaps in the
fast form wherever it applies and leaves every other op alone.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import primitives as jex_primitives


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
    split = operand.reshape(tuple(x for pair in zip(blocks, window) for x in pair))
    # Bring each window's elements together on the last axis, in row-major window order.
    ndim = len(shape)
    block_axes, window_axes = list(range(0, 2 * ndim, 2)), list(range(1, 2 * ndim, 2))
    windows = jnp.transpose(split, block_axes + window_axes).reshape(blocks + (-1,))
    if select_prim is lax.ge_p:
        target = jnp.max(windows, axis=-1, keepdims=True)
    elif select_prim is lax.le_p:
        target = jnp.min(windows, axis=-1, keepdims=True)
    else:
        raise ValueError(f"Unsupported selection {select_prim}.")
    # The first element equal to the target wins, as XLA's select does; unrolled over the
    # (few) window elements so that it all fuses into one elementwise pass.
    taken = jnp.zeros(blocks, dtype=bool)
    pieces = []
    for k in range(windows.shape[-1]):
        hit = (windows[..., k] == target[..., 0]) & ~taken
        pieces.append(jnp.where(hit, source, jnp.zeros((), source.dtype)))
        taken = taken | hit
    scattered = jnp.stack(pieces, axis=-1)
    scattered = scattered.reshape(blocks + window)
    inverse = np.argsort(block_axes + window_axes)
    return jnp.transpose(scattered, tuple(inverse)).reshape(shape)


@functools.lru_cache(maxsize=256)
def _traced(source_shape, source_dtype, operand_shape, operand_dtype, frozen_params):
    params = dict(frozen_params)
    return jax.make_jaxpr(functools.partial(tiled_select_and_scatter_add, **params))(
        jax.ShapeDtypeStruct(source_shape, source_dtype), jax.ShapeDtypeStruct(operand_shape, operand_dtype))


def vector_unit_rule():
    """A :mod:`keras_tpu._rewrite` rule replacing tiling ``select_and_scatter_add`` by its fast form."""
    def rule(eqn):
        if eqn.primitive is not jex_primitives.select_and_scatter_add_p:
            return None
        params = eqn.params
        source, operand = (v.aval for v in eqn.invars)
        if params["select_prim"] not in (lax.ge_p, lax.le_p) or not _tiles_exactly(
                operand.shape, params["window_dimensions"], params["window_strides"], params["padding"]):
            return None
        frozen = tuple(sorted((k, tuple(map(tuple, v)) if k == "padding" else v) for k, v in params.items()))
        closed = _traced(source.shape, source.dtype, operand.shape, operand.dtype, frozen)
        if closed.out_avals[0].shape != eqn.outvars[0].aval.shape or \
                closed.out_avals[0].dtype != eqn.outvars[0].aval.dtype:
            return None
        return eqn.replace(primitive=jex_primitives.closed_call_p, params={"call_jaxpr": closed})
    return rule
