"""Big models: peak memory and train-step time of keras-tpu against plain Keras, model by model.

Each configuration runs in its own fresh process (``benchmarks/_child.py``): plain Keras 3
on its JAX backend, and the same model through ``keras_to_tpu_model`` (a simulated v2-8,
default MXU numerics), on the same random data with the same seed. Models (issue #16):

* ``mlp``: an MLP of 3 hidden layers of 4096 on 4096 inputs, 10 classes, Adam, batch 256
  (50.4M parameters);
* ``bert_base``: a BERT-base-sized encoder written with Keras layers (token and position
  Embedding, 12 blocks of MultiHeadAttention + LayerNormalization + a 3072 FFN, hidden 768,
  12 heads, vocab 30522, sequence 128, a 2-class head on the first token), AdamW, batch 32
  (108.5M parameters);
* ``mlp_sweep``: the MLP's width from ~10M to ~200M parameters;
* ``bert_large``: a BERT-large-sized encoder (24 blocks, hidden 1024, 16 heads, FFN 4096,
  335M parameters) at a small batch: the largest model users bring, checked to train in
  both.

Per model it prints parameters, each child's peak host memory (``ru_maxrss``), the median
train-step time over a few steps after warm-up (wall clock, and the process's CPU seconds,
which a shared machine disturbs less), and the ratios keras-tpu / plain. Plain and
keras-tpu runs are interleaved (plain, tpu, tpu, plain with ``--repeats 2``) and the load
average is recorded before each. The last line is ``RESULT {json}``.

Usage:
    python benchmarks/big_models.py [--models mlp,bert_base,mlp_sweep,bert_large] [--steps 4]
                                    [--repeats 1] [--json out.json]
"""

import argparse
import json
import os
import resource
import statistics
import time

from _child import run_child

# Widths of the MLP sweep: 11M, 24M, (50M: the mlp model), 101M, 168M and 208M parameters at 4096 inputs.
MLP_SWEEP_WIDTHS = (1536, 2560, 6144, 8192, 9216)


def mlp_spec(width, inputs=4096, hidden=3, classes=10, batch=256):
    return {"kind": "mlp", "width": width, "inputs": inputs, "hidden": hidden, "classes": classes, "batch": batch}


def bert_spec(blocks, hidden, heads, ffn, batch, vocab=30522, seq=128, classes=2):
    return {"kind": "bert", "blocks": blocks, "hidden": hidden, "heads": heads, "ffn": ffn, "batch": batch,
            "vocab": vocab, "seq": seq, "classes": classes}


def mlp_params(spec):
    w, i, h, c = spec["width"], spec["inputs"], spec["hidden"], spec["classes"]
    return i * w + w + (h - 1) * (w * w + w) + w * c + c


# -- the child: one model, one mode ------------------------------------------------------------------------------


