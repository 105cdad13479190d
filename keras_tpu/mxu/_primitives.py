"""The MXU as JAX primitives: ``mxu_dot_general`` and ``mxu_conv``.

Each takes the same operands and parameters as ``lax.dot_general`` /
``lax.conv_general_dilated`` plus ``mxu_precision``, and computes what a TPU
matrix unit computes (see :mod:`keras_tpu.mxu._numerics`). Being primitives,
they appear by name in jaxprs, so a traced program's MXU work can be found and
costed (:mod:`keras_tpu.mxu._program`).

Their autodiff and batching rules reuse JAX's rules for the plain ops and
route the ops those rules produce back onto the MXU, so ``grad`` and ``vmap``
of MXU code stay on the MXU. Like ``jax/_src/lax/convolution.py``, this
module keeps each primitive's rules beside it, including the rewrite rule
that replaces the plain op by the primitive (:func:`mxu_rule`) and
:func:`route`, which the transpose and batching rules need; the public
routing module :mod:`keras_tpu.mxu._routing` re-exports them. (So of the MXU
package this module imports only :mod:`~keras_tpu.mxu._numerics` and
:mod:`~keras_tpu.mxu._kernels`.)

Lowering: each bf16 pass is one XLA dot or convolution with exact products
and float32 accumulation, in the form :mod:`keras_tpu.mxu._kernels` chooses
for the op's layout and shape on this host (bf16 operands with a float32
result, or bfloat16-rounded float32 operands; see there for the measured
numbers). A convolution is lowered to XLA's own convolution rather than an
explicit im2col GEMM: the numbers are the
same up to float32 summation order, and XLA:CPU's convolution is several times
faster than materialising the im2col matrix. The im2col mapping onto the
array is what the cost model (:mod:`keras_tpu.mxu._cost`) and the reference
systolic array (:mod:`keras_tpu.mxu._systolic`) use.
"""

import collections
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from keras_tpu import _rewrite as rewrite
from keras_tpu.mxu import _kernels as kernels
from keras_tpu.mxu._numerics import Precision, canonical_precision, is_mxu_dtype, multipass, op_precision


def _static(*shapes):
    """Whether every dimension is a number (``jax.export``'s symbolic batch is not: no measured choice)."""
    return all(isinstance(d, int) for shape in shapes for d in shape)


def dot_form(lhs, rhs, dimension_numbers, bf16_valued=(False, False)):
    """The form (:mod:`keras_tpu.mxu._kernels`) one bf16 pass of a dot of ``lhs`` and ``rhs`` (arrays or avals)
    runs in; ``bf16_valued``: per operand, whether a float32 operand holds bfloat16 values already.

    Example:
        >>> dot_form(jnp.ones((8, 4)), jnp.ones((4, 3)), (((1,), (0,)), ((), ()))) in kernels.DOT_FORMS
        True
    """
    if not _static(lhs.shape, rhs.shape):
        return kernels.ROUND_F32
    layout = kernels.dot_layout(lhs.ndim, rhs.ndim, dimension_numbers)
    bf16 = [a.dtype == jnp.bfloat16 or valued for a, valued in zip((lhs, rhs), bf16_valued)]
    bf16_operand = bf16[0] != bf16[1]  # a weight rounded once
    return kernels.choose_form("dot", layout, kernels.dot_gemm(lhs.shape, rhs.shape, dimension_numbers),
                               bf16_operand)


def _dot_pass(lhs, rhs, out_shape, dimension_numbers, bf16_valued=(False, False)):
    """The chosen form of one bf16 pass of this dot: ``(form, pass function)``."""
    form = dot_form(lhs, rhs, dimension_numbers, bf16_valued)
    return form, lambda a, b: kernels.dot_pass(a, b, dimension_numbers, form)


