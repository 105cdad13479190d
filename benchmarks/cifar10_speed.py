"""Speed and memory of the CIFAR-10 notebook model: keras-tpu against plain Keras, in one run.

Trains and evaluates the classic TPU notebook's CNN on the bundled CIFAR-10 at
batch 1024, once on the simulated TPU (8 cores, bf16 MXU numerics) and once
with plain Keras on its JAX backend on the same CPU, and prints images/s,
the ratios, and each run's peak memory. Training is one epoch over
``--train-images``; evaluation, being short, is the best of three passes over
``--eval-images``. Each configuration runs in its own
fresh process, so neither inherits the other's compiled programs, memory or
XLA settings.

A third run, plain Keras with XLA:CPU's YNNPACK fusions turned off (the option
keras-tpu compiles its training program with), shows how much of the gain
comes from that option rather than from the 8-core program.

Usage:
    python benchmarks/cifar10_speed.py [--train-images 10240] [--eval-images 10000] [--json out.json]
"""

import argparse
import json
import os
import resource
import time

from _child import run_child

MODES = {
    "keras_tpu": "keras-tpu, simulated v2-8 (8 cores, bf16 MXU)",
    "keras": "plain Keras 3, JAX backend (default XLA:CPU options)",
    "keras_no_ynn": "plain Keras 3, JAX backend, YNNPACK fusions off",
}


def measure(mode, train_images, eval_images, batch_size):
    """Runs in the child process: time training and evaluation, report peak memory."""
    if mode == "keras_tpu":
        import keras_tpu
        from keras_tpu.datasets import cifar10
    else:
        os.environ["KERAS_BACKEND"] = "jax"
        if mode == "keras_no_ynn":
            os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_experimental_ynn_fusion_type="
        from keras_tpu.datasets import cifar10  # the loader only; keras_tpu itself is not imported
    import keras

    from keras_tpu.examples.cifar10 import create_model

    (x_train, y_train), (x_test, y_test) = cifar10.load_data()
    keras.utils.set_random_seed(0)
    model = create_model()  # the notebook's model, shared with `python -m keras_tpu cifar10`
    if mode == "keras_tpu":
        model = keras_tpu.keras_to_tpu_model(model)
    x, y = x_train[:train_images], y_train[:train_images]
    # Warm up: compile the train and test programs outside the timed runs.
    model.fit(x[:batch_size], y[:batch_size], batch_size=batch_size, epochs=1, verbose=0)
    model.evaluate(x_test[:batch_size], y_test[:batch_size], batch_size=batch_size, verbose=0)
    started = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=True)
    train_seconds = time.perf_counter() - started
    eval_seconds = float("inf")
    for _ in range(3):  # evaluation is short: take the best of three on this shared machine
        started = time.perf_counter()
        model.evaluate(x_test[:eval_images], y_test[:eval_images], batch_size=batch_size, verbose=0)
        eval_seconds = min(eval_seconds, time.perf_counter() - started)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "mode": mode, "train_images": len(x), "eval_images": min(eval_images, len(x_test)),
        "train_images_per_s": len(x) / train_seconds,
        "eval_images_per_s": min(eval_images, len(x_test)) / eval_seconds,
        "peak_rss_mib": peak_kib / 1024,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-images", type=int, default=10240)
    parser.add_argument("--eval-images", type=int, default=10000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(measure(args.child, args.train_images, args.eval_images, args.batch_size)))
        return

    results = {}
    for mode in args.modes.split(","):
        print(f"Running {MODES[mode]} ...", flush=True)
        results[mode] = run_child(__file__, [mode, "--train-images", args.train_images,
                                             "--eval-images", args.eval_images, "--batch-size", args.batch_size])

    print()
    print(f"CIFAR-10 notebook CNN, batch {args.batch_size}, {os.cpu_count()} CPU cores")
    print(f"{'configuration':58s} {'train img/s':>12s} {'eval img/s':>11s} {'peak MiB':>9s}")
    for mode, r in results.items():
        print(f"{MODES[mode]:58s} {r['train_images_per_s']:12.0f} {r['eval_images_per_s']:11.0f} "
              f"{r['peak_rss_mib']:9.0f}")
    if "keras_tpu" in results and "keras" in results:
        tpu, plain = results["keras_tpu"], results["keras"]
        print()
        print(f"keras-tpu / plain Keras: training {tpu['train_images_per_s'] / plain['train_images_per_s']:.2f}x, "
              f"evaluation {tpu['eval_images_per_s'] / plain['eval_images_per_s']:.2f}x, "
              f"peak memory {tpu['peak_rss_mib'] / plain['peak_rss_mib']:.2f}x")
        if "keras_no_ynn" in results:
            other = results["keras_no_ynn"]
            print(f"keras-tpu / plain Keras with YNNPACK off: training "
                  f"{tpu['train_images_per_s'] / other['train_images_per_s']:.2f}x, evaluation "
                  f"{tpu['eval_images_per_s'] / other['eval_images_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
