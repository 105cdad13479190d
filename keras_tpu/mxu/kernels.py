"""How one bfloat16 MXU pass is emitted for XLA:CPU, chosen per op by measurement.

An MXU pass multiplies bfloat16 operands exactly and sums the products in
float32. XLA:CPU can compute that in several *forms*, all giving the MXU's
numbers (exact bf16 products, float32 sums; they differ only in the order of
the float32 additions):

``round_f32``
    bf16-valued float32 operands, float32 dot/conv at ``HIGHEST`` (a float32
    product of two bf16 values is exact). The fallback.
``bf16``
    bf16 operands, ``preferred_element_type=float32``: the MXU's own types.
``bf16_canonical``
    bf16 operands first transposed into the forward layout (dot lhs
    ``[batch, M, K]``, rhs ``[batch, K, N]``; convolution NHWC / HWIO -> NHWC),
    the result transposed back if needed.
``bf16_swapped`` (dots only)
    the transposed product ``rhs^T lhs^T`` in the forward layout, its result
    transposed back (moves the other operand).

Which is fastest depends on the host and on the op's layout. Issue #13
reports, on an AVX-512 BF16 host, a native bf16 dot at ~311 GFLOP/s against
~156 for ``round_f32`` in the forward layout, but slower in the weight-gradient
layout (43 vs 54) and faster in the input-gradient one (49 vs 40). The host
this package was measured on is different: an Intel Xeon "Cascade Lake"
(AVX-512 and VNNI, *no* BF16 instructions), 2 cores. There XLA:CPU either
hands a bf16 dot to YNNPACK (slower than its float32 path on this CPU) or
converts its operands back to float32, so no bf16 form beats ``round_f32``,
and ``round_f32`` costs no more than a plain float32 op (the rounding fuses
into the operand copy). ``benchmarks/mxu_kernels.py``, default XLA options,
GFLOP per CPU-second (load average 5-20 from other jobs; differences under
~10% are noise), ``round_f32`` / best bf16 form:

=================================  ==========  ===========  ==========
op                                 forward     weight grad  input grad
=================================  ==========  ===========  ==========
dot 1024x1024x1024                 59 / 46     63 / 57      69 / 59
dot 4096x1024x1024                 88 / 64     66 / 57      65 / 67
dot 1024x784x1024 (MLP layer)      67 / 62     57 / 58      77 / 68
dot batched 32x 512x64x512         27 / 24     27 / 24      70 / 51
conv b128 32x32x64->64 3x3         84 / 71     72 / 70      13 / 13
conv b128 32x32x64->128 3x3 /2     71 / 59     42 / 39      12 / 13
=================================  ==========  ===========  ==========

With YNNPACK fusions off (how keras-tpu compiles training steps) the picture
is the same (dot 1024^3: 75 / 69, 73 / 66, 81 / 71). In none of the 48
cases measured did a bf16 form win by 10% on both the CPU and the wall-clock
figure. Transposing an operand explicitly into the forward layout
(``bf16_canonical``, ``bf16_swapped``) does not help either: XLA folds such
transposes back into the dot unless they are fenced off, and fenced they
only add a copy. End to end, the train step of a 784-1024-1024-10 MLP at
batch 1024 takes 123 ms of CPU with ``round_f32`` and 151 ms with ``bf16``.

So the choice is a table keyed by host class (:func:`host_class`):

* ``"no_bf16"`` (no bf16 dot instructions; measured here): ``round_f32``
  for every op.
* ``"bf16"`` (AVX-512 BF16 / AMX-BF16 / Arm BF16 hosts; from issue #13's
  figures, *not* measured here): ``bf16`` for forward-layout and
  input-gradient-layout dots, ``round_f32`` for the rest. Measure such a
  host with the benchmark and write a table (below) to confirm or correct.

A table measured on the host itself overrides these: run
``python benchmarks/mxu_kernels.py --write-table FILE`` and point
``KERAS_TPU_MXU_KERNEL_TABLE`` at ``FILE``; each op then takes the form that
was fastest for the measured op of the same kind and layout nearest in shape.
``KERAS_TPU_MXU_FORM`` (or :func:`use_form`) forces one form everywhere,
for tests and benchmarks.

Every form compiles and runs on XLA:CPU for every op class tested
(``tests/test_mxu_kernels.py``: dots with batch and transposed contracting
dims, convolutions with strides, dilations, feature and batch groups, the
ops of their gradients, vmapped ops), and gives exact products with float32
sums. The bf16 forms need their operands and results fenced with an
optimization barrier (:func:`_fenced`): unfenced, XLA:CPU fails at run time
on a bf16 dot whose result is transposed, as in every weight gradient.
``round_f32`` stays the fallback for anything the table does not cover.
"""

