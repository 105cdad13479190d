"""Eight simulated cores in the memory of one (issue #16): the replicated state exists once on this host."""

import ctypes
import ctypes.util
import gc
import os
import sys

import jax
import keras
import numpy as np
import pytest

import keras_tpu
from keras_tpu import _host as host


def live_bytes():
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_training_on_eight_cores_keeps_one_copy_of_the_weights_and_optimizer_slots(monkeypatch):
    from keras_tpu import _rounded_weights

    copies = []  # the rounded copies the products read (float32 ones on a host whose products multiply float32)
    round_weights = _rounded_weights.round_weights

    def recording(*args):
        made = round_weights(*args)
        copies.append(sum(a.nbytes for a in made))
        return made

    monkeypatch.setattr(_rounded_weights, "round_weights", recording)
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
    # Weights, optimizer slots and metrics once (not eight times), within 10% for the odd scalar; and one set of
    # the weights' rounded copies, if the steps read them (each step returns those of the weights it wrote).
    assert len(copies) <= 1
    assert state <= held < 1.1 * state + sum(copies), (held, state, copies)


def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux") or host._malloc_trim() is None, reason="glibc only")
def test_freed_c_heap_goes_back_to_the_system():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(8192) for _ in range(20000)]  # 160 MiB of small blocks, as a compiler's scratch
    for block in blocks:
        ctypes.memset(block, 1, 8192)
    kept = blocks[::100]  # one block in each 800 KiB stays: glibc cannot shrink its heap from the top
    for block in blocks:
        if block not in kept:
            libc.free(block)
    before = resident_mib()
    assert host.release_freed_memory()
    after = resident_mib()
    for block in kept:
        libc.free(block)
    assert before - after > 100, (before, after)


def test_every_compile_gives_the_compilers_scratch_back(monkeypatch):
    calls = []
    release = host.release_freed_memory
    monkeypatch.setattr(host, "release_freed_memory", lambda: calls.append(1) or release())
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile("sgd", "mse")
    tpu = keras_tpu.keras_to_tpu_model(model)
    x, y = np.ones((64, 8), "float32"), np.ones((64, 4), "float32")
    tpu.fit(x, y, batch_size=64, verbose=0)
    assert len(calls) == 1
    tpu.evaluate(x, y, batch_size=64, verbose=0)
    tpu.evaluate(x, y, batch_size=64, verbose=0)  # compiled already
    assert len(calls) == 2


class _RecordsTheCollector(keras.layers.Layer):
    """A layer that records, each time its ``call`` runs (it runs when a program is traced), whether Python's
    garbage collector is enabled."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def call(self, x):
        self.seen.append(gc.isenabled())
        return x


def test_programs_are_traced_and_compiled_with_the_garbage_collector_paused():
    recorder = _RecordsTheCollector()
    model = keras.Sequential([keras.Input((8,)), recorder, keras.layers.Dense(4)])
    model.compile("sgd", "mse", metrics=["mae"])
    tpu = keras_tpu.keras_to_tpu_model(model)
    x, y = np.ones((64, 8), "float32"), np.ones((64, 4), "float32")
    tpu.evaluate(x, y, batch_size=64, verbose=0)  # (Keras' own symbolic build traces the model first: not ours)
    assert gc.isenabled()
    for run in (lambda: tpu.fit(x, y, batch_size=64, verbose=0), lambda: tpu.evaluate(x, y, batch_size=32, verbose=0),
                lambda: tpu.predict(x, batch_size=64, verbose=0)):
        recorder.seen.clear()
        run()
        assert recorder.seen and not any(recorder.seen), recorder.seen  # every trace of its programs
        assert gc.isenabled()  # and enabled again after them

    strategy = keras_tpu.TPUStrategy(keras_tpu.TPUClusterResolver(tpu="local"))
    with strategy.scope():
        layer = _RecordsTheCollector()
        dense = keras.layers.Dense(4)
        dense.build((None, 8))

    def replica_fn(x):
        return dense(layer(x))

    for _ in range(2):
        strategy.run(replica_fn, args=(np.ones((8, 8), "float32"),))
    assert layer.seen and not any(layer.seen), layer.seen  # traced once, the collector paused
    assert gc.isenabled()

    gc.disable()  # a collector its user disabled stays disabled
    try:
        with host.collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
