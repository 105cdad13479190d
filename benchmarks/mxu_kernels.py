"""Speed of the ways one bfloat16 MXU pass can be emitted for XLA:CPU, and of an MLP train step.

The forms (see :mod:`keras_tpu.mxu.kernels`): ``round_f32`` (bf16-valued
float32 operands, float32 op at HIGHEST), ``bf16`` (bf16 operands,
``preferred_element_type=float32``), ``bf16_canonical`` (bf16 operands
transposed into the forward layout first) and, for dots, ``bf16_swapped``
(the transposed product in the forward layout, result transposed back).
``f32`` is the plain float32 op on unrounded operands, for reference only
(it is not the MXU's arithmetic).

Cases: a dot in the three layouts of a dense layer's training step, as
autodiff emits them (forward ``x @ w``; weight gradient
``dot_general(g, x, contracting 0/0)``; input gradient
``dot_general(g, w, contracting 1/1)``), plus a batched (attention-like)
dot; and a convolution with the two convolutions autodiff emits for its
gradients. Each under XLA:CPU's default options and with YNNPACK fusions
off (the option keras-tpu compiles training programs with).

Timing: forms are interleaved round by round and each keeps its best round.
Two figures per form: GFLOP/s of wall time, and GFLOP per CPU-second of the
process (all threads). On a host shared with other jobs the wall figure
swings by 2x while the CPU figure moves much less, so forms are compared by
the CPU figure (x2 on this 2-core host is the uncontended wall speed if the
form parallelises as well); ``--write-table`` records a bf16 form only where
it wins by 10% on both figures.

``--mlp`` times the train step of a dense MLP 784-1024-1024-10 at batch
1024 through ``keras_tpu.mxu.route(jax.value_and_grad(loss))``, with every
pass forced to each form and with the automatic choice.

Usage:
    python benchmarks/mxu_kernels.py [--rounds 7] [--quick] [--mlp] [--json rows.json] [--write-table table.json]
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras_tpu  # noqa: E402,F401  (the simulated TPU's process set-up)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from keras_tpu import mxu, rewrite  # noqa: E402
from keras_tpu.mxu import kernels  # noqa: E402

CONFIGS = {
    "default": {},
    "no_ynn": {"xla_cpu_experimental_ynn_fusion_type": ""},
}

# (batch or None, M, K, N)
DOT_SHAPES = [(None, 1024, 1024, 1024), (None, 4096, 1024, 1024), (None, 1024, 784, 1024),
              (None, 1024, 1024, 10), (32, 512, 64, 512)]
QUICK_DOT_SHAPES = [(None, 1024, 1024, 1024)]
# (batch, height, width, in channels, out channels, kernel, stride)
CONV_SHAPES = [(128, 32, 32, 64, 64, 3, 1), (128, 32, 32, 64, 128, 3, 2), (128, 28, 28, 1, 32, 3, 1)]
QUICK_CONV_SHAPES = [(128, 32, 32, 64, 64, 3, 1)]
REFERENCE = "f32"
# A bf16 form is written to the table only if it beats round_f32 by this factor (CPU and wall figures).
MARGIN = 1.10


def time_forms(functions, args, rounds, calls_per_round=2):
    """Best wall and CPU seconds per call of each function, interleaving the functions round by round."""
    for f in functions.values():
        jax.block_until_ready(f(*args))
    wall = {name: float("inf") for name in functions}
    cpu = dict(wall)
    for _ in range(rounds):
        for name, f in functions.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(calls_per_round):
                out = f(*args)
            jax.block_until_ready(out)
            wall[name] = min(wall[name], (time.perf_counter() - w0) / calls_per_round)
            cpu[name] = min(cpu[name], (time.process_time() - c0) / calls_per_round)
    return wall, cpu


def dot_cases(shapes):
    """(layout label, gemm, lhs shape, rhs shape, dimension numbers) of the three layouts per shape."""
    for b, m, k, n in shapes:
        bs, bd = ((b,), ((0,), (0,))) if b else ((), ((), ()))
        o = len(bs)
        yield "forward", (b or 1, m, k, n), bs + (m, k), bs + (k, n), (((o + 1,), (o,)), bd)
        yield "weight_grad", (b or 1, m, k, n), bs + (m, n), bs + (m, k), (((o,), (o,)), bd)
        yield "input_grad", (b or 1, m, k, n), bs + (m, n), bs + (k, n), (((o + 1,), (o + 1,)), bd)


def conv_cases(shapes):
    """The forward convolution and the two autodiff builds for its gradients, with their parameters."""
    for batch, h, w, cin, cout, size, stride in shapes:
        x = jax.ShapeDtypeStruct((batch, h, w, cin), jnp.float32)
        k = jax.ShapeDtypeStruct((size, size, cin, cout), jnp.float32)

        def conv(x, k, stride=stride):
            return lax.conv_general_dilated(x, k, (stride, stride), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

        def train(x, k):
            y, vjp = jax.vjp(conv, x, k)
            return vjp(y)

        found = rewrite.walk(jax.make_jaxpr(train)(x, k), lambda e: e.primitive is lax.conv_general_dilated_p)
        labelled = {"forward": found[0].eqn}
        for occurrence in found[1:]:
            out_shape = occurrence.eqn.outvars[0].aval.shape
            labelled["weight_grad" if out_shape == k.shape else "input_grad"] = occurrence.eqn
        out_hw = -(-h // stride) * -(-w // stride)
        flops = 2 * batch * out_hw * size * size * cin * cout
        for label in ("forward", "input_grad", "weight_grad"):
            eqn = labelled[label]
            geometry = {key: eqn.params[key] for key in (
                "window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers",
                "feature_group_count", "batch_group_count")}
            lhs_shape, rhs_shape = (v.aval.shape for v in eqn.invars)
            gemm = kernels.conv_gemm(lhs_shape, rhs_shape, eqn.outvars[0].aval.shape, geometry["dimension_numbers"],
                                     geometry["feature_group_count"], geometry["batch_group_count"])
            yield (label, f"b{batch} {h}x{w}x{cin}->{cout} {size}x{size}/s{stride}", gemm, lhs_shape, rhs_shape,
                   geometry, flops)


def _reference_dot(dn):
    return lambda a, b: lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST)


def _reference_conv(geometry):
    return lambda a, b: lax.conv_general_dilated(a, b, **geometry, precision=lax.Precision.HIGHEST)


def run_ops(rounds, quick):
    rng = np.random.default_rng(0)
    rows = []
    for layout, gemm, lhs_shape, rhs_shape, dn in dot_cases(QUICK_DOT_SHAPES if quick else DOT_SHAPES):
        lhs = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
        rhs = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
        shape = ("" if gemm[0] == 1 else f"{gemm[0]}x ") + "x".join(map(str, gemm[1:]))
        for config, options in CONFIGS.items():
            functions = {form: jax.jit(lambda a, b, form=form: kernels.dot_pass(a, b, dn, form),
                                       compiler_options=options or None) for form in kernels.DOT_FORMS}
            functions[REFERENCE] = jax.jit(_reference_dot(dn), compiler_options=options or None)
            wall, cpu = time_forms(functions, (lhs, rhs), rounds)
            flops = 2 * np.prod(gemm)
            rows.append(_row("dot", layout, kernels.dot_layout(len(lhs_shape), len(rhs_shape), dn), shape, gemm,
                             config, flops, wall, cpu))
    for layout, shape, gemm, lhs_shape, rhs_shape, geometry, flops in conv_cases(
            QUICK_CONV_SHAPES if quick else CONV_SHAPES):
        lhs = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
        rhs = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
        for config, options in CONFIGS.items():
            functions = {form: jax.jit(lambda a, b, form=form: kernels.conv_pass(a, b, geometry, form),
                                       compiler_options=options or None) for form in kernels.CONV_FORMS}
            functions[REFERENCE] = jax.jit(_reference_conv(geometry), compiler_options=options or None)
            wall, cpu = time_forms(functions, (lhs, rhs), rounds)
            rows.append(_row("conv", layout, kernels.conv_layout(geometry["dimension_numbers"]), shape, gemm,
                             config, flops, wall, cpu))
    return rows


def _row(kind, label, layout, shape, gemm, config, flops, wall, cpu):
    row = {"kind": kind, "label": label, "layout": layout, "shape": shape, "gemm": [int(g) for g in gemm],
           "config": config, "load": os.getloadavg()[0],
           "gflops_wall": {f: flops / s / 1e9 for f, s in wall.items()},
           "gflops_cpu": {f: flops / s / 1e9 for f, s in cpu.items()}}
    forms = [f for f in row["gflops_cpu"] if f != REFERENCE]
    fastest = max(forms, key=row["gflops_cpu"].get)
    # A bf16 form must beat round_f32 by MARGIN on both figures; anything less is within this host's noise.
    wins = all(row[figure][fastest] >= MARGIN * row[figure][kernels.ROUND_F32]
               for figure in ("gflops_cpu", "gflops_wall"))
    row["best"] = fastest if wins else kernels.ROUND_F32
    print_row(row)
    return row


def print_row(row):
    cpu, wall = row["gflops_cpu"], row["gflops_wall"]
    figures = "  ".join(f"{f}={cpu[f]:5.1f}/{wall[f]:5.1f}" for f in cpu)
    base = cpu[kernels.ROUND_F32]
    native = max((f for f in cpu if f in kernels.NATIVE_FORMS), key=cpu.get)
    print(f"{row['kind']:4s} {row['label']:11s} {row['shape']:27s} {row['config']:7s} {figures}  "
          f"| best bf16 {native} x{cpu[native] / base:.2f} -> {row['best']}  (load {row['load']:.1f})", flush=True)


# ----------------------------------------------------------------------------- MLP


def mlp_step_function(sizes=(784, 1024, 1024, 10)):
    def loss(params, x, y):
        h = x
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            if i + 1 < len(params):
                h = jax.nn.relu(h)
        logp = jax.nn.log_softmax(h)
        return -jnp.mean(jnp.sum(logp * y, axis=-1))

    def init(rng):
        return [(jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32), jnp.zeros((b,), jnp.float32))
                for a, b in zip(sizes[:-1], sizes[1:])]

    return loss, init


def run_mlp(rounds, batch=1024):
    loss, init = mlp_step_function()
    rng = np.random.default_rng(0)
    params = init(rng)
    x = jnp.asarray(rng.standard_normal((batch, 784)), jnp.float32)
    y = jax.nn.one_hot(rng.integers(0, 10, batch), 10)
    results = {}
    for config, options in CONFIGS.items():
        functions = {}
        for form in (None,) + kernels.DOT_FORMS:
            with kernels.use_form(form):
                step = jax.jit(mxu.route(jax.value_and_grad(loss)), compiler_options=options or None)
                functions[form or "auto"] = step.lower(params, x, y).compile()  # forms chosen in the block
        wall, cpu = time_forms(functions, (params, x, y), rounds, calls_per_round=5)
        results[config] = {"wall_ms": {f: s * 1e3 for f, s in wall.items()},
                           "cpu_ms": {f: s * 1e3 for f, s in cpu.items()}}
        print(f"MLP 784-1024-1024-10 batch {batch} train step, {config}: "
              + "  ".join(f"{f}={cpu[f] * 1e3:.1f}/{wall[f] * 1e3:.1f} ms" for f in functions)
              + f"  (CPU/wall ms; load {os.getloadavg()[0]:.1f})", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="one dot and one conv shape")
    parser.add_argument("--mlp", action="store_true", help="only the MLP train step")
    parser.add_argument("--json", help="write all measurements to this file")
    parser.add_argument("--write-table", help="write the per-op best forms (default XLA options) for "
                                              "KERAS_TPU_MXU_KERNEL_TABLE to this file")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, host class {kernels.host_class()}; "
          f"GFLOP per CPU-second / GFLOP/s wall, best of {args.rounds} rounds", flush=True)
    out = {}
    if args.mlp:
        out["mlp"] = run_mlp(args.rounds)
    else:
        out["ops"] = run_ops(args.rounds, args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.write_table and "ops" in out:
        table = [{k: r[k] for k in ("kind", "layout", "gemm", "best")} for r in out["ops"] if r["config"] == "default"]
        with open(args.write_table, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
