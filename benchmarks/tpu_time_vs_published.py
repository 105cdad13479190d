"""Predicted TPU step times against published measurements of real Cloud TPUs.

Each workload is rebuilt in Keras 3 as its source describes it, profiled with
``keras_tpu.profile`` (the whole-step model of :mod:`keras_tpu._step_time`) on the
accelerator type, batch and deployment of the measurement, and compared with
the published step time. One model and one set of constants explain them all:
nothing here is fitted per workload.

Workloads and sources:

* ``cifar10_colab``: the README's CIFAR-10 CNN (the classic "Keras on TPU"
  Colab notebook) under ``keras_to_tpu_model`` with NumPy input, global batch
  1024 on a v2-8 reached over the network from Colab (2018-2019); the
  notebook's log: ~6 s per epoch of 50,000 images (49 steps) = ~122 ms/step.
* ``mnist_tpuestimator``: tensorflow/tpu ``tools/colab/mnist_tpuestimator.ipynb``
  (TF 1.13, saved outputs): the notebook's CNN, global batch 256 (32 per core),
  ``iterations_per_loop=234``, ``input_fn`` (tf.data) on the TPU host;
  "global_step/sec: 981.384" = 1.02 ms/step.
* ``mnist_keras_tpustrategy``: tensorflow/tpu ``tools/colab/keras_mnist_tpu.ipynb``
  (TF 2.2, saved outputs): the notebook's CNN under ``TPUStrategy`` on a Colab
  TPU (a remote TPU node), global batch 512 (64 per core), tf.data on the TPU
  host, one step per call (``steps_per_execution`` did not exist in TF 2.2);
  "117/117 - 1s 11ms/step" (epochs 2-10 print 10-11 ms; 11 ms taken).
* ``resnet50_train_v2``: MLPerf Training v0.5 (Dec 2018), Google's
  ``cloud_v2.8`` ResNet-50 v1.5 entry, bf16, global batch 1024: 4,473 images/s
  = 229 ms/step.
* ``resnet50_infer_v3``: MLPerf Inference v0.5 (Nov 2019), Google
  ``tpu-v3.8x1`` ResNet-50 v1.5 Offline: 32,716 samples/s at global batch
  2048 = 62.6 ms/step.
* ``resnet50_train_v3``: the v3-8 training step implied by the MLPerf
  measured v3/v2 ResNet-50 training speed-up of 1.66x (issue #11): 229 / 1.66 =
  138 ms/step (its ratio is the speed-up check, not an independent source).

Two rows are where a constant was chosen (marked "calibrates"): the remote
call's cost (``REMOTE_CALL_S``, from ``mnist_keras_tpustrategy``) and the host's
per-core infeed work (``HOST_INFEED_PER_CORE_S``, from ``mnist_tpuestimator``).
The other rows use those constants and published hardware figures only.

Prints a table (predicted, measured, ratio) and ends with one line
``RESULT {"rows": [...], "v3_over_v2": ...}``.

Usage:
    KERAS_BACKEND=jax python benchmarks/tpu_time_vs_published.py [--workloads a,b,...] [--verbose]
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402

import keras_tpu  # noqa: E402
from keras_tpu.examples.cifar10 import create_model  # noqa: E402

V3_OVER_V2_MEASURED = 1.66  # MLPerf ResNet-50 training, v3-8 over v2-8 (issue #11)


# -- the models, as their sources write them -------------------------------------------------------------------------


def cifar10_notebook_cnn():
    """The classic notebook's CNN (notebooks/cifar10_tpu.ipynb), Adam, sparse labels: the README's demo model."""
    return create_model()


def mnist_tpuestimator_cnn():
    """tools/colab/mnist_tpuestimator.ipynb's model_fn: three convolutions without bias, each with
    BatchNormalization(scale=False) and ReLU, Dense(200) + BN + ReLU + Dropout(0.5), Dense(10);
    softmax cross-entropy on one-hot labels, Adam."""
    from keras import layers

    inp = keras.Input((28 * 28,), name="image")
    y = layers.Reshape((28, 28, 1))(inp)
    for filters, kernel, strides in ((6, 3, 1), (12, 6, 2), (24, 6, 2)):
        y = layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization(scale=False, center=True)(y)
        y = layers.Activation("relu")(y)
    y = layers.Flatten()(y)
    y = layers.Dense(200, use_bias=False)(y)
    y = layers.BatchNormalization(scale=False, center=True)(y)
    y = layers.Activation("relu")(y)
    y = layers.Dropout(0.5)(y)
    logits = layers.Dense(10)(y)
    model = keras.Model(inp, logits, name="mnist_tpuestimator")
    model.compile(keras.optimizers.Adam(0.01), keras.losses.CategoricalCrossentropy(from_logits=True))
    return model


def mnist_keras_cnn():
    """tools/colab/keras_mnist_tpu.ipynb's make_model (TF 2.2): 12/24/32 filters, Dense(200), Dropout(0.4)."""
    from keras import layers

    model = keras.Sequential([keras.Input((28 * 28,)), layers.Reshape((28, 28, 1), name="image")], name="keras_mnist")
    for filters, kernel, strides in ((12, 3, 1), (24, 6, 2), (32, 6, 2)):
        model.add(layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False))
        model.add(layers.BatchNormalization(scale=False, center=True))
        model.add(layers.Activation("relu"))
    model.add(layers.Flatten())
    model.add(layers.Dense(200, use_bias=False))
    model.add(layers.BatchNormalization(scale=False, center=True))
    model.add(layers.Activation("relu"))
    model.add(layers.Dropout(0.4))
    model.add(layers.Dense(10, activation="softmax"))
    model.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy"])
    return model