import contextlib
import functools
import json
import math
import os

import jax.numpy as jnp
from jax import lax

ROUND_F32 = "round_f32"
BF16 = "bf16"
BF16_CANONICAL = "bf16_canonical"
BF16_SWAPPED = "bf16_swapped"

DOT_FORMS = (ROUND_F32, BF16, BF16_CANONICAL, BF16_SWAPPED)
CONV_FORMS = (ROUND_F32, BF16, BF16_CANONICAL)
NATIVE_FORMS = (BF16, BF16_CANONICAL, BF16_SWAPPED)

#: Layouts. A dot is "forward" when lhs is ``[batch, free, contracting]`` and
#: rhs ``[batch, contracting, free]`` (``x @ w``); "lhs_transposed" when only
#: lhs is not (a weight gradient ``g^T x``); "rhs_transposed" when only rhs is
#: not (an input gradient ``g w^T``); "both_transposed" otherwise. A
#: convolution is "forward" when its operands are NHWC/HWIO-like,
#: "weight_grad" when the lhs is not (autodiff's kernel-gradient convolution
#: swaps its batch and feature axes), "input_grad" when only the kernel is not.
DOT_LAYOUTS = ("forward", "lhs_transposed", "rhs_transposed", "both_transposed")
CONV_LAYOUTS = ("forward", "input_grad", "weight_grad")

# Best form per (kind, layout) and host class; see the module docstring for the numbers.
BUILTIN_TABLES = {
    "no_bf16": {},  # round_f32 everywhere (measured: no bf16 form faster in any layout)
    "bf16": {("dot", "forward"): BF16, ("dot", "rhs_transposed"): BF16},  # issue #13's figures
}

_forced = None


@contextlib.contextmanager
def use_form(form):
    """Emit every MXU pass lowered inside the ``with`` block in ``form`` (``None``: choose).

    Applies to programs *lowered* (first traced and compiled) in the block:
    use fresh functions, as ``jax.jit`` reuses a function's compiled program.
    A dot-only form (``bf16_swapped``) leaves convolutions to the table.
    """
    global _forced
    if form is not None and form not in DOT_FORMS:
        raise ValueError(f"Unknown MXU kernel form {form!r}; use one of {DOT_FORMS} or None.")
    previous, _forced = _forced, form
    try:
        yield
    finally:
        _forced = previous


def forced_form():
    """The form forced by :func:`use_form` or ``KERAS_TPU_MXU_FORM``, or ``None``."""
    if _forced is not None:
        return _forced
    env = os.environ.get("KERAS_TPU_MXU_FORM", "").strip().lower()
    if env in ("", "auto"):
        return None
    if env not in DOT_FORMS:
        raise ValueError(f"KERAS_TPU_MXU_FORM={env!r}; use one of {DOT_FORMS} or 'auto'.")
    return env


def choice_key():
    """What the form choice depends on besides the op (for caches of lowered programs)."""
    return forced_form(), os.environ.get("KERAS_TPU_MXU_KERNEL_TABLE")


@functools.lru_cache(maxsize=None)
def host_class():
    """``"bf16"`` if this CPU has bfloat16 dot instructions (AVX-512 BF16, AMX-BF16, Arm BF16), else ``"no_bf16"``."""
    flags = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    flags.update(value.split())
                    break
    except OSError:
        pass
    # Elsewhere (no /proc/cpuinfo) "no_bf16": round_f32, correct and never slower than measured here.
    return "bf16" if flags & {"avx512_bf16", "amx_bf16", "bf16"} else "no_bf16"


# ----------------------------------------------------------------------------- layouts


def dot_layout(lhs_ndim, rhs_ndim, dimension_numbers):
    """The layout class of a ``dot_general`` (see :data:`DOT_LAYOUTS`)."""
    lhs_perm, rhs_perm = _dot_canonical_perms(lhs_ndim, rhs_ndim, dimension_numbers)
    lhs_ok, rhs_ok = _is_identity(lhs_perm), _is_identity(rhs_perm)
    return {(True, True): "forward", (False, True): "lhs_transposed",
            (True, False): "rhs_transposed", (False, False): "both_transposed"}[(lhs_ok, rhs_ok)]


