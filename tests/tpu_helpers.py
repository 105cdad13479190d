"""Small models and data shared by the TPU-model tests."""

import re

import jax
import keras
import numpy as np

import keras_tpu
from keras_tpu import _rounded_weights


def small_classifier(seed=0, optimizer=None, **compile_kwargs):
    """A row-independent model (no BatchNormalization, no Dropout): TPU training must match the CPU."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=compile_kwargs.pop("metrics", ["sparse_categorical_accuracy"]), **compile_kwargs)
    return model


def small_cnn(seed=0):
    """Two convolution blocks (convolution, ReLU, max pooling) and a 10-logit head on 16x16x3 images: XLA:CPU fuses
    its forward pass, reductions included, into one YNNPACK kernel, as it does the README's CIFAR-10 CNN's."""
    layers = keras.layers
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((16, 16, 3)), layers.Conv2D(32, 3, padding="same", activation="relu"),
                              layers.MaxPooling2D(), layers.Conv2D(32, 3, padding="same", activation="relu"),
                              layers.MaxPooling2D(), layers.Flatten(), layers.Dense(10)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def classification_data(rows=200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 6)).astype("float32")
    y = (x[:, :3].argmax(axis=1)).reshape(-1, 1)
    return x, y


def on_tpu(model, precision="highest", **kwargs):
    return keras_tpu.keras_to_tpu_model(model, keras_tpu.TPUDistributionStrategy(precision=precision, **kwargs))


def assert_weights_close(first, second, atol):
    assert len(first) == len(second)
    for a, b in zip(first, second):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)


_COMPILED = re.compile(r"Compiled the TPU (\w+) program \(global batch (\d+)(?:, (\d+) real rows)?, (\d+) step\(s\)")


def compiled_programs(caplog):
    """The TPU programs compiled while ``caplog`` recorded, from the log lines a user sees:
    a list of ``(mode, global_batch, steps_per_call)``."""
    found = []
    for record in caplog.records:
        match = _COMPILED.search(record.getMessage())
        if match:
            found.append((match.group(1), int(match.group(2)), int(match.group(4))))
    return found


class WithoutWeightCopies(_rounded_weights.ReadingRoundedWeights):
    """For monkeypatching ``_rounded_weights.reading_rounded_weights``: no copies, every product rounds the
    float32 weight it reads (as before copies existed)."""

    def copies_to_make(self, state, *rest, axis_env=None):
        return False, [], []

    def without_copies(self, state, *rest, transform=None):
        closed, out_shape = jax.make_jaxpr(self.fn, return_shape=True)(state, *rest)
        closed = closed if transform is None else transform(closed)
        return jax.tree.unflatten(jax.tree.structure(out_shape),
                                  jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves((state, *rest))))


def record_weight_copies(monkeypatch):
    """The shapes of the copies each round_weights call makes, as a list that fills as they are made."""
    copied = []
    original = _rounded_weights.round_weights

    def recording(trainable, positions=None, dtypes=None):
        copies = original(trainable, positions, dtypes)
        copied.append([a.shape for a in copies])
        return copies

    monkeypatch.setattr(_rounded_weights, "round_weights", recording)
    return copied


def written_shapes(compiled_text):
    """The shapes of the values the entry computation of an optimised HLO module (``Compiled.as_text()``)
    writes out, e.g. ``["f32[256,64]", ...]``."""
    entry = compiled_text[compiled_text.index("\nENTRY"):]
    return re.findall(r"^\s*(?:ROOT )?%\S+ = (\w+\[[\d,]*\])", entry, flags=re.M)
