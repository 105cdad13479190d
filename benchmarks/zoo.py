"""A zoo of models: keras-tpu against plain Keras, Keras data-parallel and Keras mixed_bfloat16, in one run.

Models (issue #13), each on random data of its input shape:

* ``cifar_cnn``: the README's CIFAR-10 notebook CNN (4 convolutions, BatchNormalization,
  Dropout, 2 dense layers), batch 1024;
* ``resnet``: a ResNet-20-style CIFAR network (3 stages of 3 residual blocks, 16/32/64
  filters, BatchNormalization, projection shortcuts), batch 512;
* ``mobilenet``: MobileNet-style depthwise-separable blocks (DepthwiseConv2D + 1x1
  Conv2D, BatchNormalization, ReLU6), batch 512;
* ``char_lstm``: a character language model, Embedding + 2 x LSTM(256) over 64 steps, a
  per-step softmax over 96 characters, batch 256;
* ``transformer``: a 2-block Transformer encoder (MultiHeadAttention 4 x 32, FFN 512,
  LayerNormalization) over 64 tokens, a pooled classifier, batch 256;
* ``mlp``: 784-1024-1024-10, batch 1024;
* ``embedding``: an embedding-heavy model (100k x 64 table, 32 tokens, average pooling, two
  dense layers), batch 1024.

Configurations, each model in a fresh process (``benchmarks/_child.py``):

* ``keras_tpu``: ``keras_to_tpu_model`` (simulated v2-8, 8 cores, default bf16 MXU numerics);
* ``keras``: plain Keras 3 on JAX (default XLA:CPU options);
* ``keras_dp``: plain Keras with ``keras.distribution.DataParallel`` over 8 virtual CPU devices;
* ``keras_bf16``: plain Keras with the ``mixed_bfloat16`` dtype policy.

Per child: training examples/s (``fit`` over ``--train-steps`` batches after a warm-up
step), evaluation examples/s (best of 5 ``evaluate`` passes), the process CPU seconds per
training step, compile time (the first ``fit`` and ``evaluate`` calls minus a steady
step, plus what the timed ``evaluate`` passes took beyond the best one: keras-tpu compiles a
second layout of a convolutional model's inference program there, see
``keras_tpu._programs.LayoutTrial``), and peak host memory (``ru_maxrss``). Configurations run interleaved model by
model; ``--repeats 2`` runs them a second time in reverse order and keeps each
configuration's best. Prints a Markdown table of figures and ratios to plain Keras (and
the geometric mean of the ratios), and writes ``benchmarks/results/zoo.json`` (a run of some models or
configurations: a file named after them).

Usage:
    python benchmarks/zoo.py [--quick] [--models cifar_cnn,mlp] [--configs keras_tpu,keras]
                             [--repeats 1] [--json benchmarks/results/zoo.json]
"""

import argparse
import json
import math
import os
import resource
import sys
import time

from _child import results_path, run_child

CONFIGS = {
    "keras_tpu": "keras-tpu (keras_to_tpu_model, 8 simulated cores, bf16 MXU)",
    "keras": "plain Keras 3 on JAX",
    "keras_dp": "plain Keras, DataParallel over 8 virtual CPU devices",
    "keras_bf16": "plain Keras, mixed_bfloat16 policy",
}

# name: (batch size, training steps, quick training steps, evaluation batches)
MODELS = {
    "cifar_cnn": (1024, 8, 3, 4),
    "resnet": (512, 6, 2, 4),
    "mobilenet": (512, 8, 3, 4),
    "char_lstm": (256, 6, 2, 4),
    "transformer": (256, 8, 3, 4),
    "mlp": (1024, 30, 10, 10),
    "embedding": (1024, 30, 10, 10),
}

SEQUENCE_LENGTH = 64
CHARACTERS = 96
TOKENS = 20000
EMBEDDING_ROWS = 100_000


# -- the models -----------------------------------------------------------------------------------------------


