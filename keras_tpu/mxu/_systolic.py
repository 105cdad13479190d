"""A cycle-level reference model of a weight-stationary systolic array, in numpy.

This is the slow, literal model the fast MXU primitive and the cost model are
checked against. Every clock cycle it moves each register of an ``R x C`` grid
of multiply-accumulate cells:

* **weights** are shifted in from the top, one row per cycle, and then stay;
* **activations** enter at the left edge, row ``r`` delayed by ``r`` cycles
  (the skew), and move one cell to the right per cycle;
* **partial sums** move one cell down per cycle, each cell adding
  ``activation * weight``; finished sums leave the bottom row.

A GEMM larger than the array is cut into folds of ``R`` rows of ``K`` by ``C``
columns of ``N`` (SCALE-Sim's order: column folds outer, row folds inner);
the folds' partial results are added in float32. Operands are rounded to
bfloat16, products are exact and sums are float32, as on the MXU.
"""

import dataclasses

import ml_dtypes
import numpy as np

from keras_tpu.mxu._numerics import PASS_PRODUCTS, PASS_PARTS, canonical_precision


def to_bfloat16(x):
    """Round to bfloat16 (nearest, ties to even) and return float32."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _split(x, parts):
    pieces, rest = [], np.asarray(x, dtype=np.float32)
    for _ in range(parts):
        piece = to_bfloat16(rest)
        pieces.append(piece)
        rest = (rest - piece).astype(np.float32)
    return pieces


@dataclasses.dataclass
class SimulationResult:
    """What :meth:`SystolicArray.matmul` produced.

    Example:
        >>> result = SystolicArray(4, 4).matmul(np.ones((5, 6)), np.ones((6, 3)))
        >>> result.product.shape, result.folds, result.cycles, result.busy_macs
        ((5, 3), 2, 29, 90)
    """

    product: np.ndarray     # float32 [M, N]
    cycles: int             # index of the last busy cycle (SCALE-Sim's "total cycles")
    folds: int
    busy_macs: int          # cell-cycles that multiplied real (non-padding) data

    @property
    def clock_ticks(self):
        return self.cycles + 1


class SystolicArray:
    """A ``rows x cols`` weight-stationary systolic array, simulated cycle by cycle.

    Example:
        >>> array = SystolicArray(4, 4)
        >>> result = array.matmul(np.ones((5, 6)), np.ones((6, 3)))
        >>> float(result.product[0, 0]), result.cycles
        (6.0, 29)
    """

    def __init__(self, rows=128, cols=128):
        if rows < 1 or cols < 1:
            raise ValueError(f"The array needs at least one row and column; got {rows}x{cols}.")
        self.rows, self.cols = int(rows), int(cols)

    def matmul(self, a, w, precision="default"):
        """``a[M, K] @ w[K, N]`` on the array; returns a :class:`SimulationResult`.

        ``precision`` "high"/"highest" run 3/6 bfloat16 passes (each a full
        set of folds), summed in float32.
        """
        a, w = np.asarray(a, dtype=np.float32), np.asarray(w, dtype=np.float32)
        if a.ndim != 2 or w.ndim != 2 or a.shape[1] != w.shape[0]:
            raise ValueError(f"matmul needs [M, K] and [K, N] matrices; got {a.shape} and {w.shape}.")
        precision = canonical_precision(precision)
        a_parts, w_parts = _split(a, PASS_PARTS[precision]), _split(w, PASS_PARTS[precision])
        total, cycles, folds, busy = None, 0, 0, 0
        for i, j in PASS_PRODUCTS[precision]:
            part = self._run_folds(a_parts[i], w_parts[j])
            total = part.product if total is None else (total + part.product).astype(np.float32)
            cycles += part.clock_ticks
            folds += part.folds
            busy += part.busy_macs
        return SimulationResult(total, cycles - 1, folds, busy)

    def conv2d(self, x, kernel, strides=(1, 1), padding="valid", precision="default"):
        """A channels-last 2-D convolution of one or more images, by im2col on the array.

        ``x`` is ``[batch, h, w, c]`` and ``kernel`` ``[kh, kw, c, out]``.
        Returns the :class:`SimulationResult` of the im2col GEMM, its product
        reshaped to ``[batch, out_h, out_w, out]``.
        """
        x, kernel = np.asarray(x, dtype=np.float32), np.asarray(kernel, dtype=np.float32)
        kh, kw, c, out = kernel.shape
        if isinstance(padding, str) and padding.lower() == "same":
            pads = []
            for size, k, s in zip(x.shape[1:3], (kh, kw), strides):
                total = max((-(-size // s) - 1) * s + k - size, 0)
                pads.append((total // 2, total - total // 2))
        elif isinstance(padding, str):
            pads = [(0, 0), (0, 0)]
        else:
            pads = list(padding)
        x = np.pad(x, [(0, 0), pads[0], pads[1], (0, 0)])
        sh, sw = strides
        oh, ow = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
        patches = np.stack([x[:, i:i + (oh - 1) * sh + 1:sh, j:j + (ow - 1) * sw + 1:sw, :]
                            for i in range(kh) for j in range(kw)], axis=3)
        result = self.matmul(patches.reshape(-1, kh * kw * c), kernel.reshape(kh * kw * c, out), precision)
        result.product = result.product.reshape(x.shape[0], oh, ow, out)
        return result

    def _run_folds(self, a, w):
        R, C = self.rows, self.cols
        M, K = a.shape
        N = w.shape[1]
        row_folds, col_folds = -(-K // R), -(-N // C)
        out = np.zeros((M, N), dtype=np.float32)
        ticks, busy = 0, 0
        for fc in range(col_folds):
            for fr in range(row_folds):
                tile = np.zeros((R, C), dtype=np.float32)
                block = w[fr * R:(fr + 1) * R, fc * C:(fc + 1) * C]
                tile[:block.shape[0], :block.shape[1]] = block
                tile_real = np.zeros((R, C), dtype=bool)
                tile_real[:block.shape[0], :block.shape[1]] = True
                feed = np.zeros((M, R), dtype=np.float32)
                feed[:, :block.shape[0]] = a[:, fr * R:(fr + 1) * R]
                partial, fold_ticks, fold_busy = self._one_fold(tile, tile_real, feed, block.shape[0])
                out[:, fc * C:fc * C + block.shape[1]] += partial[:, :block.shape[1]]
                ticks += fold_ticks
                busy += fold_busy
        return SimulationResult(out, ticks - 1, row_folds * col_folds, busy)

    def _one_fold(self, tile, tile_real, feed, real_rows):
        R, C = self.rows, self.cols
        M = feed.shape[0]
        ticks = 0
        # Weight load: rows are pushed in bottom-first and shift down one row per cycle.
        weights = np.zeros((R, C), dtype=np.float32)
        for row in range(R - 1, -1, -1):
            weights[1:] = weights[:-1].copy()
            weights[0] = tile[row]
            ticks += 1
        acts = np.zeros((R, C), dtype=np.float32)
        act_real = np.zeros((R, C), dtype=bool)
        sums = np.zeros((R, C), dtype=np.float32)
        out = np.zeros((M, C), dtype=np.float32)
        busy = 0
        rows_idx = np.arange(R)
        for t in range(M + R + C - 2):
            # Activations move right; row r takes element (m = t - r, r) of the fold's input.
            acts[:, 1:] = acts[:, :-1].copy()
            act_real[:, 1:] = act_real[:, :-1].copy()
            m = t - rows_idx
            entering = (m >= 0) & (m < M)
            acts[:, 0] = np.where(entering, feed[np.clip(m, 0, M - 1), rows_idx], 0.0)
            act_real[:, 0] = entering & (rows_idx < real_rows)
            # Partial sums move down, each cell adding its product (exact bf16 x bf16 in float32).
            products = acts * weights
            sums = np.concatenate([products[:1], sums[:-1] + products[1:]], axis=0).astype(np.float32)
            busy += int(np.count_nonzero(act_real & tile_real))
            # The bottom row holds finished sums for m = t - (R - 1) - c.
            m_out = t - (R - 1) - np.arange(C)
            done = (m_out >= 0) & (m_out < M)
            out[m_out[done], np.nonzero(done)[0]] = sums[R - 1, done]
            ticks += 1
        return out, ticks, busy
