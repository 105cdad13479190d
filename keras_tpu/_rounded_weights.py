"""Weights the MXU reads in bfloat16, rounded once for a whole evaluation instead of in every step.

At the default precision the MXU multiplies bfloat16 values, so every step of
a float32 model rounds each weight it multiplies. Training changes the weights
every step; evaluation and prediction do not. Their programs therefore take,
besides the float32 state, bfloat16 copies of the trainable weights made once
for a state (:func:`round_weights`), and a ``dot_general`` at the default
precision that reads a weight directly multiplies the copy
(:func:`reading_rounded_weights`). Everything else (a bias, an embedding
lookup, a product at ``high`` or ``highest`` precision, a convolution, whose
kernel is small and which XLA:CPU runs no faster on bfloat16 operands) reads
the float32 weight, and the state a program returns is the float32 one. The
numbers do not change: such a product rounds its operands to bfloat16 anyway.

At small batches the rounding cost as much as the product: keras.io's MNIST
MLP (784-512-512-10) at batch 32 ran a 32x784x512 product in 313 us with both
operands rounded per call against 133 us on a bfloat16 copy, and plain
float32 in 163 us (``lax.dot_general`` alone, this project's 2-core host).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from keras_tpu.mxu._numerics import Precision, canonical_precision, op_precision


def roundable(leaves):
    """Positions of the float32 arrays of two or more dimensions among ``leaves`` (kernels, not biases).

    Example:
        >>> roundable([jnp.ones((3, 4)), jnp.ones(4), jnp.ones((2, 2), "int32")])
        [0]
    """
    return [i for i, a in enumerate(leaves) if a.dtype == jnp.float32 and a.ndim >= 2]


@jax.jit
def _to_bfloat16(arrays):
    return [a.astype(jnp.bfloat16) for a in arrays]


def round_weights(trainable):
    """bfloat16 copies of the roundable arrays of ``trainable`` (a pytree), in :func:`roundable` order.

    Example:
        >>> [a.dtype for a in round_weights([jnp.ones((3, 4)), jnp.ones(4)])]
        [dtype(bfloat16)]
    """
    leaves = jax.tree.leaves(trainable)
    return _to_bfloat16([leaves[i] for i in roundable(leaves)])


def reading_rounded_weights(fn, precision="default"):
    """``fn(state, *rest)`` as ``fn(state, rounded, *rest)``, its default-precision products reading ``rounded``.

    ``state[0]`` holds the trainable weights and ``rounded`` is
    ``round_weights(state[0])``. Every ``dot_general`` at the
    top level of ``fn``'s program that runs at the default precision (the op
    asks for none higher and ``precision`` is ``"default"``) and takes one of
    those weights as an operand takes its bfloat16 copy instead; the result
    keeps its float32 type. Products inside nested programs (a ``scan`` body,
    say) keep reading the float32 weight.

    Example:
        >>> f = reading_rounded_weights(lambda state, x: x @ state[0][0])
        >>> w = jnp.full((3, 2), 1 / 3)
        >>> f(([w],), round_weights([w]), jnp.ones((1, 3))).dtype
        dtype('float32')
    """
    default = canonical_precision(precision)

    def with_rounded(state, rounded, *rest):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(state, *rest)
        jaxpr = closed.jaxpr
        weights = jaxpr.invars[:len(jax.tree.leaves(state[0]))]  # the program's first inputs are state[0]'s
        positions = roundable([v.aval for v in weights])
        copies = [jex_core.Var(jax.core.ShapedArray(weights[i].aval.shape, jnp.bfloat16)) for i in positions]
        copy_of = {weights[i]: copy for i, copy in zip(positions, copies)}
        eqns = [_reading_copies(eqn, copy_of, default) for eqn in jaxpr.eqns]
        rewritten = jaxpr.replace(invars=jaxpr.invars + copies, eqns=eqns)
        flat = jax.tree.leaves((state, *rest)) + list(rounded)
        out = jax.core.eval_jaxpr(rewritten, closed.consts, *flat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return with_rounded


def _reading_copies(eqn, copy_of, default):
    """``eqn`` with its weight operands replaced by their bfloat16 copies, where it is a default-precision product."""
    if eqn.primitive is not lax.dot_general_p or not any(v in copy_of for v in eqn.invars[:2] if isinstance(v, jex_core.Var)):
        return eqn
    if op_precision(eqn.params.get("precision"), default) is not Precision.DEFAULT:
        return eqn
    out_dtype = eqn.outvars[0].aval.dtype
    if out_dtype != jnp.float32 or any(v.aval.dtype != jnp.float32 for v in eqn.invars[:2]):
        return eqn
    invars = [copy_of.get(v, v) if isinstance(v, jex_core.Var) else v for v in eqn.invars]
    # Mixed operand types need the result type spelled out (float32, as before).
    return eqn.replace(invars=invars, params=dict(eqn.params, preferred_element_type=out_dtype))
