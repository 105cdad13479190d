"""The TPU matrix unit (MXU): numerics, JAX primitives, routing, reference array and cost model.

Example:
    >>> import jax.numpy as jnp
    >>> from keras_tpu import mxu
    >>> c = mxu.matmul(jnp.ones((128, 288)), jnp.ones((288, 64)))       # bf16 multiply, f32 sum
    >>> mxu.gemm_cost(m=1024, k=288, n=64).cycles                        # on a 128x128 array
    4217
"""

from keras_tpu.mxu._cost import ConvCost, GemmCost, Timing, conv_cost, gemm_cost, scalesim_layer_cost
from keras_tpu.mxu._numerics import Precision, canonical_precision, round_to_bfloat16
from keras_tpu.mxu._primitives import (MXU_PRIMITIVES, conv_general_dilated, dot_general, matmul,
                                      mxu_conv_p, mxu_dot_general_p)
from keras_tpu.mxu._program import MXUOp, mxu_ops, split_name_stack, trace_mxu_ops
from keras_tpu.mxu._routing import mxu_rule, route
from keras_tpu.mxu._systolic import SimulationResult, SystolicArray

__all__ = [
    "ConvCost", "GemmCost", "MXUOp", "MXU_PRIMITIVES", "Precision", "SimulationResult", "SystolicArray",
    "Timing", "canonical_precision", "conv_cost", "conv_general_dilated", "dot_general", "gemm_cost",
    "matmul", "mxu_conv_p", "mxu_dot_general_p", "mxu_ops", "mxu_rule", "round_to_bfloat16", "route",
    "scalesim_layer_cost",
    "split_name_stack", "trace_mxu_ops",
]