def dot_gemm(lhs_shape, rhs_shape, dimension_numbers):
    """``(batch, M, K, N)`` of a ``dot_general``."""
    (lc, rc), (lb, rb) = dimension_numbers
    m = math.prod(d for i, d in enumerate(lhs_shape) if i not in lc and i not in lb)
    n = math.prod(d for i, d in enumerate(rhs_shape) if i not in rc and i not in rb)
    return math.prod(lhs_shape[i] for i in lb), m, math.prod(lhs_shape[i] for i in lc), n


def conv_layout(dimension_numbers):
    """The layout class of a convolution (see :data:`CONV_LAYOUTS`)."""
    lhs_perm, rhs_perm, _ = _conv_canonical_perms(dimension_numbers)
    if not _is_identity(lhs_perm):
        return "weight_grad"
    return "forward" if _is_identity(rhs_perm) else "input_grad"


def conv_gemm(lhs_shape, rhs_shape, out_shape, dimension_numbers, feature_group_count, batch_group_count):
    """``(groups, M, K, N)`` of a convolution mapped by im2col (as :mod:`keras_tpu.mxu.program` does)."""
    lspec, rspec, ospec = dimension_numbers
    groups = feature_group_count * batch_group_count
    m = out_shape[ospec[0]] * math.prod(out_shape[i] for i in ospec[2:])
    k = math.prod(rhs_shape[i] for i in rspec[2:]) * rhs_shape[rspec[1]]
    return groups, m, k, rhs_shape[rspec[0]] // groups


# ----------------------------------------------------------------------------- choice


@functools.lru_cache(maxsize=4)
def _load_table(path):
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    return tuple((r["kind"], r["layout"], tuple(r["gemm"]), r["best"]) for r in rows)


def _measured_choice(kind, layout, gemm):
    path = os.environ.get("KERAS_TPU_MXU_KERNEL_TABLE")
    if not path:
        return None
    rows = [r for r in _load_table(path) if r[0] == kind and r[1] == layout]
    if not rows:
        return None
    distance = lambda row: sum(abs(math.log(max(a, 1)) - math.log(max(b, 1))) for a, b in zip(row[2], gemm))
    return min(rows, key=distance)[3]


def choose_form(kind, layout, gemm):
    """The form for one op: forced, else from a measured table, else the built-in table, else ``round_f32``.

    ``kind`` is ``"dot"`` or ``"conv"``; ``gemm`` is ``(batch or groups, M, K, N)``.
    """
    forms = DOT_FORMS if kind == "dot" else CONV_FORMS
    forced = forced_form()
    if forced is not None and forced in forms:
        return forced
    measured = _measured_choice(kind, layout, gemm)
    if measured in forms:
        return measured
    return BUILTIN_TABLES.get(host_class(), {}).get((kind, layout), ROUND_F32)


def operand_dtype(form):
    """The dtype a form's operands are given in (``multipass`` splits into it)."""
    return jnp.float32 if form == ROUND_F32 else jnp.bfloat16


# ----------------------------------------------------------------------------- forms


def _fenced(*arrays):
    """``arrays`` behind an XLA optimization barrier.

    XLA:CPU (jax 0.10.2) decides early whether a bf16 x bf16 -> f32 dot runs
    in YNNPACK or is converted to float32; a transpose it folds into the dot
    afterwards (``(a @ b).T``, which autodiff emits for every weight
    gradient, or an operand's transpose) can turn a YNNPACK dot into one
    that neither path takes, and the program then fails at run time with
    "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32".
    Fencing the bf16 operands and the result keeps each bf16 op exactly as
    emitted.
    """
    fenced = lax.optimization_barrier(arrays)
    return fenced[0] if len(arrays) == 1 else fenced


def _is_identity(perm):
    return tuple(perm) == tuple(range(len(perm)))


def _transpose(x, perm):
    return x if _is_identity(perm) else lax.transpose(x, tuple(perm))


def _barrier_unless_identity(x, perm):
    """``x`` behind an optimization barrier if it is about to be transposed (see below)."""
    return x if _is_identity(perm) else lax.optimization_barrier(x)


def _materialized_transpose(x, perm):
    """``x`` transposed, kept as its own array: the barrier stops XLA from folding the transpose back into the dot."""
    return x if _is_identity(perm) else lax.optimization_barrier(lax.transpose(x, tuple(perm)))


def _dot_canonical_perms(lhs_ndim, rhs_ndim, dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    lf = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs_ndim) if d not in rc and d not in rb]
    return list(lb) + lf + list(lc), list(rb) + list(rc) + rf