def _conv_pass(lhs, rhs, out_shape, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
               feature_group_count, batch_group_count, bf16_valued=(False, False), window_reversed=False):
    """The chosen form of one bf16 pass of this convolution: ``(form, pass function)``; ``window_reversed``:
    the window is ``rhs`` reversed in its spatial dimensions (see :func:`_reversed_windows`)."""
    geometry = dict(window_strides=window_strides, padding=padding, lhs_dilation=lhs_dilation,
                    rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                    feature_group_count=feature_group_count, batch_group_count=batch_group_count)
    as_dot = kernels.conv_as_dot(lhs.shape, rhs.shape, **geometry) if _static(lhs.shape, rhs.shape, out_shape) \
        else None
    if as_dot is not None and window_reversed:
        form, one_pass = _conv_pass(lhs, rhs, out_shape, **geometry)
        return form, lambda a, b: one_pass(a, lax.rev(b, tuple(dimension_numbers.rhs_spec[2:])))
    if as_dot is not None:
        # A pointwise convolution and its gradients are matrix products (as a TPU runs them): on the dot's
        # forms, native bf16 where that measured faster, and no convolution for XLA:CPU to canonicalise.
        dot_numbers, dropped, _ = as_dot
        rhs_shape = tuple(d for i, d in enumerate(rhs.shape) if i not in dropped)
        form = kernels.choose_form("dot", kernels.dot_layout(lhs.ndim, len(rhs_shape), dot_numbers),
                                   kernels.dot_gemm(lhs.shape, rhs_shape, dot_numbers))
        return form, lambda a, b: kernels.conv_dot_pass(a, b, out_shape, dimension_numbers, as_dot, form)
    if _static(lhs.shape, rhs.shape, out_shape):
        gemm = kernels.conv_gemm(lhs.shape, rhs.shape, out_shape, dimension_numbers, feature_group_count,
                                 batch_group_count)
        form = kernels.choose_form("conv", kernels.conv_layout(dimension_numbers), gemm)
    else:
        form = kernels.ROUND_F32
    return form, lambda a, b: kernels.conv_pass(a, b, geometry, form, window_reversed)


