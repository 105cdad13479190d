"""Models as keras.io's examples write them: keras-tpu against plain Keras, in one run.

The zoo (``benchmarks/zoo.py``) measures large batches of seven architectures.
Users' notebooks also bring small batches, recurrent text models and steps of
their own; each model here is our own version of such an example, on random
data of its shapes:

* ``mnist_convnet``: keras.io's "Simple MNIST convnet" (2 convolutions, max
  pooling, dropout), batch 128;
* ``text_bigru``: a bidirectional GRU(64) text classifier over 200 tokens of a
  20k vocabulary (keras.io's "Bidirectional LSTM on IMDB" with one GRU), batch 32;
* ``text_conv1d``: keras.io's "Text classification from scratch" (Embedding,
  two strided Conv1D(128, 7), global max pooling), 500 tokens, batch 32;
* ``mlp_b32``: a 784-512-512-10 MLP with RMSprop at batch 32 (keras.io's MNIST MLP);
* ``own_train_step``: keras.io's "Customizing what happens in fit() with JAX":
  a 784-256-10 model whose ``train_step``/``test_step`` are written with
  ``stateless_call``, ``jax.value_and_grad`` and ``optimizer.stateless_apply``, batch 64;
* ``dcgan``: keras.io's DCGAN on 28x28 images (Conv2DTranspose generator,
  strided Conv2D discriminator), two SGD optimizers in the model's own ``train_step``,
  batch 64 (training only: it has no evaluation loss);
* ``custom_loop``: TensorFlow's "Use TPUs" guide's custom training loop (its convnet
  with 32 filters instead of 256, Adam, L2 regularizers, two metrics), batch 200: under
  ``TPUStrategy`` the guide's ``strategy.run(step_fn)`` with a ``step_fn`` defined on each
  step; plain Keras runs the same loop as one jitted step of the whole batch (training only).

Configurations, each model in a fresh process: ``keras_tpu`` (``keras_to_tpu_model``,
or a ``TPUStrategy`` scope for the GAN, whose ``compile`` takes two optimizers) and
``keras`` (plain Keras 3 on JAX). Figures as in the zoo: training examples/s after a
warm-up step, evaluation examples/s (best of 3), compile time (first ``fit`` and
``evaluate`` minus a steady step, plus the timed evaluations' excess over the best),
peak host memory.

Usage:
    python benchmarks/users_code.py [--models dcgan,mlp_b32] [--repeats 2]
                                    [--json benchmarks/results/users_code.json]
"""

import argparse
import json
import os
import resource
import sys
import time

from _child import results_path, run_child
from zoo import best_of, markdown_table

CONFIGS = {"keras_tpu": "keras-tpu (8 simulated cores, bf16 MXU)", "keras": "plain Keras 3 on JAX"}

# name: (batch size, training steps, evaluation batches): at least ~0.5 s of plain Keras' time each, as small
# models' figures from fewer steps varied by +-20% on this shared machine.
MODELS = {
    "mnist_convnet": (128, 40, 40),
    "text_bigru": (32, 12, 12),
    "text_conv1d": (32, 40, 40),
    "mlp_b32": (32, 400, 400),
    "own_train_step": (64, 400, 400),
    "dcgan": (64, 6, 0),
    "custom_loop": (200, 20, 0),
}


