"""Keras 3 code as its users write it, on the simulated TPU (issue #15): losses added in call()."""

import contextlib
import logging

import keras
import numpy as np
import pytest

import keras_tpu


class MeanSquareActivity(keras.layers.Layer):
    """A layer that adds a loss in call(), averaged over its rows (as Keras' activity regularizers are)."""

    def call(self, h):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(h)))
        return h


def regularised_model(scope=None):
    keras.utils.set_random_seed(0)
    with scope or contextlib.nullcontext():
        model = keras.Sequential([keras.Input((6,)),
                                  keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.01)),
                                  MeanSquareActivity(), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    return model


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    # 100 rows in batches of 32: three full batches and a partial one of 4 (fewer rows than cores).
    return rng.standard_normal((100, 6)).astype("float32"), rng.standard_normal((100, 2)).astype("float32")


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_losses_added_in_call_are_exact_on_partial_batches(front_end, data, caplog):
    x, y = data
    cpu = regularised_model()
    if front_end == "TPUStrategy":
        tpu = regularised_model(keras_tpu.TPUStrategy(precision="highest").scope())
    else:
        tpu = keras_tpu.keras_to_tpu_model(regularised_model(),
                                           keras_tpu.TPUDistributionStrategy(precision="highest"))
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        got = tpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    want = cpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6)
    for a, b in zip(tpu.get_weights(), cpu.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)
    np.testing.assert_allclose(tpu.evaluate(x, y, batch_size=32, verbose=0),
                               cpu.evaluate(x, y, batch_size=32, verbose=0), rtol=2e-6)
    # The partial batch of 4 rows ran on 4 cores, one row each, with no padding row.
    assert "4 rows do not split evenly over 8" in caplog.text
    assert "adds losses in call()" in caplog.text


def test_models_without_losses_in_call_keep_the_padded_program(data, caplog):
    x, y = data
    keras.utils.set_random_seed(0)
    with keras_tpu.TPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, kernel_regularizer="l2"),
                                  keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    # A weight regularizer does not depend on the rows: one padded program serves every batch.
    assert "adds losses in call()" not in caplog.text
    assert caplog.text.count("Compiled the TPU train program (global batch 32,") == 1


def test_log_lines_start_on_a_line_of_their_own_beside_the_progress_bar(tmp_path):
    """Compile messages (the validation program compiles while the epoch's bar is open) and the weight copy of
    each ModelCheckpoint save are not printed onto the progress bar's line (stdout and stderr merged, as in a
    terminal or a notebook cell)."""
    import subprocess
    import sys

    code = f"""
import keras_tpu, keras, numpy as np
x = np.random.default_rng(0).standard_normal((64, 4)).astype("float32"); y = x[:, :1]
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
tpu = keras_tpu.keras_to_tpu_model(model)
tpu.fit(x, y, batch_size=16, epochs=2, validation_data=(x, y), verbose=1,
        callbacks=[keras.callbacks.ModelCheckpoint({str(tmp_path / "m.weights.h5")!r}, save_weights_only=True)])
"""
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("XLA_FLAGS",)}
    env.update(KERAS_BACKEND="jax", PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    text = result.stdout
    assert "Compiled the TPU test program" in text and "Copying TPU weights to the CPU" in text
    starts = [i for i in range(len(text)) if text.startswith("INFO:keras_tpu:", i)]
    assert starts
    for i in starts:
        assert i == 0 or text[i - 1] == "\n", repr(text[max(0, i - 80):i + 40])
