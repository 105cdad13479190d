"""Cycle cost of matrix work on a weight-stationary systolic array (SCALE-Sim v2's model).

A GEMM ``out[M, N] = A[M, K] @ W[K, N]`` maps onto an ``R x C`` array with the
weights stationary: ``K`` runs down the rows, ``N`` across the columns, and the
``M`` rows of ``A`` stream through. It takes ``ceil(K/R) * ceil(N/C)`` folds;
each fold loads its weights (``R`` cycles), streams ``M`` rows with an
``R``-cycle skew and drains through ``C`` columns, ``2R + C + M - 2`` cycles in
all. SCALE-Sim v2 reports the index of the last busy cycle, so the total is
``folds * (2R + C + M - 2) - 1``. Utilisation is MACs / (cycles * R * C).

A convolution maps by im2col: ``M = batch * out_h * out_w``,
``K = kh * kw * in_channels / groups``, ``N = out_channels / groups``, and each
group is a separate GEMM. SCALE-Sim describes a convolution by its input
*after* padding and has no batch or dilation: a padded, batched or dilated
convolution corresponds to the SCALE-Sim layer with the same ``M, K, N``
(:attr:`ConvCost.scalesim_layer` gives it for batch 1). SCALE-Sim also sizes
outputs as ``ceil((H - k + s) / s)`` where XLA and Keras use
``floor((H - k) / s) + 1``; :func:`scalesim_layer_cost` costs a SCALE-Sim
topology row by SCALE-Sim's own convention.

SCALE-Sim also models two other dataflows with the same fold formula and a
different mapping (Samajdar et al., "SCALE-Sim", arXiv:1811.02883, section
III): output stationary (``"os"``: ``M`` down the rows, ``N`` across, ``K``
streams) and input stationary (``"is"``: ``K`` down the rows, ``M`` across,
``N`` streams). ``dataflow="ws"`` is the default and the TPU's own; the
profile maps a weight gradient (whose "weights" are activations) the cheapest
of the three ways, as a compiler choosing which operand to hold does.

On a core with several MXUs (v3: 2, v4 and v5e: 4) the folds are shared
among them. Time is the larger of compute time and HBM time (a roofline), with
bfloat16 operands and float32 results moved once.
"""

import dataclasses
import math

from keras_tpu._accelerators import GENERATIONS, accelerator_spec

BF16_BYTES = 2
F32_BYTES = 4

