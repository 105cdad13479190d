"""Speed of the ways one bfloat16 MXU pass can be emitted for XLA:CPU, and of an MLP train step.

The forms (see :mod:`keras_tpu.mxu._kernels`): ``round_f32`` (bf16-valued
float32 operands, float32 op at HIGHEST), ``bf16`` (bf16 operands,
``preferred_element_type=float32``), ``bf16_canonical`` (bf16 operands
transposed into the forward layout first) and, for dots, ``bf16_swapped``
(the transposed product in the forward layout, result transposed back).
``f32`` is the plain float32 op on unrounded operands, for reference only
(it is not the MXU's arithmetic).

Cases: a dot in the three layouts of a dense layer's training step, as
autodiff emits them (forward ``x @ w``; weight gradient
``dot_general(g, x, contracting 0/0)``; input gradient
``dot_general(g, w, contracting 1/1)``) for the dense layers of
``benchmarks/zoo.py``'s models as one core sees them (MLP, CNN head, LSTM
gates, Transformer projections and FFN, embedding model), the attention dots
of Keras' MultiHeadAttention exactly as traced (batch, heads and transposed
operands included); and the convolutions of the zoo's CIFAR CNN, ResNet and
MobileNet (depthwise and pointwise), each with the two convolutions autodiff
emits for its gradients. Each under three XLA:CPU option sets: its defaults
(keras-tpu's test and predict programs), YNNPACK fusions off, and YNNPACK for
dots only (``kernels.compiler_options()`` on a bf16 host).

Timing: forms are interleaved round by round and each keeps its best round;
``(+N%)`` is how much slower the median round was (the spread). Two figures
per form: GFLOP/s of wall time, and GFLOP per CPU-second of the process (all
threads). On a host shared with other jobs the wall figure swings by 2x
while the CPU figure moves much less, so forms are compared by the CPU
figure; ``--write-table`` records a bf16 form only where it wins by 10%.

``--mlp`` times the train step of a dense MLP 784-1024-1024-10 at batch
1024 through ``keras_tpu.mxu.route(jax.value_and_grad(loss))``, with every
pass forced to each form and with the automatic choice. ``--keras MODELS``
times zoo models' train steps through ``keras_to_tpu_model`` the same way,
each form in a fresh process, interleaved.

Usage:
    python benchmarks/mxu_kernels.py [--rounds 7] [--quick] [--configs default,no_ynn,ynn_dot] [--json rows.json]
                                     [--write-table table.json --table-config ynn_dot]
    python benchmarks/mxu_kernels.py --mlp
    python benchmarks/mxu_kernels.py --keras mlp,cifar_cnn [--forms auto,round_f32,bf16] [--steps 4] [--repeats 2]
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

from keras_tpu import mxu, _rewrite as rewrite  # noqa: E402
from keras_tpu.mxu import _kernels as kernels  # noqa: E402

# XLA:CPU option sets: its defaults (YNNPACK dots and convolutions; keras-tpu's test and
# predict programs), YNNPACK fusions off (keras-tpu's train programs) and YNNPACK for dots only.
CONFIGS = {
    "default": {},
    "no_ynn": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "ynn_dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
}

# (batch or None, M, K, N): the dense layers of benchmarks/zoo.py's models as one core's
# program sees them (M = rows of the core's batch, or rows x time steps).
DOT_SHAPES = [
    (None, 1024, 1024, 1024), (None, 1024, 784, 1024), (None, 1024, 1024, 10),    # MLP (8 cores x 128 rows)
    (None, 128, 3136, 512), (None, 128, 512, 10),                                 # CIFAR CNN head (one core)
    (None, 256, 256, 1024), (None, 256, 64, 1024), (None, 16384, 256, 96),        # char LSTM gates, softmax
    (None, 16384, 128, 128), (None, 16384, 128, 512), (None, 16384, 512, 128),    # Transformer projections, FFN
    (None, 1024, 64, 256),                                                        # embedding model
    (1024, 64, 32, 64), (1024, 64, 64, 32),                                       # attention, (batch x heads)
    (None, 64, 784, 256), (None, 64, 256, 10),                                    # benchmarks/users_code.py's
    (None, 32, 784, 512), (None, 32, 512, 512), (None, 32, 512, 10),              # MLPs at batch 64 and 32
    (None, 16, 1024, 1024),                                                       # a batch of 16
]
QUICK_DOT_SHAPES = [(None, 1024, 1024, 1024)]
# Attention dots exactly as Keras' MultiHeadAttention and autodiff emit them on one core's
# [8, 32, 64, 4 x 32] activations: (label, lhs shape, rhs shape, dimension numbers).
ATTENTION_DOTS = [
    ("scores", (8, 32, 64, 4, 1, 32), (8, 32, 64, 4, 32), (((5,), (4,)), ((0, 1, 3), (0, 1, 3)))),
    ("context", (8, 32, 64, 4, 32), (8, 1, 32, 4, 64, 64), (((2,), (5,)), ((0, 1, 3), (0, 2, 3)))),
    ("scores grad", (8, 32, 4, 32, 1, 64), (8, 32, 64, 4, 32), (((3,), (4,)), ((0, 1, 2), (0, 1, 3)))),
    ("probs grad", (8, 32, 4, 32, 1, 64), (8, 1, 32, 4, 64, 64), (((4, 5), (1, 4)), ((0, 1, 2), (0, 2, 3)))),
    ("value grad", (8, 32, 4, 64, 1, 64), (8, 32, 64, 4, 1, 32), (((3, 4), (2, 4)), ((0, 1, 2), (0, 1, 3)))),
    ("query grad", (8, 32, 4, 64, 1, 64), (8, 32, 64, 4, 32), (((5,), (2,)), ((0, 1, 2), (0, 1, 3)))),
]
# (batch, height, width, in channels, out channels, kernel, stride, feature groups): the
# convolutions of the zoo's CIFAR CNN (128 rows a core), ResNet and MobileNet (64 rows a core).
CONV_SHAPES = [
    (128, 32, 32, 3, 32, 3, 1, 1), (128, 32, 32, 32, 32, 3, 1, 1), (128, 16, 16, 32, 64, 3, 1, 1),
    (128, 16, 16, 64, 64, 3, 1, 1),                                                               # CIFAR CNN
    (64, 32, 32, 16, 16, 3, 1, 1), (64, 32, 32, 16, 32, 3, 2, 1), (64, 16, 16, 32, 32, 3, 1, 1),
    (64, 8, 8, 64, 64, 3, 1, 1), (64, 32, 32, 16, 32, 1, 2, 1),                                    # ResNet
    (64, 32, 32, 32, 32, 3, 1, 32), (64, 16, 16, 128, 128, 3, 1, 128), (64, 8, 8, 256, 256, 3, 1, 256),  # depthwise
    (64, 32, 32, 32, 64, 1, 1, 1), (64, 16, 16, 128, 128, 1, 1, 1), (64, 8, 8, 256, 256, 1, 1, 1),  # pointwise
]
QUICK_CONV_SHAPES = [(128, 32, 32, 32, 32, 3, 1, 1)]
REFERENCE = "f32"
# A bf16 form is written to the table only if it beats round_f32 by this factor (CPU and wall figures).
MARGIN = 1.10


def time_forms(functions, args, rounds, calls_per_round=2, samples=None):
    """Best wall and CPU seconds per call of each function, interleaving the functions round by round.

    ``samples``, if given, receives every round's ``(wall, cpu)`` per function (for the spread).
    """
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
            w, c = (time.perf_counter() - w0) / calls_per_round, (time.process_time() - c0) / calls_per_round
            wall[name], cpu[name] = min(wall[name], w), min(cpu[name], c)
            if samples is not None:
                samples.setdefault(name, []).append((w, c))
    return wall, cpu


def spread(values):
    """(median - best) / best of a list of timings: how far a typical round is from the best one."""
    best, median = min(values), float(np.median(values))
    return (median - best) / best


def dot_cases(shapes, attention=()):
    """(label, lhs shape, rhs shape, dimension numbers): the three layouts per shape, then ``attention``'s dots."""
    for b, m, k, n in shapes:
        bs, bd = ((b,), ((0,), (0,))) if b else ((), ((), ()))
        o = len(bs)
        yield "forward", bs + (m, k), bs + (k, n), (((o + 1,), (o,)), bd)
        yield "weight_grad", bs + (m, n), bs + (m, k), (((o,), (o,)), bd)
        yield "input_grad", bs + (m, n), bs + (k, n), (((o + 1,), (o + 1,)), bd)
    yield from attention


