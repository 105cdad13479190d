"""The MXU work of a traced program: every MXU op, its GEMM shape, cost and origin.

After :func:`keras_tpu.mxu.route`, a program's matrix work is the
``mxu_dot_general`` and ``mxu_conv`` equations of its jaxpr. :func:`mxu_ops`
finds them all (inside loops, branches and nested calls), maps each onto the
array (see :mod:`keras_tpu.mxu._cost`) and records where it came from: the
name stack that JAX keeps, which for a Keras model names the layer, and
whether autodiff made it (backward) or not (forward).

Two mappings differ from plain im2col, as a TPU compiler's do:

* A convolution with input dilation (a transposed convolution, and the
  input gradient of every strided convolution) is costed by its non-zero
  products: im2col would stream the zeros inserted between input elements
  through the array, a compiler splits the convolution into phases that skip
  them. ``K`` becomes the average number of kernel taps that land on a real
  input element, times the input channels (exact per spatial dimension).
* A weight gradient (a backward op whose result has the shape of a forward
  op's weights) is mapped the cheapest of SCALE-Sim's dataflows
  (:meth:`~keras_tpu.mxu._cost.GemmCost.cheapest_dataflow`); its ``cost.dataflow``
  says which.
"""

import dataclasses
import math
import re

import jax

from keras_tpu import _rewrite as rewrite
from keras_tpu.mxu._cost import GemmCost
from keras_tpu.mxu._numerics import Precision
from keras_tpu.mxu._primitives import mxu_conv_p, mxu_dot_general_p
from keras_tpu.mxu._routing import route


@dataclasses.dataclass(frozen=True)
class MXUOp:
    """One MXU operation of a program, as it runs on one core.

    Example:
        >>> op, = trace_mxu_ops(lambda a, b: a @ b, jnp.ones((8, 4)), jnp.ones((4, 2)))
        >>> op.kind, op.pass_name, op.precision, (op.cost.m, op.cost.k, op.cost.n)
        ('dot', 'forward', <Precision.DEFAULT: 1>, (8, 4, 2))
    """

    kind: str                 # "dot" or "conv"
    name_stack: str           # JAX's name stack, e.g. "transpose(jvp(functional))/conv2d"
    scopes: tuple             # the name scopes without transformations, outermost first
    backward: bool            # created by autodiff (a transposed op)
    cost: GemmCost            # one execution, all groups and bf16 passes included
    repeats: int              # executions per program call (scan trip counts multiplied)
    precision: Precision
    lhs_shape: tuple
    rhs_shape: tuple
    out_shape: tuple
    in_loop: bool = False     # inside a while loop: trip count unknown, counted once
    in_branch: bool = False   # inside a cond branch: may not run
    dtypes: tuple = ("float32", "float32", "float32")   # lhs, rhs and result element types
    weight_gradient: bool = False                        # a backward op producing a weight's gradient
    zero_skipped: float = 0.0  # share of im2col's products skipped as zeros of an input dilation

    @property
    def pass_name(self):
        return "backward" if self.backward else "forward"

    @property
    def cycles(self):
        """Cycles of all executions per program call."""
        return self.repeats * self.cost.cycles

    @property
    def macs(self):
        return self.repeats * self.cost.macs // self.precision.passes


_TRANSFORM = re.compile(r"^(\w+)\((.*)\)$")


def split_name_stack(name_stack):
    """``"transpose(jvp(model))/dense"`` -> ``(("model", "dense"), {"transpose", "jvp"})``.

    Example:
        >>> scopes, transforms = split_name_stack("transpose(jvp(model))/dense")
        >>> scopes, sorted(transforms)
        (('model', 'dense'), ['jvp', 'transpose'])
    """
    scopes, transforms = [], set()
    for part in str(name_stack).split("/"):
        match = _TRANSFORM.match(part)
        while match:
            transforms.add(match.group(1))
            part = match.group(2)
            match = _TRANSFORM.match(part)
        if part:
            scopes.append(part)
    return tuple(scopes), transforms


def _dot_gemm(eqn):
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    free_l = [d for i, d in enumerate(lhs) if i not in lc and i not in lb]
    free_r = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
    batch = math.prod(lhs[i] for i in lb)
    return math.prod(free_l), math.prod(lhs[i] for i in lc), math.prod(free_r), batch


def _taps_on_real_inputs(out_size, in_size, kernel_size, stride, rhs_dilation, lhs_dilation, pad_low):
    """Over one spatial dimension: the (output position, kernel tap) pairs that read a real input
    element, not a zero inserted by the input dilation or padding."""
    dilated_in = (in_size - 1) * lhs_dilation + 1
    count = 0
    for o in range(out_size):
        for t in range(kernel_size):
            p = o * stride + t * rhs_dilation - pad_low
            count += 0 <= p < dilated_in and p % lhs_dilation == 0
    return count


