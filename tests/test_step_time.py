"""The whole-step model: vector unit and HBM, all-reduce, input, host, and how they combine (issue #11)."""

import re

import jax
import jax.numpy as jnp
import keras
import pytest

import keras_tpu
from keras_tpu import _hbm as hbm, _step_time as step_time
from keras_tpu._accelerators import system_figures
from keras_tpu.mxu import trace_mxu_ops


def kernels_of(fn, *args):
    return step_time.vector_kernels(jax.make_jaxpr(fn)(*args))


def test_an_elementwise_chain_fuses_into_its_reduction():
    x = jnp.ones((128, 256))
    [work] = kernels_of(lambda x: jnp.sum(jnp.tanh(x * 2.0 + 1.0)), x)
    # One kernel reads x once and writes a scalar; its four elementwise ops and the sum are vector work.
    assert work.kernels == 1
    assert work.hbm_bytes == hbm.array_bytes((128, 256), "float32") + hbm.array_bytes((), "float32")
    assert work.vpu_ops == 128 * 256 * (1 + 1 + step_time.VPU_OPS_TRANSCENDENTAL + 1)


def test_sibling_reductions_read_their_operand_once():
    x = jnp.ones((256, 512))
    one = kernels_of(lambda x: jnp.mean(x, axis=0), x)[0]
    both = kernels_of(lambda x: (jnp.mean(x, axis=0), jnp.mean(x * x, axis=0)), x)[0]
    # BatchNormalization's mean and variance: one multi-output kernel, x read once, two results written.
    assert both.kernels == 1 == one.kernels
    assert both.hbm_bytes - one.hbm_bytes < 0.05 * hbm.array_bytes((256, 512), "float32")


def test_results_are_written_and_work_feeding_a_matrix_product_is_free():
    x, w = jnp.ones((128, 256)), jnp.ones((256, 128))
    # The optimizer-style update is a program result: a kernel that reads its inputs and writes it.
    [update] = kernels_of(lambda w, g: w - 0.1 * g, w, w)
    assert update.kernels == 1 and update.hbm_bytes == 3 * hbm.array_bytes((256, 128), "float32")
    # relu(x) feeding a routed matrix product fuses into it: no HBM traffic of its own.
    routed = keras_tpu.mxu.route(lambda x, w: jax.nn.relu(x) @ w, "default")
    works = kernels_of(routed, x, w)
    assert sum(k.hbm_bytes for k in works) == 0 and sum(k.vpu_ops for k in works) == 128 * 256


def test_scan_bodies_count_once_per_trip():
    def body(c, _):
        return jnp.tanh(c) * 0.5, None

    once = sum(k.kernels for k in kernels_of(lambda c: jax.lax.scan(body, c, None, length=1)[0], jnp.ones((8, 128))))
    ten = sum(k.kernels for k in kernels_of(lambda c: jax.lax.scan(body, c, None, length=10)[0], jnp.ones((8, 128))))
    assert ten - once == 9 * (once - 1)  # one loop entry, then the body's kernels per trip


def test_allreduce_is_a_ring_over_the_chips():
    assert step_time.allreduce_time(100e6, "v2-8", 1) == 0.0
    v2, v3 = step_time.allreduce_time(100e6, "v2-8", 8), step_time.allreduce_time(100e6, "v3-8", 8)
    ring = 2 * 3 / 4 * 100e6 / system_figures("v2").ici_allreduce_bytes_per_second_per_chip
    on_chip = 3 * 100e6 / 350e9
    assert v2 == pytest.approx(ring + on_chip + 6 * 1e-6)
    assert v3 < v2
    # Tiny gradients cost the hops' latency.
    assert step_time.allreduce_time(4, "v2-8", 8) == pytest.approx(6e-6, rel=0.01)


