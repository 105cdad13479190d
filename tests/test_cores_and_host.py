"""Part 3: eight cores on any host."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keras_tpu._cores import CoreLayout
from tests.conftest import run_python


def _core_program(layout):
    def core_fn(x):
        index = layout.core_index()
        total = layout.psum(jnp.sum(x))
        mean = layout.pmean(jnp.sum(x))
        gathered = layout.all_gather(x[:1])
        return x * 0 + index, total, mean, gathered
    return jax.jit(layout.per_core(core_fn, sharded_args=(True,), sharded_outputs=(True, False, False, False)))


def test_one_process_holds_its_eight_cores_on_one_device():
    # One copy of the weights and no cross-device collective to wait on (see keras_tpu/_cores.py).
    layout = CoreLayout(8)
    assert layout.num_devices == 1 and layout.cores_per_device == 8
    assert layout.sub_layout(1).num_cores == 1 and layout.sub_layout(4).cores_per_device == 4


@pytest.mark.parametrize("num_devices", [1, 2, 4, 8])
def test_collectives_are_the_same_whatever_the_device_count(num_devices):
    layout = CoreLayout(8, devices=jax.devices()[:num_devices])
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    index, total, mean, gathered = _core_program(layout)(x)
    np.testing.assert_array_equal(np.asarray(index)[:, 0], np.repeat(np.arange(8), 2))
    assert float(total) == x.sum()
    assert float(mean) == pytest.approx(x.sum() / 8)
    np.testing.assert_array_equal(np.asarray(gathered), x[::2])  # first row of each core, core order


def test_cores_that_cannot_be_spread_evenly_are_refused():
    with pytest.raises(ValueError, match="evenly"):
        CoreLayout(8, devices=jax.devices()[:3])


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
def test_importing_keras_tpu_first_gives_eight_devices_in_a_fresh_process():
    result = run_python("import keras_tpu, jax; print('DEVICES', len(jax.devices()))")
    assert result.returncode == 0, result.stderr
    assert "DEVICES 8" in result.stdout


@pytest.mark.slow
def test_keras_on_another_backend_is_refused_with_instructions():
    result = run_python("import keras_tpu", env={"KERAS_BACKEND": "torch"})
    assert result.returncode != 0
    assert "KERAS_BACKEND=jax" in result.stderr
