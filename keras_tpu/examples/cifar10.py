"""The classic "Keras on TPU" CIFAR-10 notebook as a program.

Trains the notebook's CNN on CIFAR-10 on the simulated TPU with Keras'
progress bar, prints the test accuracy, saves the weights in tf.keras' HDF5
layout and checks that a plain CPU Keras model loads them.

Run it with ``python -m keras_tpu cifar10 [--epochs 10]``.
"""

import argparse
import os
import time

import keras_tpu

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def create_model():
    """The notebook's model: 4 convolutions, 2 poolings, 2 dense layers, BatchNormalization and Dropout."""
    import keras
    from keras.layers import BatchNormalization, Conv2D, Dense, Dropout, Flatten, Input, MaxPooling2D

    inp = Input(shape=(32, 32, 3), name="Input")
    x = BatchNormalization()(inp)
    x = Conv2D(32, (3, 3), padding="same", activation="relu")(x)
    x = Conv2D(32, (3, 3), activation="relu", padding="same")(x)
    x = MaxPooling2D(pool_size=(2, 2))(x)
    x = Dropout(0.25)(x)
    x = BatchNormalization()(x)
    x = Conv2D(64, (3, 3), padding="same", activation="relu")(x)
    x = Conv2D(64, (3, 3), activation="relu")(x)
    x = MaxPooling2D(pool_size=(2, 2))(x)
    x = Dropout(0.25)(x)
    x = Flatten()(x)
    x = Dense(512, activation="relu")(x)
    x = Dropout(0.5)(x)
    out = Dense(10, activation="softmax")(x)
    model = keras.Model(inputs=[inp], outputs=[out])
    model.compile(optimizer=keras.optimizers.Adam(0.001), loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model


def run(epochs=10, batch_size=128 * 8, train_images=None, weights_path="cifar10_model.h5", tpu=None,
        accelerator_type="v2-8", precision="default", verbose=1, seed=None):
    """Train, evaluate, save and reload; returns a dict of the results."""
    import keras

    if seed is not None:
        keras.utils.set_random_seed(seed)
    (x_train, y_train), (x_test, y_test) = keras_tpu.datasets.cifar10.load_data()
    if train_images:
        x_train, y_train = x_train[:train_images], y_train[:train_images]
    resolver = keras_tpu.TPUClusterResolver(tpu, accelerator_type=accelerator_type)
    tpu_model = keras_tpu.keras_to_tpu_model(
        create_model(), strategy=keras_tpu.TPUDistributionStrategy(resolver, precision=precision))
    started = time.perf_counter()
    history = tpu_model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=verbose)
    train_seconds = time.perf_counter() - started
    loss, accuracy = tpu_model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
    tpu_model.save_weights(weights_path)
    cpu_model = create_model()
    cpu_model.load_weights(weights_path)  # plain Keras 3, no TPU involved
    probabilities = cpu_model.predict(x_test[111:112], verbose=0)[0]
    return {
        "epochs": epochs, "train_images": len(x_train), "train_seconds": train_seconds,
        "train_accuracy": history.history["sparse_categorical_accuracy"][-1],
        "test_loss": loss, "test_accuracy": accuracy, "weights_path": os.path.abspath(weights_path),
        "example_prediction": CLASSES[int(probabilities.argmax())], "example_label": CLASSES[int(y_test[111, 0])],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m keras_tpu cifar10",
                                     description="Train the CIFAR-10 notebook model on the simulated TPU.")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128 * 8, help="global batch (default 1024 = 128 x 8 cores)")
    parser.add_argument("--train-images", type=int, default=None, help="train on the first N images only")
    parser.add_argument("--weights", default="cifar10_model.h5", help="where to save the weights")
    parser.add_argument("--tpu", default=None,
                        help="TPU address or name (simulated locally either way); default: COLAB_TPU_ADDR, TPU_NAME "
                             "or KERAS_TPU_WORKERS from the environment, else the local TPU")
    parser.add_argument("--accelerator-type", default="v2-8")
    parser.add_argument("--precision", default="default", choices=["default", "high", "highest"])
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    result = run(args.epochs, args.batch_size, args.train_images, args.weights, args.tpu, args.accelerator_type,
                 args.precision, verbose=1, seed=args.seed)
    images_per_second = result["epochs"] * result["train_images"] / result["train_seconds"]
    print(f"\nTrained {result['epochs']} epoch(s) on {result['train_images']} images in "
          f"{result['train_seconds']:.0f} s ({images_per_second:.0f} images/s).")
    print(f"Test accuracy: {result['test_accuracy']:.4f} (loss {result['test_loss']:.4f})")
    print(f"Weights saved to {result['weights_path']}; a plain Keras model loaded them and predicts "
          f"test image 111 as {result['example_prediction']} (label: {result['example_label']}).")
    return result