def resnet50_v15(bfloat16=True, compile_for_training=True):
    """ResNet-50 v1.5 as MLPerf writes it (the stride on the 3x3 convolution of each bottleneck),
    BatchNormalization after every convolution, 1000 classes; SGD with momentum (MLPerf v0.5's
    TPU entry), bfloat16 activations (``mixed_bfloat16``) as the TPU entries ran it."""
    from keras import layers

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16" if bfloat16 else "float32")
    try:
        def bn(x):
            return layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)

        def bottleneck(x, filters, strides, project):
            shortcut = x
            if project:
                shortcut = bn(layers.Conv2D(4 * filters, 1, strides=strides, use_bias=False)(x))
            y = layers.ReLU()(bn(layers.Conv2D(filters, 1, use_bias=False)(x)))
            y = layers.ReLU()(bn(layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False)(y)))
            y = bn(layers.Conv2D(4 * filters, 1, use_bias=False)(y))
            return layers.ReLU()(layers.Add()([y, shortcut]))

        inp = keras.Input((224, 224, 3), name="images")
        x = layers.ReLU()(bn(layers.Conv2D(64, 7, strides=2, padding="same", use_bias=False)(inp)))
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        for stage, (filters, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = bottleneck(x, filters, strides, project=block == 0)
        x = layers.GlobalAveragePooling2D()(x)
        out = layers.Dense(1000, dtype="float32")(x)
        model = keras.Model(inp, out, name="resnet50_v1_5")
    finally:
        keras.config.set_dtype_policy(previous)
    if compile_for_training:
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


# -- the workloads ----------------------------------------------------------------------------------------------------

WORKLOADS = {
    "cifar10_colab": dict(
        build=cifar10_notebook_cnn, accelerator="v2-8", batch=1024, step="train",
        deployment="remote_client_input", steps_per_call=1, input_dtype="float32",
        measured_s=6.0 / 49,
        source="classic Keras-on-TPU CIFAR-10 Colab notebook log: ~6 s/epoch of 50,000 images (49 steps)"),
    "mnist_tpuestimator": dict(
        build=mnist_tpuestimator_cnn, accelerator="v2-8", batch=256, step="train",
        deployment="remote_host_input", steps_per_call=234, input_dtype="float32",
        measured_s=1 / 981.384,
        calibrates="keras_tpu._step_time.HOST_INFEED_PER_CORE_S",
        source="tensorflow/tpu tools/colab/mnist_tpuestimator.ipynb: global_step/sec 981.384"),
    "mnist_keras_tpustrategy": dict(
        build=mnist_keras_cnn, accelerator="v2-8", batch=512, step="train",
        deployment="remote_host_input", steps_per_call=1, input_dtype="float32",
        measured_s=0.011,
        calibrates="keras_tpu._step_time.REMOTE_CALL_S",
        source="tensorflow/tpu tools/colab/keras_mnist_tpu.ipynb (TF 2.2): 117/117 - 1s 11ms/step"),
    "resnet50_train_v2": dict(
        build=resnet50_v15, accelerator="v2-8", batch=1024, step="train",
        deployment="remote_host_input", steps_per_call=100, input_dtype="bfloat16",
        measured_s=1024 / 4473,
        source="MLPerf Training v0.5, Google cloud_v2.8 ResNet-50: 4,473 images/s"),
    "resnet50_infer_v3": dict(
        build=lambda: resnet50_v15(compile_for_training=False), accelerator="v3-8", batch=2048, step="inference",
        deployment="remote_host_input", steps_per_call=100, input_dtype="bfloat16",
        measured_s=2048 / 32716,
        source="MLPerf Inference v0.5, Google tpu-v3.8x1 ResNet-50 Offline: 32,716 samples/s"),
    "resnet50_train_v3": dict(
        build=resnet50_v15, accelerator="v3-8", batch=1024, step="train",
        deployment="remote_host_input", steps_per_call=100, input_dtype="bfloat16",
        measured_s=1024 / 4473 / V3_OVER_V2_MEASURED,
        source="MLPerf v0.5 ResNet-50 training, v3-8 = v2-8 x 1.66 (the measured speed-up, issue #11)"),
}


def run(names, verbose=False):
    rows, reports = [], {}
    for name in names:
        spec = WORKLOADS[name]
        keras.utils.set_random_seed(0)
        started = time.perf_counter()
        model = spec["build"]()
        report = keras_tpu.profile(model, batch_size=spec["batch"], accelerator_type=spec["accelerator"],
                                   deployment=spec["deployment"], steps_per_execution=spec["steps_per_call"],
                                   input_dtype=spec["input_dtype"], advise=False)
        predicted = report.step_time(spec["step"])
        reports[name] = report
        rows.append({"workload": name, "accelerator": spec["accelerator"], "global_batch": spec["batch"],
                     "predicted_s": predicted, "measured_s": spec["measured_s"],
                     "ratio": predicted / spec["measured_s"], "bound": report.bound(spec["step"]),
                     "mxu_only_s": report.mxu_time(spec["step"]), "source": spec["source"],
                     "calibrates": spec.get("calibrates", "")})
        if verbose:
            print(report.summary(spec["step"]), file=sys.stderr)
            print(f"  ({time.perf_counter() - started:.0f} s to profile)", file=sys.stderr)
    return rows, reports


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    rows, _ = run(args.workloads.split(","), args.verbose)
    print(f"{'workload':26s} {'TPU':6s} {'batch':>6s} {'MXU-only ms':>11s} {'predicted ms':>12s} "
          f"{'measured ms':>11s} {'ratio':>6s}  bound")
    for r in rows:
        print(f"{r['workload']:26s} {r['accelerator']:6s} {r['global_batch']:6d} {r['mxu_only_s'] * 1e3:11.2f} "
              f"{r['predicted_s'] * 1e3:12.2f} {r['measured_s'] * 1e3:11.2f} {r['ratio']:6.2f}  {r['bound']}"
              + (f"  (calibrates {r['calibrates']})" if r["calibrates"] else ""))
    by_name = {r["workload"]: r for r in rows}
    v3_over_v2 = None
    if "resnet50_train_v2" in by_name and "resnet50_train_v3" in by_name:
        v3_over_v2 = by_name["resnet50_train_v2"]["predicted_s"] / by_name["resnet50_train_v3"]["predicted_s"]
        print(f"ResNet-50 training, v3-8 over v2-8: predicted {v3_over_v2:.2f}x, measured {V3_OVER_V2_MEASURED}x")
    result = {"rows": [{k: r[k] for k in ("workload", "predicted_s", "measured_s", "ratio")} for r in rows],
              "v3_over_v2": v3_over_v2}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
