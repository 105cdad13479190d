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

The rule and :func:`route` are defined beside the primitives, in
:mod:`keras_tpu.mxu._primitives` (whose autodiff and batching rules route the
ops they build); this module is their public home.
"""

from keras_tpu.mxu._primitives import mxu_rule, route

__all__ = ["mxu_rule", "route"]
