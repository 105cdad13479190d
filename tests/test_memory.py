"""Eight simulated cores in the memory of one (issue #16): the replicated state exists once on this host."""

import gc

import jax
import keras
import numpy as np

import keras_tpu


def live_bytes():
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_training_on_eight_cores_keeps_one_copy_of_the_weights_and_optimizer_slots():
    x = np.random.default_rng(0).standard_normal((256, 512)).astype("float32")
    y = np.zeros((256, 1), "int32")
    before = live_bytes()
    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])
    model.compile(keras.optimizers.Adam(), "sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)
    state = sum(v.value.nbytes for v in model.variables + model.optimizer.variables)  # 19 MB
    tpu = keras_tpu.keras_to_tpu_model(model)
    assert tpu.strategy.num_cores == 8
    tpu.fit(x, y, batch_size=256, epochs=2, verbose=0)
    held = live_bytes() - before
    # Weights, optimizer slots and metrics once (not eight times), within 10% for the odd scalar.
    assert state <= held < 1.1 * state, (held, state)
