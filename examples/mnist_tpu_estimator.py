"""MNIST with TPUEstimator: TensorFlow's classic ``mnist_tpu.py`` on keras-tpu.

The model, flags and structure follow TensorFlow's TPU MNIST example: a CNN
(two 5x5 convolutions with max pooling, a 1024-unit dense layer with dropout,
10 logits) trained by TF 1's ``GradientDescentOptimizer`` with an exponentially decaying
learning rate (``keras_tpu.train``) through a ``CrossShardOptimizer``, evaluated with an accuracy
``metric_fn``. The TensorFlow layers become Keras layers; everything else
is the same workflow.

Data: the MNIST copy bundled with keras-tpu is the official 10,000-image test
split, divided 8,000 for training / 2,000 for evaluation (the full MNIST is
used instead if Keras has it cached).

    python examples/mnist_tpu_estimator.py --model_dir=/tmp/mnist_tpu --train_steps=1000
"""

import argparse

import keras_tpu  # first: it selects Keras' JAX backend
import keras
import numpy as np
from keras_tpu import estimator as tpu_estimator, train


def metric_fn(labels, logits):
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    accuracy.update_state(labels, logits)
    return {"accuracy": accuracy}


def model_fn(features, labels, mode, params):
    """The network of TensorFlow's mnist_tpu.py, with Keras layers."""
    x = keras.layers.Reshape((28, 28, 1))(features)
    x = keras.layers.Rescaling(1.0 / 255)(x)
    x = keras.layers.Conv2D(32, 5, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D(2, 2, padding="same")(x)
    x = keras.layers.Conv2D(64, 5, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D(2, 2, padding="same")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(1024, activation="relu")(x)
    x = keras.layers.Dropout(0.4)(x)
    logits = keras.layers.Dense(10)(x)

    if mode == tpu_estimator.ModeKeys.PREDICT:
        predictions = {"class_ids": keras.ops.argmax(logits, axis=1), "probabilities": keras.ops.softmax(logits)}
        return tpu_estimator.TPUEstimatorSpec(mode=mode, predictions=predictions)

    loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    if mode == tpu_estimator.ModeKeys.EVAL:
        return tpu_estimator.TPUEstimatorSpec(mode=mode, loss=loss, eval_metrics=(metric_fn, [labels, logits]))

    # TensorFlow's lines, with tf.train -> keras_tpu.train and tf.contrib.tpu -> tpu_estimator.
    learning_rate = train.exponential_decay(
        params["learning_rate"], train.get_global_step(), decay_steps=100000, decay_rate=0.96)
    optimizer = train.GradientDescentOptimizer(learning_rate=learning_rate)
    if params["use_tpu"]:
        optimizer = tpu_estimator.CrossShardOptimizer(optimizer)
    return tpu_estimator.TPUEstimatorSpec(mode=mode, loss=loss,
                                          train_op=optimizer.minimize(loss, train.get_global_step()))


def _data(train):
    (x_train, y_train), (x_test, y_test) = keras_tpu.datasets.mnist.load_data()
    x, y = (x_train, y_train) if train else (x_test, y_test)
    return x.astype(np.float32), y.astype(np.int32)


def train_input_fn(params):
    """Whole arrays: the estimator batches them (params["batch_size"] rows per core, shuffled)."""
    return _data(train=True)


def eval_input_fn(params):
    return _data(train=False)


def predict_input_fn(params):
    features, _ = _data(train=False)
    return features[:params.get("predict_examples", 10)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tpu", default=None, help="TPU address or name (simulated locally)")
    parser.add_argument("--model_dir", default="/tmp/mnist_tpu")
    parser.add_argument("--use_tpu", type=lambda v: v.lower() != "false", default=True)
    parser.add_argument("--batch_size", type=int, default=1024, help="global batch size")
    parser.add_argument("--train_steps", type=int, default=1000)
    parser.add_argument("--eval_steps", type=int, default=0, help="0 evaluates the whole evaluation set")
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--iterations", type=int, default=50, help="steps per device call")
    parser.add_argument("--num_shards", type=int, default=8)
    parser.add_argument("--seed", type=int, default=None, help="RunConfig's tf_random_seed (weights, dropout)")
    args = parser.parse_args(argv)

    run_config = tpu_estimator.RunConfig(
        master=args.tpu, model_dir=args.model_dir, tf_random_seed=args.seed,
        tpu_config=tpu_estimator.TPUConfig(iterations_per_loop=args.iterations, num_shards=args.num_shards))
    estimator = tpu_estimator.TPUEstimator(
        model_fn=model_fn, use_tpu=args.use_tpu, config=run_config, params={"learning_rate": args.learning_rate},
        train_batch_size=args.batch_size, eval_batch_size=args.batch_size, predict_batch_size=args.batch_size)
    estimator.train(input_fn=train_input_fn, max_steps=args.train_steps)
    results = estimator.evaluate(input_fn=eval_input_fn, steps=args.eval_steps or None)
    print("Evaluation results:", results)
    for i, prediction in enumerate(estimator.predict(input_fn=predict_input_fn)):
        print(f"example {i}: class {int(prediction['class_ids'])} "
              f"(p={float(prediction['probabilities'].max()):.3f})")
    return results


if __name__ == "__main__":
    main()
