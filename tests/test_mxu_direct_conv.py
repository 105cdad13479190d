"""The direct convolution kernels (keras_tpu.mxu._direct_conv): which convolutions they run, the MXU's numbers, the
build cache.

Exactness is checked as in test_mxu_kernels: integer operands small enough that exact products summed in float32
in any order give exactly the float64 result. Every covered case also checks that the kernels' custom calls are
in the program, so a silent fall back to XLA's convolution fails the test.
"""

import ctypes
import os
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from keras_tpu import mxu
from keras_tpu.mxu import _direct_conv as direct
from keras_tpu.mxu import _kernels as kernels

pytestmark = pytest.mark.skipif(not direct.available(), reason="needs an x86 host with AVX-512 BF16 and g++")

FORWARD, WEIGHT_GRAD = "keras_tpu_mxu_conv_forward", "keras_tpu_mxu_conv_weight_grad"


@pytest.fixture(autouse=True)
def _kernels_wherever_they_run(monkeypatch):
    # These tests are about the kernels themselves: take them wherever they run, whether or not this host measured
    # them faster than XLA's convolutions (keras_tpu.mxu._kernels.conv_kernels_here).
    monkeypatch.setenv("KERAS_TPU_DIRECT_CONV", "1")

CASES = {
    # name: (lhs shape, rhs shape, conv kwargs, (forward kernel calls, weight-gradient calls) in value and grads)
    "same_odd_features": ((2, 9, 7, 5), (3, 3, 5, 20), dict(window_strides=(1, 1), padding="SAME",
                                                              dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    "wide": ((2, 9, 13, 64), (3, 3, 64, 64), dict(window_strides=(1, 1), padding="VALID",
                                                   dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    "thirty_two": ((3, 8, 8, 32), (3, 3, 32, 32), dict(window_strides=(1, 1), padding="SAME",
                                                       dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    # Rows split into even tiles of columns: 30 columns of 16 outputs as 15 + 15, 14 of 64 as 5 + 5 + 4 (16 + 1).
    "long_rows": ((2, 4, 30, 16), (3, 3, 16, 16), dict(window_strides=(1, 1), padding="SAME",
                                                       dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    "fourteen_columns": ((2, 5, 16, 64), (3, 3, 64, 64), dict(window_strides=(1, 1), padding="VALID",
                                                              dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    # A strided convolution's input gradient dilates its lhs: one forward call per residue of the stride.
    "strided": ((2, 11, 9, 6), (3, 2, 6, 33), dict(window_strides=(2, 1), padding="VALID",
                                                   dimension_numbers=("NHWC", "HWIO", "NHWC")), (3, 1)),
    "strided_same": ((2, 11, 9, 6), (3, 3, 6, 16), dict(window_strides=(2, 2), padding="SAME",
                                                        dimension_numbers=("NHWC", "HWIO", "NHWC")), (5, 1)),
    "stride_three": ((2, 12, 13, 5), (5, 3, 5, 16), dict(window_strides=(3, 2), padding=((1, 2), (0, 1)),
                                                         dimension_numbers=("NHWC", "HWIO", "NHWC")), (7, 1)),
    # A transposed convolution (lhs dilated): four residues, and four for its kernel gradient (lhs dilated too).
    "transposed": ((2, 5, 6, 8), (3, 3, 8, 16), dict(window_strides=(1, 1), padding=((1, 2), (1, 2)),
                                                     lhs_dilation=(2, 2), dimension_numbers=("NHWC", "HWIO", "NHWC")),
                   (5, 4)),
    "asymmetric_padding": ((2, 8, 9, 4), (3, 3, 4, 16), dict(window_strides=(1, 1), padding=((0, 2), (1, 0)),
                                                             dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    "nchw": ((2, 6, 9, 7), (12, 6, 4, 3), dict(window_strides=(1, 1), padding="SAME",
                                               dimension_numbers=("NCHW", "OIHW", "NCHW")), (2, 1)),
    # Dilated windows (atrous convolutions): the dilation steps over the input rows and columns in both kernels.
    "atrous": ((2, 11, 9, 6), (3, 3, 6, 16), dict(window_strides=(1, 1), padding="SAME", rhs_dilation=(2, 3),
                                                  dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    "conv1d_causal_dilated": ((3, 30, 8), (2, 8, 16), dict(window_strides=(1,), padding=((8, 0),), rhs_dilation=(8,),
                                                           dimension_numbers=("NWC", "WIO", "NWC")), (2, 1)),
    # At most 4 output features: summed along the inputs (16 or more of them), forward or as an input gradient.
    "few_outputs": ((2, 9, 7, 40), (3, 3, 40, 3), dict(window_strides=(1, 1), padding="SAME",
                                                       dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    "one_output_strided": ((2, 13, 11, 20), (3, 3, 20, 1), dict(window_strides=(2, 2), padding="SAME",
                                                                dimension_numbers=("NHWC", "HWIO", "NHWC")), (5, 1)),
    "four_outputs_atrous": ((2, 11, 9, 17), (3, 3, 17, 4), dict(window_strides=(1, 1), padding=((2, 1), (0, 3)),
                                                                rhs_dilation=(2, 2),
                                                                dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    "two_outputs_wide": ((2, 5, 23, 64), (3, 5, 64, 2), dict(window_strides=(1, 1), padding="SAME",
                                                             dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    "rgb_first_layer": ((2, 10, 12, 3), (3, 3, 3, 32), dict(window_strides=(1, 1), padding="SAME",
                                                            dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    # A valid convolution's input gradient pads two rows on each side: output rows skip the window rows of zeros.
    "rgb_first_layer_valid": ((2, 10, 12, 3), (3, 3, 3, 32), dict(window_strides=(1, 1), padding="VALID",
                                                                  dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 1)),
    "conv1d": ((3, 17, 8), (5, 8, 16), dict(window_strides=(1,), padding="SAME",
                                            dimension_numbers=("NWC", "WIO", "NWC")), (2, 1)),
    "conv1d_strided": ((3, 17, 8), (5, 8, 16), dict(window_strides=(2,), padding="VALID",
                                                    dimension_numbers=("NWC", "WIO", "NWC")), (3, 1)),
}


def _conv(kwargs):
    return lambda a, b: lax.conv_general_dilated(a, b, **kwargs)


def _value_and_grads(op, c):
    return lambda a, b: (op(a, b), jax.grad(lambda a, b: jnp.sum(op(a, b) * c), argnums=(0, 1))(a, b))


def _f64(fun, *args):
    with jax.enable_x64(True):
        return jax.tree.map(np.asarray, fun(*(np.asarray(a, np.float64) for a in args)))


def _calls(fun, *args):
    text = jax.jit(mxu.route(fun)).lower(*args).as_text()
    return text.count(f"custom_call @{FORWARD}"), text.count(f"custom_call @{WEIGHT_GRAD}")


@pytest.fixture(params=["fma", "bf16_dot"])
def sums(request, monkeypatch):
    """Both ways the kernels sum the products (see direct.sums_on_fma), whichever this host runs faster."""
    monkeypatch.setattr(direct, "sums_on_fma", lambda: request.param == "fma")
    return request.param


@pytest.mark.parametrize("case", sorted(CASES))
def test_covered_convolutions_and_their_gradients_run_on_the_kernels_exactly(rng, case, sums):
    lhs_shape, rhs_shape, kwargs, calls = CASES[case]
    op = _conv(kwargs)
    a = rng.integers(-15, 16, lhs_shape).astype(np.float32)
    b = rng.integers(-15, 16, rhs_shape).astype(np.float32)
    c = rng.integers(-15, 16, jax.eval_shape(op, a, b).shape).astype(np.float32)
    fun = _value_and_grads(op, c)
    assert _calls(fun, a, b) == calls
    got = jax.jit(mxu.route(fun))(a, b)
    want = _f64(lambda a, b: _value_and_grads(op, jnp.asarray(c, jnp.float64))(a, b), a, b)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(g, np.float64), w)


@pytest.mark.parametrize("case", ["same_odd_features", "thirty_two", "atrous", "asymmetric_padding"])
def test_the_kernels_take_their_operands_as_xla_holds_them(rng, case):
    # Padding, an odd number of input features, output features that are no multiple of 16 and the input
    # gradient's swapped and reversed window are the kernels' own: XLA writes no padded, reordered, reversed or
    # sliced copy of an operand or a result, only the bf16 casts (ResNet-20's training program compiled in 4.0 s
    # with such copies, 3.1 s without).
    lhs_shape, rhs_shape, kwargs, _ = CASES[case]
    op = _conv(kwargs)
    a, b = rng.standard_normal(lhs_shape).astype(np.float32), rng.standard_normal(rhs_shape).astype(np.float32)
    c = rng.standard_normal(jax.eval_shape(op, a, b).shape).astype(np.float32)
    program = jax.jit(mxu.route(_value_and_grads(op, c))).lower(a, b).compile().as_text()
    assert program.count(f'custom_call_target="{FORWARD}"') == 2
    assert program.count(f'custom_call_target="{WEIGHT_GRAD}"') == 1
    for copying in (" pad(", " slice(", " transpose(", " copy(", " reverse("):
        assert copying not in program, copying


@pytest.mark.parametrize("kwargs", [
    dict(window_strides=(1, 1), padding=((2, 2), (2, 2)), lhs_dilation=(2, 2), rhs_dilation=(2, 1),
         dimension_numbers=("NHWC", "HWIO", "NHWC")),
    dict(window_strides=(2, 2), padding=((2, 2), (2, 2)), lhs_dilation=(2, 2),
         dimension_numbers=("NHWC", "HWIO", "NHWC")),
    dict(window_strides=(1, 1), padding="SAME", feature_group_count=2, dimension_numbers=("NHWC", "HWIO", "NHWC")),
], ids=["lhs_and_rhs_dilation", "lhs_dilation_strided", "groups"])
def test_other_convolutions_stay_on_xla(rng, kwargs):
    op = _conv(kwargs)
    rhs_shape = (3, 3, 4 // kwargs.get("feature_group_count", 1), 16)
    a, b = rng.integers(-15, 16, (2, 7, 7, 4)).astype(np.float32), rng.integers(-15, 16, rhs_shape).astype(np.float32)
    with kernels.use_form(kernels.BF16_DIRECT):
        assert _calls(op, a, b) == (0, 0)
        got = jax.jit(mxu.route(op))(a, b)
    np.testing.assert_array_equal(np.asarray(got, np.float64), _f64(op, a, b))
    volume = lax.conv_dimension_numbers((1, 4, 4, 4, 2), (2, 2, 2, 2, 16), ("NDHWC", "DHWIO", "NDHWC"))
    assert direct.direct_conv(jnp.ones((1, 4, 4, 4, 2)), jnp.ones((2, 2, 2, 2, 16)), (1, 1, 1), ((0, 0),) * 3,
                              (1, 1, 1), (1, 1, 1), volume, 1, 1) is None   # three spatial dimensions


def test_operands_are_rounded_to_bfloat16_and_products_summed_in_float32(rng, sums):
    op = _conv(CASES["wide"][2])
    a = rng.standard_normal((2, 9, 13, 64)).astype(np.float32)
    b = rng.standard_normal((3, 3, 64, 64)).astype(np.float32)
    bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float64)
    got = np.asarray(jax.jit(mxu.route(op))(a, b), np.float64)
    reference, magnitude = _f64(op, bf16(a), bf16(b)), _f64(op, np.abs(bf16(a)), np.abs(bf16(b)))
    assert np.all(np.abs(got - reference) <= 576 * 2.0**-24 * magnitude + 1e-30)
    assert np.abs(got - _f64(op, a, b)).max() > 100 * np.abs(got - reference).max()


@pytest.mark.parametrize("precision", ["high", "highest"])
def test_multipass_precisions_run_every_pass_on_the_kernels(rng, precision):
    op = _conv(CASES["thirty_two"][2])
    a = rng.standard_normal((3, 8, 8, 32)).astype(np.float32)
    b = rng.standard_normal((3, 3, 32, 32)).astype(np.float32)
    text = jax.jit(mxu.route(op, precision)).lower(a, b).as_text()
    assert text.count(f"custom_call @{FORWARD}") == {"high": 3, "highest": 6}[precision]
    got = np.asarray(jax.jit(mxu.route(op, precision))(a, b), np.float64)
    want = _f64(op, a, b)
    assert np.abs(got - want).max() < {"high": 1e-4, "highest": 2e-5}[precision] * np.abs(want).max()


def test_a_keras_convnet_trains_on_the_kernels_as_on_the_cpu(monkeypatch):
    import keras

    from tests.tpu_helpers import on_tpu

    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((12, 12, 3)), keras.layers.Conv2D(16, 3, activation="relu"),
                                  keras.layers.Conv2D(32, 3, padding="same"), keras.layers.GlobalAveragePooling2D(),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.MeanSquaredError())
        return model

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 12, 12, 3)).astype(np.float32), rng.standard_normal((64, 4)).astype(np.float32)
    cpu = build()
    cpu_history = cpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"]
    covered, direct_conv = [], direct.direct_conv
    monkeypatch.setattr(direct, "direct_conv", lambda *a, **k: covered.append(direct_conv(*a, **k)) or covered[-1])
    tpu = on_tpu(build())   # precision="highest": six passes, every one on the kernels
    tpu_history = tpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"]
    assert sum(out is not None for out in covered) >= 3     # the forward, input and weight gradients
    np.testing.assert_allclose(tpu_history, cpu_history, rtol=2e-5)
    for got, want in zip(tpu.get_weights(), cpu.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_kernels_sum_on_whichever_instruction_this_host_runs_faster():
    # The bf16 dot instruction adds two products per lane, an FMA one: Intel's Emerald Rapids yields 0.50x the
    # products on it, AMD's Zen 4 about 2x. The kernels take the FMAs where the dot yields fewer.
    speedup = direct._library.MxuBf16DotSpeedup()
    assert 0.1 < speedup < 10
    if abs(speedup - 1) > 0.2:   # (a host where both run alike may measure either side of 1)
        assert direct.sums_on_fma() == (speedup < 1)


def test_the_kernels_are_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_TPU_CACHE_DIR", str(tmp_path))
    compiler = os.environ.get("CXX") or "g++"
    path = direct._compile(compiler)
    assert os.path.dirname(path) == str(tmp_path / "kernels") and path.endswith(".so")
    built = os.stat(path).st_mtime_ns
    assert direct._compile(compiler) == path and os.stat(path).st_mtime_ns == built
    assert os.listdir(tmp_path / "kernels") == [os.path.basename(path)]   # no staging or object file left behind
    # One library of the source's two parts, compiled side by side: the forward kernel's and the weight
    # gradient's handlers, and the instruction timing, all in it.
    library = ctypes.CDLL(path)
    assert all(hasattr(library, name) for name in ("MxuConvForward", "MxuConvWeightGrad", "MxuBf16DotSpeedup"))
    with pytest.raises(OSError):
        direct._compile(str(tmp_path / "no-such-compiler"))
    # A failed build leaves nothing in the cache.
    monkeypatch.setattr(direct, "_FLAGS", direct._FLAGS + ("-DKERAS_TPU_TEST", "--no-such-option"))
    with pytest.raises(subprocess.CalledProcessError) as failed:
        direct._compile(compiler)
    assert "no-such-option" in failed.value.stderr   # the compiler's own message, for the warning that logs it
    assert os.listdir(tmp_path / "kernels") == [os.path.basename(path)]


def test_the_kernels_are_off_without_avx512_bf16_or_when_disabled(monkeypatch):
    monkeypatch.setenv("KERAS_TPU_DIRECT_CONV", "0")
    assert direct.available.__wrapped__() is False
    monkeypatch.delenv("KERAS_TPU_DIRECT_CONV")
    monkeypatch.setattr(direct, "_cpu_flags", lambda: {"avx512f", "avx512bw"})
    assert direct.available.__wrapped__() is False


def test_inference_leaves_convolutions_of_few_products_to_xla(rng):
    # One input feature, 3x3: 9 products per output, which XLA fuses with its neighbours in an evaluation.
    op = _conv(dict(window_strides=(1, 1), padding="VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    a, b = rng.integers(-15, 16, (4, 10, 10, 1)).astype(np.float32), rng.integers(-15, 16, (3, 3, 1, 32))
    b = b.astype(np.float32)
    for mode, calls in (("train", (1, 0)), ("test", (0, 0)), ("predict", (0, 0)), (None, (1, 0))):
        with kernels.lowering_mode(mode):
            assert _calls(op, a, b) == calls, mode
    wider = rng.integers(-15, 16, (4, 10, 10, 2)).astype(np.float32), rng.integers(-15, 16, (3, 3, 2, 32))
    with kernels.lowering_mode("test"):
        assert _calls(op, wider[0], wider[1].astype(np.float32)) == (1, 0)    # 18 products
