"""Every form of an MXU pass (keras_tpu.mxu._kernels) is the MXU's arithmetic and compiles on XLA:CPU.

Exactness is checked with integer operands in [-255, 255] (8-bit
significands, exact in bfloat16): their products need 16 bits and a sum of up
to 256 of them stays below 2**24, so exact products summed in float32 in any
order give exactly the float64 result, while a product rounded to bfloat16
anywhere would not. Rounding is checked with random operands against a
float64 reference on the bfloat16-rounded operands.
"""

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from keras_tpu import mxu
from keras_tpu.mxu import _direct_conv as direct
from keras_tpu.mxu import _kernels as kernels
from tests.tpu_helpers import written_shapes

DOT_CASES = {
    # name: (lhs shape, rhs shape, dimension numbers)
    "forward": ((24, 200), (200, 16), (((1,), (0,)), ((), ()))),
    "weight_grad_layout": ((200, 24), (200, 16), (((0,), (0,)), ((), ()))),
    "input_grad_layout": ((24, 200), (16, 200), (((1,), (1,)), ((), ()))),
    "both_transposed": ((200, 24), (16, 200), (((0,), (1,)), ((), ()))),
    "batched": ((3, 24, 100), (3, 100, 16), (((2,), (1,)), ((0,), (0,)))),
    "batch_not_leading": ((24, 3, 100), (100, 16, 3), (((2,), (0,)), ((1,), (2,)))),
    "two_contracting_dims": ((10, 24, 20), (20, 16, 10), (((0, 2), (2, 0)), ((), ()))),
    "matrix_vector": ((24, 200), (200,), (((1,), (0,)), ((), ()))),
}

