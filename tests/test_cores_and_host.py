"""Part 3: eight cores on any host."""

import jax
import pytest

from keras_tpu._cores import CoreLayout
from tests.conftest import run_python


def test_one_process_holds_its_eight_cores_on_one_device():
    # One copy of the weights and no cross-device collective to wait on (see keras_tpu/_cores.py).
    layout = CoreLayout(8)
    assert layout.num_devices == 1 and layout.cores_per_device == 8
    assert layout.sub_layout(1).num_cores == 1 and layout.sub_layout(4).cores_per_device == 4


def test_collectives_are_the_same_whatever_the_device_count():
    # Experiments may lay the cores over several devices of one process; JAX is asked for them first.
    code = """
import jax, jax.numpy as jnp, numpy as np
import keras_tpu
from keras_tpu._cores import CoreLayout
def core_fn(x):
    return (x * 0 + layout.core_index(), layout.psum(jnp.sum(x)), layout.pmean(jnp.sum(x)),
            layout.all_gather(x[:1]))
x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
for num_devices in (1, 2, 4, 8):
    layout = CoreLayout(8, devices=jax.devices()[:num_devices])
    run = jax.jit(layout.per_core(core_fn, sharded_args=(True,), sharded_outputs=(True, False, False, False)))
    index, total, mean, gathered = run(x)
    assert np.asarray(index)[:, 0].tolist() == np.repeat(np.arange(8), 2).tolist()
    assert float(total) == x.sum() and abs(float(mean) - x.sum() / 8) < 1e-3
    assert np.asarray(gathered).tolist() == x[::2].tolist()  # first row of each core, core order
    print("DEVICES", layout.num_devices, "CORES PER DEVICE", layout.cores_per_device, "OK")
"""
    result = run_python(code, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert result.returncode == 0, result.stderr
    for per_device in (8, 4, 2, 1):
        assert f"DEVICES {8 // per_device} CORES PER DEVICE {per_device} OK" in result.stdout


@pytest.mark.slow
def test_a_keras_model_trains_the_same_on_one_two_or_eight_devices():
    # Layouts of several devices bound the programs in flight (CoreLayout.max_programs_in_flight) while each
    # step donates the state of the one before.
    code = """
import jax, numpy as np
import keras_tpu
from keras_tpu._cores import CoreLayout
from keras_tpu._replicated_steps import ReplicatedSteps
from tests.tpu_helpers import classification_data, small_classifier
x, y = classification_data(256)
for count in (1, 2, 8):
    model = small_classifier()
    steps = ReplicatedSteps(model, CoreLayout(8, devices=jax.devices()[:count]), "default")
    model.train_function = steps.train_function(1)
    model.make_train_function = lambda force=False: None
    losses = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history["loss"]
    print("DEVICES", count, "LOSSES", [round(v, 5) for v in losses])
"""
    result = run_python(code, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert result.returncode == 0, result.stderr[-3000:]
    losses = {line.split(" LOSSES ")[0]: line.split(" LOSSES ")[1] for line in result.stdout.splitlines()
              if line.startswith("DEVICES")}
    assert set(losses) == {"DEVICES 1", "DEVICES 2", "DEVICES 8"}
    assert len(set(losses.values())) == 1, losses


def test_cores_that_cannot_be_spread_evenly_are_refused():
    with pytest.raises(ValueError, match="evenly"):
        CoreLayout(8, devices=jax.devices()[:1] * 3)


@pytest.mark.slow
def test_jax_started_with_one_device_before_keras_tpu():
    code = """
import logging, jax, jax.numpy as jnp, numpy as np
jnp.ones(3).block_until_ready()           # the backend is running with 1 CPU device
import keras_tpu
from keras_tpu._cores import CoreLayout
layout = CoreLayout(8)
def core_fn(x):
    return layout.core_index() + 0 * x, layout.psum(jnp.sum(x))
run = jax.jit(layout.per_core(core_fn, (True,), (True, False)))
index, total = run(np.ones((16, 2), np.float32))
print("DEVICES", len(jax.devices()), "CPD", layout.cores_per_device, "TOTAL", float(total))
print("INDEX", np.asarray(index)[::2, 0].astype(int).tolist())
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "DEVICES 1 CPD 8 TOTAL 32.0" in result.stdout
    assert "INDEX [0, 1, 2, 3, 4, 5, 6, 7]" in result.stdout


@pytest.mark.slow
def test_importing_keras_tpu_leaves_jax_one_device_and_a_thread_pool_the_size_of_the_host():
    # Eight virtual devices would give XLA:CPU an eight-thread pool on a two-core host (see keras_tpu/_host.py).
    code = """
import os, keras_tpu, jax, jax.numpy as jnp
(jnp.ones((256, 256)) @ jnp.ones((256, 256))).block_until_ready()
pool = sum(open(f"/proc/self/task/{t}/comm").read().startswith("tf_XLAEigen") for t in os.listdir("/proc/self/task"))
print("DEVICES", len(jax.devices()), "POOL AT MOST CORES", pool <= max(os.cpu_count(), 1))
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "DEVICES 1 POOL AT MOST CORES True" in result.stdout
    # A user who asks for more devices gets them.
    result = run_python("import keras_tpu, jax; print('DEVICES', len(jax.devices()))",
                        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert "DEVICES 8" in result.stdout, result.stderr


def test_importing_keras_tpu_has_xla_compile_at_llvm_o2_unless_the_flags_set_a_level():
    # Keras' own programs (a model's weight initializers) compile at -O2 like keras-tpu's (see
    # keras_tpu._host.quicker_code_generation); XLA reads the level from XLA_FLAGS when JAX's backend starts.
    code = """
import os, keras_tpu, keras
keras.layers.Dense(3).build((None, 5))   # Keras' initializer programs: JAX's backend has started
from jax._src.lib import xla_client
level = xla_client.CompileOptions().executable_build_options.debug_options.xla_backend_optimization_level
print("LEVEL", level, "FLAGS", os.environ["XLA_FLAGS"])
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "LEVEL 2 FLAGS --xla_backend_optimization_level=2" in result.stdout
    # A level the user sets is kept, and so are the user's other flags.
    result = run_python(code, env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_backend_optimization_level=3"})
    assert "LEVEL 3 FLAGS --xla_cpu_enable_fast_math=false --xla_backend_optimization_level=3" in result.stdout, \
        result.stderr
    result = run_python(code, env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert "LEVEL 2 FLAGS --xla_cpu_enable_fast_math=false --xla_backend_optimization_level=2" in result.stdout, \
        result.stderr


def test_a_large_gradient_leaves_the_training_program_as_its_own_buffer_and_steps_run_alone(monkeypatch):
    # XLA:CPU maps a program's temporaries afresh for each run: a large gradient (an embedding table's) held
    # there faults in again at every step. The training program returns it instead, in a buffer the host's
    # allocator reuses, and runs one step at a time (two in flight would hold two); the numbers are the CPU's.
    import re

    import keras
    import numpy as np

    import keras_tpu
    from keras_tpu._placement import installed_on
    from tests.tpu_helpers import assert_weights_close

    queued = programs_in_flight_per_call(monkeypatch)

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,), dtype="int32"), keras.layers.Embedding(20_000, 64),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 20_000, (200, 8)).astype("int32"), rng.integers(0, 2, (200,))
    cpu, tpu = build(), keras_tpu.keras_to_tpu_model(build(), keras_tpu.TPUDistributionStrategy(precision="highest"))
    np.testing.assert_allclose(tpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"],
                               cpu.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"],
                               rtol=1e-5)
    assert_weights_close(tpu.get_weights(), cpu.get_weights(), atol=1e-6)
    assert max(queued[1:]) == 1  # (the first step finds out)
    program = installed_on(tpu).steps.last_programs["train"]
    assert program._in_flight.limit == 1
    for executable in program._executables.values():  # (a full batch's program and the last one's)
        layout = re.search(r"entry_computation_layout=\{\((.*)\)->\((.*)\)\}", executable.as_text()).group(2)
        assert layout.count("f32[20000,64]") == 4, layout  # the table and Adam's two slots, and its gradient


@pytest.mark.slow
def test_keras_on_another_backend_is_refused_with_instructions():
    result = run_python("import keras_tpu", env={"KERAS_BACKEND": "torch"})
    assert result.returncode != 0
    assert "KERAS_BACKEND=jax" in result.stderr


def programs_in_flight_per_call(monkeypatch):
    """A list that gets, at each program dispatched, how many programs are then in flight."""
    from keras_tpu import _cores

    queued = []
    original_add = _cores.ProgramsInFlight.add

    def add(self, outputs):
        original_add(self, outputs)
        queued.append(len(self))

    monkeypatch.setattr(_cores.ProgramsInFlight, "add", add)
    return queued


def test_a_fit_keeps_at_most_two_programs_in_flight(monkeypatch):
    # Queued programs hold their batches: a long fit() must wait for its older steps (the MLP zoo model's peak
    # memory 720 -> 614 MiB), however fast the host dispatches them.
    import keras_tpu
    from tests.tpu_helpers import classification_data, small_classifier

    queued = programs_in_flight_per_call(monkeypatch)
    x, y = classification_data(512)
    model = keras_tpu.keras_to_tpu_model(small_classifier())
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert len(queued) == 512 // 32 and max(queued) == 2
    assert CoreLayout(8).max_programs_in_flight == 2