def _conv_gemm(eqn):
    """``(m, k, n, groups, zero_skipped)`` of a convolution, ``k`` counting non-zero taps only."""
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    out = eqn.outvars[0].aval.shape
    dn = eqn.params["dimension_numbers"]
    groups = eqn.params["feature_group_count"] * eqn.params["batch_group_count"]
    out_positions = math.prod(out[i] for i in dn.out_spec[2:])
    kernel_positions = math.prod(rhs[i] for i in dn.rhs_spec[2:])
    m = out[dn.out_spec[0]] * out_positions
    k = kernel_positions * rhs[dn.rhs_spec[1]]
    n = rhs[dn.rhs_spec[0]] // groups
    lhs_dilation = tuple(eqn.params.get("lhs_dilation") or (1,) * len(dn.out_spec[2:]))
    if any(d > 1 for d in lhs_dilation) and out_positions and kernel_positions:
        taps = 1.0
        for dim, (o_i, l_i, r_i) in enumerate(zip(dn.out_spec[2:], dn.lhs_spec[2:], dn.rhs_spec[2:])):
            pad_low = eqn.params["padding"][dim][0]
            real = _taps_on_real_inputs(out[o_i], lhs[l_i], rhs[r_i], eqn.params["window_strides"][dim],
                                        (eqn.params.get("rhs_dilation") or (1,) * len(lhs_dilation))[dim],
                                        lhs_dilation[dim], pad_low)
            taps *= real / out[o_i]
        dense_k = k
        k = max(1, round(taps)) * rhs[dn.rhs_spec[1]]
        return m, k, n, groups, 1.0 - k / dense_k
    return m, k, n, groups, 0.0


def mxu_ops(closed_jaxpr, rows=128, cols=128):
    """All MXU ops of a routed program's jaxpr, in program order.

    Example:
        >>> ops = mxu_ops(jax.make_jaxpr(route(lambda a, b: a @ b))(jnp.ones((8, 4)), jnp.ones((4, 2))))
        >>> ops[0].cost.m, ops[0].cost.k, ops[0].cost.n
        (8, 4, 2)
    """
    found = rewrite.walk(closed_jaxpr, lambda e: e.primitive in (mxu_dot_general_p, mxu_conv_p))
    ops = []
    for occurrence in found:
        eqn = occurrence.eqn
        kind = "dot" if eqn.primitive is mxu_dot_general_p else "conv"
        m, k, n, count, zero_skipped = _dot_gemm(eqn) + (0.0,) if kind == "dot" else _conv_gemm(eqn)
        if min(m, k, n, count) == 0:
            continue  # an empty product does no work
        precision = eqn.params["mxu_precision"]
        scopes, transforms = split_name_stack(occurrence.name_stack)
        ops.append(MXUOp(
            kind=kind, name_stack=occurrence.name_stack, scopes=scopes, backward="transpose" in transforms,
            cost=GemmCost(m, k, n, rows, cols, count * precision.passes),
            repeats=occurrence.repeats, precision=precision,
            lhs_shape=tuple(eqn.invars[0].aval.shape), rhs_shape=tuple(eqn.invars[1].aval.shape),
            out_shape=tuple(eqn.outvars[0].aval.shape),
            in_loop=occurrence.in_loop, in_branch=occurrence.in_branch,
            dtypes=tuple(str(v.aval.dtype) for v in (eqn.invars[0], eqn.invars[1], eqn.outvars[0])),
            zero_skipped=zero_skipped,
        ))
    return _map_weight_gradients(ops)


def _map_weight_gradients(ops):
    """Mark backward ops whose result has a forward op's weight shape, and map them the cheapest way."""
    weight_shapes = {tuple(sorted(op.rhs_shape)) for op in ops if not op.backward}
    mapped = []
    for op in ops:
        if op.backward and tuple(sorted(op.out_shape)) in weight_shapes:
            op = dataclasses.replace(op, weight_gradient=True, cost=op.cost.cheapest_dataflow())
        mapped.append(op)
    return mapped


def trace_mxu_ops(fun, *args, precision="default", rows=128, cols=128, **kwargs):
    """Route ``fun`` onto the MXU, trace it with ``args`` and return its :class:`MXUOp` list.

    Example:
        >>> import jax.numpy as jnp
        >>> ops = trace_mxu_ops(jax.grad(lambda w, x: jnp.sum(x @ w)), jnp.ones((3, 2)), jnp.ones((4, 3)))
        >>> [op.pass_name for op in ops]
        ['forward', 'backward']
    """
    return mxu_ops(jax.make_jaxpr(route(fun, precision))(*args, **kwargs), rows, cols)
