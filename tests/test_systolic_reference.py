"""Part 6: the cycle-level reference array agrees with the fast primitive and the cost model."""

import numpy as np
import pytest

from keras_tpu import mxu
from keras_tpu.mxu import SystolicArray


@pytest.mark.parametrize("rows, cols, m, k, n", [
    (4, 4, 5, 6, 3),      # partial row and column folds
    (8, 8, 16, 8, 8),     # exactly one fold
    (3, 5, 7, 11, 13),    # non-square array, ragged folds
    (8, 4, 1, 20, 9),     # a single activation row
])
def test_product_matches_the_mxu_primitive_and_cycles_match_the_model(rng, rows, cols, m, k, n):
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    result = SystolicArray(rows, cols).matmul(a, w)
    fast = np.asarray(mxu.matmul(a, w))
    # Same bf16 products; only the float32 summation order differs.
    np.testing.assert_allclose(result.product, fast, rtol=1e-5, atol=1e-5 * np.abs(fast).max())
    cost = mxu.gemm_cost(m, k, n, rows=rows, cols=cols)
    assert result.cycles == cost.cycles
    assert result.folds == cost.folds
    assert result.busy_macs == cost.macs  # every real multiply happened exactly once


def test_integer_inputs_give_bit_identical_products(rng):
    a = rng.integers(-8, 8, (12, 10)).astype(np.float32)
    w = rng.integers(-8, 8, (10, 6)).astype(np.float32)
    result = SystolicArray(4, 4).matmul(a, w)
    np.testing.assert_array_equal(result.product, a @ w)
    np.testing.assert_array_equal(result.product, np.asarray(mxu.matmul(a, w)))


def test_a_full_size_array(rng):
    a = rng.standard_normal((6, 130)).astype(np.float32)
    w = rng.standard_normal((130, 3)).astype(np.float32)
    result = SystolicArray(128, 128).matmul(a, w)
    assert result.cycles == mxu.gemm_cost(6, 130, 3).cycles == 2 * (2 * 128 + 128 + 6 - 2) - 1
    np.testing.assert_allclose(result.product, mxu.matmul(a, w), rtol=1e-5, atol=1e-5)


def test_the_array_rounds_to_bfloat16():
    a = np.array([[1 + 2**-9]], np.float32)
    result = SystolicArray(2, 2).matmul(a, np.ones((1, 1), np.float32))
    assert result.product[0, 0] == 1.0


def test_multipass_precision_on_the_array(rng):
    a = rng.standard_normal((5, 9)).astype(np.float32)
    w = rng.standard_normal((9, 4)).astype(np.float32)
    single = SystolicArray(4, 4).matmul(a, w)
    high = SystolicArray(4, 4).matmul(a, w, precision="high")
    np.testing.assert_allclose(high.product, mxu.matmul(a, w, precision="high"), rtol=1e-5, atol=1e-6)
    assert high.cycles + 1 == 3 * (single.cycles + 1)
    exact = a.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(high.product - exact).max() < np.abs(single.product - exact).max() / 20


@pytest.mark.parametrize("strides, padding", [((1, 1), "same"), ((2, 2), "valid"), ((2, 1), "same")])
def test_convolution_by_im2col(rng, strides, padding):
    x = rng.standard_normal((2, 7, 6, 3)).astype(np.float32)
    kernel = rng.standard_normal((3, 2, 3, 5)).astype(np.float32)
    result = SystolicArray(8, 4).conv2d(x, kernel, strides=strides, padding=padding)
    fast = np.asarray(mxu.conv_general_dilated(x, kernel, strides, padding.upper(),
                                               dimension_numbers=("NHWC", "HWIO", "NHWC")))
    np.testing.assert_allclose(result.product, fast, rtol=1e-5, atol=1e-5 * np.abs(fast).max())
    cost = mxu.conv_cost(x.shape, kernel.shape, strides=strides, padding=padding, rows=8, cols=4)
    assert result.product.shape == cost.output_shape
    assert result.cycles == cost.cycles