def build_model(name, keras):
    """The compiled Keras model ``name`` of the zoo."""
    layers = keras.layers
    if name == "cifar_cnn":
        from keras_tpu.examples.cifar10 import create_model

        return create_model()
    if name == "resnet":
        inputs = keras.Input((32, 32, 3))
        x = _conv_bn(layers, inputs, 16, relu=True)
        for stage, filters in enumerate((16, 32, 64)):
            for block in range(3):
                stride = 2 if stage > 0 and block == 0 else 1
                y = _conv_bn(layers, x, filters, stride=stride, relu=True)
                y = _conv_bn(layers, y, filters, relu=False)
                if stride != 1 or x.shape[-1] != filters:   # projection shortcut
                    x = _conv_bn(layers, x, filters, size=1, stride=stride, relu=False)
                x = layers.Activation("relu")(layers.Add()([x, y]))
        x = layers.GlobalAveragePooling2D()(x)
        return _compiled(keras, keras.Model(inputs, layers.Dense(10, activation="softmax")(x)))
    if name == "mobilenet":
        inputs = keras.Input((32, 32, 3))
        x = _conv_bn(layers, inputs, 32, stride=1, relu=True)
        for filters, stride in ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)):
            x = layers.DepthwiseConv2D(3, strides=stride, padding="same", use_bias=False)(x)
            x = layers.ReLU(6.0)(layers.BatchNormalization()(x))
            x = _conv_bn(layers, x, filters, size=1, relu=True)
        x = layers.GlobalAveragePooling2D()(x)
        return _compiled(keras, keras.Model(inputs, layers.Dense(10, activation="softmax")(x)))
    if name == "char_lstm":
        inputs = keras.Input((SEQUENCE_LENGTH,), dtype="int32")
        x = layers.Embedding(CHARACTERS, 64)(inputs)
        x = layers.LSTM(256, return_sequences=True)(x)
        x = layers.LSTM(256, return_sequences=True)(x)
        return _compiled(keras, keras.Model(inputs, layers.Dense(CHARACTERS, activation="softmax")(x)))
    if name == "transformer":
        inputs = keras.Input((SEQUENCE_LENGTH,), dtype="int32")
        x = layers.Embedding(TOKENS, 128)(inputs)
        for _ in range(2):
            attention = layers.MultiHeadAttention(num_heads=4, key_dim=32)(x, x)
            x = layers.LayerNormalization()(layers.Add()([x, attention]))
            ffn = layers.Dense(128)(layers.Dense(512, activation="relu")(x))
            x = layers.LayerNormalization()(layers.Add()([x, ffn]))
        x = layers.GlobalAveragePooling1D()(x)
        return _compiled(keras, keras.Model(inputs, layers.Dense(2, activation="softmax")(x)))
    if name == "mlp":
        inputs = keras.Input((784,))
        x = layers.Dense(1024, activation="relu")(inputs)
        x = layers.Dense(1024, activation="relu")(x)
        return _compiled(keras, keras.Model(inputs, layers.Dense(10, activation="softmax")(x)))
    if name == "embedding":
        inputs = keras.Input((32,), dtype="int32")
        x = layers.GlobalAveragePooling1D()(layers.Embedding(EMBEDDING_ROWS, 64)(inputs))
        x = layers.Dense(256, activation="relu")(x)
        return _compiled(keras, keras.Model(inputs, layers.Dense(2, activation="softmax")(x)))
    raise ValueError(f"Unknown zoo model {name!r}; one of {sorted(MODELS)}.")


