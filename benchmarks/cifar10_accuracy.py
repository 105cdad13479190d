"""Does training on the simulated TPU learn as well as training on the CPU?

Part 1 (``--compare``): the notebook's recipe for 5 epochs on the first
10,000 bundled CIFAR-10 training images, with 3 seeds on plain Keras (CPU,
float32) and 3 seeds on the simulated TPU (8 cores, bf16 MXU numerics), each
scored on the 10,000 test images. The TPU runs should fall inside the spread
of the CPU runs.

Part 2 (``--full``): the recipe on all 50,000 training images for 10 epochs
on the simulated TPU: time per epoch and test accuracy.

Each run is its own process. Results are printed and, with ``--json``, saved.

Usage:
    python benchmarks/cifar10_accuracy.py --compare --full --json benchmarks/results/accuracy.json
"""

import argparse
import json
import os
import statistics
import time

from _child import run_child


def run(engine, seed, train_images, epochs):
    """Runs in the child process."""
    if engine == "tpu":
        import keras_tpu
    else:
        os.environ["KERAS_BACKEND"] = "jax"
    import keras

    from keras_tpu.examples.cifar10 import create_model
    from keras_tpu.datasets import cifar10

    (x_train, y_train), (x_test, y_test) = cifar10.load_data()
    keras.utils.set_random_seed(seed)
    model = create_model()
    if engine == "tpu":
        model = keras_tpu.keras_to_tpu_model(model)

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = getattr(self, "seconds", []) + [time.perf_counter() - self.started]

    timer = EpochTimer()
    history = model.fit(x_train[:train_images], y_train[:train_images], batch_size=1024, epochs=epochs,
                        verbose=0, callbacks=[timer])
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=1024, verbose=0)
    return {"engine": engine, "seed": seed, "train_images": train_images, "epochs": epochs,
            "epoch_seconds": timer.seconds, "train_accuracy": history.history["sparse_categorical_accuracy"][-1],
            "test_loss": loss, "test_accuracy": accuracy}


def child(engine, seed, train_images, epochs):
    result = run_child(__file__, [engine, "--seed", seed, "--train-images", train_images, "--epochs", epochs])
    print(f"  {engine} seed {seed}: test accuracy {result['test_accuracy']:.4f}, "
          f"{statistics.mean(result['epoch_seconds']):.1f} s/epoch", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-images", type=int, default=10000)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.child, args.seed, args.train_images, args.epochs)))
        return

    results = {}
    if args.compare:
        print("Part 1: 5 epochs on 10,000 training images, batch 1024")
        for engine in ("cpu", "tpu"):
            results[engine] = [child(engine, int(s), 10000, 5) for s in args.seeds.split(",")]
        for engine in ("cpu", "tpu"):
            accuracies = [r["test_accuracy"] for r in results[engine]]
            print(f"  {engine}: test accuracy mean {statistics.mean(accuracies):.4f}, "
                  f"range {min(accuracies):.4f} - {max(accuracies):.4f}")
    if args.full:
        print("Part 2: 10 epochs on all 50,000 training images on the simulated TPU, batch 1024")
        full = child("tpu", 0, 50000, 10)
        results["full"] = full
        print(f"  epochs 10, {statistics.mean(full['epoch_seconds'][1:]):.1f} s per epoch after the first "
              f"({full['epoch_seconds'][0]:.1f} s with compilation), train accuracy {full['train_accuracy']:.4f}, "
              f"test accuracy {full['test_accuracy']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