def build_model(name, keras):
    """The compiled Keras model ``name``."""
    layers = keras.layers
    if name == "mnist_convnet":
        model = keras.Sequential([keras.Input((28, 28, 1)), layers.Conv2D(32, 3, activation="relu"),
                                  layers.MaxPooling2D(2), layers.Conv2D(64, 3, activation="relu"),
                                  layers.MaxPooling2D(2), layers.Flatten(), layers.Dropout(0.5),
                                  layers.Dense(10, activation="softmax")])
        model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
        return model
    if name in ("text_bigru", "text_conv1d"):
        tokens = keras.Input((200 if name == "text_bigru" else 500,), dtype="int32")
        x = layers.Embedding(20000, 128)(tokens)
        if name == "text_bigru":
            x = layers.Bidirectional(layers.GRU(64))(x)
        else:
            x = layers.Conv1D(128, 7, strides=3, activation="relu")(layers.Dropout(0.5)(x))
            x = layers.Conv1D(128, 7, strides=3, activation="relu")(x)
            x = layers.Dense(128, activation="relu")(layers.GlobalMaxPooling1D()(x))
        model = keras.Model(tokens, layers.Dense(1, activation="sigmoid")(x))
        model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
        return model
    if name == "mlp_b32":
        model = keras.Sequential([keras.Input((784,)), layers.Dense(512, activation="relu"),
                                  layers.Dense(512, activation="relu"), layers.Dense(10, activation="softmax")])
        model.compile("rmsprop", "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model
    if name == "own_train_step":
        from _users_models import OwnTrainStep

        inputs = keras.Input((784,))
        model = OwnTrainStep(inputs, layers.Dense(10)(layers.Dense(256, activation="relu")(inputs)))
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model
    if name == "dcgan":
        from _users_models import DCGAN

        model = DCGAN()   # SGD keeps no slots, so the two optimizers' state need not travel in Keras' state tuple
        model.compile(keras.optimizers.SGD(0.01), keras.optimizers.SGD(0.01))
        return model
    raise ValueError(f"Unknown model {name!r}; one of {sorted(MODELS)}.")


def make_data(name, examples, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    if name == "mnist_convnet":
        return rng.random((examples, 28, 28, 1), np.float32), np.eye(10, dtype=np.float32)[rng.integers(0, 10, examples)]
    if name in ("text_bigru", "text_conv1d"):
        length = 200 if name == "text_bigru" else 500
        return rng.integers(0, 20000, (examples, length)).astype(np.int32), rng.integers(0, 2, (examples, 1))
    if name in ("mlp_b32", "own_train_step"):
        return rng.random((examples, 784), np.float32), rng.integers(0, 10, examples)
    if name == "dcgan":   # x: the generator's noise, y: real images
        return rng.standard_normal((examples, 128)).astype(np.float32), rng.random((examples, 28, 28, 1), np.float32)
    raise ValueError(name)


def measure(config, name):
    """In a fresh interpreter: build, compile, time, report."""
    import contextlib

    os.environ["KERAS_BACKEND"] = "jax"
    if config == "keras_tpu":
        import keras_tpu
    import keras

    batch, train_steps, eval_batches = MODELS[name]
    keras.utils.set_random_seed(0)
    if name == "custom_loop":
        return measure_custom_loop(config, keras, batch, train_steps)
    if config == "keras_tpu" and name == "dcgan":
        scope = keras_tpu.TPUStrategy().scope()
    else:
        scope = contextlib.nullcontext()
    with scope:
        model = build_model(name, keras)
    if config == "keras_tpu" and name != "dcgan":
        model = keras_tpu.keras_to_tpu_model(model)
    x, y = make_data(name, batch * max(train_steps, eval_batches))

    started = time.perf_counter()
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)
    first_fit = time.perf_counter() - started
    first_eval = 0.0
    if eval_batches:
        started = time.perf_counter()
        model.evaluate(x[:batch], y[:batch], batch_size=batch, verbose=0)
        first_eval = time.perf_counter() - started

    train_x, train_y = x[:batch * train_steps], y[:batch * train_steps]
    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(train_x, train_y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    train_wall, train_cpu = time.perf_counter() - wall, time.process_time() - cpu
    eval_walls = []
    for _ in range(3 if eval_batches else 0):
        started = time.perf_counter()
        model.evaluate(x[:batch * eval_batches], y[:batch * eval_batches], batch_size=batch, verbose=0)
        eval_walls.append(time.perf_counter() - started)
    eval_wall = min(eval_walls, default=float("inf"))
    step = train_wall / train_steps
    eval_step = eval_wall / eval_batches if eval_batches else 0.0
    return {
        "config": config, "model": name, "batch": batch, "load": os.getloadavg()[0],
        "train_per_s": batch * train_steps / train_wall,
        "eval_per_s": batch * eval_batches / eval_wall if eval_batches else float("nan"),
        "train_step_ms": 1e3 * step, "train_step_cpu_ms": 1e3 * train_cpu / train_steps,
        # As in zoo.py: the timed evaluations' excess over the best counts too (a layout trial compiles there).
        "compile_s": max(first_fit - step, 0.0) + (max(first_eval - eval_step, 0.0) if eval_batches else 0.0)
                     + sum(w - eval_wall for w in eval_walls),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def measure_custom_loop(config, keras, batch, train_steps):
    """``measure`` for a custom training loop (no ``fit``): the first step's excess is its compile time."""
    import jax
    import numpy as np
    from _users_models import guide_custom_loop

    strategy = None
    if config == "keras_tpu":
        import keras_tpu
        strategy = keras_tpu.TPUStrategy()
    step, state = guide_custom_loop(strategy)

    def wait():
        # Under the strategy, the state is the model's Keras variables: wait for their values (jax waits on arrays
        # only, and a step returns before its program has run).
        jax.block_until_ready([v.value if isinstance(v, keras.Variable) else v for v in jax.tree.leaves(state)])

    rng = np.random.default_rng(0)
    images = rng.random((batch * train_steps, 28, 28, 1), np.float32)
    labels = rng.integers(0, 10, batch * train_steps)
    started = time.perf_counter()
    step(images[:batch], labels[:batch])
    wait()
    first = time.perf_counter() - started
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(0, batch * train_steps, batch):
        step(images[i:i + batch], labels[i:i + batch])
    wait()
    train_wall, train_cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "config": config, "model": "custom_loop", "batch": batch, "load": os.getloadavg()[0],
        "train_per_s": batch * train_steps / train_wall, "eval_per_s": float("nan"),
        "train_step_ms": 1e3 * train_wall / train_steps, "train_step_cpu_ms": 1e3 * train_cpu / train_steps,
        "compile_s": max(first - train_wall / train_steps, 0.0),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", help="where the results go (default: benchmarks/results/users_code.json for a run "
                                       "of every model, else a file named after those run)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    models, configs = args.models.split(","), list(CONFIGS)
    args.json = args.json or results_path(__file__, models, list(MODELS))
    runs = {name: {config: [] for config in configs} for name in models}
    for repeat in range(args.repeats):
        for name in models:
            for config in (configs if repeat % 2 == 0 else configs[::-1]):   # interleaved, alternating order
                print(f"[{repeat + 1}/{args.repeats}] {name}: {CONFIGS[config]} (load {os.getloadavg()[0]:.1f}) ...",
                      flush=True)
                result = run_child(__file__, [config, name])
                runs[name][config].append(result)
                print(f"    train {result['train_per_s']:.0f}/s, eval {result['eval_per_s']:.0f}/s, "
                      f"compile {result['compile_s']:.1f} s, peak {result['peak_rss_mib']:.0f} MiB", flush=True)
    results = {name: {config: best_of(r) for config, r in by_config.items() if r} for name, by_config in runs.items()}
    table = markdown_table(results, models, configs)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"repeats": args.repeats, "runs": runs, "best": results, "table": table}, f, indent=1)
    print(f"\nKeras users' code, {os.cpu_count()} CPU cores, best of {args.repeats}; ratios against plain Keras")
    print(table)


if __name__ == "__main__":
    sys.exit(main())