#: SCALE-Sim's dataflows: weight, output and input stationary.
DATAFLOWS = ("ws", "os", "is")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Predicted time of one MXU op on one core of an accelerator.

    Example:
        >>> timing = gemm_cost(1024, 288, 64).timing("v3-8")   # a v3 core's two MXUs share the 3 folds
        >>> timing.compute_cycles, timing.bound
        (2811, 'compute')
    """

    compute_cycles: int
    compute_s: float
    memory_s: float

    @property
    def time_s(self):
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self):
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclasses.dataclass(frozen=True)
class GemmCost:
    """The cost of ``count`` GEMMs ``[m, k] @ [k, n]`` on a ``rows x cols`` array.

    ``dataflow`` is SCALE-Sim's: ``"ws"`` (weight stationary, the TPU's and the
    default), ``"os"`` (output stationary) or ``"is"`` (input stationary).

    Example:
        >>> cost = GemmCost(m=1024, k=288, n=64)   # as gemm_cost(1024, 288, 64)
        >>> cost.folds, cost.cycles, cost.padded_shape
        (3, 4217, (1024, 384, 128))
    """

    m: int
    k: int
    n: int
    rows: int = 128
    cols: int = 128
    count: int = 1
    dataflow: str = "ws"

    def __post_init__(self):
        for name in ("m", "k", "n", "rows", "cols", "count"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GEMM {name} must be a positive integer; got {value!r}.")
        if self.dataflow not in DATAFLOWS:
            raise ValueError(f"dataflow must be one of {DATAFLOWS}; got {self.dataflow!r}.")

    @property
    def _mapping(self):
        """(dimension down the rows, dimension across the columns, dimension streamed), per SCALE-Sim."""
        return {"ws": (self.k, self.n, self.m), "os": (self.m, self.n, self.k), "is": (self.k, self.m, self.n)}[
            self.dataflow]

    @property
    def row_folds(self):
        return math.ceil(self._mapping[0] / self.rows)

    @property
    def col_folds(self):
        return math.ceil(self._mapping[1] / self.cols)

    @property
    def folds(self):
        return self.count * self.row_folds * self.col_folds

    @property
    def cycles_per_fold(self):
        return 2 * self.rows + self.cols + self._mapping[2] - 2

    @property
    def cycles(self):
        """Total cycles as SCALE-Sim v2 reports them (index of the last cycle)."""
        return self.folds * self.cycles_per_fold - 1

    @property
    def macs(self):
        return self.count * self.m * self.k * self.n

    @property
    def flops(self):
        return 2 * self.macs

    @property
    def utilization(self):
        """MACs / (cycles * array cells): SCALE-Sim's "overall utilization"."""
        return self.macs / (self.cycles * self.rows * self.cols)

    @property
    def mapping_efficiency(self):
        """Average fraction of the array's cells holding a weight (SCALE-Sim's mapping efficiency)."""
        down, across, _ = self._mapping
        return (down * across) / (self.row_folds * self.col_folds * self.rows * self.cols)

    @property
    def padding_waste(self):
        """Fraction of the array left idle because ``k``/``n`` do not fill whole folds."""
        return 1.0 - self.mapping_efficiency

    @property
    def padded_shape(self):
        """``(m, k, n)`` with the two mapped dimensions rounded up to whole folds."""
        rounded = {"m": self.m, "k": self.k, "n": self.n}
        spatial = {"ws": ("k", "n"), "os": ("m", "n"), "is": ("k", "m")}[self.dataflow]
        rounded[spatial[0]] = self.row_folds * self.rows
        rounded[spatial[1]] = self.col_folds * self.cols
        return (rounded["m"], rounded["k"], rounded["n"])

    @property
    def compute_utilization(self):
        """SCALE-Sim's per-fold "compute utilization" (fill and drain of each fold counted)."""
        streamed = self._mapping[2]
        per_fold_cycles = 2 * self.rows + 2 * self.cols + streamed - 3
        return self.mapping_efficiency * streamed / per_fold_cycles

    def with_dataflow(self, dataflow):
        """The same GEMMs mapped with another of SCALE-Sim's dataflows.

        Example:
            >>> gemm_cost(9, 25088, 6).with_dataflow("os").cycles < gemm_cost(9, 25088, 6).cycles
            True
        """
        return dataclasses.replace(self, dataflow=dataflow)

    def cheapest_dataflow(self):
        """This GEMM mapped the cheapest of SCALE-Sim's three ways (fewest cycles; ties keep ``"ws"``).

        A weight gradient ``dW[K_in, N] = X^T[K_in, rows] @ dY[rows, N]``
        contracts over all the rows of the batch: weight stationary reloads the
        array ``rows / 128`` times and streams only ``K_in`` rows through each
        load, which output stationary avoids.

        Example:
            >>> gemm_cost(9, 25088, 6).cheapest_dataflow().dataflow
            'os'
        """
        return min((self.with_dataflow(d) for d in DATAFLOWS), key=lambda c: (c.cycles, DATAFLOWS.index(c.dataflow)))

    # Element traffic between the array and its on-chip buffers (SCALE-Sim's SRAM counts, weight stationary).
    @property
    def ifmap_reads(self):
        return self.count * self.m * self.k * self.col_folds

    @property
    def filter_reads(self):
        return self.count * self.k * self.n

    @property
    def ofmap_writes(self):
        return self.count * self.m * self.n * self.row_folds

    @property
    def hbm_bytes(self):
        """Bytes moved to and from HBM: bf16 operands read once, float32 results written once."""
        return self.count * ((self.m * self.k + self.k * self.n) * BF16_BYTES + self.m * self.n * F32_BYTES)

    def timing(self, accelerator="v2-8", hbm_bytes=None):
        """Predicted :class:`Timing` on one core of ``accelerator`` (a type name or AcceleratorSpec).

        ``hbm_bytes`` replaces :attr:`hbm_bytes` when the caller knows the
        operands' real size (a convolution reads its input once, not its
        im2col matrix; an operand of several bf16 passes is read once).

        Example:
            >>> gemm_cost(1024, 288, 64).timing("v3-8").bound
            'compute'
        """
        spec = _spec(accelerator)
        if (spec.mxu_rows, spec.mxu_cols) != (self.rows, self.cols):
            raise ValueError(f"This cost is for a {self.rows}x{self.cols} array; {spec.generation} "
                             f"has {spec.mxu_rows}x{spec.mxu_cols} MXUs.")
        compute_cycles = math.ceil(self.folds / spec.mxus_per_core) * self.cycles_per_fold - 1
        return Timing(
            compute_cycles=compute_cycles,
            compute_s=compute_cycles / spec.clock_hz,
            memory_s=(self.hbm_bytes if hbm_bytes is None else hbm_bytes) / spec.hbm_bytes_per_second_per_core,
        )

    def as_dict(self):
        """The figures as a flat dict (for tables and CSV)."""
        return {
            "m": self.m, "k": self.k, "n": self.n, "count": self.count, "rows": self.rows, "cols": self.cols,
            "dataflow": self.dataflow,
            "folds": self.folds, "cycles": self.cycles, "macs": self.macs,
            "utilization": self.utilization, "mapping_efficiency": self.mapping_efficiency,
            "padding_waste": self.padding_waste, "hbm_bytes": self.hbm_bytes,
        }


