"""MXU arithmetic: bfloat16 multiplies, float32 accumulation, and the multi-pass precisions.

A TPU's matrix unit multiplies bfloat16 numbers and accumulates in float32.
A float32 matmul therefore runs, by default, as one pass on inputs rounded to
bfloat16. For more accuracy XLA splits each float32 operand into a sum of
bfloat16 parts and adds several bf16 products (JAX's documented TPU
semantics):

=========  ============================  ======  =====================================
precision  aliases                       passes  products (hi/mid/lo parts)
=========  ============================  ======  =====================================
default    ``bfloat16``, ``fastest``       1     hi*hi
high       ``bfloat16_3x``                 3     lo*hi + hi*lo + hi*hi
highest    ``float32``                     6     lo*hi + mid*mid + hi*lo + mid*hi + hi*mid + hi*hi
=========  ============================  ======  =====================================

The product of two bfloat16 numbers (8-bit significands) is exact in float32
(24-bit significand), so a pass is either a float32 product of the rounded
values or a bf16 x bf16 -> float32 product; both give exactly the MXU's
products and accumulate in float32. Which of the two XLA:CPU runs faster
depends on the host and the op's layout: :mod:`keras_tpu.mxu._kernels`
chooses, and :func:`multipass` hands the passes their operands in the dtype
the chosen form takes.
"""

import enum

import jax.numpy as jnp
from jax import lax


class Precision(enum.Enum):
    """How many bfloat16 passes an MXU op makes.

    Example:
        >>> Precision.HIGH.passes, canonical_precision("float32")
        (3, <Precision.HIGHEST: 6>)
    """

    DEFAULT = 1
    HIGH = 3
    HIGHEST = 6

    @property
    def passes(self):
        return self.value


_NAMES = {
    "default": Precision.DEFAULT, "bfloat16": Precision.DEFAULT, "fastest": Precision.DEFAULT,
    "high": Precision.HIGH, "bfloat16_3x": Precision.HIGH,
    "highest": Precision.HIGHEST, "float32": Precision.HIGHEST,
}


#: The MXU passes of JAX's dot algorithm presets (``jax.lax.DotAlgorithmPreset``): the fewest that compute at
#: least what the preset asks. ``jax.nn.dot_product_attention`` (Keras' attention without dropout) asks
#: ``BF16_BF16_F32`` for bfloat16 queries and ``F16_F16_F32`` for float16 ones. bfloat16 products summed in
#: float32 are the MXU's own passes (``_X9``, nine of them, is more than its six: HIGHEST). float8 operands are
#: exact in bfloat16 (one pass); float16's 11-bit and TensorFlow-32's 10-bit significands need a second
#: bfloat16 part (HIGH, three passes); two TF32 parts, float32 and float64 take HIGHEST. ``DEFAULT`` is the
#: configured precision, as ``precision=None`` is.
_PRESET_PASSES = {
    "BF16_BF16_BF16": Precision.DEFAULT, "BF16_BF16_F32": Precision.DEFAULT,
    "BF16_BF16_F32_X3": Precision.HIGH, "BF16_BF16_F32_X6": Precision.HIGHEST, "BF16_BF16_F32_X9": Precision.HIGHEST,
    "ANY_F8_ANY_F8_F32": Precision.DEFAULT, "ANY_F8_ANY_F8_F32_FAST_ACCUM": Precision.DEFAULT,
    "ANY_F8_ANY_F8_ANY": Precision.DEFAULT, "ANY_F8_ANY_F8_ANY_FAST_ACCUM": Precision.DEFAULT,
    "F16_F16_F16": Precision.HIGH, "F16_F16_F32": Precision.HIGH,
    "TF32_TF32_F32": Precision.HIGH, "TF32_TF32_F32_X3": Precision.HIGHEST,
    "F32_F32_F32": Precision.HIGHEST, "F64_F64_F64": Precision.HIGHEST,
}


def _preset_passes(precision):
    """The MXU passes an op given a dot algorithm preset runs (``None``: not a preset, or ``DEFAULT``)."""
    if not isinstance(precision, lax.DotAlgorithmPreset) or precision.name == "DEFAULT":
        return None
    if precision.name not in _PRESET_PASSES:
        raise ValueError(f"keras_tpu's MXU has no passes for the dot algorithm {precision!r}.")
    return _PRESET_PASSES[precision.name]


def canonical_precision(precision):
    """Normalise a precision given as a name, ``jax.lax.Precision``, ``jax.lax.DotAlgorithmPreset`` or
    :class:`Precision`.

    ``None`` means ``"default"``.

    Example:
        >>> canonical_precision("bfloat16_3x")
        <Precision.HIGH: 3>
        >>> canonical_precision(lax.DotAlgorithmPreset.BF16_BF16_F32_X6)
        <Precision.HIGHEST: 6>
    """
    if precision is None:
        return Precision.DEFAULT
    if isinstance(precision, Precision):
        return precision
    if isinstance(precision, lax.Precision):
        return Precision[precision.name]
    if isinstance(precision, lax.DotAlgorithmPreset):
        return _preset_passes(precision) or Precision.DEFAULT
    if isinstance(precision, lax.DotAlgorithm):
        raise ValueError(f"keras_tpu's MXU runs the dot algorithms of jax.lax.DotAlgorithmPreset (bf16 passes "
                         f"summed in float32: BF16_BF16_F32, its _X3 and _X6), not a custom {precision!r}.")
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
        # dot_general/conv carry one precision per operand; the MXU uses the higher.
        first, second = (canonical_precision(p) for p in precision)
        return max(first, second, key=lambda p: p.passes)
    if isinstance(precision, str) and precision.lower() in _NAMES:
        return _NAMES[precision.lower()]
    raise ValueError(
        f"Unknown MXU precision {precision!r}. Use one of: "
        + ", ".join(repr(n) for n in _NAMES)
        + ", a jax.lax.Precision, a jax.lax.DotAlgorithmPreset, or None."
    )