CONV_CASES = {
    # name: (lhs shape, rhs shape, kwargs of lax.conv_general_dilated)
    "nhwc_same": ((2, 9, 9, 8), (3, 3, 8, 5), dict(window_strides=(1, 1), padding="SAME",
                                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "strided_dilated": ((2, 11, 10, 6), (3, 2, 6, 4), dict(window_strides=(2, 3), padding=((1, 2), (0, 1)),
                                                           rhs_dilation=(2, 1),
                                                           dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "lhs_dilated": ((2, 5, 5, 4), (3, 3, 4, 3), dict(window_strides=(1, 1), padding=((2, 2), (2, 2)),
                                                     lhs_dilation=(2, 2),
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "feature_groups": ((2, 7, 7, 6), (3, 3, 2, 9), dict(window_strides=(1, 1), padding="SAME",
                                                        feature_group_count=3,
                                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "depthwise": ((2, 7, 7, 4), (3, 3, 1, 4), dict(window_strides=(2, 2), padding="SAME", feature_group_count=4,
                                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "batch_groups": ((6, 7, 7, 4), (3, 3, 4, 6), dict(window_strides=(1, 1), padding="VALID",
                                                      batch_group_count=3,
                                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "nchw": ((2, 4, 9, 9), (5, 4, 3, 3), dict(window_strides=(1, 1), padding="SAME",
                                              dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    "conv1d": ((2, 30, 8), (5, 8, 6), dict(window_strides=(2,), padding="SAME",
                                           dimension_numbers=("NWC", "WIO", "NWC"))),
    "depthwise_dilated": ((2, 11, 10, 3), (3, 2, 1, 3), dict(window_strides=(1, 2), padding=((1, 2), (0, 1)),
                                                             rhs_dilation=(2, 1), feature_group_count=3,
                                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "depthwise_multiplier": ((2, 9, 8, 4), (3, 3, 1, 8), dict(window_strides=(2, 2), padding="SAME",
                                                              feature_group_count=4,
                                                              dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "depthwise_nchw": ((2, 4, 9, 9), (4, 1, 3, 3), dict(window_strides=(1, 1), padding="SAME", feature_group_count=4,
                                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    # Matrix products (kernels.conv_as_dot): a 1x1 kernel at stride 1, and a window as large as the input.
    "pointwise": ((2, 5, 6, 8), (1, 1, 8, 6), dict(window_strides=(1, 1), padding="VALID",
                                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "pointwise_nchw": ((2, 8, 5, 6), (6, 8, 1, 1), dict(window_strides=(1, 1), padding="SAME",
                                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    "whole_window": ((2, 4, 5, 3), (4, 5, 3, 7), dict(window_strides=(2, 2), padding="VALID",
                                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))),
}


def direct_for(layout):
    """The built-in table's form for an ordinary convolution of ``layout`` in training on a bf16 host: the direct
    kernels where they run and this host measured them faster than XLA's convolutions."""
    return kernels.conv_kernels_here() if direct.available() else kernels.ROUND_F32


def integers(rng, shape):
    return rng.integers(-255, 256, size=shape).astype(np.float32)


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def f64(fun, *args):
    """``fun`` (a plain lax op) in float64 on float64 copies of ``args``."""
    with jax.enable_x64(True):
        return np.asarray(fun(*(np.asarray(a, np.float64) for a in args)))


def _dot(dn):
    return lambda a, b: lax.dot_general(a, b, dn)


def _conv(kwargs):
    return lambda a, b: lax.conv_general_dilated(a, b, **kwargs)


def routed(fun, form, precision="default"):
    """``fun`` on the MXU, jitted and lowered with every pass in ``form``."""
    def run(*args):
        with kernels.use_form(form):
            return jax.jit(mxu.route(fun, precision)).lower(*args).compile()(*args)
    return run


@pytest.mark.parametrize("form", kernels.DOT_FORMS)
@pytest.mark.parametrize("case", sorted(DOT_CASES))
def test_dot_forms_are_exact_products_with_float32_sums(rng, case, form):
    lhs_shape, rhs_shape, dn = DOT_CASES[case]
    a, b = integers(rng, lhs_shape), integers(rng, rhs_shape)
    got = routed(_dot(dn), form)(a, b)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), f64(_dot(dn), a, b))


@pytest.mark.parametrize("form", kernels.CONV_FORMS)
@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_forms_are_exact_products_with_float32_sums(rng, case, form):
    lhs_shape, rhs_shape, kwargs = CONV_CASES[case]
    a, b = integers(rng, lhs_shape), integers(rng, rhs_shape)
    got = routed(_conv(kwargs), form)(a, b)
    np.testing.assert_array_equal(np.asarray(got), f64(_conv(kwargs), a, b))


def _assert_close_to_rounded_reference(got, reference, abs_reference, k):
    # Any float32 summation order of k exact products: |error| <= k * 2**-24 * sum |products|.
    bound = k * 2.0**-24 * abs_reference + 1e-30
    assert np.all(np.abs(np.asarray(got, np.float64) - reference) <= bound)


@pytest.mark.parametrize("form", kernels.DOT_FORMS)
@pytest.mark.parametrize("case", ["forward", "weight_grad_layout", "batch_not_leading"])
def test_dot_forms_round_inputs_to_bfloat16(rng, case, form):
    lhs_shape, rhs_shape, dn = DOT_CASES[case]
    a = rng.standard_normal(lhs_shape).astype(np.float32)
    b = rng.standard_normal(rhs_shape).astype(np.float32)
    got = routed(_dot(dn), form)(a, b)
    reference = f64(_dot(dn), bf16(a), bf16(b))
    _assert_close_to_rounded_reference(got, reference, f64(_dot(dn), np.abs(bf16(a)), np.abs(bf16(b))), 200)
    unrounded = f64(_dot(dn), a, b)
    assert np.abs(np.asarray(got) - unrounded).max() > 100 * np.abs(np.asarray(got) - reference).max()


@pytest.mark.parametrize("form", kernels.CONV_FORMS)
def test_conv_forms_round_inputs_to_bfloat16(rng, form):
    lhs_shape, rhs_shape, kwargs = CONV_CASES["strided_dilated"]
    a = rng.standard_normal(lhs_shape).astype(np.float32)
    b = rng.standard_normal(rhs_shape).astype(np.float32)
    got = routed(_conv(kwargs), form)(a, b)
    reference = f64(_conv(kwargs), bf16(a), bf16(b))
    _assert_close_to_rounded_reference(got, reference, f64(_conv(kwargs), np.abs(bf16(a)), np.abs(bf16(b))), 36)


def _grads(op, a, b, c):
    """d/da and d/db of sum(op(a, b) * c)."""
    return jax.grad(lambda a, b: jnp.sum(op(a, b) * c), argnums=(0, 1))(a, b)


@pytest.mark.parametrize("form", kernels.ALL_FORMS)
@pytest.mark.parametrize("case", ["forward", "batched", "strided_dilated", "feature_groups", "depthwise", "pointwise",
                                  "pointwise_nchw"])
def test_gradients_are_exact_in_every_form(rng, case, form):
    if case in DOT_CASES:
        lhs_shape, rhs_shape, dn = DOT_CASES[case]
        op = _dot(dn)
    else:
        lhs_shape, rhs_shape, kwargs = CONV_CASES[case]
        op = _conv(kwargs)
    a, b = integers(rng, lhs_shape), integers(rng, rhs_shape)
    c = integers(rng, jax.eval_shape(op, a, b).shape)
    # Routing the gradient program, and differentiating the routed op (the primitives' transpose rules).
    routed_grads = routed(lambda a, b: _grads(op, a, b, c), form)(a, b)
    with kernels.use_form(form):
        grads_of_routed = jax.jit(lambda a, b: _grads(mxu.route(op), a, b, c)).lower(a, b).compile()(a, b)
    with jax.enable_x64(True):
        want = _grads(op, *(np.asarray(v, np.float64) for v in (a, b)), np.asarray(c, np.float64))
    # The gradient ops sum at most a few hundred products, so they are exact too.
    for got in (routed_grads, grads_of_routed):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("form", kernels.DOT_FORMS)
def test_vmapped_ops_are_exact_in_every_form(rng, form):
    lhs_shape, rhs_shape, kwargs = CONV_CASES["nhwc_same"]
    x, k = integers(rng, (3,) + lhs_shape), integers(rng, (3,) + rhs_shape)
    a, b = integers(rng, (3, 24, 100)), integers(rng, (3, 100, 16))
    got_conv = routed(jax.vmap(_conv(kwargs)), form)(x, k)
    got_dot = routed(jax.vmap(jnp.matmul), form)(a, b)
    np.testing.assert_array_equal(np.asarray(got_conv), f64(jax.vmap(_conv(kwargs)), x, k))
    np.testing.assert_array_equal(np.asarray(got_dot), f64(jax.vmap(jnp.matmul), a, b))
    # vmap of an already-routed function goes through the primitives' batching rule.
    inner = mxu.route(_conv(kwargs))
    with kernels.use_form(form):
        batched = jax.jit(jax.vmap(inner)).lower(x, k).compile()(x, k)
    np.testing.assert_array_equal(np.asarray(batched), f64(jax.vmap(_conv(kwargs)), x, k))


@pytest.mark.parametrize("form", kernels.NATIVE_FORMS)
@pytest.mark.parametrize("precision", ["high", "highest"])
def test_multipass_precisions_in_native_forms(rng, precision, form):
    a = rng.standard_normal((32, 200)).astype(np.float32)
    b = rng.standard_normal((200, 16)).astype(np.float32)
    fallback = np.asarray(routed(jnp.matmul, kernels.ROUND_F32, precision)(a, b), np.float64)
    got = np.asarray(routed(jnp.matmul, form, precision)(a, b), np.float64)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    # The same passes, exact products: the forms differ only by float32 summation order.
    assert np.all(np.abs(got - fallback) <= 3 * 200 * 2.0**-24 * scale)
    tolerance = {"high": 2e-5, "highest": 2e-6}[precision]
    assert np.abs(got - exact).max() < tolerance * np.abs(exact).max()


def test_bfloat16_operands_skip_the_passes_of_zero_parts(rng):
    a = jnp.asarray(rng.standard_normal((16, 64)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((64, 8)), jnp.bfloat16)
    dot = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    for form in kernels.DOT_FORMS:
        for precision in ("high", "highest"):
            with kernels.use_form(form):
                hlo = jax.jit(mxu.route(dot, precision)).lower(a, b).as_text()
            assert hlo.count("stablehlo.dot_general") == 1, (form, precision)
            got = routed(dot, form, precision)(a, b)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(routed(dot, form)(a, b)))


@pytest.mark.parametrize("case", ["pointwise", "pointwise_nchw", "whole_window"])
def test_convolutions_that_are_matrix_products_run_as_dots_with_their_gradients(case):
    lhs_shape, rhs_shape, kwargs = CONV_CASES[case]
    op = _conv(kwargs)
    a, b = jnp.ones(lhs_shape), jnp.ones(rhs_shape)
    c = jnp.ones(jax.eval_shape(op, a, b).shape)
    # A pointwise convolution's gradients are pointwise and whole-window ones (a whole window's are not).
    fun = op if case == "whole_window" else lambda a, b: (op(a, b), _grads(op, a, b, c))
    text = jax.jit(mxu.route(fun)).lower(a, b).as_text()
    assert "convolution" not in text and "dot_general" in text
    # Any other convolution stays one (XLA's, or the direct kernels' custom call), not a product.
    lhs_shape, rhs_shape, kwargs = CONV_CASES["nhwc_same"]
    text = jax.jit(mxu.route(_conv(kwargs))).lower(jnp.ones(lhs_shape), jnp.ones(rhs_shape)).as_text()
    assert ("convolution" in text or "keras_tpu_mxu_conv_forward" in text) and "dot_general" not in text


def _dot_lines(fun, form, *args):
    with kernels.use_form(form):
        text = jax.jit(mxu.route(fun)).lower(*args).as_text()
    return [line for line in text.splitlines() if "stablehlo.dot_general" in line]


def test_the_chosen_form_is_what_is_emitted():
    a, b = jnp.ones((8, 16)), jnp.ones((16, 4))
    (line,) = _dot_lines(jnp.matmul, kernels.ROUND_F32, a, b)
    assert "(tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>" in line
    (line,) = _dot_lines(jnp.matmul, kernels.BF16, a, b)
    assert "(tensor<8x16xbf16>, tensor<16x4xbf16>) -> tensor<8x4xf32>" in line
    # Weight-gradient layout: canonical transposes lhs, swapped computes the transposed product.
    g, x = jnp.ones((32, 4)), jnp.ones((32, 16))
    wgrad = lambda g, x: lax.dot_general(g, x, (((0,), (0,)), ((), ())))
    (line,) = _dot_lines(wgrad, kernels.BF16, g, x)
    assert "contracting_dims = [0] x [0]" in line
    (line,) = _dot_lines(wgrad, kernels.BF16_CANONICAL, g, x)
    assert "(tensor<4x32xbf16>, tensor<32x16xbf16>) -> tensor<4x16xf32>" in line
    (line,) = _dot_lines(wgrad, kernels.BF16_SWAPPED, g, x)
    assert "(tensor<16x32xbf16>, tensor<32x4xbf16>) -> tensor<16x4xf32>" in line


@pytest.mark.parametrize("form", kernels.DOT_FORMS)
def test_bf16_dots_survive_the_transposes_xla_folds(rng, form):
    # Without the barriers in kernels._fenced, XLA:CPU folds these transposes into a bf16 dot
    # after choosing its kernel and fails at run time ("DotThunk ... BF16 x BF16 = F32").
    x, y = integers(rng, (24, 200)), integers(rng, (16, 24))
    c = integers(rng, (16, 24))
    cases = {
        "result transposed": (lambda x, y: (y @ x).T, (x, y)),
        "constant operand, result transposed": (lambda x, y: (jnp.asarray(c) @ x).T + y.sum(), (x, y)),
        "operands transposed": (lambda x, y: x.T @ y.T, (x, y)),
    }
    for name, (fun, args) in cases.items():
        want = f64(fun, *args) if "constant" not in name else (c.astype(np.float64) @ x).T + y.sum()
        np.testing.assert_array_equal(np.asarray(routed(fun, form)(*args)), want, err_msg=name)


def test_layouts_of_the_ops_autodiff_makes():
    def eqns(fun, *args):
        closed = jax.make_jaxpr(fun)(*args)
        return [e for e in closed.jaxpr.eqns if e.primitive in (lax.dot_general_p, lax.conv_general_dilated_p)]

    x, w = jnp.ones((8, 5)), jnp.ones((5, 3))
    forward, weight_grad, input_grad = eqns(
        jax.value_and_grad(lambda w, x: jnp.sum(x @ w), argnums=(0, 1)), w, x)
    layout = lambda e: kernels.dot_layout(*(v.aval.ndim for v in e.invars), e.params["dimension_numbers"])
    assert [layout(e) for e in (forward, weight_grad, input_grad)] == ["forward", "lhs_transposed", "rhs_transposed"]

    img, ker = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4))
    conv = lambda i, k: jnp.sum(lax.conv_general_dilated(i, k, (1, 1), "SAME",
                                                         dimension_numbers=("NHWC", "HWIO", "NHWC")))
    convs = eqns(jax.value_and_grad(conv, argnums=(0, 1)), img, ker)
    layouts = sorted(kernels.conv_layout(e.params["dimension_numbers"]) for e in convs)
    assert layouts == ["forward", "input_grad", "weight_grad"]


def test_choice_on_this_host_and_its_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("KERAS_TPU_MXU_FORM", raising=False)
    monkeypatch.delenv("KERAS_TPU_MXU_KERNEL_TABLE", raising=False)
    assert kernels.host_class() in kernels.BUILTIN_TABLES
    host = kernels.host_class()
    for kind, layouts in (("dot", kernels.DOT_LAYOUTS), ("conv", kernels.CONV_LAYOUTS)):
        for layout in layouts:
            for gemm in ((1, 64, 64, 64), (1, 1024, 784, 1024), (1, 1024, 1024, 10)):
                assert kernels.choose_form(kind, layout, gemm) == kernels.builtin_choice(host, kind, layout, gemm)
    # A measured table: the nearest measured shape of the same kind and layout decides.
    table = tmp_path / "table.json"
    table.write_text(json.dumps([
        {"kind": "dot", "layout": "forward", "gemm": [1, 1024, 1024, 1024], "best": "bf16"},
        {"kind": "dot", "layout": "forward", "gemm": [1, 1024, 1024, 10], "best": "round_f32"},
        {"kind": "conv", "layout": "weight_grad", "gemm": [1, 9, 8192, 64], "best": "bf16_canonical"},
    ]))
    monkeypatch.setenv("KERAS_TPU_MXU_KERNEL_TABLE", str(table))
    assert kernels.choose_form("dot", "forward", (1, 2048, 1024, 512)) == "bf16"
    assert kernels.choose_form("dot", "forward", (1, 2048, 1024, 16)) == "round_f32"
    assert kernels.choose_form("conv", "weight_grad", (1, 9, 4096, 32)) == "bf16_canonical"
    assert kernels.choose_form("dot", "lhs_transposed", (1, 64, 64, 64)) == kernels.builtin_choice(
        host, "dot", "lhs_transposed", (1, 64, 64, 64))
    # Forcing wins; a dot-only form leaves convolutions to the table.
    monkeypatch.setenv("KERAS_TPU_MXU_FORM", "bf16_swapped")
    assert kernels.choose_form("dot", "forward", (1, 8, 8, 8)) == "bf16_swapped"
    assert kernels.choose_form("conv", "weight_grad", (1, 9, 4096, 32)) == "bf16_canonical"
    with kernels.use_form("round_f32"):
        assert kernels.choose_form("dot", "forward", (1, 2048, 1024, 512)) == "round_f32"
    monkeypatch.setenv("KERAS_TPU_MXU_FORM", "fp8")
    with pytest.raises(ValueError, match="KERAS_TPU_MXU_FORM"):
        kernels.choose_form("dot", "forward", (1, 8, 8, 8))
    with pytest.raises(ValueError, match="Unknown MXU kernel form"):
        with kernels.use_form("fp8"):
            pass


def _float32_transposes_of_shape(form, fun, shape, *args):
    """The instructions named ``transpose...`` with a float32 result of ``shape`` in ``fun``'s compiled program."""
    with kernels.use_form(form):
        text = jax.jit(mxu.route(fun)).lower(*args).compile().as_text()
    named = re.compile(r"\s*(?:ROOT )?%(\S*transpose\S*) = f32\[" + ",".join(map(str, shape)) + r"\]")
    return [m.group(1) for m in map(named.match, text.splitlines()) if m]


def test_a_swapped_weight_gradient_reaches_the_optimizer_without_a_float32_transpose():
    # Autodiff emits a weight gradient as a product in the (outputs, inputs) order followed by a transpose into
    # the weight's shape. The swapped form's own transpose cancels it; the canonical form leaves a float32
    # transpose, which XLA fuses into each consumer (an optimizer's updates) as a strided read.
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(256, 128)).astype(np.float32), rng.normal(size=(128, 64)).astype(np.float32) / 8
    weight_grad = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
    assert _float32_transposes_of_shape(kernels.BF16_SWAPPED, weight_grad, w.shape, w, x) == []
    assert _float32_transposes_of_shape(kernels.BF16_CANONICAL, weight_grad, w.shape, w, x) != []
    grads = {}
    for form in (kernels.BF16_SWAPPED, kernels.BF16_CANONICAL):
        with kernels.use_form(form):
            grads[form] = jax.jit(mxu.route(weight_grad))(w, x)
    np.testing.assert_allclose(grads[kernels.BF16_SWAPPED], grads[kernels.BF16_CANONICAL], rtol=1e-5, atol=1e-6)


def test_bf16_host_table_takes_native_forms_only_where_they_were_measured_faster(monkeypatch):
    choice = lambda kind, layout, gemm: kernels.builtin_choice("bf16", kind, layout, gemm)
    # On a host whose native bf16 products measured slower than float32 ones, no dot is native.
    monkeypatch.setattr(kernels, "native_bf16_dots_here", lambda: False)
    for layout in ("forward", "rhs_transposed", "lhs_transposed"):
        assert choice("dot", layout, (1, 1024, 1024, 1024)) == kernels.ROUND_F32
        assert kernels.choose_form("dot", layout, (1, 1024, 1024, 1024), bf16_operand=True) in (
            kernels.ROUND_F32, kernels.builtin_choice(kernels.host_class(), "dot", layout, (1, 1024, 1024, 1024)))
    # On one where they measured faster (an AMD EPYC, Zen 4), the table's shape rules decide:
    monkeypatch.setattr(kernels, "native_bf16_dots_here", lambda: True)
    # The MLP's hidden layers: native bf16 in all three layouts of the training step.
    assert choice("dot", "forward", (1, 1024, 784, 1024)) == kernels.BF16
    assert choice("dot", "rhs_transposed", (1, 1024, 1024, 784)) == kernels.BF16
    assert choice("dot", "lhs_transposed", (1, 1024, 1024, 784)) == kernels.BF16_SWAPPED
    # The 4096-wide MLP of benchmarks/big_models.py (256 rows in all) and the LSTM's per-step products (256
    # rows): native in all three layouts, weight gradients contracting the 256 rows included.
    assert choice("dot", "forward", (1, 256, 4096, 4096)) == kernels.BF16
    assert choice("dot", "rhs_transposed", (1, 256, 4096, 4096)) == kernels.BF16
    assert choice("dot", "lhs_transposed", (1, 4096, 256, 4096)) == kernels.BF16_SWAPPED
    assert choice("dot", "lhs_transposed", (1, 1024, 256, 64)) == kernels.BF16_SWAPPED
    # The Transformer's FFN weight gradients contract 16384 rows: native too.
    assert choice("dot", "lhs_transposed", (1, 128, 16384, 512)) == kernels.BF16_SWAPPED
    assert choice("dot", "forward", (1, 64, 4096, 4096)) == kernels.ROUND_F32
    # Weight gradients over a small global batch (keras.io's MLPs at batch 32 and 64) and a 10-class head's
    # weight gradient: native once 16 rows are contracted into an input side of 64 features or more.
    assert choice("dot", "lhs_transposed", (1, 256, 64, 784)) == kernels.BF16_SWAPPED
    assert choice("dot", "lhs_transposed", (1, 10, 1024, 1024)) == kernels.BF16_SWAPPED
    assert choice("dot", "lhs_transposed", (1, 1024, 8, 1024)) == kernels.ROUND_F32
    assert choice("dot", "lhs_transposed", (1, 64, 1024, 10)) == kernels.ROUND_F32
    # Narrow outputs (a 10-class head), attention-sized batched dots and thin input gradients
    # measured faster as round_f32.
    assert choice("dot", "forward", (1, 1024, 1024, 10)) == kernels.ROUND_F32
    assert choice("dot", "forward", (1024, 64, 32, 64)) == kernels.ROUND_F32
    assert choice("dot", "rhs_transposed", (1024, 32, 64, 64)) == kernels.ROUND_F32
    assert choice("dot", "rhs_transposed", (1, 128, 512, 3136)) == kernels.ROUND_F32
    assert choice("dot", "both_transposed", (1, 1024, 1024, 1024)) == kernels.ROUND_F32
    # XLA's bf16 convolution forms were never faster than its float32 one; the direct kernels are, where they run.
    for layout in kernels.CONV_LAYOUTS:
        assert choice("conv", layout, (1, 131072, 288, 32)) == direct_for(layout)
    # Hosts without bf16 instructions keep round_f32 everywhere.
    assert kernels.builtin_choice("no_bf16", "dot", "forward", (1, 1024, 784, 1024)) == kernels.ROUND_F32


@pytest.mark.skipif(kernels.host_class() != "bf16", reason="XLA:CPU keeps bf16 dots only on hosts with bf16 instructions")
@pytest.mark.parametrize("form", [kernels.BF16_CANONICAL, kernels.BF16_SWAPPED])
def test_a_transposed_bf16_operand_reaches_the_compiled_dot_in_bf16(form):
    # A weight gradient (contracting the rows of both operands, under vmap over the cores) in a form that
    # transposes an operand: XLA:CPU must run the dot on bf16 operands. It converted them to float32 when
    # the transpose was only a change of layout, which made these forms as slow as float32.
    g, x = jnp.ones((8, 128, 256), jnp.float32), jnp.ones((8, 128, 192), jnp.float32)
    dimension_numbers = (((0, 1), (0, 1)), ((), ()))
    step = jax.jit(lambda g, x: kernels.dot_pass(g, x, dimension_numbers, form).T * 2.0,
                   compiler_options=kernels.compiler_options("train"))
    compiled = step.lower(g, x).compile()
    text = compiled.as_text()
    dots = re.findall(r"= \S+ dot\(%([\w.\-]+), %([\w.\-]+)\)", text)
    assert dots
    for operands in dots:
        for name in operands:
            assert re.search(rf"%{re.escape(name)} = bf16\[", text), (name, text)
    np.testing.assert_array_equal(np.asarray(compiled(g, x)), np.full((192, 256), 2.0 * 1024))


DEPTHWISE_CASES = ["depthwise", "depthwise_dilated", "depthwise_multiplier", "depthwise_nchw"]


@pytest.mark.parametrize("case", DEPTHWISE_CASES)
def test_taps_form_sums_depthwise_convolutions_without_xla_convolutions(rng, case):
    lhs_shape, rhs_shape, kwargs = CONV_CASES[case]
    op = _conv(kwargs)
    a, b = integers(rng, lhs_shape), integers(rng, rhs_shape)
    c = integers(rng, jax.eval_shape(op, a, b).shape)
    with kernels.use_form(kernels.TAPS):
        forward_text = jax.jit(mxu.route(op)).lower(a, b).as_text()
        grads_text = jax.jit(mxu.route(lambda a, b: _grads(op, a, b, c))).lower(a, b).as_text()
    assert "stablehlo.convolution" not in forward_text
    # Of the gradient program's convolutions only the weight gradient (batch-grouped) stays one,
    # and with a channel multiplier the input gradient too (several input features per group).
    assert grads_text.count("stablehlo.convolution") == (2 if case == "depthwise_multiplier" else 1)
    np.testing.assert_array_equal(np.asarray(routed(op, kernels.TAPS)(a, b)), f64(op, a, b))


def _against_round_f32(rng, case, form, precision, products):
    """``(op, a, b, got, scale)``: a summed form of ``case`` on random operands, checked against ``round_f32``
    at ``precision`` (the same passes, ``products`` per output summed in another order)."""
    lhs_shape, rhs_shape, kwargs = case
    op = _conv(kwargs)
    a = rng.standard_normal(lhs_shape).astype(np.float32)
    b = rng.standard_normal(rhs_shape).astype(np.float32)
    got = np.asarray(routed(op, form, precision)(a, b), np.float64)
    fallback = np.asarray(routed(op, kernels.ROUND_F32, precision)(a, b), np.float64)
    scale = f64(op, np.abs(a), np.abs(b))
    assert np.all(np.abs(got - fallback) <= 2 * products * 2.0**-24 * scale + 1e-30)
    return op, a, b, got, scale


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_taps_form_rounds_inputs_to_bfloat16_and_keeps_multipass_precision(rng, precision):
    op, a, b, got, _ = _against_round_f32(rng, CONV_CASES["depthwise_dilated"], kernels.TAPS, precision, 6)
    if precision == "default":
        reference = f64(op, bf16(a), bf16(b))
        _assert_close_to_rounded_reference(got, reference, f64(op, np.abs(bf16(a)), np.abs(bf16(b))), 6)
        assert np.abs(got - f64(op, a, b)).max() > 100 * np.abs(got - reference).max()
    else:
        assert np.abs(got - f64(op, a, b)).max() < 2e-6 * np.abs(f64(op, a, b)).max()


def test_bf16_host_table_sums_depthwise_convolutions_over_their_taps():
    choice = lambda layout, gemm: kernels.builtin_choice("bf16", "conv", layout, gemm)
    depthwise = (128, 65536, 9, 1)   # 128 groups of one input and one output feature
    assert choice("forward", depthwise) == kernels.TAPS
    assert choice("input_grad", depthwise) == kernels.TAPS
    assert choice("weight_grad", (128, 9, 65536, 1)) == kernels.ROUND_F32   # measured slower summed
    assert choice("forward", (1, 65536, 288, 32)) == direct_for("forward")                 # an ordinary convolution


def test_eager_calls_follow_the_forced_form(rng):
    a, b = integers(rng, (8, 16)), integers(rng, (16, 4))
    results = []
    for form in kernels.DOT_FORMS:
        with kernels.use_form(form):
            results.append(np.asarray(mxu.matmul(a, b)))
    for r in results:
        np.testing.assert_array_equal(r, a.astype(np.float64) @ b.astype(np.float64))


@pytest.mark.parametrize("mode", ["train", "test", "predict"])
def test_compiler_options_keep_bf16_dots_on_ynnpack_where_the_table_picks_them(mode):
    options = kernels.compiler_options(mode)
    x, k = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 4))
    conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    a = jnp.ones((64, 64), jnp.bfloat16)
    dot = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    conv_text = jax.jit(conv, compiler_options=options or None).lower(x, k).compile().as_text()
    dot_text = jax.jit(dot, compiler_options=options or None).lower(a, a).compile().as_text()
    bf16_host = kernels.host_class() == "bf16"
    # Training programs never run convolutions in YNNPACK; on bf16 hosts no program does.
    assert ("__ynn" in conv_text) == (not bf16_host and mode != "train")
    # The native forms the "bf16" table picks are only fast as YNNPACK dots.
    if bf16_host:
        assert "__ynn" in dot_text


FEW_OUTPUT_CASES = {
    "rgb_same": ((2, 9, 9, 8), (3, 3, 8, 3), dict(window_strides=(1, 1), padding="SAME",
                                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "gray_valid_7x7": ((2, 12, 11, 16), (7, 7, 16, 1), dict(window_strides=(1, 1), padding="VALID",
                                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "uneven_padding_nchw": ((2, 6, 8, 7), (2, 6, 3, 2), dict(window_strides=(1, 1), padding=((2, 0), (1, 3)),
                                                             dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    "conv1d": ((2, 30, 8), (5, 8, 3), dict(window_strides=(1,), padding="SAME",
                                           dimension_numbers=("NWC", "WIO", "NWC"))),
    "cropping_padding": ((2, 9, 8, 5), (3, 3, 5, 2), dict(window_strides=(1, 1), padding=((-1, 2), (0, -1)),
                                                          dimension_numbers=("NHWC", "HWIO", "NHWC"))),
}


@pytest.mark.parametrize("case", sorted(FEW_OUTPUT_CASES))
def test_output_taps_form_runs_few_output_convolutions_as_one_product(rng, case):
    lhs_shape, rhs_shape, kwargs = FEW_OUTPUT_CASES[case]
    op = _conv(kwargs)
    a, b = integers(rng, lhs_shape), integers(rng, rhs_shape)
    with kernels.use_form(kernels.OUTPUT_TAPS):
        text = jax.jit(mxu.route(op)).lower(a, b).as_text()
    assert "stablehlo.convolution" not in text and "stablehlo.dot_general" in text
    np.testing.assert_array_equal(np.asarray(routed(op, kernels.OUTPUT_TAPS)(a, b)), f64(op, a, b))


def test_the_input_gradient_of_a_layer_reading_rgb_images_is_one_product():
    """A first convolution after a BatchNormalization of the images needs its input's gradient: 3 outputs."""
    lhs_shape, rhs_shape = (2, 9, 9, 3), (3, 3, 3, 8)
    op = _conv(dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    x, w = np.ones(lhs_shape, np.float32), np.ones(rhs_shape, np.float32)
    input_grad = lambda x, w: jax.grad(lambda x: jnp.sum(op(x, w) ** 2))(x)
    with kernels.use_form(kernels.OUTPUT_TAPS):
        text = jax.jit(mxu.route(input_grad)).lower(x, w).as_text()
    assert text.count("stablehlo.convolution") == 1   # the forward one: 8 outputs, stays a convolution
    assert kernels.builtin_choice("bf16", "conv", "input_grad", (1, 2 * 81, 72, 3)) == kernels.OUTPUT_TAPS


def test_bf16_host_table_takes_output_taps_only_for_three_outputs_or_fewer():
    choice = lambda layout, gemm: kernels.builtin_choice("bf16", "conv", layout, gemm)
    assert choice("forward", (1, 131072, 288, 3)) == kernels.OUTPUT_TAPS
    assert choice("input_grad", (1, 131072, 288, 1)) == kernels.OUTPUT_TAPS
    assert choice("forward", (1, 131072, 288, 4)) == direct_for("forward")      # output_taps measured slower, erratic
    assert choice("weight_grad", (1, 27, 131072, 3)) == direct_for("weight_grad")
    assert choice("forward", (128, 65536, 9, 1)) == kernels.TAPS           # depthwise: taps first
    assert kernels.builtin_choice("no_bf16", "conv", "forward", (1, 131072, 288, 3)) == kernels.ROUND_F32
    # More than 49 columns (taps times outputs) are left to XLA's convolution even when forced.
    op = _conv(dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    a, b = np.ones((1, 8, 8, 4), np.float32), np.ones((5, 5, 4, 3), np.float32)
    with kernels.use_form(kernels.OUTPUT_TAPS):
        assert "stablehlo.convolution" in jax.jit(mxu.route(op)).lower(a, b).as_text()


@pytest.mark.parametrize("precision", ["default", "high", "highest"])
def test_output_taps_form_keeps_the_passes_of_each_precision(rng, precision):
    op, a, b, got, scale = _against_round_f32(rng, FEW_OUTPUT_CASES["rgb_same"], kernels.OUTPUT_TAPS, precision, 72)
    exact = f64(op, a, b)
    error = {"default": 2.0**-8, "high": 2.0**-15, "highest": 2.0**-21}[precision]
    assert np.abs(got - exact).max() <= error * scale.max()
    if precision == "default":
        assert np.abs(got - exact).max() > 2.0**-16 * scale.max()   # bf16 products, not float32 ones


_IMAGES, _KERNEL = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 4))
_CONVOLVE = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
_POOL = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
_MEAN = lambda x: jnp.mean(x, axis=(1, 2))


def test_has_windows_finds_convolutions_and_poolings_wherever_they_are():
    in_a_loop = lambda x: lax.scan(lambda total, image: (total + _POOL(image[None]).sum(), None), 0.0, x)[0]
    assert kernels.has_windows(jax.make_jaxpr(_CONVOLVE)(_IMAGES, _KERNEL))
    assert kernels.has_windows(jax.make_jaxpr(mxu.route(_CONVOLVE))(_IMAGES, _KERNEL))   # on the MXU
    assert kernels.has_windows(jax.make_jaxpr(_POOL)(_IMAGES))
    assert kernels.has_windows(jax.make_jaxpr(jax.grad(lambda x: _POOL(x).sum()))(_IMAGES))
    assert kernels.has_windows(jax.make_jaxpr(in_a_loop)(_IMAGES))
    assert not kernels.has_windows(jax.make_jaxpr(_MEAN)(_IMAGES))
    assert not kernels.has_windows(jax.make_jaxpr(mxu.route(lambda a, b: jnp.tanh(a @ b)))(jnp.ones((4, 4)),
                                                                                      jnp.ones((4, 4))))


def test_only_inference_without_windows_on_a_bf16_host_changes_its_options(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")   # (the suite's own sets LLVM's level: see the next test)
    monkeypatch.setattr(kernels, "host_class", lambda: "bf16")
    plain, pooled = jax.make_jaxpr(_MEAN)(_IMAGES), jax.make_jaxpr(_POOL)(_IMAGES)
    # every program, every host (see the next tests)
    exact = {"xla_allow_excess_precision": False, "xla_backend_optimization_level": 2}
    dots_and_sums = {**exact, "xla_cpu_experimental_ynn_fusion_type":
                     "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"}
    for mode in ("test", "predict"):
        assert kernels.compiler_options(mode, plain) == {
            **exact, "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
        # With windows, inference takes the training programs' options: XLA's own convolutions.
        assert kernels.compiler_options(mode, pooled) == kernels.compiler_options(mode) == dots_and_sums
    assert kernels.compiler_options("train", plain) == kernels.compiler_options("train", pooled) == \
        kernels.compiler_options("train") == dots_and_sums
    monkeypatch.setattr(kernels, "host_class", lambda: "no_bf16")   # measured on bf16 hosts only
    assert kernels.compiler_options("test", plain) == kernels.compiler_options("test", pooled) == exact


def test_programs_compile_at_llvm_o2_unless_xla_flags_set_the_level(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert all(kernels.compiler_options(mode)["xla_backend_optimization_level"] == 2
               for mode in ("train", "test", "predict"))
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=1")
    assert all("xla_backend_optimization_level" not in kernels.compiler_options(mode)
               for mode in ("train", "test", "predict"))
    # The level import keras_tpu puts into XLA_FLAGS is asked for per program too: the flags do not apply where
    # JAX's backend started before the import.
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")
    assert all(kernels.compiler_options(mode)["xla_backend_optimization_level"] == 2
               for mode in ("train", "test", "predict"))


def test_loop_count_counts_nested_loops_and_a_models_own_loop_keeps_loop_invariant_motion():
    x = jnp.ones((8, 3))
    cores = jax.make_jaxpr(lambda x: lax.map(jnp.tanh, x))(x)
    recurrent = jax.make_jaxpr(lambda x: lax.map(lambda r: lax.scan(lambda c, v: (c * v, c), 1.0, r)[1], x))(x)
    fori_in_jit = jax.make_jaxpr(jax.jit(lambda x: lax.fori_loop(0, 3, lambda i, a: a + 1, x)))(x)
    assert kernels.loop_count(jax.make_jaxpr(jnp.tanh)(x)) == 0
    assert (kernels.loop_count(cores), kernels.loop_count(recurrent), kernels.loop_count(fori_in_jit)) == (1, 2, 1)
    most = kernels.LOOP_INVARIANT_MOTION_ABOVE_WEIGHTS
    assert not kernels.hoists_loop_invariants("train", cores, own_loops=1, weights=most)
    assert kernels.hoists_loop_invariants("train", cores, own_loops=1, weights=most + 1)
    assert kernels.hoists_loop_invariants("train", recurrent, own_loops=1, weights=1000)
    assert kernels.hoists_loop_invariants("train", cores, own_loops=0, weights=1000)
    assert all(kernels.hoists_loop_invariants(mode, cores, own_loops=1, weights=1000) for mode in ("test", "predict"))


def _computed_in_loop(compiled_text, opcode):
    """Whether a compiled program's (one) while loop runs ``opcode`` in its body, or in a kernel its body calls."""
    computations = {m.group(1): m.group(0) for m in re.finditer(r"^%?([\w.-]+) \(.*?^}", compiled_text, re.M | re.S)}
    seen, pending = set(), [re.search(r"while\(.*body=%?([\w.-]+)", compiled_text).group(1)]
    while pending:
        name = pending.pop()
        if name not in seen:
            seen.add(name)
            pending.extend(re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.-]+)", computations[name]))
    return any(f" {opcode}(" in computations[name] for name in seen)


def test_a_program_without_loop_invariant_motion_computes_invariants_in_its_loop(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=1")
    assert "xla_disable_hlo_passes" not in kernels.compiler_options("train")
    without = kernels.compiler_options("train", hoist_loop_invariants=False)
    assert without["xla_disable_hlo_passes"] == "while-loop-invariant-code-motion"
    # What the loop does not change (exp of the weights) is lifted out of the body, or computed in it.
    per_core = lambda w, x: lax.map(lambda r: r * jnp.exp(w), x)
    w, x = jnp.ones((16,)), jnp.ones((8, 16))
    lifted = jax.jit(per_core).lower(w, x).compile(kernels.compiler_options("train")).as_text()
    kept = jax.jit(per_core).lower(w, x).compile(without).as_text()
    assert not _computed_in_loop(lifted, "exponential") and _computed_in_loop(kept, "exponential")
    # (the passes XLA_FLAGS disables stay disabled)
    monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=algsimp --xla_backend_optimization_level=1")
    assert kernels.compiler_options("train", hoist_loop_invariants=False)["xla_disable_hlo_passes"] == \
        "algsimp,while-loop-invariant-code-motion"


def test_an_embedding_lookup_fuses_with_its_pooling_in_inference_without_windows(monkeypatch):
    # The embedding model's evaluation: with YNNPACK reductions the looked-up rows (256 x 32 x 64) are written
    # out for YNNPACK's sum; without, XLA sums them as it looks them up.
    monkeypatch.setattr(kernels, "host_class", lambda: "bf16")
    table, ids = jnp.ones((1000, 64)), jnp.zeros((256, 32), jnp.int32)
    lookup_mean = lambda t, i: jnp.mean(jnp.take(t, i, axis=0), axis=1) @ jnp.ones((64, 16))
    traced = jax.jit(lookup_mean).trace(table, ids)
    fused = traced.lower().compile(kernels.compiler_options("test", traced.jaxpr)).as_text()
    with_ynnpack_sum = traced.lower().compile(kernels.compiler_options("test")).as_text()
    assert "f32[256,32,64]" in written_shapes(with_ynnpack_sum)
    assert "f32[256,32,64]" not in written_shapes(fused)


def _bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _exact_conv(a, k):
    return np.asarray(lax.conv_general_dilated(a, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                               precision=lax.Precision.HIGHEST))


@pytest.mark.parametrize("host", ["bf16", "no_bf16"])
def test_an_inference_convolution_multiplies_exactly_rounded_operands(monkeypatch, host):
    # On hosts without bf16 instructions XLA hands an inference program's convolution, with the bf16 rounding of
    # its operands, to one YNNPACK fusion; on bf16 hosts it runs on XLA's own convolution. The MXU's numbers must
    # survive either: the result is the float32 convolution of the rounded operands, not of the float32 ones.
    monkeypatch.setattr(kernels, "host_class", lambda: host)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16, 16, 32)).astype(np.float32)
    k = rng.standard_normal((3, 3, 32, 32)).astype(np.float32)
    layer = lambda x, k: _CONVOLVE(jnp.maximum(x * 1.37 + 0.1, 0), k)
    traced = jax.jit(mxu.route(layer)).trace(x, k)
    compiled = traced.lower().compile(kernels.compiler_options("test", traced.jaxpr))
    assert ("__ynn" in compiled.as_text()) == (host == "no_bf16")
    y = np.maximum(x * np.float32(1.37) + np.float32(0.1), 0).astype(np.float32)
    want = _exact_conv(_bf16(y), _bf16(k))
    unrounded = np.asarray(_CONVOLVE(y, _bf16(k)))
    got = np.asarray(compiled(x, k))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(got - unrounded)) > 1e-2   # the rounding matters at these values


def _pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _two_conv_blocks(x, k1, k2):   # the CIFAR-10 CNN's evaluation in small: what XLA fuses into one YNNPACK kernel
    h = _pool(jnp.maximum(_CONVOLVE(x, k1), 0))
    return jnp.sum(_pool(jnp.maximum(_CONVOLVE(h, k2), 0)), axis=(1, 2))


def _two_conv_blocks_exact(x, k1, k2):
    h = np.asarray(_pool(np.maximum(_exact_conv(_bf16(x), _bf16(k1)), 0)))
    h = np.asarray(_pool(np.maximum(_exact_conv(_bf16(h), _bf16(k2)), 0)))
    return h.astype(np.float64).sum(axis=(1, 2))


def _summed_product(a, w):   # a product whose rows are summed in the same program (a bias gradient, a mean)
    return jnp.sum(a @ w, axis=0)


def _summed_product_exact(a, w):
    return (_bf16(a).astype(np.float64) @ _bf16(w).astype(np.float64)).sum(axis=0)


@pytest.mark.parametrize("host", ["bf16", "no_bf16"])
@pytest.mark.parametrize("mode", ["train", "test"])
@pytest.mark.parametrize("case", ["two_conv_blocks", "summed_product"])
def test_roundings_survive_fusion_with_reductions(monkeypatch, host, mode, case):
    # XLA's default lets it drop a float32 -> bf16 -> float32 round trip as excess precision, and it did where the
    # rounding was fused with a reduction (YNNPACK's fusion of a whole forward pass returned the unrounded float32
    # network's numbers). keras-tpu's options forbid that: the results are those of exactly rounded operands.
    monkeypatch.setattr(kernels, "host_class", lambda: host)
    rng = np.random.default_rng(0)
    if case == "two_conv_blocks":
        fn, exact = _two_conv_blocks, _two_conv_blocks_exact
        args = (rng.standard_normal((32, 16, 16, 32)).astype(np.float32) * 1.37 + 0.1,
                rng.standard_normal((3, 3, 32, 32)).astype(np.float32),
                rng.standard_normal((3, 3, 32, 32)).astype(np.float32))
    else:
        fn, exact = _summed_product, _summed_product_exact
        args = (rng.standard_normal((256, 512)).astype(np.float32) * 1.37 + 0.1,
                rng.standard_normal((512, 256)).astype(np.float32))
    want = exact(*args)
    scale = np.max(np.abs(want))
    with kernels.use_form(kernels.ROUND_F32):   # the form that rounds in float32 (a native bf16 product cannot lose it)
        traced = jax.jit(mxu.route(fn)).trace(*args)
        options = kernels.compiler_options(mode, traced.jaxpr)
        got = np.asarray(traced.lower().compile(options)(*args), np.float64)
    # Float32 sums in another order may flip a rounding of the second block's input: ~1e-5 of the scale at most.
    assert np.max(np.abs(got - want)) / scale < 2e-4


def test_without_the_option_xla_drops_a_rounding_fused_with_a_reduction(monkeypatch):
    # What the option above guards against (and what makes that test able to fail): the same program compiled with
    # XLA's default precision rule, two convolution blocks fused into one YNNPACK kernel with the sum after them,
    # comes out ~2e-3 of the scale off the exactly rounded result, as if computed in float32 throughout.
    monkeypatch.setattr(kernels, "host_class", lambda: "bf16")
    rng = np.random.default_rng(0)
    args = (rng.standard_normal((32, 16, 16, 32)).astype(np.float32) * 1.37 + 0.1,
            rng.standard_normal((3, 3, 32, 32)).astype(np.float32),
            rng.standard_normal((3, 3, 32, 32)).astype(np.float32))
    with kernels.use_form(kernels.ROUND_F32):   # XLA's convolutions, which it can fuse into YNNPACK
        traced = jax.jit(mxu.route(_two_conv_blocks)).trace(*args)
        lowered = traced.lower()
    options = kernels.compiler_options("test", traced.jaxpr)
    loose = lowered.compile({k: v for k, v in options.items() if k != "xla_allow_excess_precision"})
    if "__ynn" not in loose.as_text():
        pytest.skip("XLA:CPU did not fuse the program into YNNPACK here")
    want = _two_conv_blocks_exact(*args)
    unrounded = np.asarray(jax.jit(_two_conv_blocks)(*args), np.float64)   # float32 throughout
    got = np.asarray(loose(*args), np.float64)
    scale = np.max(np.abs(want))
    assert np.max(np.abs(got - want)) / scale > 5e-4
    assert np.max(np.abs(got - unrounded)) / scale < np.max(np.abs(got - want)) / scale / 10
