"""Part 4: the MXU primitive computes what a TPU computes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from keras_tpu import mxu
from keras_tpu.mxu._numerics import canonical_precision, split_bfloat16


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def f64_product_of_rounded(a, b):
    return bf16(a) @ bf16(b)


def test_default_is_one_bf16_pass_with_float32_accumulation(rng):
    a = rng.standard_normal((64, 300)).astype(np.float32)
    b = rng.standard_normal((300, 40)).astype(np.float32)
    got = np.asarray(mxu.matmul(a, b))
    assert got.dtype == np.float32
    reference = f64_product_of_rounded(a, b)
    # Exact products, float32 sums: error of float32 accumulation only.
    np.testing.assert_allclose(got, reference, rtol=0, atol=300 * 2**-23 * np.abs(reference).max())
    # ...and clearly not the float32 product: the inputs really were rounded.
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(got - exact).max() > 100 * np.abs(reference - got).max()


def test_rounding_is_to_nearest_even():
    one_ulp = 2.0**-7  # bfloat16 spacing at 1.0
    a = np.array([[1 + one_ulp / 2, 1 + 3 * one_ulp / 2, 1 + one_ulp / 2 + 2**-20]], np.float32)
    got = np.asarray(mxu.matmul(a, np.eye(3, dtype=np.float32)))
    np.testing.assert_array_equal(got[0], [1.0, 1 + 2 * one_ulp, 1 + one_ulp])


def test_products_are_exact_in_float32():
    # Two bf16 numbers with full 8-bit significands: their product needs 16 bits.
    x = np.float32(1 + 127 * 2**-7)
    got = float(mxu.matmul(np.array([[x]], np.float32), np.array([[x]], np.float32))[0, 0])
    assert got == float(np.float64(x) * np.float64(x))


@pytest.mark.parametrize("precision, alias, tolerance", [
    ("high", "bfloat16_3x", 2e-5),
    ("highest", "float32", 2e-6),
])
def test_multipass_precisions(rng, precision, alias, tolerance):
    a = rng.standard_normal((32, 200)).astype(np.float32)
    b = rng.standard_normal((200, 16)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    got = np.asarray(mxu.matmul(a, b, precision=precision))
    scale = np.abs(exact).max()
    assert np.abs(got - exact).max() < tolerance * scale
    np.testing.assert_array_equal(got, np.asarray(mxu.matmul(a, b, precision=alias)))
    np.testing.assert_array_equal(got, np.asarray(mxu.matmul(a, b, precision=getattr(lax.Precision, precision.upper()))))
    default_error = np.abs(np.asarray(mxu.matmul(a, b)) - exact).max()
    assert np.abs(got - exact).max() < default_error / 20


def test_high_drops_only_the_lo_times_lo_term(rng):
    a = rng.standard_normal((8, 50)).astype(np.float32)
    b = rng.standard_normal((50, 8)).astype(np.float32)
    a_hi, a_lo = (np.asarray(p, np.float64) for p in split_bfloat16(jnp.asarray(a), 2))
    b_hi, b_lo = (np.asarray(p, np.float64) for p in split_bfloat16(jnp.asarray(b), 2))
    reference = a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi
    got = np.asarray(mxu.matmul(a, b, precision="high"))
    np.testing.assert_allclose(got, reference, rtol=1e-6, atol=1e-5)


def test_precision_names_are_checked():
    assert canonical_precision(None) is mxu.Precision.DEFAULT
    assert canonical_precision("bfloat16") is mxu.Precision.DEFAULT
    with pytest.raises(ValueError, match="bfloat16_3x"):
        canonical_precision("double")


@pytest.mark.parametrize("preset, passes", [("BF16_BF16_F32", "default"), ("BF16_BF16_F32_X3", "high"),
                                            ("BF16_BF16_F32_X6", "highest"), ("F32_F32_F32", "highest")])
def test_a_dot_algorithm_preset_runs_its_passes_whatever_the_default(rng, preset, passes):
    """A product that names a dot algorithm (jax.nn.dot_product_attention asks BF16_BF16_F32 for bfloat16 queries)
    runs its passes on the MXU under every configured precision; DEFAULT follows the configured one."""
    a = rng.standard_normal((16, 64)).astype(np.float32)
    b = rng.standard_normal((64, 8)).astype(np.float32)
    einsum = lambda a, b: jnp.einsum("ij,jk->ik", a, b, precision=getattr(lax.DotAlgorithmPreset, preset),
                                     preferred_element_type=jnp.float32)
    want = np.asarray(mxu.matmul(a, b, precision=passes))
    for configured in ("default", "highest"):
        np.testing.assert_array_equal(np.asarray(mxu.route(einsum, precision=configured)(a, b)), want)
    default_preset = lambda a, b: jnp.einsum("ij,jk->ik", a, b, precision=lax.DotAlgorithmPreset.DEFAULT)
    np.testing.assert_array_equal(np.asarray(mxu.route(default_preset, precision="high")(a, b)),
                                  np.asarray(mxu.matmul(a, b, precision="high")))


def test_works_under_jit_grad_and_vmap(rng):
    a = rng.standard_normal((6, 5)).astype(np.float32)
    b = rng.standard_normal((5, 4)).astype(np.float32)
    jitted = jax.jit(mxu.matmul)(a, b)
    np.testing.assert_array_equal(jitted, mxu.matmul(a, b))
    # Gradients: d/dA sum(A @ B) = 1 @ B^T, itself computed on the MXU (B rounded to bf16).
    grad_a = jax.grad(lambda a: jnp.sum(mxu.matmul(a, b)))(a)
    np.testing.assert_allclose(grad_a, np.ones((6, 4)) @ bf16(b).T, rtol=1e-6)
    batched = jax.vmap(mxu.matmul, in_axes=(0, None))(np.stack([a, 2 * a]), b)
    np.testing.assert_array_equal(batched[1], mxu.matmul(2 * a, b))
    # The gradient program holds MXU ops and no plain dot.
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda a: jnp.sum(mxu.matmul(a, b))))(a))
    assert "mxu_dot_general" in jaxpr and " dot_general" not in jaxpr


def test_bfloat16_inputs_give_bfloat16_results_accumulated_in_float32(rng):
    a = rng.standard_normal((4, 512)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((512, 4)).astype(ml_dtypes.bfloat16)
    got = mxu.matmul(jnp.asarray(a), jnp.asarray(b))
    assert got.dtype == jnp.bfloat16
    reference = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32).astype(ml_dtypes.bfloat16)
    # One rounding at the end (float32 accumulation), not one per partial sum.
    assert np.mean(np.asarray(got, np.float32) == reference.astype(np.float32)) > 0.9


def test_integer_products_stay_off_the_mxu():
    a = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    jaxpr = str(jax.make_jaxpr(mxu.route(lambda x: x @ x.T))(a))
    assert "mxu_dot_general" not in jaxpr
    np.testing.assert_array_equal(mxu.route(lambda x: x @ x.T)(a), a @ a.T)


def test_convolution_numerics(rng):
    x = rng.standard_normal((2, 9, 9, 5)).astype(np.float32)
    k = rng.standard_normal((3, 3, 5, 7)).astype(np.float32)
    dn = ("NHWC", "HWIO", "NHWC")
    got = np.asarray(mxu.conv_general_dilated(x, k, (2, 2), "SAME", dimension_numbers=dn))
    # Same as a float32 convolution of the bf16-rounded inputs (exact products, f32 sums).
    rounded = lax.conv_general_dilated(jnp.asarray(bf16(x), jnp.float32), jnp.asarray(bf16(k), jnp.float32),
                                       (2, 2), "SAME", dimension_numbers=dn, precision=lax.Precision.HIGHEST)
    np.testing.assert_allclose(got, np.asarray(rounded), rtol=1e-6, atol=1e-5)
    exact = np.asarray(lax.conv_general_dilated(x, k, (2, 2), "SAME", dimension_numbers=dn,
                                                precision=lax.Precision.HIGHEST))
    assert np.abs(got - exact).max() > 1e-3  # visibly rounded
    highest = mxu.conv_general_dilated(x, k, (2, 2), "SAME", dimension_numbers=dn, precision="highest")
    np.testing.assert_allclose(highest, exact, rtol=1e-5, atol=1e-5)