def op_precision(requested, default):
    """The precision an op runs at: its own if it asked for more than DEFAULT, else the default.

    On a TPU, ``precision=None``/``DEFAULT`` in an op means "the configured
    default"; an explicit ``HIGH``/``HIGHEST`` is honoured, and so is a dot
    algorithm preset, which names its passes (``BF16_BF16_F32``: one, whatever
    the default).

    Example:
        >>> op_precision(None, "highest"), op_precision(lax.DotAlgorithmPreset.BF16_BF16_F32, "highest")
        (<Precision.HIGHEST: 6>, <Precision.DEFAULT: 1>)
    """
    preset = _preset_passes(requested)
    if preset is not None:
        return preset
    own = canonical_precision(requested)
    return own if own is not Precision.DEFAULT else canonical_precision(default)


def round_to_bfloat16(x):
    """Round to the nearest bfloat16 (ties to even) and return float32.

    Example:
        >>> float(round_to_bfloat16(jnp.float32(1.0 + 2**-9)))
        1.0
    """
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def split_bfloat16(x, parts, dtype=jnp.float32, bf16_valued=False):
    """Split ``x`` into ``parts`` bfloat16-valued arrays whose sum approximates ``x``.

    The first part is ``x`` rounded to bfloat16, each next part the rounded
    remainder, so three parts carry all 24 bits of a float32 significand.
    The parts are returned as ``dtype`` (float32 or bfloat16; either holds
    them exactly). ``bf16_valued``: ``x`` is float32 but holds bfloat16 values
    already (a weight rounded once), which are its first part as they are.
    """
    if x.dtype == jnp.bfloat16 or bf16_valued:
        # Already bf16 values: one part is exact, the others are zero.
        return [x.astype(dtype)] + [jnp.zeros_like(x, dtype) for _ in range(parts - 1)]
    x = x.astype(jnp.float32)
    pieces = []
    for i in range(parts):
        piece = x.astype(jnp.bfloat16)
        pieces.append(piece.astype(dtype))
        if i + 1 < parts:
            x = x - piece.astype(jnp.float32)
    return pieces


# (lhs part, rhs part) products per precision, smallest first so that the
# float32 sum loses as little as possible (the order XLA uses for bf16_3x/6x).
PASS_PRODUCTS = {
    Precision.DEFAULT: ((0, 0),),
    Precision.HIGH: ((1, 0), (0, 1), (0, 0)),
    Precision.HIGHEST: ((2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0)),
}

PASS_PARTS = {Precision.DEFAULT: 1, Precision.HIGH: 2, Precision.HIGHEST: 3}


def multipass(bilinear, lhs, rhs, precision, operand_dtype=jnp.float32, bf16_valued=(False, False)):
    """Evaluate ``bilinear(lhs, rhs)`` as the MXU does at ``precision``.

    ``bilinear`` must be a bilinear op (a dot or a convolution) computing
    exact products and float32 sums of its bfloat16-valued operands, given
    as ``operand_dtype`` (float32 or bfloat16); the passes are summed in
    float32. ``bf16_valued``: per operand, whether a float32 operand holds
    bfloat16 values already (see :func:`split_bfloat16`).

    Example:
        >>> a, b = jnp.full((1, 2), 1 + 2**-9), jnp.ones((2, 1))   # 1 + 2**-9 rounds to 1.0 in bfloat16
        >>> float(multipass(jnp.matmul, a, b, "default")[0, 0]), float(multipass(jnp.matmul, a, b, "highest")[0, 0])
        (2.0, 2.00390625)
    """
    precision = canonical_precision(precision)
    lhs_parts = split_bfloat16(lhs, PASS_PARTS[precision], operand_dtype, bf16_valued[0])
    rhs_parts = split_bfloat16(rhs, PASS_PARTS[precision], operand_dtype, bf16_valued[1])
    # A bfloat16 operand has no lo/mid parts: skip the passes that would multiply zeros.
    used_l = 1 if lhs.dtype == jnp.bfloat16 or bf16_valued[0] else len(lhs_parts)
    used_r = 1 if rhs.dtype == jnp.bfloat16 or bf16_valued[1] else len(rhs_parts)
    total = None
    for i, j in PASS_PRODUCTS[precision]:
        if i >= used_l or j >= used_r:
            continue
        product = bilinear(lhs_parts[i], rhs_parts[j])
        total = product if total is None else total + product
    return total


def is_mxu_dtype(dtype):
    """Float types the MXU takes (float64 is not a TPU type and stays off the MXU)."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize <= 4