def test_deployments_and_how_the_parts_combine():
    assert set(step_time.DEPLOYMENTS) == {"tpu_vm", "remote_host_input", "remote_client_input"}
    with pytest.raises(ValueError, match="Unknown deployment"):
        step_time.deployment("laptop")
    batch = 1024 * 32 * 32 * 3 * 4
    over_network = step_time.input_time(batch, "v2-8", 8, "remote_client_input")
    from_host = step_time.input_time(batch, "v2-8", 8, "tpu_vm")
    enqueue = 8 * step_time.HOST_INFEED_PER_CORE_S
    assert over_network == pytest.approx(batch / step_time.REMOTE_FEED_BYTES_PER_S + enqueue)
    assert from_host == pytest.approx(batch / (4 * 15.75e9) + enqueue)
    parts = step_time.StepTime(mxu=4e-3, vector=1e-3, memory=2e-3, allreduce=1e-4, input=over_network,
                               host=0.010, input_bytes=batch, call_s=0.010, steps_per_call=1,
                               deployment="remote_client_input")
    assert parts.total == pytest.approx(over_network + 0.010) and parts.bound == "input"
    assert sum(parts.shares().values()) == pytest.approx(1.0)
    fixed = parts.replaced("v2-8", 8, deployment_name="tpu_vm", steps_per_call=32)
    assert fixed.bound == "mxu" and fixed.total == pytest.approx(parts.device + step_time.LOCAL_CALL_S / 32)
    assert "bound by input" in parts.describe()


def small_cnn():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.MaxPooling2D(name="pool")(h)
    h = keras.layers.Flatten()(h)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax", name="head")(h), name="small")
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def test_the_profile_reports_every_part_and_advises_on_the_bound():
    model = small_cnn()
    colab = keras_tpu.profile(model, batch_size=1024, deployment="remote_client_input", input_dtype="float32")
    parts = colab.parts("train")
    assert parts.input == pytest.approx(1024 * (32 * 32 * 3 * 4 + 4) / step_time.REMOTE_FEED_BYTES_PER_S
                                        + 8 * step_time.HOST_INFEED_PER_CORE_S)
    assert colab.bound("train") == "input" and parts.allreduce > 0 and parts.vector > 0 and parts.memory > 0
    advice = colab.advice[0]
    assert "feed from the TPU host" in advice and "steps_per_execution=32" in advice and "ms per step" in advice
    now, then = (float(v) for v in re.search(r"([\d.]+) ms -> ([\d.]+) ms per step", advice).groups())
    assert now == pytest.approx(parts.total * 1e3, rel=0.01) and then < now / 5
    # On a TPU VM with 32 steps per call the same step is the device's.
    vm = keras_tpu.profile(model, batch_size=1024, deployment="tpu_vm", steps_per_execution=32, advise=False)
    assert vm.bound("train") in ("mxu", "vector", "memory")
    assert vm.step_time("train") == pytest.approx(vm.device_time("train") + step_time.LOCAL_CALL_S / 32)
    text = vm.summary("train")
    assert "MXU-only lower bound" in text and "bound by" in text
    rows = vm.rows("train")
    assert all({"mxu_s", "vector_s", "memory_s", "dataflow"} <= set(r) for r in rows)
    layers = {(e["layer"], e["pass"]): e for e in vm.layers("train")}
    assert layers[("bn", "backward")]["memory_s"] + layers[("bn", "backward")]["vector_s"] > 0
    assert layers[("conv", "forward")]["mxu_s"] > 0


def test_the_v3_over_v2_speedup_is_less_than_the_mxus_alone():
    model = small_cnn()
    v2 = keras_tpu.profile(model, batch_size=1024, accelerator_type="v2-8", advise=False)
    v3 = keras_tpu.profile(model, batch_size=1024, accelerator_type="v3-8", advise=False)
    mxu_speedup = v2.mxu_time("train") / v3.mxu_time("train")
    device_speedup = v2.device_time("train") / v3.device_time("train")
    # v3 doubles the MXUs and clocks them 34% faster, but its HBM is only 29% faster.
    assert 1.2 < device_speedup < mxu_speedup


def test_transposed_convolutions_cost_their_non_zero_products():
    x, k = jnp.ones((4, 16, 16, 8)), jnp.ones((3, 3, 8, 16))

    def transposed(x, k):
        return jax.lax.conv_transpose(x, k, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    [op] = trace_mxu_ops(transposed, x, k)
    # A stride-2 transposed 3x3 convolution: on average 9/4 taps of each output land on a real input.
    assert op.zero_skipped > 0.5 and op.cost.k in (16, 24) and op.cost.m == 4 * 32 * 32


def test_several_bf16_passes_read_their_operands_once():
    default = keras_tpu.profile(small_cnn(), batch_size=256, advise=False)
    highest = keras_tpu.profile(small_cnn(), batch_size=256, precision="highest", advise=False)
    d = [r for r in default.rows("inference") if r["kind"] == "conv"][0]
    h = [r for r in highest.rows("inference") if r["kind"] == "conv"][0]
    assert h["cycles"] > 5 * d["cycles"] and h["hbm_bytes"] == d["hbm_bytes"]
