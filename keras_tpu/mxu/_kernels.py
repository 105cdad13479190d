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
``taps`` (convolutions only)
    a grouped convolution with one input feature per group (a depthwise
    convolution and its input gradient) as a float32 sum over the window's
    taps of elementwise products of bf16-valued float32 operands (exact);
    ``round_f32`` for any other convolution.
``output_taps`` (convolutions only)
    a convolution with few output features (stride 1, no dilation or
    groups) as one float32 product of the input's rows with every tap's
    kernel at once (``M x K x taps*N``), each tap's columns then summed at
    their shifted positions; ``round_f32`` for any other convolution.
``bf16_direct`` (convolutions only)
    keras-tpu's own convolution kernels (:mod:`keras_tpu.mxu._direct_conv`),
    which multiply bf16 pairs exactly and sum them in float32 with the CPU's
    AVX-512 BF16 dot instruction, the MXU's arithmetic at twice the float32
    rate; ``round_f32`` for a convolution they do not cover.

Which is fastest depends on the host, the op's layout and shape, and the
XLA:CPU options: a bf16 dot is fast only where XLA hands it to YNNPACK
(``xla_cpu_experimental_ynn_fusion_type`` containing
``LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT``, XLA's default); with YNNPACK fusions
off XLA converts its operands back to float32 and no bf16 form wins.

*AMD EPYC with AVX-512 BF16* (host class ``"bf16"``; 2 cores shared with
other jobs, load 8-14). ``benchmarks/mxu_kernels.py``, GFLOP per
CPU-second, best of 5 interleaved rounds (a median round is typically
1-15% slower than the best, up to 2x on ops under ~1 ms), with YNNPACK for
dots only (XLA's default options give the same dot figures);
``round_f32`` / best bf16 form (which), GEMM ``(batch x) M x K x N``:

=========================================  ======================  ==================
op (layout)                                round_f32 / native      ratio
=========================================  ======================  ==================
dot 1024x784x1024 forward (MLP layer)      208 / 369 (bf16)        1.78
dot 1024x1024x784 input grad               202 / 373 (bf16)        1.85
dot 1024x1024x784 weight grad              181 / 378 (swapped)     2.09 (canonical 1.99)
dot 1024x256x64 weight grad (LSTM input)   37 / 146 (canonical)    3.9
dot 1024x256x256 weight grad (LSTM gates)  108 / 270 (canonical)   2.5
dot 256x256x1024 forward (LSTM gates)      158 / 215 (canonical)   1.36
dot 16384x128x128 forward (projection)     135 / 231 (bf16)        1.71
dot 16384x96x256 input grad                160 / 270 (bf16)        1.68
dot 1024x1024x10 forward (10-class head)   84 / 55                 0.65
dot 10x1024x1024 weight grad (head)        56 / 59                 1.05
dot 128x16384x512 weight grad (FFN)        115 / 200 (canonical)   1.74
dot 1024x 32x64x64 input grad (attention)  78 / 48                 0.62
dot 1024x 64x32x64 forward (attention)     126 / 113               0.90
dot attention scores (both transposed)     45 / 56 (bf16)          1.24 (default 1.15)
conv b128 32x32x32->32 3x3 forward         137 / 122               0.89
conv ... input grad                        132 / 121               0.92
conv ... weight grad                       39 / 37                 0.95
conv b128 16x16x32->64 3x3 fwd/in/weight   168 / 155, 128 / 116,   0.90-0.96
                                           ~80 / ~75
=========================================  ======================  ==================

With YNNPACK fusions off (today's training programs), the same dots run
0.44-0.95x in a bf16 form (1024^3 forward: 195 / 185; 16384x512x128: 158 /
69), except a few weight gradients (``bf16_canonical`` 1.7x on 1024x256x64).
The native wins are shape-dependent: both free dimensions must be wide (a
10-class head loses) and the small batched attention dots lose or tie.
(The weight-gradient figures are from ``benchmarks/results/mxu_kernels_bf16_host_dots.log``,
after :func:`_materialized_transpose` was made to move the data: before,
XLA:CPU ran every transposed-operand form in float32, and weight gradients
measured 0.5-1.2x.) Native bf16 convolutions do not pay: in 72
cases (the zoo's CIFAR CNN, ResNet and pointwise convolutions, forward and
both gradients, two or three option sets) they ran 0.39-1.04x, except three
small ones (a strided 3x3 input gradient 1.24-1.68x, two weight gradients
1.14-1.24x under one option set only). An im2col GEMM on the native bf16
dot is far slower: building the patches alone costs several times XLA's
whole convolution (b128 32x32x32->32: 14 GFLOP/s forward and 10 for the
weight gradient, against 140-190 and 40-57; only a 3-channel input layer
gains, 34 against 25, under XLA's default options alone). A pointwise
convolution (1x1 kernel, stride 1) needs no patches: it and its gradients
are matrix products (:func:`conv_as_dot`) and run on the dot's forms, as a
TPU runs them: MobileNet's training step 965 -> 732 ms and its evaluation of
512 images 196 -> 89 ms (its cores in a loop, in-process). So other
convolutions stay on ``round_f32``, except depthwise ones: XLA:CPU runs a convolution
with one input feature per group at 0.3-0.9 GFLOP/s in every form
(MobileNet's depthwise layers, b64 32x32x32, 16x16x128, 8x8x256 3x3,
forward and input gradient), and ``taps`` runs them at 18-25; their weight
gradients (a batch-grouped convolution, 0.4-2.8 GFLOP/s) summed the same way
were slower still, so they stay on XLA's.

End to end, through ``keras_to_tpu_model`` with YNNPACK dots on, CPU
seconds per train step: the 784-1024-1024-10 MLP at batch 1024, 55 ms with
the automatic choice, 50-54 with ``bf16``/``bf16_canonical`` everywhere,
75-84 with ``round_f32``, 96-106 with ``bf16_swapped`` (with YNNPACK fusions
off: 86-98 auto, 86-93 ``round_f32``); MobileNet at batch 512, 4.0 s auto
against 15.4 s ``round_f32``; the CIFAR-10 CNN at batch 1024, 2.2-2.3 s in
every form (its convolutions, on ``round_f32``, dominate). With the weight
gradients native too (the table below; wall ms per train step, best of 3-6
interleaved rounds against plain Keras in the same process): the MLP 26.5 vs
30.0, the char LSTM 446 vs 562, the Transformer 312 vs 395.

*Intel Xeon "Cascade Lake"* (AVX-512 and VNNI, *no* BF16; host class
``"no_bf16"``; measured before): XLA:CPU either hands a bf16 dot to
YNNPACK (slower than its float32 path on that CPU) or converts its operands
back to float32, so no bf16 form beats ``round_f32`` (round_f32 / best bf16:
dot 1024^3 59 / 46 forward, 63 / 57 weight grad, 69 / 59 input grad; conv
b128 32x32x64->64 84 / 71, 72 / 70, 13 / 13; in none of 48 cases did a bf16
form win by 10%), and the MLP train step took 123 ms of CPU with
``round_f32`` and 151 ms with ``bf16``.

So the choice is a table keyed by host class (:func:`host_class`), each
entry a form or a :class:`ShapeRule` (a form above a shape threshold,
``round_f32`` below it):

* ``"no_bf16"``: ``round_f32`` for every op.
* ``"bf16"`` with the direct kernels available: ``bf16_direct`` for every
  ungrouped convolution that neither rule below takes (b128 per core, ms
  XLA's float32 / direct with its operand preparation, best of 25 in each of
  two interleaved rounds: 32x32x32->32 3x3 forward 15.6-19.1 / 9.9-16.0,
  weight gradient 38.3-41.4 / 10.2-14.3; 16x16x32->64 forward 7.0-7.5 /
  3.7-4.0, weight gradient 10.5-12.0 / 4.4-4.6; 16x16x64->64 valid forward
  10.8-11.7 / 6.0-6.3, weight gradient 14.9-15.8 / 6.4-6.5; the 3-channel
  first layer forward 6.0-6.4 / 3.2-3.3), except, in evaluation and
  prediction programs, forward convolutions of fewer than 16 products per
  output (see :class:`DirectRule`).
* ``"bf16"``: dots in the forward layout ``bf16`` when M >= 128, N >= 64 and
  K >= 64; input-gradient layout (rhs transposed) ``bf16`` when M >= 256 and
  N >= 128; weight-gradient layout (lhs transposed) ``bf16_swapped`` when
  N >= 64 and K >= 16 (as fast as ``bf16_canonical`` alone, faster in a
  training step, see the table's comment); ``round_f32`` for other dots; ``taps`` for convolutions of
  at least 8 groups of at most 4 output features each in the forward and
  input-gradient layouts (:class:`GroupedRule`), ``output_taps`` for
  ungrouped ones of at most 3 output features in those layouts
  (:class:`FewOutputsRule`: the input gradient of a first layer reading RGB
  images ran 2.5-3x faster, the CIFAR-10 CNN's train step 751-759 -> 670-720
  ms with the pooling gradient of :mod:`keras_tpu._vector_unit`),
  ``round_f32`` for other convolutions. The dot figures assume YNNPACK dots, which
  :func:`compiler_options` keeps on (and YNNPACK convolutions off) in every
  program on such hosts, training and inference alike. (``taps`` would
  likely pay on ``"no_bf16"`` hosts too, as the slow grouped convolution is
  XLA's, but it was not measured there.)

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
import dataclasses
import functools
import itertools
import json
import math
import os
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from keras_tpu import _rewrite as rewrite
from keras_tpu._host import LLVM_OPTIMIZATION_LEVEL, llvm_level_in_xla_flags
from keras_tpu.mxu import _direct_conv as direct
from keras_tpu.mxu import _host_speed as host_speed

ROUND_F32 = "round_f32"
BF16 = "bf16"
BF16_CANONICAL = "bf16_canonical"
BF16_SWAPPED = "bf16_swapped"

TAPS = "taps"
OUTPUT_TAPS = "output_taps"
BF16_DIRECT = "bf16_direct"

DOT_FORMS = (ROUND_F32, BF16, BF16_CANONICAL, BF16_SWAPPED)
CONV_FORMS = (ROUND_F32, BF16, BF16_CANONICAL, TAPS, OUTPUT_TAPS, BF16_DIRECT)
ALL_FORMS = DOT_FORMS + (TAPS, OUTPUT_TAPS, BF16_DIRECT)
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



@dataclasses.dataclass(frozen=True)
class ShapeRule:
    """``form`` for an op whose GEMM ``(batch, M, K, N)`` is big enough, else ``round_f32``.

    Native bf16 GEMMs win on this class of host only once both free
    dimensions (M, N) reach ``min_free`` and the contraction K lies in
    ``[min_k, max_k]``: below that, packing the bf16 operands costs more than
    the faster multiply saves (see the module docstring for the numbers).

    Example:
        >>> ShapeRule(BF16, min_free=64)((1, 1024, 1024, 10))
        'round_f32'
        >>> ShapeRule(BF16, min_free=64)((1, 1024, 1024, 1024))
        'bf16'
    """

    form: str
    min_free: int = 1
    min_k: int = 1
    max_k: float = math.inf
    min_m: int = 1
    min_n: int = 1

    def __call__(self, gemm):
        _, m, k, n = gemm
        fits = (min(m, n) >= self.min_free and m >= self.min_m and n >= self.min_n
                and self.min_k <= k <= self.max_k)
        return self.form if fits else ROUND_F32


@dataclasses.dataclass(frozen=True)
class FewOutputsRule:
    """``output_taps`` for an ungrouped convolution of at most ``max_n`` output features, else ``round_f32``.

    XLA:CPU (Eigen's convolution: YNNPACK's takes no convolution of 16
    channels or fewer) runs such a convolution far below its rate at wide
    outputs; the input gradient of a first layer reading RGB images (32 ->
    3 features, 3x3, batch 128 at 32x32) took 5.3-6.3 ms per core, 1.8-2.1
    as ``output_taps``. Measured here, b128 unless noted, ms ``round_f32`` /
    ``output_taps`` (training options; inference options in brackets):
    32->3 3x3 5.3 / 1.8 (2.6 / 1.9), 64->3 3x3 11.6 / 2.9 (23.5 / 3.1),
    128->3 3x3 24.6 / 5.1 (43.7 / 5.3), 16x16 64->3 2.2 / 0.5 (1.2 / 0.6),
    32->2 3x3 5.7 / 1.3 (2.5 / 1.2), 32->1 3x3 3.7 / 0.8 (3.1 / 0.9), 64->1
    5x5 15.6 / 2.8 (28.9 / 2.8), 14x14 128->1 7x7 8.1 / 1.3 (10.0 / 1.4),
    3->3 3x3 2.3 / 1.2 (2.3 / 1.2). Wider outputs lose, and erratically
    (XLA:CPU's product of 36-80 columns ran 1-12 ms): 32->4 3x3 6.3 / 2.6
    (2.9 / 12.0), 32->8 3x3 5.2 / 23.4, 32->2 5x5 14.9 / 16.0, 64->3 5x5
    14.3 / 15.2 (5.8 / 11.3); so the form covers at most
    :data:`OUTPUT_TAPS_MAX_COLUMNS` columns of taps times outputs. Where the
    direct kernels run (:class:`DirectRule`, before this rule in the table),
    they take these convolutions first: they sum few outputs along the input
    features (32->3 3x3, b128: 1.6 ms against 3.0 here).

    Example:
        >>> FewOutputsRule()((1, 131072, 288, 3)), FewOutputsRule()((1, 131072, 288, 32))
        ('output_taps', 'round_f32')
    """

    max_n: int = 3

    def __call__(self, gemm):
        groups, _, _, n = gemm
        return OUTPUT_TAPS if groups == 1 and n <= self.max_n else ROUND_F32


@dataclasses.dataclass(frozen=True)
class GroupedRule:
    """``taps`` for a grouped convolution with at least ``min_groups`` groups of at most ``max_n``
    output features each (a depthwise convolution and its input gradient), else ``round_f32``.

    XLA:CPU runs such convolutions at 0.3-0.9 GFLOP/s in every other form;
    summed over the window's taps as elementwise products they run at 18-25.

    Example:
        >>> GroupedRule()((32, 65536, 9, 1)), GroupedRule()((1, 65536, 288, 32))
        ('taps', 'round_f32')
    """

    min_groups: int = 8
    max_n: int = 4

    def __call__(self, gemm):
        groups, _, _, n = gemm
        return TAPS if groups >= self.min_groups and n <= self.max_n else ROUND_F32


#: In an evaluation or prediction program, a convolution contracting fewer products per output stays on XLA
#: (see :class:`DirectRule`).
INFERENCE_DIRECT_MIN_K = 16


@dataclasses.dataclass(frozen=True)
class DirectRule:
    """``bf16_direct`` for an ungrouped convolution where the direct kernels run on this host and measured faster
    than XLA's convolutions there (:func:`conv_kernels_here`), else ``round_f32``.

    ``inference_min_k``: in an evaluation or prediction program (:func:`lowering_mode`),
    a convolution contracting fewer than this many products per output (window taps
    times input features) stays on XLA, which fuses it with its neighbours into one
    YNNPACK kernel. keras.io's MNIST convnet (a 3x3 convolution of one channel, K = 9,
    first) evaluated a batch of 128 in 3.5-3.7 ms with its first layer on XLA, 4.3-4.8
    with it on the kernels and 3.8-4.2 with both layers on XLA; its training step took
    15.6 ms with both on the kernels, 17.5-21.4 with the first on XLA (in-process,
    two rounds). The CIFAR-10 CNN's 3-channel first layer (K = 27) evaluates faster on
    the kernels (with its other layers: 222 against 340 ms per 1024 images).

    Example:
        >>> DirectRule()((1, 131072, 288, 32)) in ("bf16_direct", "round_f32"), DirectRule()((32, 65536, 9, 1))
        (True, 'round_f32')
        >>> with lowering_mode("test"):
        ...     DirectRule(inference_min_k=16)((1, 86528, 9, 32))
        'round_f32'
    """

    inference_min_k: int = 1
    layout: str = "forward"

    def __call__(self, gemm):
        inference = _lowering_mode in ("test", "predict")
        if gemm[2] < self.inference_min_k and inference or gemm[0] != 1 or not direct.available():
            return ROUND_F32
        return BF16_DIRECT if conv_kernels_here(inference) == BF16_DIRECT else ROUND_F32


@dataclasses.dataclass(frozen=True)
class FirstMatch:
    """The first of ``rules`` that picks a form other than ``round_f32``.

    Example:
        >>> FirstMatch((GroupedRule(), FewOutputsRule()))((1, 131072, 288, 3))
        'output_taps'
    """

    rules: tuple

    def __call__(self, gemm):
        for rule in self.rules:
            form = rule(gemm)
            if form != ROUND_F32:
                return form
        return ROUND_F32


@dataclasses.dataclass(frozen=True)
class WhereNativeIsFaster:
    """``rule``'s form on a host whose native bf16 products measured faster (:func:`native_bf16_dots_here`), else
    ``round_f32``.

    Example:
        >>> WhereNativeIsFaster(ShapeRule(BF16))((1, 1024, 1024, 1024)) in ("bf16", "round_f32")
        True
    """

    rule: object

    def __call__(self, gemm):
        return self.rule(gemm) if native_bf16_dots_here() else ROUND_F32


# Best form per (kind, layout) and host class: a form, or a ShapeRule choosing by the GEMM's
# shape; missing entries are round_f32. See the module docstring for the numbers.
BUILTIN_TABLES = {
    "no_bf16": {},  # round_f32 everywhere (measured: no bf16 form faster in any layout)
    "bf16": {
        # benchmarks/results/mxu_kernels_bf16_host_dots.log (YNNPACK dots, 5 rounds): native bf16 wins 1.2-1.8x in
        # the forward layout once M >= 128 and N, K >= 64 (a 10-class head and the small attention dots lose),
        # 1.4-2x in the input-gradient layout from M >= 256 and N >= 128 (0.73x at 128 rows x 3136, 0.88-0.99x at
        # N = 64), and 1.7-3.9x for weight gradients in the canonical layout from K >= 128 contracted rows up to
        # 16384 (the LSTM's 256-row gradients 2.5-3.9x, the Transformer's 16384-row FFN gradients 1.7-2.2x).
        ("dot", "forward"): WhereNativeIsFaster(ShapeRule(BF16, min_free=64, min_k=64, min_m=128)),
        ("dot", "rhs_transposed"): WhereNativeIsFaster(ShapeRule(BF16, min_free=128, min_m=256)),
        # Weight gradients swapped, not canonical: autodiff transposes a weight gradient's result back into the
        # weight's shape, and the swapped product's own transpose cancels it (canonical left a strided f32
        # transpose, fused into each optimizer update: the MLP's train step 23.5 -> 19.8 ms, Transformer's
        # 270 -> 253, CIFAR CNN's 938 -> 905, LSTM and embedding model unchanged).
        # From 16 contracted rows, as long as the weight's input side (N) has 64 features: a model's product over
        # a small global batch (keras.io's MLPs at batch 32 and 64, the cores' gradients summed in one product)
        # gains too. With the weight gradient's transpose back into the kernel's shape, us: 256x64x784 142 swapped
        # / 234 round_f32 / 226 f32, 10x64x512 30 / 93 / 87, 1024x16x1024 149 / 332 / 344; 64x1024x10 (N = 10)
        # 57 / 40 / 23 loses. Train step, in-process A/B against plain Keras: keras.io's 784-256-10 model with its
        # own train_step at batch 64 0.95x -> 1.02-1.07x, the 784-512-512-10 MLP at batch 32 0.93-0.96x -> 1.01x,
        # the zoo's MLP 1.80x -> 1.90x; the zoo's other models and users' code choose the same forms as before.
        ("dot", "lhs_transposed"): WhereNativeIsFaster(ShapeRule(BF16_SWAPPED, min_k=16, min_n=64)),
        # The direct kernels before output_taps: they sum a convolution of at most 4 outputs along its inputs
        # (CIFAR-10's first-layer input gradient, b128: 1.6 against 3.0 ms, 64 -> 3 features 2.6 against 14-17).
        ("conv", "forward"): FirstMatch((GroupedRule(), DirectRule(inference_min_k=INFERENCE_DIRECT_MIN_K),
                                          FewOutputsRule())),
        ("conv", "input_grad"): FirstMatch((GroupedRule(), DirectRule(layout="input_grad"), FewOutputsRule())),
        ("conv", "weight_grad"): DirectRule(layout="weight_grad"),
    },
}

_forced = None
_lowering_mode = None


@contextlib.contextmanager
def lowering_mode(mode):
    """Programs lowered inside the ``with`` block are keras-tpu's ``"train"``, ``"test"`` or ``"predict"``
    programs (as :func:`compiler_options` names them); some rules choose by it."""
    global _lowering_mode
    previous, _lowering_mode = _lowering_mode, mode
    try:
        yield
    finally:
        _lowering_mode = previous


@contextlib.contextmanager
def use_form(form):
    """Emit every MXU pass lowered inside the ``with`` block in ``form`` (``None``: choose).

    Applies to programs *lowered* (first traced and compiled) in the block:
    use fresh functions, as ``jax.jit`` reuses a function's compiled program.
    A dot-only form (``bf16_swapped``) leaves convolutions to the table, a
    convolution-only one (``taps``) dots.
    """
    global _forced
    if form is not None and form not in ALL_FORMS:
        raise ValueError(f"Unknown MXU kernel form {form!r}; use one of {ALL_FORMS} or None.")
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
    if env not in ALL_FORMS:
        raise ValueError(f"KERAS_TPU_MXU_FORM={env!r}; use one of {ALL_FORMS} or 'auto'.")
    return env


def choice_key():
    """What the form choice depends on besides the op (for caches of lowered programs)."""
    return forced_form(), os.environ.get("KERAS_TPU_MXU_KERNEL_TABLE"), direct.always_on()


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


#: YNNPACK fusion types XLA:CPU may use, per host class and program mode (``None``: XLA's
#: defaults, YNNPACK dots, reductions and convolutions). On hosts without bf16 instructions
#: YNNPACK's convolutions are several times slower for the weight-gradient convolutions of a
#: training step and faster for inference. On bf16 hosts the native bf16 dots of the table above
#: need YNNPACK dots, and every program leaves YNNPACK's convolution fusions off (XLA may still
#: fold convolutions into another YNNPACK fusion, see below): XLA's own (Eigen's) convolutions
#: ran faster here in every layer measured, b128 per core, ms XLA / YNNPACK: 32x32x32->32 3x3
#: forward 7.6 / 11.6, input gradient 8.6 / 12.8, weight gradient 15.9 / 27.0; 16x16x64->64
#: unpadded forward 5.3 / 32.8; ResNet-20's 16x16x32->32 (b64) 0.9 / 1.4. Evaluation step with
#: XLA's defaults / these options, wall ms, 2 interleaved rounds: the CIFAR-10 CNN 147, 139 /
#: 141, 134 (XLA still hands its merged forward pass, convolutions included, to one YNNPACK
#: fusion); ResNet-20 185, 179 / 162, 167; MobileNet 96, 98 / 82, 77 (their cores in a loop);
#: keras.io's MNIST convnet and Conv1D text classifier unchanged. YNNPACK reductions pay in
#: every program with windows: without them XLA splits every large sum (a bias gradient, a
#: batch norm's statistics) into a slow reduce-window and a reduce. Train step with / without,
#: wall ms, best of 4-5 interleaved rounds (benchmarks/zoo.py's models): MobileNet 1472 / 1837,
#: ResNet-20 964 / 1119, MLP 15.4 / 17.4, char LSTM 318 / 338, CIFAR-10 CNN 894 / 910,
#: Transformer 286 / 284, the embedding model 16.1 / 15.3; the CIFAR-10 CNN's evaluation step
#: 146 / 512 ms.
_YNN_DOTS_AND_SUMS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"
_YNN_FUSION_TYPES = {
    "no_bf16": {"train": "", "test": None, "predict": None},
    "bf16": {"train": _YNN_DOTS_AND_SUMS, "test": _YNN_DOTS_AND_SUMS, "predict": _YNN_DOTS_AND_SUMS},
}


#: An inference program without windows (no convolution, no pooling) keeps its reductions out of
#: YNNPACK on bf16 hosts. XLA then fuses each reduction with the op that produces its operand: an
#: embedding lookup with the mean that pools it (1024 x 32 rows of a 100,000 x 64 table: 0.5 ms
#: fused against 1.6-3.0 with the looked-up rows written out for YNNPACK's sum), a layer
#: normalization or a softmax with its elementwise input. Evaluation step with / without YNNPACK
#: reductions, wall ms, 3 interleaved rounds (benchmarks/zoo.py's models): the embedding model
#: 3.0-5.1 / 1.0-2.0, the Transformer 76-81 / 60-64, the MLP 5.7-6.4 / 5.3-5.4, the char LSTM
#: 68-119 / 70-118 (its recurrence dominates). A program with windows needs them for its poolings
#: (the CIFAR-10 CNN's evaluation step 146 ms with YNNPACK reductions, 512 without; ResNet-20's 200
#: / 227), and so do training programs (see above: only the embedding model's step gained without,
#: 15.3-15.8 against 15.8-17.3 ms, from its lookup; the MLP's and the char LSTM's sums over the
#: batch lost).
_INFERENCE_WITHOUT_WINDOWS = {"bf16": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}

#: The ops that make a program's windows: convolutions (as traced, or routed to the MXU) and poolings.
_WINDOW_PRIMITIVES = frozenset({"conv_general_dilated", "mxu_conv", "reduce_window", "reduce_window_sum",
                                "reduce_window_max", "reduce_window_min", "select_and_scatter_add",
                                "select_and_gather_add"})


def has_windows(program):
    """Whether a traced program (a ``ClosedJaxpr``, nested programs included) convolves or pools.

    Example:
        >>> import jax
        >>> has_windows(jax.make_jaxpr(lambda x: jnp.mean(x, axis=1))(jnp.ones((2, 3))))
        False
    """
    return bool(rewrite.walk(program, lambda eqn: eqn.primitive.name in _WINDOW_PRIMITIVES))


#: XLA options every keras-tpu program is compiled with, on every host: the MXU's bf16 roundings must survive
#: compilation. XLA's default (``xla_allow_excess_precision``) lets it drop a float32 -> bfloat16 ->
#: float32 round trip as mere excess precision, and it did wherever the rounding landed in a fusion
#: with a reduction: YNNPACK's fusion of two convolution blocks (convolution, ReLU, max pooling)
#: and a sum, the CIFAR-10 CNN's evaluation in small, returned the unrounded float32 numbers
#: (1.9e-3 off the exactly rounded ones, 1.3e-7 with this option); the CIFAR-10 CNN's predictions
#: were as far from the exact ones as the float32 network's (mean 2.8e-4 of the largest
#: probability against 2.9e-4; 1.0e-5 with this option); a rounded product summed over its rows
#: was 1.7e-3 off; max pooling of rounded values returned unrounded ones; one training step of a
#: small CNN updated its weights 1.4% off on average; and the zoo's Transformer trained to a
#: different loss (0.7010 against 0.7009 over 10 steps). The MLP's and the Transformer's
#: training programs compile to the same HLO either way (their code generation differs), and no
#: zoo model's step measured slower in interleaved runs.
_EXACT_ROUNDING = {"xla_allow_excess_precision": False}

#: XLA:CPU compiles every fusion it emits into machine code of its own, through LLVM's optimizer at -O3 by default:
#: about 12-14 ms per distinct small kernel here (40 elementwise kernels of different shapes: 570 ms; at -O2 367,
#: at -O1 334, at -O0 275), and a training program has a hundred or two (ResNet-20's: 181). -O2 keeps LLVM's
#: vectorizers (-O1 does not: the CIFAR-10 CNN's training step took 718-731 ms at -O1 against 649-671). In-process
#: A/B, models built and fitted alternately, first fit() (mostly the compile) / training step, -O2 against -O3, s /
#: ms: ResNet-20 4.39-4.55 / 644-658 against 4.64-5.10 / 652-709; the CIFAR-10 CNN 2.61-3.08 / 639-693 against
#: 2.91-3.32 / 643-699; MobileNet 5.74-5.86 / 1181-1214 against 5.88-6.91 / 1218-1238; the Transformer 2.40-2.46 /
#: 411-425 against 2.67-3.09 / 423; the char LSTM 1.96-2.10 / 605-648 against 2.05-2.38 / 614-625; the MLP and
#: the embedding model (a few kernels) alike. The kernels that do a step's heavy work (YNNPACK's, Eigen's and
#: keras-tpu's own convolutions) are compiled already and do not change.
_QUICKER_CODE_GENERATION = {"xla_backend_optimization_level": LLVM_OPTIMIZATION_LEVEL}


#: A training program whose only loops are keras-tpu's own (the cores', and the stacked steps' of
#: ``steps_per_execution``) compiles without XLA's loop-invariant code motion, where its weights are few
#: (:func:`hoists_loop_invariants`). The pass lifts what a loop body computes from values the loop does not change
#: out of the loop: in the cores' loop of a model with convolutions, each weight's bfloat16 rounding and batch
#: normalization's per-channel factors. Lifted, each is a small kernel of its own, which XLA:CPU compiles one by one
#: (ResNet-20's training program: 600 elementwise kernels with the pass, 557 without); left in the body, they fuse
#: into the ops that read them and run once per core, a pass over the weights (ResNet-20's 0.27M, the README CNN's
#: 1.7M) that costs nothing measurable next to the convolutions. The same traced program lowered and compiled afresh,
#: alternately, 4 times each, XLA's compile without / with the pass, s: MobileNet's training program 3.26-3.54 /
#: 3.51-4.17, ResNet-20's 2.26-2.36 / 2.31-2.44, the CIFAR-10 CNN's 1.79-2.19 / 1.91-1.97. Their steps, run
#: alternately 10 times each on the same arguments, ms (a noisy machine): MobileNet 1292-1530 (median 1365) /
#: 1327-1594 (1422), ResNet-20 615-1089 (837) / 638-1111 (969), the CIFAR-10 CNN 631-784 (707) / 641-797 (711).
#: Inference programs keep the pass: MobileNet's evaluation compiled sooner without it (0.79-0.86 s against
#: 0.99-1.12) but ran slower (240-296 ms per step, median 269, against 215-255, median 242). A model's own loops (a
#: recurrent layer's, a loss's) keep it too: the pass lifts their weights' roundings out of every time step.
_WITHOUT_LOOP_INVARIANT_MOTION = "while-loop-invariant-code-motion"

#: The most weights (elements) a training program may have for :data:`_WITHOUT_LOOP_INVARIANT_MOTION`: what the
#: pass would lift runs once per core instead, a few passes over the weights per step (4M float32 weights: about 8
#: MiB rounded per core), where the compile time it saves is paid once.
LOOP_INVARIANT_MOTION_ABOVE_WEIGHTS = 4 * 1024 * 1024

_LOOP_PRIMITIVES = frozenset({"scan", "while"})


def loop_count(program):
    """How many loops (``scan``, ``while``: ``fori_loop``, ``lax.map``) a traced program runs, nested ones included.

    Example:
        >>> import jax
        >>> loop_count(jax.make_jaxpr(lambda x: jax.lax.map(lambda r: jax.lax.cumsum(r), x))(jnp.ones((2, 3))))
        1
        >>> loop_count(jax.make_jaxpr(lambda x: jax.lax.map(
        ...     lambda r: jax.lax.fori_loop(0, 3, lambda i, a: a * 2, r), x))(jnp.ones((2, 3))))
        2
    """
    jaxpr = program.jaxpr if isinstance(program, jex_core.ClosedJaxpr) else program
    count = 0
    for eqn in jaxpr.eqns:
        count += (eqn.primitive.name in _LOOP_PRIMITIVES) + sum(map(loop_count, rewrite.sub_jaxprs(eqn)))
    return count


def hoists_loop_invariants(mode, program, own_loops, weights):
    """Whether XLA lifts loop invariants out of a program's loops (see :data:`_WITHOUT_LOOP_INVARIANT_MOTION`):
    ``False`` for a ``"train"`` program whose loops are all keras-tpu's own (``own_loops`` of them, counted as
    :func:`loop_count` counts) and whose weights (elements) are at most :data:`LOOP_INVARIANT_MOTION_ABOVE_WEIGHTS`.

    Example:
        >>> import jax
        >>> cores_loop = jax.make_jaxpr(lambda x: jax.lax.map(jnp.tanh, x))(jnp.ones((8, 3)))
        >>> hoists_loop_invariants("train", cores_loop, own_loops=1, weights=1000)
        False
        >>> hoists_loop_invariants("test", cores_loop, own_loops=1, weights=1000)
        True
        >>> hoists_loop_invariants("train", cores_loop, own_loops=0, weights=1000)   # a loop of the model's own
        True
    """
    return not (mode == "train" and weights <= LOOP_INVARIANT_MOTION_ABOVE_WEIGHTS
                and loop_count(program) <= own_loops)


def _every_program_options():
    """The options of every keras-tpu program, on every host: ``_EXACT_ROUNDING`` and ``_QUICKER_CODE_GENERATION``,
    unless ``XLA_FLAGS`` sets LLVM's level to another (as the test suite does, ``-O1``), which is then kept.

    The level ``import keras_tpu`` put into ``XLA_FLAGS`` (:func:`keras_tpu._host.quicker_code_generation`) is
    asked for here too: the flags do not apply where JAX's backend had started before."""
    if llvm_level_in_xla_flags() not in (None, LLVM_OPTIMIZATION_LEVEL):
        return dict(_EXACT_ROUNDING)
    return {**_EXACT_ROUNDING, **_QUICKER_CODE_GENERATION}


def compiler_options(mode="train", program=None, hoist_loop_invariants=True):
    """XLA:CPU compiler options for keras-tpu's ``"train"``, ``"test"`` or ``"predict"`` programs on this host.

    ``program`` is the traced program (a ``ClosedJaxpr``): an inference
    program without windows (:func:`has_windows`) gets options of its own (see
    ``_INFERENCE_WITHOUT_WINDOWS``); without it the options are those of a
    program with windows. For ``jax.jit(...).trace(...).lower().compile(compiler_options(mode, traced.jaxpr))``
    (never empty); the built-in table's choices were measured with these options.

    Every program keeps the MXU's bf16 roundings exact (``_EXACT_ROUNDING``) and has LLVM optimize its kernels
    at ``-O2`` (``_QUICKER_CODE_GENERATION``; a level ``XLA_FLAGS`` sets is kept). ``hoist_loop_invariants=False``
    (see :func:`hoists_loop_invariants`) drops XLA's loop-invariant code motion, besides any pass ``XLA_FLAGS``
    disables.

    Example:
        >>> compiler_options("train")["xla_cpu_experimental_ynn_fusion_type"] in (
        ...     "", "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE")
        True
        >>> compiler_options("predict")["xla_allow_excess_precision"]
        False
    """
    host = host_class()
    fusion_types = _YNN_FUSION_TYPES.get(host, _YNN_FUSION_TYPES["no_bf16"])[mode]
    if mode != "train" and host in _INFERENCE_WITHOUT_WINDOWS and program is not None and not has_windows(program):
        fusion_types = _INFERENCE_WITHOUT_WINDOWS[host]
    elif mode != "train" and host == "bf16" and conv_kernels_here(inference=True) == ROUND_F32_YNNPACK:
        fusion_types = None   # XLA's defaults: YNNPACK's convolutions measured fastest on this host
    options = _every_program_options()
    if fusion_types is not None:
        options["xla_cpu_experimental_ynn_fusion_type"] = fusion_types
    if not hoist_loop_invariants:
        # (a program's option replaces the flag's value: the passes XLA_FLAGS disables stay disabled)
        disabled = re.findall(r"--xla_disable_hlo_passes=(\S+)", os.environ.get("XLA_FLAGS", ""))
        options["xla_disable_hlo_passes"] = ",".join(disabled[-1:] + [_WITHOUT_LOOP_INVARIANT_MOTION])
    return options


# ----------------------------------------------------------------------------- measured on the host

#: keras-tpu's inference options with XLA's float32 convolutions of bf16-valued operands (Eigen's), and XLA's
#: default options, which hand those convolutions to YNNPACK: the two ways besides ``bf16_direct`` that an
#: evaluation or prediction program can run its convolutions in (:func:`conv_kernels_here`).
ROUND_F32_YNNPACK = "round_f32_ynnpack"

#: The block an inference program is timed on (:func:`conv_kernels_here`): one core's share (64 images) of the
#: README's CIFAR-10 CNN's second block, two 32x32x32 -> 32 3x3 convolutions with their biases and ReLUs and a
#: 2x2 max pooling (NHWC / HWIO).
TIMED_CONV_BLOCK = ((64, 32, 32, 32), (3, 3, 32, 32))
#: A training program is timed on one core's share (64 images) of the CNN's four convolutions, with their biases,
#: ReLUs and poolings and the gradients of a loss: (input features, output features, padding, pooled after). The
#: 3-feature first convolution and the 64-feature ones run at other speeds than the block's (on an Intel Xeon,
#: forward, GFLOP/s: 86 against XLA's 24 and 270-284 against 134-176, beside 205 against 122 for the block's).
TIMED_TRAINING_CONVOLUTIONS = ((3, 32, "SAME", False), (32, 32, "SAME", True), (32, 64, "SAME", False),
                               (64, 64, "VALID", True))
#: An inference program is timed on that block and, after it in the same program, keras.io's MNIST convnet's
#: forward pass (3x3 1 -> 32 convolution, ReLU, 2x2 max pooling, 3x3 32 -> 64, ReLU, pooling, a 1600 -> 10 dense
#: layer) on this many 28x28 images, which takes about as long. The block alone chose XLA's default options
#: (YNNPACK's convolutions, 10.3 against 11.1 ms) on an Intel Xeon where whole models evaluated slower so, wall ms
#: per batch, keras-tpu's options / XLA's: the MNIST convnet 3.3 / 3.7, the zoo's CIFAR-10 CNN 196-205 / 195-198,
#: ResNet-20 232-240 / 264-270, MobileNet 126-127 / 151-152. YNNPACK fuses a whole forward pass into one of its
#: programs, and the MXU's rounding of each layer's input (any elementwise op there) costs it more than XLA's own
#: fusions pay: the MNIST convnet's forward 2.0 ms unrounded either way, rounded 2.3 with keras-tpu's options and
#: 2.9 with XLA's.
TIMED_INFERENCE_IMAGES = 512
_TIMED_CONV_VERSION = "7"   # change it whenever what is timed changes (or the kernels): every host measures again
_CONV_GEOMETRY = ("window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers",
                  "feature_group_count", "batch_group_count")


def _bf16_valued(key, shape):
    """Random float32 values that bfloat16 holds exactly (the operands an MXU pass multiplies)."""
    return jax.random.normal(key, shape).astype(jnp.bfloat16).astype(jnp.float32)


def _timed_conv_block(training):
    """The timed program as JAX traces it, flat (every convolution at its top level), and its arguments
    (bf16-valued float32 arrays): in training the loss and gradients of :data:`TIMED_TRAINING_CONVOLUTIONS`, at
    inference :data:`TIMED_CONV_BLOCK`'s output and keras.io's MNIST convnet's."""
    x_shape, w_shape = TIMED_CONV_BLOCK
    if training:
        keys = jax.random.split(jax.random.key(0), 1 + len(TIMED_TRAINING_CONVOLUTIONS))
        x = _bf16_valued(keys[0], x_shape[:3] + (TIMED_TRAINING_CONVOLUTIONS[0][0],))
        params = tuple((_bf16_valued(key, (3, 3, f_in, f_out)), jnp.zeros(f_out))
                       for key, (f_in, f_out, _, _) in zip(keys[1:], TIMED_TRAINING_CONVOLUTIONS))

        def layers(params, x):
            for (w, b), (_, _, padding, pooled) in zip(params, TIMED_TRAINING_CONVOLUTIONS):
                x = lax.conv_general_dilated(x, w, (1, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))
                x = jnp.maximum(x + b, 0.0)
                if pooled:
                    x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
            return x

        step = jax.value_and_grad(lambda params, x: jnp.mean(layers(params, x) ** 2))
        return jax.make_jaxpr(step)(params, x), (params, x)
    keys = jax.random.split(jax.random.key(0), 3)
    x = _bf16_valued(keys[0], x_shape)
    params = (_bf16_valued(keys[1], w_shape), jnp.zeros(w_shape[3]),
              _bf16_valued(keys[2], w_shape), jnp.zeros(w_shape[3]))

    def block(params, x):
        for w, b in zip(params[::2], params[1::2]):
            x = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = jnp.maximum(x + b, 0.0)
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    keys = jax.random.split(jax.random.key(1), 4)
    net_params = (_bf16_valued(keys[0], (3, 3, 1, 32)), jnp.zeros(32), _bf16_valued(keys[1], (3, 3, 32, 64)),
                  jnp.zeros(64), _bf16_valued(keys[2], (1600, 10)))
    images = _bf16_valued(keys[3], (TIMED_INFERENCE_IMAGES, 28, 28, 1))

    def mnist_convnet(net_params, images):
        *convolutions, dense = net_params
        x = images
        for w, b in zip(convolutions[::2], convolutions[1::2]):
            x = lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = lax.reduce_window(jnp.maximum(x + b, 0.0), -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return x.reshape(x.shape[0], -1) @ dense

    def both(params, x, net_params, images):
        features = block(params, x)
        # One after the other, as a model's layers run. XLA:CPU runs independent ops side by side (it drops an
        # optimization barrier), and two of the kernels' convolutions sharing the intra-op threads so took 33 ms
        # on an AMD EPYC where one after the other took 23 (XLA's convolutions 28 either way).
        images = images + 0.0 * features[0, 0, 0, 0]
        return features, mnist_convnet(net_params, images)

    args = (params, x, net_params, images)
    return jax.make_jaxpr(both)(*args), args


def _with_forms(closed, conv_form=None, dot_form=None):
    """``closed`` (a ``ClosedJaxpr``) as a function whose convolutions (``conv_form(layout, gemm)``) and dots
    (``dot_form(layout)``) are each one MXU pass in that form, as at the default precision (operands rounded to
    bfloat16, products summed in float32); ``None`` leaves them as they are."""
    def run(*args):
        env = dict(zip(closed.jaxpr.constvars, closed.consts))
        env.update(zip(closed.jaxpr.invars, args))
        read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
        for eqn in closed.jaxpr.eqns:
            operands = [read(v) for v in eqn.invars]
            name, params = eqn.primitive.name, eqn.params
            if name == "conv_general_dilated" and conv_form is not None:
                gemm = conv_gemm(operands[0].shape, operands[1].shape, eqn.outvars[0].aval.shape,
                                 params["dimension_numbers"], params["feature_group_count"],
                                 params["batch_group_count"])
                form = conv_form(conv_layout(params["dimension_numbers"]), gemm)
                rounded = [x.astype(jnp.bfloat16).astype(operand_dtype(form)) for x in operands]
                outs = [conv_pass(*rounded, {k: params[k] for k in _CONV_GEOMETRY}, form)]
            elif name == "dot_general" and dot_form is not None:
                form = dot_form(dot_layout(operands[0].ndim, operands[1].ndim, params["dimension_numbers"]))
                rounded = [x.astype(jnp.bfloat16).astype(operand_dtype(form)) for x in operands]
                outs = [dot_pass(*rounded, params["dimension_numbers"], form)]
            else:
                outs = eqn.primitive.bind(*operands, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in closed.jaxpr.outvars]
    return run


def _compiled_candidate(traced, fusion_types, **forms):
    """A candidate for :func:`host_speed.fastest`: ``traced()``'s program (``(ClosedJaxpr, args)``) with its products
    in ``forms`` (see :func:`_with_forms`), compiled with ``fusion_types``."""
    def build():
        closed, args = traced()
        flat = jax.tree.leaves(args)
        options = _every_program_options()
        if fusion_types is not None:
            options["xla_cpu_experimental_ynn_fusion_type"] = fusion_types
        return jax.jit(_with_forms(closed, **forms)).lower(*flat).compile(options), flat
    return build


def _timed_conv_program(training, choice, fusion_types):
    """A candidate for :func:`host_speed.fastest`: the timed program with its convolutions in the form ``choice``,
    compiled with ``fusion_types``. At inference the kernels' candidate leaves a convolution of fewer than
    :data:`INFERENCE_DIRECT_MIN_K` products per output on XLA, as a model's program would (:class:`DirectRule`):
    timed on the kernels, the MNIST convnet's one-channel first layer (16.5 against XLA's 5.7 ms for 512 images on
    an AMD EPYC) made XLA's way win the question although the kernels evaluated the CIFAR-10 CNN 1.5x faster."""
    def conv_form(layout, gemm):
        if choice == BF16_DIRECT and not training and gemm[2] < INFERENCE_DIRECT_MIN_K:
            return ROUND_F32
        return choice
    return _compiled_candidate(lambda: _timed_conv_block(training), fusion_types, conv_form=conv_form,
                               dot_form=lambda layout: ROUND_F32)


def conv_kernels_here(inference=False):
    """How this host runs the MXU's convolutions fastest, in training or in inference programs, as measured on it.

    keras-tpu's own kernels (``bf16_direct``, :mod:`keras_tpu.mxu._direct_conv`)
    or XLA's float32 convolutions of bf16-valued operands (``round_f32``); in
    inference also XLA's convolutions under XLA's default options, which hand
    them to YNNPACK (:data:`ROUND_F32_YNNPACK`). The kernels' speed against
    XLA's depends on the CPU (see :mod:`keras_tpu.mxu._host_speed`), so each host
    times a CIFAR-10 CNN's convolutions in each way once (in training
    :data:`TIMED_TRAINING_CONVOLUTIONS`, at inference :data:`TIMED_CONV_BLOCK`
    with keras.io's MNIST convnet after it, :data:`TIMED_INFERENCE_IMAGES`), keeps the answer on disk,
    and XLA's way wins unless another is 5% faster. A host without the kernels
    (:func:`keras_tpu.mxu._direct_conv.available`) measures only XLA's ways, and
    one without bf16 instructions nothing (``round_f32``);
    ``KERAS_TPU_DIRECT_CONV=1`` takes the kernels without measuring.

    Example:
        >>> conv_kernels_here() in ("bf16_direct", "round_f32")
        True
    """
    if host_class() != "bf16":
        return ROUND_F32
    if direct.available() and direct.always_on():
        return BF16_DIRECT
    training = not inference
    options = _YNN_FUSION_TYPES["bf16"]["train" if training else "test"]
    candidates = {ROUND_F32: _timed_conv_program(training, ROUND_F32, options)}
    if direct.available():
        candidates[BF16_DIRECT] = _timed_conv_program(training, BF16_DIRECT, options)
    if inference:
        candidates[ROUND_F32_YNNPACK] = _timed_conv_program(False, ROUND_F32, None)
    if len(candidates) == 1:
        return ROUND_F32
    x, w = TIMED_CONV_BLOCK
    what = (f"the MXU's convolutions for inference (two {w[0]}x{w[1]}x{w[2]}->{w[3]} convolutions, ReLUs and max "
            f"pooling of {x[0]}x{x[1]}x{x[2]}x{x[3]}; keras.io's MNIST convnet on {TIMED_INFERENCE_IMAGES} images)"
            if inference else f"the MXU's convolutions for training (the CIFAR-10 CNN's four convolutions and "
            f"their gradients on {x[0]} images)")
    return host_speed.fastest(f"conv_{'inference' if inference else 'training'}",
                              f"{_TIMED_CONV_VERSION}/{'+'.join(sorted(candidates))}", candidates, ROUND_F32, what)


#: The dense layer a host is timed on (:func:`native_bf16_dots_here`): the zoo MLP's 784 -> 1024 layer at
#: a batch of 1024 rows, its forward product and both gradient products.
TIMED_DENSE_LAYER = (1024, 784, 1024)
_TIMED_DENSE_VERSION = "1"
#: The native forms the built-in table gives a wide dense layer's products on a "bf16" host, per layout.
_NATIVE_DENSE_FORMS = {"forward": BF16, "rhs_transposed": BF16, "lhs_transposed": BF16_SWAPPED}


def _timed_dense_layer():
    rows, inputs, outputs = TIMED_DENSE_LAYER
    keys = jax.random.split(jax.random.key(1), 3)
    x, w, g = (_bf16_valued(k, shape) for k, shape in zip(keys, ((rows, inputs), (inputs, outputs), (rows, outputs))))
    layer = lambda x, w: x @ w
    return jax.make_jaxpr(lambda x, w, g: (layer(x, w),) + jax.vjp(layer, x, w)[1](g))(x, w, g), (x, w, g)


@functools.lru_cache(maxsize=None)
def native_bf16_dots_here():
    """Whether this host's native bf16 products (bf16 x bf16 -> f32 dots, ``bf16``/``bf16_swapped``) measured faster
    than float32 products of bf16-valued operands (``round_f32``), on :data:`TIMED_DENSE_LAYER`'s training products.

    The built-in table's native forms were measured on an AMD EPYC (Zen 4), where
    they ran 1.4-3.9x faster; an Intel Xeon (Emerald Rapids) with the same AVX-512
    BF16 flags ran the same products 0.57-0.91x as fast natively (GFLOP per
    CPU-second, 1024^3, forward / weight gradient / input gradient: round_f32
    164 / 125 / 142, best native 94 / 114 / 86). So each host times both once
    (see :mod:`keras_tpu.mxu._host_speed`), and ``round_f32`` is kept unless the
    native forms are 5% faster.

    Example:
        >>> native_bf16_dots_here() in (True, False)
        True
    """
    if host_class() != "bf16":
        return False
    options = _YNN_FUSION_TYPES["bf16"]["train"]
    candidates = {ROUND_F32: _compiled_candidate(_timed_dense_layer, options, dot_form=lambda layout: ROUND_F32),
                  BF16: _compiled_candidate(_timed_dense_layer, options, dot_form=_NATIVE_DENSE_FORMS.get)}
    rows, inputs, outputs = TIMED_DENSE_LAYER
    what = f"the MXU's native bf16 products (a {rows} x {inputs} -> {outputs} dense layer's training products)"
    return host_speed.fastest("bf16_dots", _TIMED_DENSE_VERSION, candidates, ROUND_F32, what) == BF16


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
    """``(groups, M, K, N)`` of a convolution mapped by im2col (as :mod:`keras_tpu.mxu._program` does)."""
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


#: Dots one of whose operands is a weight rounded once, per layout, on a ``"bf16"`` host (see :func:`choose_form`).
ROUNDED_WEIGHT_RULES = {
    ("dot", "forward"): WhereNativeIsFaster(ShapeRule(BF16, min_k=64, min_n=64)),
    ("dot", "rhs_transposed"): WhereNativeIsFaster(ShapeRule(BF16)),
}


def choose_form(kind, layout, gemm, bf16_operand=False):
    """The form for one op: forced, else from a measured table, else the built-in table, else ``round_f32``.

    ``kind`` is ``"dot"`` or ``"conv"``; ``gemm`` is ``(batch or groups, M, K, N)``.
    ``bf16_operand``: an operand arrives in bfloat16 (a weight's copy, rounded once
    for a whole evaluation or returned by the training step before,
    :mod:`keras_tpu._rounded_weights`). On a ``"bf16"`` host a
    forward dot then runs native at any M once N and K reach 64
    (:data:`ROUNDED_WEIGHT_RULES`): with the weight's conversion gone,
    32x784x512 took 131 us native against 285 us in ``round_f32`` (the weight
    converted back to float32 per call) and 162 us plain float32, 16x256x256
    21 / 41 / 33, 128x1024x1024 904 / 1640 / 1594. A 10-class head ties in
    isolation (128x1600x10: 123 / 137 / 78) but cost keras.io's MNIST convnet
    ~0.5 ms of its 4 ms evaluation step native, so it stays on the table's form.
    An input gradient (rhs transposed) multiplying a weight's copy, as a
    training step with few rows does (:mod:`keras_tpu._rounded_weights`), runs
    native at every shape measured, us native / ``round_f32`` / plain float32,
    ``dY[M, N] W[K, N]^T``: 32x512x512 58 / 129 / 83, 32x784x512 75 / 175 / 126,
    128x1024x1024 358 / 779 / 701, 200x512x2048 608 / 1102 / 1045, a 10-class
    head's 64x10x256 7 / 13 / 8, 8x64x128 8 / 14 / 9 (keras.io's 784-512-512-10
    MLP at batch 32: 728 -> 655 us per train step, plain Keras 660; in-process A/B).
    """
    forms = DOT_FORMS if kind == "dot" else CONV_FORMS
    forced = forced_form()
    if forced is not None and forced in forms:
        return forced
    measured = _measured_choice(kind, layout, gemm)
    if measured in forms:
        return measured
    host = host_class()
    if bf16_operand and host == "bf16" and (kind, layout) in ROUNDED_WEIGHT_RULES:
        return ROUNDED_WEIGHT_RULES[kind, layout](gemm)
    return builtin_choice(host, kind, layout, gemm)


def builtin_choice(host, kind, layout, gemm):
    """The built-in table's form for one op on a host of class ``host`` (``round_f32`` if it has no entry).

    Example:
        >>> builtin_choice("bf16", "dot", "forward", (1, 1024, 784, 1024)) == (
        ...     "bf16" if native_bf16_dots_here() else "round_f32")
        True
        >>> builtin_choice("bf16", "conv", "forward", (128, 65536, 9, 1))   # depthwise
        'taps'
        >>> builtin_choice("no_bf16", "dot", "forward", (1, 1024, 784, 1024))
        'round_f32'
    """
    entry = BUILTIN_TABLES.get(host, {}).get((kind, layout), ROUND_F32)
    return entry(tuple(gemm)) if callable(entry) else entry


def operand_dtype(form):
    """The dtype a form's operands are given in (``multipass`` splits into it)."""
    return jnp.float32 if form in (ROUND_F32, TAPS, OUTPUT_TAPS) else jnp.bfloat16


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
    """``x`` transposed into a new row-major array, which XLA can neither fold back into the dot nor leave as a
    layout change.

    A barrier alone is not enough: XLA:CPU makes a transpose a change of
    layout (no data moves), and a bf16 dot with an operand in a transposed
    layout is converted to float32 (measured: a 1024^3 product then ran at
    5.8-6.3 ms, as float32, against 2.7 ms with this form, transpose included).
    Flattening the transposed array behind the barrier forces it row-major.
    """
    if _is_identity(perm):
        return x
    transposed = lax.transpose(x, tuple(perm))
    return lax.optimization_barrier(transposed.reshape(-1)).reshape(transposed.shape)


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


def _matrix_view(x, contracting):
    """``x`` reshaped to a matrix ``(K, free)`` or ``(free, K)`` and the index of its K axis, when its
    contracting dimensions form one leading or trailing block in order (a free reshape); else ``None``."""
    contracting = tuple(contracting)
    n = len(contracting)
    if not n or n == x.ndim:
        return None
    k = math.prod(x.shape[d] for d in contracting)
    if contracting == tuple(range(n)):
        return x.reshape(k, -1), 0
    if contracting == tuple(range(x.ndim - n, x.ndim)):
        return x.reshape(-1, k), 1
    return None


def _as_matrix_dot(lhs, rhs, dimension_numbers):
    """The same product as a two-dimensional ``dot_general``, and the result's shape, or ``None``.

    Under ``jax.vmap`` over the cores a layer's product has a 3-D operand
    (``(cores, rows, features)``); XLA:CPU hands a bf16 dot to YNNPACK's fast
    kernel only as a plain matrix product and otherwise takes a slow path (the
    784-1024-1024-10 MLP trained ~1.6x slower in bf16 than in float32 until its
    dots were collapsed to matrices). The reshapes are free: no data moves.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb:
        return None
    lhs_view, rhs_view = _matrix_view(lhs, lc), _matrix_view(rhs, rc)
    if lhs_view is None or rhs_view is None:
        return None
    (lhs2, lk), (rhs2, rk) = lhs_view, rhs_view
    out_shape = tuple(d for i, d in enumerate(lhs.shape) if i not in lc) + \
        tuple(d for i, d in enumerate(rhs.shape) if i not in rc)
    return lhs2, rhs2, (((lk,), (rk,)), ((), ())), out_shape


def dot_pass(lhs, rhs, dimension_numbers, form):
    """One MXU pass of ``dot_general`` on bfloat16-valued operands; float32 result."""
    matrices = _as_matrix_dot(lhs, rhs, dimension_numbers)
    if matrices is not None and (lhs.ndim > 2 or rhs.ndim > 2):
        lhs2, rhs2, dimension_numbers2, out_shape = matrices
        return dot_pass(lhs2, rhs2, dimension_numbers2, form).reshape(out_shape)
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


def _inverse(perm):
    """The permutation that undoes ``perm``.

    Example:
        >>> _inverse((0, 3, 1, 2))
        (0, 2, 3, 1)
    """
    inverse = [0] * len(perm)
    for position, dim in enumerate(perm):
        inverse[dim] = position
    return tuple(inverse)


def _conv_canonical_perms(dimension_numbers):
    lspec, rspec, ospec = dimension_numbers
    lhs_perm = (lspec[0],) + tuple(lspec[2:]) + (lspec[1],)       # N, spatial..., C
    rhs_perm = tuple(rspec[2:]) + (rspec[1], rspec[0])           # spatial..., I, O
    out_perm = (ospec[0],) + tuple(ospec[2:]) + (ospec[1],)
    return lhs_perm, rhs_perm, out_perm


def _canonical_conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                    feature_group_count, batch_group_count, materialize=True, precision=None):
    """The convolution on operands transposed to NHWC / HWIO, its NHWC result transposed back.

    ``materialize`` keeps the transposes as row-major copies behind barriers
    (which a bf16 convolution needs, see :func:`_materialized_transpose`);
    without it they are plain transposes XLA may turn into layouts.
    """
    lhs_perm, rhs_perm, out_perm = _conv_canonical_perms(dimension_numbers)
    s = lhs.ndim - 2
    canonical = lax.ConvDimensionNumbers(
        lhs_spec=(0, s + 1) + tuple(range(1, s + 1)),
        rhs_spec=(s + 1, s) + tuple(range(s)),
        out_spec=(0, s + 1) + tuple(range(1, s + 1)))
    transpose = _materialized_transpose if materialize else _transpose
    out = lax.conv_general_dilated(transpose(lhs, lhs_perm), transpose(rhs, rhs_perm), window_strides, padding,
                                   lhs_dilation, rhs_dilation, canonical, feature_group_count, batch_group_count,
                                   precision=precision, preferred_element_type=jnp.float32)
    inverse = _inverse(out_perm)    # out is (N, spatial..., C): put each axis where dimension_numbers wants it
    return _transpose(_barrier_unless_identity(out, inverse) if materialize else out, inverse)


def conv_as_dot(lhs_shape, rhs_shape, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                feature_group_count, batch_group_count):
    """``(dot dimension numbers, kernel axes dropped, result axes)`` when a convolution is a matrix product,
    else ``None``.

    Two kinds are: a *pointwise* convolution (a 1x1 kernel at stride 1, no
    padding: each output position is its input row times the kernel, as a
    TPU maps it onto the MXU), with its input gradient; and a convolution
    whose window covers its whole unpadded input (one output position: the
    weight gradient of a pointwise convolution), contracting the spatial
    axes too. ``dot_general(lhs, rhs without the dropped axes, dims)``
    transposed by ``result axes`` holds the output's axes in canonical order
    (batch, feature, spatial...); spatial axes it lacks have size 1.

    Example:
        >>> dn = lax.conv_dimension_numbers((8, 4, 4, 3), (1, 1, 3, 5), ("NHWC", "HWIO", "NHWC"))
        >>> conv_as_dot((8, 4, 4, 3), (1, 1, 3, 5), (1, 1), ((0, 0), (0, 0)), (1, 1), (1, 1), dn, 1, 1)
        ((((3,), (0,)), ((), ())), (0, 1), (0, 3, 1, 2))
    """
    if feature_group_count != 1 or batch_group_count != 1:
        return None
    if any(d != 1 for d in tuple(lhs_dilation) + tuple(rhs_dilation)) or any(p != (0, 0) for p in padding):
        return None
    lspec, rspec, _ = dimension_numbers
    window = [rhs_shape[d] for d in rspec[2:]]
    if all(w == 1 for w in window) and all(st == 1 for st in window_strides):
        # rhs without its spatial axes keeps its out- and in-feature axes in their order.
        in_feature = 0 if rspec[1] < rspec[0] else 1
        free = [d for d in range(len(lhs_shape)) if d != lspec[1]]       # the result's leading axes
        axes = (free.index(lspec[0]), len(free)) + tuple(free.index(d) for d in lspec[2:])
        return (((lspec[1],), (in_feature,)), ((), ())), tuple(rspec[2:]), axes
    if window == [lhs_shape[d] for d in lspec[2:]]:
        contracting = (lspec[1],) + tuple(lspec[2:]), (rspec[1],) + tuple(rspec[2:])
        return (contracting, ((), ())), (), (0, 1)
    return None


def conv_dot_pass(lhs, rhs, out_shape, dimension_numbers, as_dot, form):
    """One MXU pass of a convolution that is a matrix product (``as_dot``, from :func:`conv_as_dot`)."""
    dot_numbers, dropped, axes = as_dot
    out = _transpose(dot_pass(lhs, lax.squeeze(rhs, dropped), dot_numbers, form), axes)
    ospec = dimension_numbers[2]
    canonical = out.reshape(out.shape + (1,) * (len(ospec) - out.ndim))
    perm = [0] * len(ospec)      # output axis ospec[j] is canonical axis j
    for j, dim in enumerate(ospec):
        perm[dim] = j
    return _transpose(canonical, perm).reshape(out_shape)


def conv_pass(lhs, rhs, geometry, form, window_reversed=False):
    """One MXU pass of ``conv_general_dilated`` on bfloat16-valued operands; float32 result.

    ``geometry``: the primitive's window_strides, padding, lhs_dilation,
    rhs_dilation, dimension_numbers (a ``ConvDimensionNumbers``),
    feature_group_count and batch_group_count. ``window_reversed``: the
    convolution's window is ``rhs`` reversed in its spatial dimensions (the
    direct kernels read it so; the other forms reverse it first).
    """
    if form == BF16_DIRECT:
        out = direct.direct_conv(lhs, rhs, **geometry, window_reversed=window_reversed)
        if out is not None:
            return out
        form = ROUND_F32   # not a convolution the direct kernels cover
    if window_reversed:
        rhs = lax.rev(rhs, tuple(geometry["dimension_numbers"].rhs_spec[2:]))
    if form in (TAPS, OUTPUT_TAPS):
        summed = _taps_conv if form == TAPS else _output_taps_conv
        out = summed(lhs.astype(jnp.float32), rhs.astype(jnp.float32), **geometry)
        if out is not None:
            return out
        form = ROUND_F32   # not a shape the form covers
    if form == ROUND_F32:
        if conv_layout(geometry["dimension_numbers"]) != "forward":
            # Autodiff's gradient convolutions, stated in NHWC / HWIO: XLA:CPU's own canonicalisation reaches
            # only the program's top level, and in a loop body (the cores of a convolutional model run in one,
            # see keras_tpu._replicated_steps) it ran them as naive loops, 30-140x slower. At the top level
            # both ways run equally fast (the CIFAR-10 CNN's step 848 against 872 ms).
            return _canonical_conv(lhs.astype(jnp.float32), rhs.astype(jnp.float32), **geometry, materialize=False,
                                   precision=lax.Precision.HIGHEST)
        return lax.conv_general_dilated(lhs.astype(jnp.float32), rhs.astype(jnp.float32), **geometry,
                                        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    lhs, rhs = _fenced(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16))
    if form == BF16:
        return _fenced(lax.conv_general_dilated(lhs, rhs, **geometry, preferred_element_type=jnp.float32))
    if form == BF16_CANONICAL:
        return _fenced(_canonical_conv(lhs, rhs, **geometry))
    raise ValueError(f"Unknown conv form {form!r}.")


def _taps_conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
               feature_group_count, batch_group_count):
    """A grouped convolution of bf16-valued float32 operands as a float32 sum of exact elementwise products.

    Covers convolutions with one input feature per group
    (``feature_group_count`` = input features, ``batch_group_count`` 1): the
    forward and input-gradient convolutions of a depthwise layer, summed over
    the window's taps. Returns ``None`` for anything else (the weight
    gradient, a batch-grouped convolution, summed this way per output
    position measured slower than XLA's convolution: 0.3-0.5 against
    0.6-2.8 GFLOP/s). A product of two bf16 values is exact in float32, so
    this is the MXU's arithmetic (only the order of the float32 sums differs).
    """
    lhs_perm, rhs_perm, out_perm = _conv_canonical_perms(dimension_numbers)
    in_features, in_per_group = lhs.shape[lhs_perm[-1]], rhs.shape[rhs_perm[-2]]
    if not (batch_group_count == 1 and in_per_group == 1 and feature_group_count == in_features > 1):
        return None
    lhs, rhs = lax.transpose(lhs, lhs_perm), lax.transpose(rhs, rhs_perm)   # N, S..., C and S..., I, O
    s = lhs.ndim - 2
    window, out_features = rhs.shape[:s], rhs.shape[s + 1]
    # Dilate and pad the input (lax.pad takes interior padding for lhs dilation, negative padding for cropping).
    config = [(0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)] + [(0, 0, 0)]
    lhs = lax.pad(lhs, jnp.zeros((), lhs.dtype), config)
    out_spatial = [(size - (w - 1) * d - 1) // stride + 1
                   for size, w, d, stride in zip(lhs.shape[1:-1], window, rhs_dilation, window_strides)]
    if min(out_spatial) < 1:
        return None
    groups = feature_group_count
    multiplier = out_features // groups
    total = None
    for tap in _positions(window):
        start = [0] + [t * d for t, d in zip(tap, rhs_dilation)] + [0]
        piece = _window_slice(lhs, start, out_spatial, window_strides)               # N, S'..., G
        term = piece[..., :, None] * rhs[tap][0].reshape(groups, multiplier)           # exact products
        total = term if total is None else total + term
    out = total.reshape(total.shape[:-2] + (out_features,))
    inverse = _inverse(out_perm)    # out is (N, spatial..., C): put each axis where dimension_numbers wants it
    return _transpose(out, inverse)


#: The most columns (window taps times output features) of ``output_taps``' product (see FewOutputsRule).
OUTPUT_TAPS_MAX_COLUMNS = 49


def _output_taps_conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                      feature_group_count, batch_group_count):
    """A convolution with few output features, of bf16-valued float32 operands, as one product and a sum.

    ``out[n, o, c] = sum over taps t of P[t, c, n, o + t - pad]`` with
    ``P[t, c, n, i] = sum over f of kernel[t, f, c] * input[n, i, f]``: one
    float32 product of exact bf16 products (``taps * outputs`` rows), then
    every tap's rows added at their shifted positions (zero beyond the
    input). Covers stride 1 without dilation or groups, and at most
    :data:`OUTPUT_TAPS_MAX_COLUMNS` taps times outputs; returns ``None`` for
    anything else. Only the order of the float32 sums differs from the MXU's.
    """
    lhs_perm, rhs_perm, out_perm = _conv_canonical_perms(dimension_numbers)
    if feature_group_count != 1 or batch_group_count != 1 or \
            any(d != 1 for d in (*window_strides, *lhs_dilation, *rhs_dilation)):
        return None
    lhs, rhs = lax.transpose(lhs, lhs_perm), lax.transpose(rhs, rhs_perm)   # N, S..., F and S..., F, C
    s = lhs.ndim - 2
    window, features, outputs = rhs.shape[:s], rhs.shape[s], rhs.shape[s + 1]
    taps = math.prod(window)
    out_spatial = [size + lo + hi - w + 1 for size, (lo, hi), w in zip(lhs.shape[1:-1], padding, window)]
    if taps * outputs > OUTPUT_TAPS_MAX_COLUMNS or min(out_spatial) < 1:
        return None
    kernel = jnp.moveaxis(rhs.reshape(taps, features, outputs), 1, 2).reshape(taps * outputs, features)
    rows = lhs.reshape(-1, features)
    # Tap-major rows, each a whole image plane: the shifted sums read contiguous runs. The barrier keeps XLA
    # from fusing the slices into the product (which then ran 3-6x slower).
    products = lax.optimization_barrier(lax.dot_general(kernel, rows, (((1,), (1,)), ((), ())),
                                                        precision=lax.Precision.HIGHEST))
    products = products.reshape((taps, outputs, lhs.shape[0]) + lhs.shape[1:-1])
    products = lax.pad(products, jnp.zeros((), products.dtype),
                       [(0, 0, 0)] * 3 + [(lo, hi, 0) for lo, hi in padding])   # negative padding crops
    total = None
    for t, tap in enumerate(_positions(window)):
        start = (t, 0, 0) + tap
        limit = (t + 1, outputs, lhs.shape[0]) + tuple(o + i for o, i in zip(out_spatial, tap))
        term = lax.slice(products, start, limit)[0]                                  # C, N, S'...
        total = term if total is None else total + term
    out = jnp.moveaxis(total, 0, -1)                                                # N, S'..., C
    inverse = _inverse(out_perm)    # out is (N, spatial..., C): put each axis where dimension_numbers wants it
    return _transpose(out, inverse)


def _positions(shape):
    """Every index tuple of an array of ``shape``."""
    return list(itertools.product(*(range(d) for d in shape)))


def _window_slice(x, start, out_spatial, strides):
    """``x[:, start + stride * i, ..., :]`` for the output positions ``i``."""
    limit = [x.shape[0]] + [st + (o - 1) * stride + 1 for st, o, stride in zip(start[1:-1], out_spatial, strides)] \
        + [x.shape[-1]]
    return lax.slice(x, start, limit, [1] + list(strides) + [1])