class _MXUPrimitive:
    """One MXU primitive: the plain lax op it replaces and how to run it on the MXU."""

    def __init__(self, name, plain_primitive, plain_fn, pass_fn):
        self.primitive = jex_core.Primitive(name)
        self.plain_primitive = plain_primitive
        self.plain_fn = plain_fn      # (lhs, rhs, **plain_params) -> lax op
        self.pass_fn = pass_fn        # (lhs, rhs, out_shape, **geometry params) -> (form, one bf16 pass)
        p = self.primitive
        p.def_impl(self._eager)
        p.def_abstract_eval(self._abstract_eval)
        mlir.register_lowering(p, mlir.lower_fun(self._compute, multiple_results=False))
        ad.defbilinear(p, self._transpose_rule(0), self._transpose_rule(1))
        batching.primitive_batchers[p] = self._batch_rule

    @staticmethod
    def split_params(params):
        """``(MXU precision, the plain lax op's params)``: without the hint ``bf16_valued`` (see
        :func:`reading_bf16_valued`), which transposed or batched products do not keep (they round again)."""
        params = dict(params)
        precision = params.pop("mxu_precision")
        params.pop("bf16_valued", None)
        return precision, params

    def _abstract_eval(self, lhs, rhs, **params):
        _, plain = self.split_params(params)
        plain.pop("window_reversed", None)   # (a reversed window has the same shape)
        aval, _effects = self.plain_primitive.abstract_eval(lhs, rhs, precision=None, **plain)
        return aval

    def _compute(self, lhs, rhs, **params):
        precision, plain = self.split_params(params)
        geometry = {k: v for k, v in plain.items() if k not in ("preferred_element_type", "out_sharding")}
        out = self._abstract_eval(jax.typeof(lhs), jax.typeof(rhs), **params)
        if not lhs.size or not rhs.size:  # a replica with no rows (a partial batch): nothing to multiply or sum
            return jnp.zeros(out.shape, out.dtype)
        bf16_valued = params.get("bf16_valued", (False, False))
        form, one_pass = self.pass_fn(lhs, rhs, out.shape, bf16_valued=bf16_valued, **geometry)
        result = multipass(one_pass, lhs, rhs, precision, kernels.operand_dtype(form), bf16_valued)
        return result.astype(out.dtype)

    def _eager(self, lhs, rhs, **params):
        return _jitted(self, _freeze(params), kernels.choice_key())(lhs, rhs)

    def _transpose_rule(self, operand):
        def rule(cotangent, lhs, rhs, **params):
            precision, plain = self.split_params(params)
            unknown, known = (lhs, rhs) if operand == 0 else (rhs, lhs)

            def forward(u):
                a, b = (u, known) if operand == 0 else (known, u)
                return self.plain_fn(a, b, **plain)

            transpose = jax.linear_transpose(forward, jax.ShapeDtypeStruct(unknown.aval.shape, unknown.aval.dtype))
            (result,) = route(transpose, precision=precision)(cotangent)
            return result
        return rule

    def _batch_rule(self, args, dims, **params):
        precision, plain = self.split_params(params)
        one = functools.partial(self.plain_fn, **plain)
        if self.plain_primitive is lax.conv_general_dilated_p and None not in dims:
            # Both operands differ per batch entry: each core's weight gradient, where a replica function takes
            # its gradient on its core (strategy.run). JAX's rule would fold the entries into one grouped
            # convolution, which XLA:CPU runs several times slower than the convolutions one after another.
            lhs, rhs = (jnp.moveaxis(a, d, 0) for a, d in zip(args, dims))
            return lax.map(lambda pair: route(one, precision=precision)(*pair), (lhs, rhs)), 0
        return route(jax.vmap(one, in_axes=tuple(dims)), precision=precision)(*args), 0

    def bind(self, lhs, rhs, precision, **plain_params):
        return self.primitive.bind(lhs, rhs, mxu_precision=canonical_precision(precision), **plain_params)


def _freeze(params):
    return tuple(sorted(params.items()))


@functools.lru_cache(maxsize=512)
def _jitted(op, frozen_params, choice_key):  # choice_key: the kernel-form settings the program is lowered with
    params = dict(frozen_params)
    # Compiled as keras-tpu's own programs are, so that XLA keeps the pass's bf16 rounding exact.
    return jax.jit(lambda lhs, rhs: op.primitive.bind(lhs, rhs, **params),
                   compiler_options=kernels.compiler_options("predict"))


def _plain_dot(lhs, rhs, *, dimension_numbers, preferred_element_type=None, out_sharding=None):
    return lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type,
                           out_sharding=out_sharding)


def _plain_conv(lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                feature_group_count, batch_group_count, preferred_element_type=None, out_sharding=None,
                window_reversed=False):
    if window_reversed:
        rhs = lax.rev(rhs, tuple(dimension_numbers.rhs_spec[2:]))
    return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                    dimension_numbers, feature_group_count, batch_group_count,
                                    preferred_element_type=preferred_element_type,
                                    out_sharding=out_sharding)


DOT = _MXUPrimitive("mxu_dot_general", lax.dot_general_p, _plain_dot, _dot_pass)
CONV = _MXUPrimitive("mxu_conv", lax.conv_general_dilated_p, _plain_conv, _conv_pass)

mxu_dot_general_p = DOT.primitive
mxu_conv_p = CONV.primitive
MXU_PRIMITIVES = (mxu_dot_general_p, mxu_conv_p)


_REPLACEMENTS = {
    lax.dot_general_p: mxu_dot_general_p,
    lax.conv_general_dilated_p: mxu_conv_p,
}