def _canonical_dot(lhs, rhs, dimension_numbers):
    """``dot_general`` with lhs laid out (batch, free, contracting) and rhs (batch, contracting, free).

    The result has ``dot_general``'s usual axis order (batch, lhs free, rhs
    free) as the free axes keep their order.
    """
    (lc, _), (lb, _) = dimension_numbers
    lhs_perm, rhs_perm = _dot_canonical_perms(lhs.ndim, rhs.ndim, dimension_numbers)
    lhs, rhs = _materialized_transpose(lhs, lhs_perm), _materialized_transpose(rhs, rhs_perm)
    nb, nc = len(lb), len(lc)
    n_lf = lhs.ndim - nb - nc
    dn = ((tuple(range(nb + n_lf, nb + n_lf + nc)), tuple(range(nb, nb + nc))),
          (tuple(range(nb)), tuple(range(nb))))
    return lax.dot_general(lhs, rhs, dn, preferred_element_type=jnp.float32)


def dot_pass(lhs, rhs, dimension_numbers, form):
    """One MXU pass of ``dot_general`` on bfloat16-valued operands; float32 result."""
    if form == ROUND_F32:
        return lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32), dimension_numbers,
                               precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    lhs, rhs = _fenced(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16))
    if form == BF16:
        return _fenced(lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.float32))
    if form == BF16_CANONICAL:
        return _fenced(_canonical_dot(lhs, rhs, dimension_numbers))
    if form == BF16_SWAPPED:
        (lc, rc), (lb, rb) = dimension_numbers
        out = _canonical_dot(rhs, lhs, ((rc, lc), (rb, lb)))    # (batch, rhs free, lhs free)
        nb = len(lb)
        n_lf, n_rf = lhs.ndim - nb - len(lc), rhs.ndim - nb - len(rc)
        perm = list(range(nb)) + list(range(nb + n_rf, nb + n_rf + n_lf)) + list(range(nb, nb + n_rf))
        return _transpose(_barrier_unless_identity(out, perm), perm)
    raise ValueError(f"Unknown dot form {form!r}.")


def _conv_canonical_perms(dimension_numbers):
    lspec, rspec, ospec = dimension_numbers
    lhs_perm = (lspec[0],) + tuple(lspec[2:]) + (lspec[1],)       # N, spatial..., C
    rhs_perm = tuple(rspec[2:]) + (rspec[1], rspec[0])           # spatial..., I, O
    out_perm = (ospec[0],) + tuple(ospec[2:]) + (ospec[1],)
    return lhs_perm, rhs_perm, out_perm


def _canonical_conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                    feature_group_count, batch_group_count):
    lhs_perm, rhs_perm, out_perm = _conv_canonical_perms(dimension_numbers)
    s = lhs.ndim - 2
    canonical = lax.ConvDimensionNumbers(
        lhs_spec=(0, s + 1) + tuple(range(1, s + 1)),
        rhs_spec=(s + 1, s) + tuple(range(s)),
        out_spec=(0, s + 1) + tuple(range(1, s + 1)))
    out = lax.conv_general_dilated(_materialized_transpose(lhs, lhs_perm), _materialized_transpose(rhs, rhs_perm),
                                   window_strides, padding,
                                   lhs_dilation, rhs_dilation, canonical, feature_group_count, batch_group_count,
                                   preferred_element_type=jnp.float32)
    inverse = [0] * (s + 2)      # out is (N, spatial..., C): put each axis where dimension_numbers wants it
    for position, dim in enumerate(out_perm):
        inverse[dim] = position
    return _transpose(_barrier_unless_identity(out, inverse), inverse)


def conv_pass(lhs, rhs, geometry, form):
    """One MXU pass of ``conv_general_dilated`` on bfloat16-valued operands; float32 result.

    ``geometry``: the primitive's window_strides, padding, lhs_dilation,
    rhs_dilation, dimension_numbers (a ``ConvDimensionNumbers``),
    feature_group_count and batch_group_count.
    """
    if form == ROUND_F32:
        return lax.conv_general_dilated(lhs.astype(jnp.float32), rhs.astype(jnp.float32), **geometry,
                                        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    lhs, rhs = _fenced(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16))
    if form == BF16:
        return _fenced(lax.conv_general_dilated(lhs, rhs, **geometry, preferred_element_type=jnp.float32))
    if form == BF16_CANONICAL:
        return _fenced(_canonical_conv(lhs, rhs, **geometry))
    raise ValueError(f"Unknown conv form {form!r}.")