def build_model(spec, keras):
    keras.utils.set_random_seed(0)
    if spec["kind"] == "mlp":
        inputs = keras.Input((spec["inputs"],))
        x = inputs
        for _ in range(spec["hidden"]):
            x = keras.layers.Dense(spec["width"], activation="relu")(x)
        outputs = keras.layers.Dense(spec["classes"])(x)
        model = keras.Model(inputs, outputs, name=f"mlp_{spec['width']}")
        model.compile(optimizer=keras.optimizers.Adam(1e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model
    hidden, seq = spec["hidden"], spec["seq"]
    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(spec["vocab"], hidden, name="token_embedding")(tokens)
    positions = keras.layers.Embedding(seq, hidden, name="position_embedding")(keras.ops.arange(seq)[None, :])
    x = keras.layers.LayerNormalization(epsilon=1e-12)(x + positions)
    for block in range(spec["blocks"]):
        attention = keras.layers.MultiHeadAttention(spec["heads"], hidden // spec["heads"],
                                                    name=f"attention_{block}")(x, x)
        x = keras.layers.LayerNormalization(epsilon=1e-12)(x + attention)
        ffn = keras.layers.Dense(spec["ffn"], activation="gelu")(x)
        ffn = keras.layers.Dense(hidden)(ffn)
        x = keras.layers.LayerNormalization(epsilon=1e-12)(x + ffn)
    pooled = keras.layers.Dense(hidden, activation="tanh", name="pooler")(x[:, 0])
    outputs = keras.layers.Dense(spec["classes"], name="classifier")(pooled)
    model = keras.Model(tokens, outputs, name=f"bert_{spec['blocks']}x{hidden}")
    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def make_data(spec, batches):
    import numpy as np

    rng = np.random.default_rng(0)
    rows = spec["batch"] * batches
    if spec["kind"] == "mlp":
        x = rng.standard_normal((rows, spec["inputs"]), dtype=np.float32)
    else:
        x = rng.integers(0, spec["vocab"], (rows, spec["seq"]), dtype=np.int32)
    y = rng.integers(0, spec["classes"], (rows,), dtype=np.int32)
    return x, y


def measure(mode, spec, steps, warmup):
    """Runs in the child process: train ``warmup + steps`` steps, time each, report peak memory."""
    if mode == "keras_tpu":
        import keras_tpu
    else:
        os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras

    model = build_model(spec, keras)
    params = int(model.count_params())
    if mode == "keras_tpu":
        model = keras_tpu.keras_to_tpu_model(model)
    x, y = make_data(spec, warmup + steps)
    marks = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            jax.block_until_ready(logs)
            usage = resource.getrusage(resource.RUSAGE_SELF)
            marks.append((time.perf_counter(), usage.ru_utime + usage.ru_stime))

    marks.append((time.perf_counter(), sum(resource.getrusage(resource.RUSAGE_SELF)[:2])))
    model.fit(x, y, batch_size=spec["batch"], epochs=1, verbose=0, shuffle=False, callbacks=[Timer()])
    wall = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    return {
        "mode": mode, "spec": spec, "params": params,
        "first_step_s": wall[0],
        "step_s": statistics.median(wall[warmup:]), "step_cpu_s": statistics.median(cpu[warmup:]),
        "steps_s": wall[warmup:],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loss": float(model.history.history["loss"][-1]) if model.history else None,
    }


# -- the parent: interleaved runs, the table ---------------------------------------------------------------------


def configurations(names):
    configs = []
    for name in names:
        if name == "mlp":
            configs.append(("MLP 4096 x 3 hidden, Adam (256)", mlp_spec(4096)))
        elif name == "bert_base":
            configs.append(("BERT-base-sized encoder, AdamW (32)", bert_spec(12, 768, 12, 3072, batch=32)))
        elif name == "mlp_sweep":
            for width in MLP_SWEEP_WIDTHS:
                configs.append((f"MLP {width} x 3 hidden, Adam (256)", mlp_spec(width)))
        elif name == "bert_large":
            configs.append(("BERT-large-sized encoder 24 x 1024, AdamW (8)", bert_spec(24, 1024, 16, 4096, batch=8)))
        else:
            raise SystemExit(f"unknown model {name!r}")
    return configs


def run(mode, spec, args):
    load = os.getloadavg()
    result = run_child(__file__, [mode, json.dumps(spec), "--steps", args.steps, "--warmup", args.warmup])
    result["load"] = load
    print(f"  {mode:9s} load {load[0]:5.2f}: peak {result['peak_rss_mib'] / 1024:6.2f} GiB, step "
          f"{result['step_s']:7.3f} s wall, {result['step_cpu_s']:7.3f} s CPU (first step {result['first_step_s']:.1f} s)",
          flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,bert_base,mlp_sweep,bert_large")
    parser.add_argument("--steps", type=int, default=4, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (the first compiles)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode (interleaved plain/tpu/tpu/plain)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(measure(args.child, json.loads(args.spec), args.steps, args.warmup)))
        return

    print(f"{os.cpu_count()} CPU cores; load average at start {os.getloadavg()}", flush=True)
    rows = []
    for title, spec in configurations(args.models.split(",")):
        print(f"{title} ...", flush=True)
        runs = {"keras": [], "keras_tpu": []}
        order = ["keras", "keras_tpu"]
        for repeat in range(args.repeats):
            for mode in (order if repeat % 2 == 0 else order[::-1]):
                runs[mode].append(run(mode, spec, args))
        plain, tpu = runs["keras"], runs["keras_tpu"]
        row = {
            "model": title, "spec": spec, "params": plain[0]["params"],
            "plain_peak_gib": max(r["peak_rss_mib"] for r in plain) / 1024,
            "tpu_peak_gib": max(r["peak_rss_mib"] for r in tpu) / 1024,
            "plain_step_s": statistics.median(r["step_s"] for r in plain),
            "tpu_step_s": statistics.median(r["step_s"] for r in tpu),
            "plain_step_cpu_s": statistics.median(r["step_cpu_s"] for r in plain),
            "tpu_step_cpu_s": statistics.median(r["step_cpu_s"] for r in tpu),
            "load": [r["load"][0] for r in plain + tpu],
        }
        row["memory_ratio"] = row["tpu_peak_gib"] / row["plain_peak_gib"]
        row["speed_ratio"] = row["plain_step_s"] / row["tpu_step_s"]  # > 1: keras-tpu faster
        row["cpu_speed_ratio"] = row["plain_step_cpu_s"] / row["tpu_step_cpu_s"]
        rows.append(row)

    print()
    print(f"{'model (global batch)':48s} {'params':>8s} {'peak GiB plain -> tpu':>22s} {'ratio':>6s} "
          f"{'step s plain -> tpu':>20s} {'speed':>6s} {'CPU-s speed':>11s} {'load':>10s}")
    for r in rows:
        print(f"{r['model']:48s} {r['params'] / 1e6:7.1f}M {r['plain_peak_gib']:9.2f} -> {r['tpu_peak_gib']:7.2f}  "
              f"{r['memory_ratio']:5.2f}x {r['plain_step_s']:8.2f} -> {r['tpu_step_s']:7.2f}  {r['speed_ratio']:5.2f}x "
              f"{r['cpu_speed_ratio']:10.2f}x {min(r['load']):4.1f}-{max(r['load']):4.1f}")
    targets = {
        "memory_le_1.2x_everywhere": all(r["memory_ratio"] <= 1.2 for r in rows),
        "mlp_speed_ge_1.0x": all(r["speed_ratio"] >= 1.0 for r in rows if r["spec"] == mlp_spec(4096)),
    }
    print("targets:", targets)
    result = {"cpu_count": os.cpu_count(), "rows": rows, "targets": targets}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
