"""The hooks keras_tpu puts on Keras' classes act only in the thread that asked for them.

``TPUStrategy.scope()`` adopts the models its thread creates, and a core's user-written step makes the
optimizers apply the cores' mean gradients; another thread, doing plain Keras work at the same moment,
must see plain Keras.
"""

import threading

import keras
import numpy as np

import keras_tpu
from keras_tpu import _keras_private
from keras_tpu._placement import installed_on


def _in_thread(fn):
    result = {}

    def run():
        result["value"] = fn()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result["value"]


def _sgd_step(gradient):
    variable = keras.Variable(np.ones(3, "float32"))
    optimizer = keras.optimizers.SGD(learning_rate=1.0)
    optimizer.apply([np.full(3, gradient, "float32")], [variable])
    return np.asarray(variable)


def test_an_optimizer_transform_changes_this_threads_updates_only():
    with _keras_private.optimizers_apply(lambda grads: [2 * g for g in grads]):
        here = _sgd_step(1.0)
        elsewhere = _in_thread(lambda: _sgd_step(1.0))
    after = _sgd_step(1.0)
    np.testing.assert_array_equal(here, [-1.0, -1.0, -1.0])        # 1 - 1.0 * (2 * 1)
    np.testing.assert_array_equal(elsewhere, [0.0, 0.0, 0.0])      # plain SGD
    np.testing.assert_array_equal(after, [0.0, 0.0, 0.0])          # the context is gone


def test_nested_transforms_compose_and_unwind():
    with _keras_private.optimizers_apply(lambda grads: [g + 1 for g in grads]):
        with _keras_private.optimizers_apply(lambda grads: [3 * g for g in grads]):
            np.testing.assert_array_equal(_sgd_step(1.0), [-5.0] * 3)   # (1 + 1) * 3
        np.testing.assert_array_equal(_sgd_step(1.0), [-1.0] * 3)       # 1 + 1


def _small_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])


def test_a_strategy_scope_adopts_only_models_its_own_thread_creates():
    strategy = keras_tpu.TPUStrategy(keras_tpu.TPUClusterResolver(tpu=""))
    with strategy.scope():
        mine = _small_model()
        theirs = _in_thread(_small_model)
    assert installed_on(mine).placement is strategy.placement
    assert installed_on(theirs) is None
    assert installed_on(_small_model()) is None     # after the scope