def _spec(accelerator):
    # Any AcceleratorSpec-like object: keras_tpu._accelerators' class or, while
    # keras_tpu._cluster keeps its own copy of it, the cluster's (a Topology's spec).
    if all(hasattr(accelerator, name) for name in ("mxu_rows", "mxu_cols", "mxus_per_core", "clock_hz")):
        return accelerator
    if isinstance(accelerator, str) and accelerator in GENERATIONS:
        return GENERATIONS[accelerator]
    return accelerator_spec(accelerator)[0]


def gemm_cost(m, k, n, rows=128, cols=128, count=1, dataflow="ws"):
    """Cost of ``[m, k] @ [k, n]`` on a ``rows x cols`` MXU (weight stationary unless ``dataflow`` says).

    Example:
        >>> cost = gemm_cost(m=1024, k=288, n=64)
        >>> cost.folds, cost.cycles, round(cost.utilization, 3)
        (3, 4217, 0.273)
    """
    return GemmCost(int(m), int(k), int(n), int(rows), int(cols), int(count), str(dataflow))


@dataclasses.dataclass(frozen=True)
class ConvCost(GemmCost):
    """A :class:`GemmCost` for a convolution, with its geometry.

    Example:
        >>> c = conv_cost((8, 32, 32, 3), (3, 3, 3, 16), padding="same")
        >>> c.output_shape, (c.m, c.k, c.n), c.scalesim_layer
        ((8, 32, 32, 16), (8192, 27, 16), [34, 34, 3, 3, 3, 16, 1, 1])
    """

    input_shape: tuple = ()         # (batch, *spatial, channels), unpadded
    kernel_shape: tuple = ()        # (*spatial, in_channels / groups, out_channels)
    output_shape: tuple = ()        # (batch, *spatial, out_channels)
    strides: tuple = ()
    padding: tuple = ()             # ((before, after), ...) per spatial dim
    dilation: tuple = ()

    @property
    def scalesim_layer(self):
        """The SCALE-Sim v2 topology row (batch 1) with the same GEMM per image and group:
        ``[ifmap_h, ifmap_w, filter_h, filter_w, channels, num_filter, stride_h, stride_w]``.

        The padding is folded into the input size (SCALE-Sim takes padded
        inputs) and dilation into an equivalent kernel with the same window
        size. Only 2-D convolutions have a SCALE-Sim form.
        """
        if len(self.strides) != 2:
            raise ValueError("SCALE-Sim describes 2-D convolutions only.")
        (kh, kw), out_hw = self.kernel_shape[:2], self.output_shape[1:3]
        channels = self.kernel_shape[2]
        sh, sw = self.strides
        # A window of kh x kw at stride s over an input of (out - 1) * s + k rows gives `out` rows.
        ifmap_h = (out_hw[0] - 1) * sh + kh
        ifmap_w = (out_hw[1] - 1) * sw + kw
        return [ifmap_h, ifmap_w, kh, kw, channels, self.n, sh, sw]