def _conv_bn(layers, x, filters, size=3, stride=1, relu=True):
    x = layers.Conv2D(filters, size, strides=stride, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    return layers.Activation("relu")(x) if relu else x


def _compiled(keras, model):
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model


def make_data(name, examples, seed=0):
    """Random inputs and integer labels of the model's shapes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if name in ("cifar_cnn", "resnet", "mobilenet"):
        return rng.random((examples, 32, 32, 3), np.float32), rng.integers(0, 10, (examples,))
    if name == "char_lstm":
        text = rng.integers(0, CHARACTERS, (examples, SEQUENCE_LENGTH + 1))
        return text[:, :-1].astype(np.int32), text[:, 1:]
    if name == "transformer":
        return rng.integers(0, TOKENS, (examples, SEQUENCE_LENGTH)).astype(np.int32), rng.integers(0, 2, (examples,))
    if name == "mlp":
        return rng.random((examples, 784), np.float32), rng.integers(0, 10, (examples,))
    if name == "embedding":
        return rng.integers(0, EMBEDDING_ROWS, (examples, 32)).astype(np.int32), rng.integers(0, 2, (examples,))
    raise ValueError(name)


# -- the child: one model, one configuration ------------------------------------------------------------------


def measure(config, name, train_steps, eval_batches):
    """Runs in the child process (a fresh interpreter): build, compile, time, report."""
    if config == "keras_dp":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["KERAS_BACKEND"] = "jax"
    if config.startswith("keras_tpu"):
        import keras_tpu
    import keras

    batch = MODELS[name][0]
    if config == "keras_dp":
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=keras.distribution.list_devices()))
    if config == "keras_bf16":
        keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = build_model(name, keras)
    if config.startswith("keras_tpu"):
        model = keras_tpu.keras_to_tpu_model(model)
    x, y = make_data(name, batch * max(train_steps, eval_batches))
    train_x, train_y = x[:batch * train_steps], y[:batch * train_steps]
    eval_x, eval_y = x[:batch * eval_batches], y[:batch * eval_batches]

    started = time.perf_counter()
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)
    first_fit = time.perf_counter() - started
    started = time.perf_counter()
    model.evaluate(x[:batch], y[:batch], batch_size=batch, verbose=0)
    first_eval = time.perf_counter() - started

    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(train_x, train_y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    train_wall, train_cpu = time.perf_counter() - wall, time.process_time() - cpu
    eval_walls, eval_cpu = [], float("inf")
    # Evaluation is short: the best of five passes on a shared machine. Five, not three: keras-tpu's layout trial
    # (LayoutTrial) runs over a convolutional model's first twelve evaluation batches after the first, so the
    # conv models' first three passes of four batches run both layouts.
    for _ in range(5):
        started, cpu = time.perf_counter(), time.process_time()
        model.evaluate(eval_x, eval_y, batch_size=batch, verbose=0)
        eval_walls.append(time.perf_counter() - started)
        eval_cpu = min(eval_cpu, time.process_time() - cpu)
    eval_wall = min(eval_walls)
    step, eval_step = train_wall / train_steps, eval_wall / eval_batches
    return {
        "config": config, "model": name, "batch": batch, "load": os.getloadavg()[0],
        "train_per_s": batch * train_steps / train_wall, "eval_per_s": batch * eval_batches / eval_wall,
        "train_step_ms": 1e3 * step, "train_step_cpu_ms": 1e3 * train_cpu / train_steps,
        "eval_step_cpu_ms": 1e3 * eval_cpu / eval_batches,
        # A layout trial's second compile lands in the timed passes (LayoutTrial): what they took beyond the
        # best pass counts as compile time too, in every configuration alike.
        "compile_s": max(first_fit - step, 0.0) + max(first_eval - eval_step, 0.0)
                     + sum(w - eval_wall for w in eval_walls),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# -- the parent ------------------------------------------------------------------------------------------------


def geometric_mean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def best_of(runs):
    """Per configuration: the fastest figures of its repeats, and the highest compile time and memory."""
    best = dict(runs[0])
    for run in runs[1:]:
        for key in ("train_per_s", "eval_per_s"):
            best[key] = max(best[key], run[key])
        for key in ("train_step_ms", "train_step_cpu_ms", "eval_step_cpu_ms"):
            if key in run:
                best[key] = min(best.get(key, run[key]), run[key])
        for key in ("compile_s", "peak_rss_mib"):
            best[key] = max(best[key], run[key])
    best["repeats"] = len(runs)
    return best


def _ratios(r, plain):
    """r against plain Keras: train and eval speed (wall; CPU work), compile time, peak memory."""
    cpu_ratio = lambda key: plain[key] / r[key] if key in r and key in plain else float("nan")
    return {"train": r["train_per_s"] / plain["train_per_s"], "eval": r["eval_per_s"] / plain["eval_per_s"],
            "train_cpu": cpu_ratio("train_step_cpu_ms"), "eval_cpu": cpu_ratio("eval_step_cpu_ms"),
            # A plain compile time under 0.5 s is within the noise of (first call - steady step): no ratio.
            "compile": r["compile_s"] / plain["compile_s"] if plain["compile_s"] >= 0.5 else float("nan"),
            "memory": r["peak_rss_mib"] / plain["peak_rss_mib"]}


def markdown_table(results, models, configs):
    """The Markdown table of ``results[model][config]`` with ratios against plain Keras.

    Speed ratios are given twice: from wall-clock examples/s (what a user sees on an idle host)
    and from the process's CPU seconds per step (the work done; steadier on a shared host).
    """
    lines = ["| model | configuration | train ex/s | eval ex/s | train CPU ms/step | compile s | peak MiB "
             "| train x | eval x | train x CPU | eval x CPU | compile x | memory x |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in models:
        plain = results.get(name, {}).get("keras")
        for config in configs:
            r = results.get(name, {}).get(config)
            if r is None or "train_per_s" not in r:
                continue
            if plain:
                ratio_text = " | ".join(f"{v:.2f}" for v in _ratios(r, plain).values())
            else:
                ratio_text = " | ".join(["-"] * 6)
            lines.append(f"| {name} (b{r['batch']}) | {config} | {r['train_per_s']:.0f} | {r['eval_per_s']:.0f} | "
                         f"{r['train_step_cpu_ms']:.0f} | {r['compile_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                         f"{ratio_text} |")
    lines.append("")
    for config in configs:
        if config == "keras":
            continue
        ratios = [_ratios(results[n][config], results[n]["keras"]) for n in models
                  if config in results.get(n, {}) and "keras" in results.get(n, {})]
        if ratios:
            means = {key: geometric_mean([r[key] for r in ratios]) for key in ("train", "eval", "train_cpu", "eval_cpu")}
            lines.append(f"Geometric mean over {len(ratios)} models, {config} / plain Keras: "
                         f"train {means['train']:.2f}x, eval {means['eval']:.2f}x (wall); "
                         f"train {means['train_cpu']:.2f}x, eval {means['eval_cpu']:.2f}x (CPU)")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--quick", action="store_true", help="fewer training steps per model")
    parser.add_argument("--repeats", type=int, default=1, help="run every configuration this many times")
    parser.add_argument("--json", help="where the results go (default: benchmarks/results/zoo.json for a run of "
                                       "every model and configuration, else a file named after those run)")
    parser.add_argument("--from-json", help="only print the table of an earlier run's JSON file")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        runs = saved["runs"]
        models = [m for m in MODELS if m in runs]
        configs = [c for c in CONFIGS if any(runs[m].get(c) for m in models)]
        results = {n: {c: best_of(r) for c, r in by_config.items() if r} for n, by_config in runs.items()}
        print(markdown_table(results, models, configs))
        return

    if args.child:
        config, name, train_steps, eval_batches = args.child
        print(json.dumps(measure(config, name, int(train_steps), int(eval_batches))))
        return

    models, configs = args.models.split(","), args.configs.split(",")
    args.json = args.json or results_path(__file__, models + configs, list(MODELS) + list(CONFIGS))
    runs = {name: {config: [] for config in configs} for name in models}
    for repeat in range(args.repeats):
        for name in models:
            _, steps, quick_steps, eval_batches = MODELS[name]
            order = configs if repeat % 2 == 0 else configs[::-1]   # interleave; alternate the order
            for config in order:
                print(f"[{repeat + 1}/{args.repeats}] {name}: {CONFIGS[config]} (load {os.getloadavg()[0]:.1f}) ...",
                      flush=True)
                result = run_child(__file__, [config, name, quick_steps if args.quick else steps, eval_batches])
                runs[name][config].append(result)
                print(f"    train {result['train_per_s']:.0f}/s, eval {result['eval_per_s']:.0f}/s, "
                      f"compile {result['compile_s']:.1f} s, peak {result['peak_rss_mib']:.0f} MiB", flush=True)
                _write(args.json, args, runs, models, configs)   # after every child, so a stopped run keeps its data
    table = _write(args.json, args, runs, models, configs)
    print()
    print(f"Zoo, {os.cpu_count()} CPU cores, {'quick' if args.quick else 'full'} run, best of {args.repeats}; "
          "ratios are against plain Keras (x > 1: faster / more)")
    print(table)


def _write(path, args, runs, models, configs):
    """Write the runs so far, their best figures and the table to ``path``; return the table."""
    results = {name: {config: best_of(r) for config, r in by_config.items() if r} for name, by_config in runs.items()}
    table = markdown_table(results, models, configs)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"quick": args.quick, "repeats": args.repeats, "runs": runs, "best": results, "table": table},
                  f, indent=1)
    return table


if __name__ == "__main__":
    sys.exit(main())