def mxu_rule(precision="default"):
    """A :mod:`keras_tpu._rewrite` rule that puts float dots and convolutions on the MXU.

    An op that asks for more than the default precision (``HIGH`` or
    ``HIGHEST``) gets it; all others run at ``precision``. Integer and
    float64 products stay off the MXU.

    Example:
        >>> eqn = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 3)), jnp.ones((3, 4))).eqns[0]
        >>> rewritten = mxu_rule("high")(eqn)
        >>> rewritten.primitive.name, rewritten.params["mxu_precision"]
        ('mxu_dot_general', <Precision.HIGH: 3>)
    """
    default = canonical_precision(precision)

    def rule(eqn):
        return _routed(eqn, default)

    rule.fold = functools.partial(_reversed_windows, default=default)
    return rule


def _routed(eqn, default, **extra_params):
    """``eqn`` on its MXU primitive (``extra_params`` added), or ``None`` where it stays off the MXU."""
    target = _REPLACEMENTS.get(eqn.primitive)
    if target is None or not all(is_mxu_dtype(v.aval.dtype) for v in eqn.invars):
        return None
    params = dict(eqn.params, **extra_params)
    params["mxu_precision"] = op_precision(params.pop("precision"), default)
    return eqn.replace(primitive=target, params=params)


def _reversed_windows(eqns, outvars, default):
    """``eqns`` with each convolution whose window is a ``rev`` of its spatial dimensions (autodiff's input
    gradient reverses the forward window) routed onto the MXU reading the window unreversed, with
    ``window_reversed``: the direct kernels read it back to front (:func:`kernels.conv_pass`), so the program
    keeps no reversed (and separately rounded) copy of each kernel. XLA:CPU compiled one loop for each
    reversal: the largest group of ResNet-20's training program (5 kernels, 0.31 of 2.4 MB of LLVM IR). The
    ``rev`` stays where anything else reads it.

    Example:
        >>> x, w = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4))
        >>> conv = lambda x, w: lax.conv_general_dilated(x, lax.rev(w, (0, 1)), (1, 1), "SAME",
        ...                                              dimension_numbers=("NHWC", "HWIO", "NHWC"))
        >>> eqns = _reversed_windows(jax.make_jaxpr(conv)(x, w).eqns, [], Precision.DEFAULT)
        >>> [(e.primitive.name, e.params.get("window_reversed")) for e in eqns]
        [('mxu_conv', True)]
    """
    producer = {v: e for e in eqns for v in e.outvars}
    readers = collections.Counter(v for e in eqns for v in e.invars if isinstance(v, jex_core.Var))
    readers.update(v for v in outvars if isinstance(v, jex_core.Var))
    folded, unread = [], set()
    for eqn in eqns:
        window = eqn.invars[1] if eqn.primitive is lax.conv_general_dilated_p else None
        reversal = producer.get(window) if isinstance(window, jex_core.Var) else None
        if reversal is not None and reversal.primitive is lax.rev_p:
            spatial = tuple(eqn.params["dimension_numbers"].rhs_spec[2:])
            if set(reversal.params["dimensions"]) == set(spatial) and any(window.aval.shape[d] > 1 for d in spatial):
                routed = _routed(eqn.replace(invars=[eqn.invars[0], reversal.invars[0]]), default,
                                 window_reversed=True)
                if routed is not None:
                    eqn = routed
                    readers[window] -= 1
                    if not readers[window]:
                        unread.add(window)
        folded.append(eqn)
    return [e for e in folded if not (e.primitive is lax.rev_p and e.outvars[0] in unread)]