def _normalize_padding(padding, in_spatial, kernel_spatial, strides, dilation):
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            return tuple((0, 0) for _ in in_spatial)
        if mode == "same":
            pads = []
            for size, k, s, d in zip(in_spatial, kernel_spatial, strides, dilation):
                out = math.ceil(size / s)
                total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
                pads.append((total // 2, total - total // 2))
            return tuple(pads)
        raise ValueError(f"padding must be 'valid', 'same' or explicit pairs; got {padding!r}.")
    return tuple((int(a), int(b)) for a, b in padding)


def conv_cost(input_shape, kernel_shape, strides=1, padding="valid", dilation=1, groups=1, rows=128, cols=128):
    """Cost of a channels-last convolution on a ``rows x cols`` MXU, mapped by im2col.

    Args:
        input_shape: ``(batch, *spatial, in_channels)``.
        kernel_shape: ``(*spatial, in_channels // groups, out_channels)`` (Keras' layout).
        strides, dilation: an int or one per spatial dim.
        padding: ``"valid"``, ``"same"`` or ``((before, after), ...)``.
        groups: feature groups (``in_channels`` for a depthwise convolution).

    Example:
        >>> c = conv_cost((128, 32, 32, 32), (3, 3, 32, 64), padding="same")
        >>> (c.m, c.k, c.n)
        (131072, 288, 64)
    """
    input_shape, kernel_shape = tuple(int(d) for d in input_shape), tuple(int(d) for d in kernel_shape)
    spatial = len(input_shape) - 2
    if spatial < 1 or len(kernel_shape) != spatial + 2:
        raise ValueError(f"A convolution needs input (batch, *spatial, channels) and kernel "
                         f"(*spatial, in, out) of matching rank; got {input_shape} and {kernel_shape}.")
    as_tuple = lambda v: (int(v),) * spatial if isinstance(v, int) else tuple(int(x) for x in v)
    strides, dilation = as_tuple(strides), as_tuple(dilation)
    batch, in_spatial, channels = input_shape[0], input_shape[1:-1], input_shape[-1]
    kernel_spatial, in_per_group, out_channels = kernel_shape[:spatial], kernel_shape[-2], kernel_shape[-1]
    if channels != in_per_group * groups:
        raise ValueError(f"in_channels ({channels}) must equal kernel in_channels ({in_per_group}) x groups ({groups}).")
    if out_channels % groups:
        raise ValueError(f"out_channels ({out_channels}) must be divisible by groups ({groups}).")
    pads = _normalize_padding(padding, in_spatial, kernel_spatial, strides, dilation)
    out_spatial = tuple(
        (size + lo + hi - (k - 1) * d - 1) // s + 1
        for size, (lo, hi), k, s, d in zip(in_spatial, pads, kernel_spatial, strides, dilation)
    )
    if min(out_spatial) < 1:
        raise ValueError(f"The kernel {kernel_spatial} does not fit the padded input {in_spatial}.")
    return ConvCost(
        m=batch * math.prod(out_spatial), k=math.prod(kernel_spatial) * in_per_group,
        n=out_channels // groups, rows=int(rows), cols=int(cols), count=int(groups),
        input_shape=input_shape, kernel_shape=kernel_shape,
        output_shape=(batch,) + out_spatial + (out_channels,),
        strides=strides, padding=pads, dilation=dilation,
    )


def scalesim_layer_cost(ifmap_h, ifmap_w, filter_h, filter_w, channels, num_filter, stride_h, stride_w=None,
                        rows=128, cols=128):
    """Cost of one row of a SCALE-Sim v2 convolution topology file, by SCALE-Sim's conventions.

    The input is taken as already padded and the output size is
    ``ceil((ifmap - filter + stride) / stride)``, as SCALE-Sim computes it.

    Example:
        >>> scalesim_layer_cost(224, 224, 11, 11, 3, 96, 4, rows=32, cols=32).cycles   # AlexNet conv1
        112283
    """
    stride_w = stride_h if stride_w is None else stride_w
    out_h = math.ceil((ifmap_h - filter_h + stride_h) / stride_h)
    out_w = math.ceil((ifmap_w - filter_w + stride_w) / stride_w)
    # The same GEMM as a convolution whose input gives exactly that output by floor rounding.
    return conv_cost((1, (out_h - 1) * stride_h + filter_h, (out_w - 1) * stride_w + filter_w, channels),
                     (filter_h, filter_w, channels, num_filter), strides=(stride_h, stride_w),
                     rows=rows, cols=cols)

