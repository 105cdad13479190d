"""Part 7: the cost model follows SCALE-Sim v2's weight-stationary model exactly."""

import math

import pytest

from keras_tpu import mxu
from keras_tpu.mxu._cost import conv_cost, gemm_cost, scalesim_layer_cost

# Golden COMPUTE_REPORT.csv rows of SCALE-Sim v2's own regression tests
# (github.com/scalesim-project/scale-sim-v2), both on its 32x32 weight-stationary config:
#  * test/golden_trace: topologies/conv_nets/alexnet_part.csv, Conv1 224x224x3, 11x11, 96 filters,
#    stride 4 -> "0, 112283, 0, 91.68309650614964, 94.53125, 90.78000992063485"
#  * test/general/golden_trace_user_ws: topologies/GEMM_mnk/test_mnk_input.csv, M=256 N=128 K=256,
#    limited DRAM bandwidth -> "0, 52447, 41248, 15.619577859553454, 100.0, 67.19160104986877"
#    (total 52447 includes 41248 stall cycles from its memory model; compute cycles 11199)


def test_scalesim_golden_alexnet_conv1():
    cost = scalesim_layer_cost(224, 224, 11, 11, 3, 96, 4, rows=32, cols=32)
    assert (cost.m, cost.k, cost.n) == (55 * 55, 363, 96)
    assert cost.cycles == 112283
    assert cost.utilization * 100 == pytest.approx(91.68309650614964, rel=1e-12)
    assert cost.mapping_efficiency * 100 == pytest.approx(94.53125, rel=1e-12)
    assert cost.compute_utilization * 100 == pytest.approx(90.78000992063485, rel=1e-12)
    # SCALE-Sim rounds its output size up (55) where Keras/XLA round down: the same layer as a
    # Keras convolution has a 227x227 input, and maps back to a SCALE-Sim row with the same cycles.
    keras_conv = conv_cost((1, 227, 227, 3), (11, 11, 3, 96), strides=4, rows=32, cols=32)
    assert keras_conv.cycles == 112283 and keras_conv.output_shape == (1, 55, 55, 96)
    assert scalesim_layer_cost(*keras_conv.scalesim_layer, rows=32, cols=32).cycles == 112283


def test_scalesim_golden_gemm():
    cost = gemm_cost(m=256, k=256, n=128, rows=32, cols=32)
    assert cost.cycles == 52447 - 41248
    assert cost.mapping_efficiency == 1.0
    assert cost.compute_utilization * 100 == pytest.approx(67.19160104986877, rel=1e-12)
    # SCALE-Sim's overall utilisation divides by its total cycles, stalls included.
    assert cost.macs * 100 / (52447 * 32 * 32) == pytest.approx(15.619577859553454, rel=1e-12)


def test_formula_and_derived_figures():
    cost = gemm_cost(m=1024, k=288, n=64)
    assert (cost.row_folds, cost.col_folds, cost.folds) == (3, 1, 3)
    assert cost.cycles_per_fold == 2 * 128 + 128 + 1024 - 2
    assert cost.cycles == 3 * cost.cycles_per_fold - 1
    assert cost.macs == 1024 * 288 * 64
    assert cost.utilization == pytest.approx(cost.macs / (cost.cycles * 128 * 128))
    assert cost.padded_shape == (1024, 384, 128)
    assert cost.padding_waste == pytest.approx(1 - (288 * 64) / (384 * 128))
    assert cost.ifmap_reads == 1024 * 288 and cost.filter_reads == 288 * 64
    assert cost.ofmap_writes == 1024 * 64 * 3
    assert cost.hbm_bytes == (1024 * 288 + 288 * 64) * 2 + 1024 * 64 * 4


def test_full_array_is_almost_fully_used_for_large_m():
    cost = gemm_cost(m=100_000, k=128, n=128)
    assert cost.mapping_efficiency == 1.0 and cost.utilization > 0.995


def test_timing_on_accelerators_is_a_roofline():
    cost = gemm_cost(m=4096, k=1024, n=1024)
    v2 = cost.timing("v2-8")
    assert v2.compute_cycles == cost.cycles
    assert v2.compute_s == pytest.approx(cost.cycles / 700e6)
    assert v2.memory_s == pytest.approx(cost.hbm_bytes / 350e9)
    assert v2.bound == "compute" and v2.time_s == v2.compute_s
    # Four MXUs per core share the 64 folds.
    v4 = cost.timing("v4-8")
    assert v4.compute_cycles == math.ceil(cost.folds / 4) * cost.cycles_per_fold - 1
    # One fold streaming many rows moves more bytes than the array computes on...
    assert gemm_cost(m=100_000, k=128, n=128).timing("v2-8").bound == "memory"
    # ...while a few rows against many weight folds are bound by loading the weights.
    assert gemm_cost(m=8, k=8192, n=8192).timing("v2-8").bound == "compute"


def test_convolution_mapping_groups_padding_dilation():
    same = conv_cost((8, 32, 32, 16), (3, 3, 16, 32), padding="same")
    assert (same.m, same.k, same.n, same.count) == (8 * 32 * 32, 144, 32, 1)
    assert same.output_shape == (8, 32, 32, 32) and same.padding == ((1, 1), (1, 1))
    # SCALE-Sim takes the padded input: 34x34 gives the same 32x32 output.
    assert same.scalesim_layer[:2] == [34, 34]
    strided = conv_cost((2, 9, 9, 4), (3, 3, 4, 8), strides=2, padding="same")
    assert strided.output_shape == (2, 5, 5, 8)
    depthwise = conv_cost((2, 10, 10, 6), (3, 3, 1, 6), groups=6)
    assert (depthwise.m, depthwise.k, depthwise.n, depthwise.count) == (2 * 8 * 8, 9, 1, 6)
    dilated = conv_cost((1, 16, 16, 4), (3, 3, 4, 4), dilation=2)
    assert dilated.output_shape == (1, 12, 12, 4) and dilated.k == 36
    conv1d = conv_cost((4, 50, 3), (5, 3, 7), strides=2)
    assert conv1d.output_shape == (4, 23, 7) and conv1d.k == 15


def test_bad_shapes_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="positive"):
        gemm_cost(0, 4, 4)
    with pytest.raises(ValueError, match="groups"):
        conv_cost((1, 8, 8, 6), (3, 3, 4, 6), groups=2)
    with pytest.raises(ValueError, match="fit"):
        conv_cost((1, 2, 2, 1), (5, 5, 1, 1))
    with pytest.raises(ValueError, match="Unknown TPU"):
        gemm_cost(8, 8, 8).timing("v7-8")


def test_program_costs_per_op():
    import jax
    import jax.numpy as jnp

    def layer(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    ops = mxu.trace_mxu_ops(jax.grad(layer, argnums=(0, 1)), jnp.ones((288, 64)), jnp.ones((1024, 288)))
    # forward x@w (k=288), grad wrt w (contracts the 1024 rows), grad wrt x (g @ w^T, k=64)
    assert sorted(op.cost.k for op in ops) == [64, 288, 1024]
    assert all(op.cost.macs == 1024 * 288 * 64 for op in ops)
    assert [op.pass_name for op in ops].count("backward") == 2
    highest = mxu.trace_mxu_ops(layer, jnp.ones((288, 64)), jnp.ones((1024, 288)), precision="highest")
    assert highest[0].cost.count == 6 and highest[0].macs == 1024 * 288 * 64