def reading_bf16_valued(eqn, operands):
    """``eqn``, a float32 ``dot_general`` at the MXU's default precision, as an MXU product whose operands at
    positions ``operands`` hold bfloat16 values in float32 arrays (weights rounded once, see
    :mod:`keras_tpu._rounded_weights`): its pass multiplies them as they are instead of rounding them again.

    Example:
        >>> eqn = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 3)), jnp.ones((3, 4))).eqns[0]
        >>> reading_bf16_valued(eqn, [1]).params["bf16_valued"]
        (False, True)
    """
    routed = mxu_rule("default")(eqn)
    if routed is None or routed.primitive is not mxu_dot_general_p or routed.params["mxu_precision"] is not \
            Precision.DEFAULT:
        raise ValueError(f"Only a float dot_general at the default precision reads bfloat16-valued operands; got "
                         f"{eqn.primitive} with {eqn.params.get('precision')}.")
    return routed.replace(params=dict(routed.params, bf16_valued=tuple(i in operands for i in range(2))))


def route(fun, precision="default"):
    """Return ``fun`` with all its matrix work on the MXU (see :mod:`keras_tpu.mxu._routing`).

    Args:
        fun: a JAX-traceable function of arrays (or pytrees of arrays).
        precision: ``"default"`` (one bfloat16 pass), ``"high"``
            (bf16_3x) or ``"highest"`` (bf16_6x), or an alias.

    Compile the routed function with ``xla_allow_excess_precision`` off, as
    keras-tpu compiles its own programs: by default XLA may drop the bf16
    rounding of the MXU's operands where it fuses it with a reduction (see
    ``keras_tpu.mxu._kernels.compiler_options``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from keras_tpu import mxu
        >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
        >>> grads = jax.jit(mxu.route(jax.grad(loss)), compiler_options={"xla_allow_excess_precision": False})(
        ...     jnp.ones((3, 2)), jnp.ones((4, 3)))
    """
    return rewrite.transform(fun, mxu_rule(precision))


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """``lax.dot_general`` on the MXU.

    Example:
        >>> out = dot_general(jnp.ones((4, 3)), jnp.ones((3, 2)), (((1,), (0,)), ((), ())))
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if preferred_element_type is None and lhs.dtype != rhs.dtype:
        common = jnp.result_type(lhs, rhs)
        lhs, rhs = lhs.astype(common), rhs.astype(common)
    (lc, rc), (lb, rb) = dimension_numbers
    dn = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    pet = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
    return DOT.bind(lhs, rhs, precision, dimension_numbers=dn, preferred_element_type=pet, out_sharding=None)


def matmul(lhs, rhs, precision=None):
    """Matrix product on the MXU (``jnp.matmul`` semantics, float32 result for float32 inputs).

    Inputs are rounded to bfloat16, products are exact, sums are float32.
    ``precision`` is ``"default"`` (one bf16 pass), ``"high"`` (bf16_3x) or
    ``"highest"`` (bf16_6x); aliases ``"bfloat16"``, ``"bfloat16_3x"``,
    ``"float32"`` and ``jax.lax.Precision`` values are accepted.

    Example:
        >>> import keras_tpu
        >>> c = keras_tpu.mxu.matmul(jnp.ones((128, 256)), jnp.ones((256, 64)))
        >>> c.shape, c.dtype
        ((128, 64), dtype('float32'))
    """
    return route(jnp.matmul, precision=canonical_precision(precision))(lhs, rhs)


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                         precision=None, preferred_element_type=None):
    """``lax.conv_general_dilated`` on the MXU (same arguments).

    Example:
        >>> y = conv_general_dilated(jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4)), (1, 1), "SAME",
        ...                          dimension_numbers=("NHWC", "HWIO", "NHWC"))
    """
    def conv(a, b):
        return lax.conv_general_dilated(a, b, window_strides, padding, lhs_dilation, rhs_dilation,
                                        dimension_numbers, feature_group_count, batch_group_count,
                                        preferred_element_type=preferred_element_type)

    return route(conv, precision=canonical_precision(precision))(lhs, rhs)


__all__ = ["Precision", "mxu_dot_general_p", "mxu_conv_p", "MXU_PRIMITIVES", "dot_general", "matmul",
           "conv_general_dilated", "mxu_rule", "route"]
