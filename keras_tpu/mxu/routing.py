"""Route every matrix multiplication and convolution of a JAX program onto the MXU.

:func:`route` takes any JAX function (a Keras train step, say) and returns
one that computes the same thing with each floating-point ``dot_general`` and
``conv_general_dilated`` replaced by the MXU primitives, wherever they occur:
in the backward pass that autodiff built, in nested ``jit``, ``scan``,
``while``, ``cond``, ``remat`` and in ``custom_jvp``/``custom_vjp``
functions. Differentiating or vmapping a routed function keeps the new ops on
the MXU as well.

An op that asks for more than the default precision (``precision=HIGH`` or
``HIGHEST``) gets it, as on a TPU; all others run at the routing precision.
Integer and float64 products stay off the MXU.
"""

from jax import lax

from keras_tpu import rewrite
from keras_tpu.mxu.numerics import canonical_precision, is_mxu_dtype, op_precision
from keras_tpu.mxu.primitives import mxu_conv_p, mxu_dot_general_p

_REPLACEMENTS = {
    lax.dot_general_p: mxu_dot_general_p,
    lax.conv_general_dilated_p: mxu_conv_p,
}


def mxu_rule(precision="default"):
    """A :mod:`keras_tpu.rewrite` rule that puts float dots and convolutions on the MXU."""
    default = canonical_precision(precision)

    def rule(eqn):
        target = _REPLACEMENTS.get(eqn.primitive)
        if target is None or not all(is_mxu_dtype(v.aval.dtype) for v in eqn.invars):
            return None
        params = dict(eqn.params)
        params["mxu_precision"] = op_precision(params.pop("precision"), default)
        return eqn.replace(primitive=target, params=params)

    return rule


def route(fun, precision="default"):
    """Return ``fun`` with all its matrix work on the MXU.

    Args:
        fun: a JAX-traceable function of arrays (or pytrees of arrays).
        precision: ``"default"`` (one bfloat16 pass), ``"high"``
            (bf16_3x) or ``"highest"`` (bf16_6x), or an alias.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from keras_tpu import mxu
        >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
        >>> grads = jax.jit(mxu.route(jax.grad(loss)))(jnp.ones((3, 2)), jnp.ones((4, 3)))
    """
    return rewrite.transform(fun, mxu_rule(precision))