def conv_cases(shapes):
    """The forward convolution and the two autodiff builds for its gradients, with their parameters."""
    for batch, h, w, cin, cout, size, stride, groups in shapes:
        x = jax.ShapeDtypeStruct((batch, h, w, cin), jnp.float32)
        k = jax.ShapeDtypeStruct((size, size, cin // groups, cout), jnp.float32)

        def conv(x, k, stride=stride, groups=groups):
            return lax.conv_general_dilated(x, k, (stride, stride), "SAME", feature_group_count=groups,
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
        flops = 2 * batch * out_hw * size * size * cin * cout // groups
        for label in ("forward", "input_grad", "weight_grad"):
            eqn = labelled[label]
            geometry = {key: eqn.params[key] for key in (
                "window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers",
                "feature_group_count", "batch_group_count")}
            lhs_shape, rhs_shape = (v.aval.shape for v in eqn.invars)
            gemm = kernels.conv_gemm(lhs_shape, rhs_shape, eqn.outvars[0].aval.shape, geometry["dimension_numbers"],
                                     geometry["feature_group_count"], geometry["batch_group_count"])
            name = f"b{batch} {h}x{w}x{cin}->{cout} {size}x{size}/s{stride}" + (" dw" if groups > 1 else "")
            yield label, name, gemm, lhs_shape, rhs_shape, geometry, flops


def _reference_dot(dn):
    return lambda a, b: lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST)


def _reference_conv(geometry):
    return lambda a, b: lax.conv_general_dilated(a, b, **geometry, precision=lax.Precision.HIGHEST)


def run_ops(rounds, quick, configs=tuple(CONFIGS), kinds=("dot", "conv"), only=""):
    """Measure every form of every case (of ``kinds``, whose shape text contains ``only``) under ``configs``."""
    rng = np.random.default_rng(0)
    rows = []
    dots = dot_cases(QUICK_DOT_SHAPES if quick else DOT_SHAPES, () if quick else ATTENTION_DOTS)
    for label, lhs_shape, rhs_shape, dn in (dots if "dot" in kinds else ()):
        if only and only not in f"{label} {lhs_shape} {rhs_shape}":
            continue
        lhs = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
        rhs = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
        gemm = kernels.dot_gemm(lhs_shape, rhs_shape, dn)
        shape = ("" if gemm[0] == 1 else f"{gemm[0]}x ") + "x".join(map(str, gemm[1:]))
        for config in configs:
            options = CONFIGS[config] or None
            functions = {form: jax.jit(lambda a, b, form=form: kernels.dot_pass(a, b, dn, form),
                                       compiler_options=options) for form in kernels.DOT_FORMS}
            functions[REFERENCE] = jax.jit(_reference_dot(dn), compiler_options=options)
            samples = {}
            wall, cpu = time_forms(functions, (lhs, rhs), rounds, samples=samples)
            rows.append(_row("dot", label, kernels.dot_layout(len(lhs_shape), len(rhs_shape), dn), shape, gemm,
                             config, 2 * np.prod(gemm), wall, cpu, samples))
    convs = conv_cases(QUICK_CONV_SHAPES if quick else CONV_SHAPES)
    for label, shape, gemm, lhs_shape, rhs_shape, geometry, flops in (convs if "conv" in kinds else ()):
        if only and only not in shape:
            continue
        lhs = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
        rhs = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
        for config in configs:
            options = CONFIGS[config] or None
            functions = {form: jax.jit(lambda a, b, form=form: kernels.conv_pass(a, b, geometry, form),
                                       compiler_options=options) for form in kernels.CONV_FORMS}
            functions[REFERENCE] = jax.jit(_reference_conv(geometry), compiler_options=options)
            samples = {}
            wall, cpu = time_forms(functions, (lhs, rhs), rounds, samples=samples)
            rows.append(_row("conv", label, kernels.conv_layout(geometry["dimension_numbers"]), shape, gemm,
                             config, flops, wall, cpu, samples))
    return rows


def _row(kind, label, layout, shape, gemm, config, flops, wall, cpu, samples):
    row = {"kind": kind, "label": label, "layout": layout, "shape": shape, "gemm": [int(g) for g in gemm],
           "config": config, "load": os.getloadavg()[0],
           "gflops_wall": {f: flops / s / 1e9 for f, s in wall.items()},
           "gflops_cpu": {f: flops / s / 1e9 for f, s in cpu.items()},
           "spread_cpu": {f: spread([c for _, c in v]) for f, v in samples.items()},
           "spread_wall": {f: spread([w for w, _ in v]) for f, v in samples.items()}}
    forms = [f for f in row["gflops_cpu"] if f != REFERENCE]
    fastest = max(forms, key=row["gflops_cpu"].get)
    # A bf16 form must beat round_f32 by MARGIN in GFLOP per CPU-second (the wall figure swings with
    # the other jobs on this host); anything less is within the noise.
    wins = row["gflops_cpu"][fastest] >= MARGIN * row["gflops_cpu"][kernels.ROUND_F32]
    row["best"] = fastest if wins else kernels.ROUND_F32
    print_row(row)
    return row


def print_row(row):
    cpu, wall = row["gflops_cpu"], row["gflops_wall"]
    figures = "  ".join(f"{f}={cpu[f]:5.1f}/{wall[f]:5.1f}(+{100 * row['spread_cpu'][f]:.0f}%)" for f in cpu)
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


# ----------------------------------------------------------------------------- Keras train steps


def keras_step_child(name, form, steps):
    """In a fresh process: the train step of zoo model ``name`` through keras_to_tpu_model, every MXU pass in ``form``."""
    import keras

    import zoo

    if form != "auto":
        os.environ["KERAS_TPU_MXU_FORM"] = form
    batch = zoo.MODELS[name][0]
    keras.utils.set_random_seed(0)
    model = keras_tpu.keras_to_tpu_model(zoo.build_model(name, keras))
    x, y = zoo.make_data(name, batch * steps)
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)   # compile
    wall, cpu = [], []
    for _ in range(2):   # two timed epochs; the best counts
        w0, c0 = time.perf_counter(), time.process_time()
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        wall.append((time.perf_counter() - w0) / steps * 1e3)
        cpu.append((time.process_time() - c0) / steps * 1e3)
    return {"model": name, "form": form, "wall_ms": min(wall), "cpu_ms": min(cpu), "load": os.getloadavg()[0]}


def run_keras_steps(models, forms, steps, repeats):
    """Train-step times of zoo models with every MXU pass forced to each form, and with the automatic choice."""
    from _child import run_child

    results = {}
    for repeat in range(repeats):
        for name in models:
            for form in (forms if repeat % 2 == 0 else forms[::-1]):   # interleaved, alternating order
                r = run_child(__file__, [name, form, steps])
                results.setdefault(name, {}).setdefault(form, []).append(r)
                print(f"{name:10s} {form:15s} train step {r['cpu_ms']:7.1f} ms CPU {r['wall_ms']:7.1f} ms wall "
                      f"(load {r['load']:.1f})", flush=True)
    print()
    for name, by_form in results.items():
        print(f"{name}: " + "  ".join(
            f"{form}={min(r['cpu_ms'] for r in runs):.0f}/{min(r['wall_ms'] for r in runs):.0f}"
            f" [{max(r['cpu_ms'] for r in runs):.0f}/{max(r['wall_ms'] for r in runs):.0f}]"
            for form, runs in by_form.items()) + "  (ms CPU/wall per step, best [worst])")
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="one dot and one conv shape")
    parser.add_argument("--mlp", action="store_true", help="only the MLP train step")
    parser.add_argument("--keras", help="train steps of these zoo models (comma-separated) through "
                                        "keras_to_tpu_model, per forced form and auto")
    parser.add_argument("--forms", default="auto," + ",".join(kernels.DOT_FORMS), help="forms for --keras")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per epoch for --keras")
    parser.add_argument("--repeats", type=int, default=2, help="runs per form for --keras")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write all measurements to this file")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="XLA option sets to measure under")
    parser.add_argument("--kinds", default="dot,conv", help="dot, conv or both")
    parser.add_argument("--only", default="", help="only the cases whose shape text contains this")
    parser.add_argument("--table-config", default="default", help="the option set whose bests --write-table writes")
    parser.add_argument("--write-table", help="write the per-op best forms (under --table-config) for "
                                              "KERAS_TPU_MXU_KERNEL_TABLE to this file")
    args = parser.parse_args()
    if args.child:
        name, form, steps = args.child
        print(json.dumps(keras_step_child(name, form, int(steps))))
        return
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, host class {kernels.host_class()}; "
          f"GFLOP per CPU-second / GFLOP/s wall, best of {args.rounds} rounds", flush=True)
    out = {}
    if args.keras:
        out["keras"] = run_keras_steps(args.keras.split(","), args.forms.split(","), args.steps, args.repeats)
    elif args.mlp:
        out["mlp"] = run_mlp(args.rounds)
    else:
        out["ops"] = run_ops(args.rounds, args.quick, args.configs.split(","), args.kinds.split(","), args.only)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.write_table and "ops" in out:
        table = [{k: r[k] for k in ("kind", "layout", "gemm", "best")} for r in out["ops"] if r["config"] == args.table_config]
        with open(args.write_table, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
