import logging

import pytest

import keras_tpu
from keras_tpu import _process
from keras_tpu._accelerators import ACCELERATOR_TYPES, accelerator_spec


def test_grpc_address_is_accepted_and_stripped():
    resolver = keras_tpu.TPUClusterResolver(tpu="grpc://10.0.0.2:8470")
    assert resolver.workers == ["10.0.0.2:8470"]
    assert resolver.master() == "grpc://10.0.0.2:8470"
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.2:8470"]}
    assert resolver.num_accelerators() == {"TPU": 8}


@pytest.mark.parametrize("local", [None, "", "local"])
def test_local_names_mean_the_local_tpu(local, monkeypatch):
    for var in ("COLAB_TPU_ADDR", "TPU_NAME", "KERAS_TPU_WORKERS"):
        monkeypatch.delenv(var, raising=False)
    resolver = keras_tpu.TPUClusterResolver(local)
    assert resolver.is_local and resolver.master() == ""
    # One simulated worker, with an address, so that TF code printing the workers runs.
    assert resolver.cluster_spec().as_dict() == {"worker": ["localhost:8470"]}
    assert resolver.cluster_spec().as_dict()["worker"] == ["localhost:8470"]
    assert resolver.cluster_spec().num_tasks("worker") == 1
    assert resolver.num_accelerators() == {"TPU": 8}


def test_colab_and_tpu_name_environment(monkeypatch):
    monkeypatch.delenv("KERAS_TPU_WORKERS", raising=False)
    monkeypatch.setenv("COLAB_TPU_ADDR", "10.1.2.3:8470")
    assert keras_tpu.TPUClusterResolver().master() == "grpc://10.1.2.3:8470"
    monkeypatch.delenv("COLAB_TPU_ADDR")
    monkeypatch.setenv("TPU_NAME", "my-tpu")
    resolver = keras_tpu.TPUClusterResolver()
    assert resolver.tpu == "my-tpu" and resolver.is_local
    assert resolver.cluster_spec().as_dict() == {"worker": ["localhost:8470"]}
    # An explicit argument wins over the environment.
    assert keras_tpu.TPUClusterResolver("grpc://1.1.1.1:1").master() == "grpc://1.1.1.1:1"


def test_accelerator_types_from_public_specs():
    for name, mxus, clock in [("v2-8", 1, 700e6), ("v3-8", 2, 940e6), ("v4-8", 4, 1050e6),
                              ("v5litepod-8", 4, 1500e6)]:
        spec, cores = accelerator_spec(name)
        assert cores == 8 and spec.mxus_per_core == mxus and spec.clock_hz == clock
        assert (spec.mxu_rows, spec.mxu_cols) == (128, 128)
    v2, _ = accelerator_spec("v2-8")
    assert v2.peak_flops_per_core == pytest.approx(22.9e12, rel=0.01)
    assert v2.hbm_bytes_per_core == 8 * 2**30
    # Chip figures published by Google: v3 123 TFLOP/s, v4 275, v5e 197.
    for name, chip_tflops in [("v3-8", 123), ("v4-8", 275), ("v5litepod-8", 197)]:
        spec, _ = accelerator_spec(name)
        assert spec.peak_flops_per_core * spec.cores_per_chip / 1e12 == pytest.approx(chip_tflops, rel=0.01)


def test_unknown_accelerator_type_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        keras_tpu.TPUClusterResolver(accelerator_type="v9-8")
    message = str(info.value)
    assert "v9-8" in message and "v2-8" in message and "v5litepod-8" in message
    with pytest.raises(ValueError):
        accelerator_spec("v2-7")
    assert "v3-8" in ACCELERATOR_TYPES


def keras_tpu_log(caplog, fn, level=logging.INFO):
    """What ``fn()`` logs on the keras_tpu logger (which does not propagate to pytest's handler)."""
    logger = logging.getLogger("keras_tpu")
    logger.addHandler(caplog.handler)
    caplog.clear()
    try:
        with caplog.at_level(level, logger="keras_tpu"):
            result = fn()
    finally:
        logger.removeHandler(caplog.handler)
    return caplog.text, result


def test_initialize_logs_the_tensorflow_lines(caplog, monkeypatch):
    from keras_tpu import _cluster as cluster

    monkeypatch.setattr(_process.STATE, "announced", {})  # as in a fresh process
    text, topology = keras_tpu_log(
        caplog, lambda: keras_tpu.initialize_tpu_system(keras_tpu.TPUClusterResolver("grpc://10.0.0.2:8470")))
    assert "Found TPU system:" in text
    assert "*** Num TPU Cores: 8" in text
    assert "*** Num TPU Workers: 1" in text
    assert "*** Num TPU Cores Per Worker: 8" in text
    assert topology.num_cores == 8 and topology.num_chips == 4 and topology.mxus_per_core == 1
    assert topology.mxu_shape == (128, 128)
    # Every core has a device (how many cores share one device is the core layout's business).
    assert len(topology.layout.core_devices()) == 8 and topology.mesh is not None
    assert "8 cores" in topology.describe()


def test_topology_for_other_generations():
    topology = keras_tpu.initialize_tpu_system(keras_tpu.TPUClusterResolver(accelerator_type="v3-8"))
    assert topology.accelerator_type == "v3-8" and topology.mxus_per_core == 2
    assert topology.hbm_bytes_per_core == 16 * 2**30
    keras_tpu.initialize_tpu_system(keras_tpu.TPUClusterResolver())  # back to the default v2-8


def test_bad_resolver_arguments():
    with pytest.raises(TypeError):
        keras_tpu.TPUClusterResolver(tpu=42)
    with pytest.raises(TypeError):
        keras_tpu.initialize_tpu_system("grpc://x:1")
    with pytest.raises(ValueError):
        keras_tpu.TPUClusterResolver(task_index="first")


def test_pod_workers_from_arguments_and_environment(monkeypatch):
    from_list = keras_tpu.TPUClusterResolver(["grpc://10.0.0.2:8476", "10.0.0.3:8476"], task_index=1)
    from_string = keras_tpu.TPUClusterResolver("10.0.0.2:8476,10.0.0.3:8476", task_index=1)
    for resolver in (from_list, from_string):
        assert resolver.workers == ["10.0.0.2:8476", "10.0.0.3:8476"] and resolver.num_workers == 2
        assert resolver.task_index == 1 and resolver.master() == "grpc://10.0.0.2:8476"
        assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.2:8476", "10.0.0.3:8476"]}
        assert resolver.num_accelerators() == {"TPU": 4}  # a v2-8 over two workers
    monkeypatch.setenv("KERAS_TPU_WORKERS", "h1:1,h2:1,h3:1,h4:1")
    monkeypatch.setenv("KERAS_TPU_TASK_INDEX", "3")
    from_env = keras_tpu.TPUClusterResolver(accelerator_type="v2-32")
    assert from_env.num_workers == 4 and from_env.task_index == 3 and from_env.num_accelerators() == {"TPU": 8}
    # A single TPU address is one worker whatever the environment says about tasks.
    assert keras_tpu.TPUClusterResolver("grpc://10.0.0.2:8470").task_index == 0
    with pytest.raises(ValueError, match="out of range"):
        keras_tpu.TPUClusterResolver(["a:1", "b:1"], task_index=2)


def test_the_found_tpu_system_block_is_logged_once_per_system(caplog, monkeypatch):
    from keras_tpu import _cluster as cluster

    monkeypatch.setattr(_process.STATE, "announced", {})
    resolver = keras_tpu.TPUClusterResolver("grpc://10.0.0.9:8470")

    def notebook():  # the usual TF 2 cell: initialize, then the strategy (which initializes again)
        keras_tpu.experimental_connect_to_cluster(resolver)
        keras_tpu.initialize_tpu_system(resolver)
        keras_tpu.initialize_tpu_system(resolver)
        return keras_tpu.TPUStrategy(resolver)

    text, _ = keras_tpu_log(caplog, notebook)
    assert text.count("Found TPU system:") == 1 and text.count("*** Num TPU Cores: 8") == 1
    assert text.count("Available Device: /job:worker/replica:0/task:0/device:TPU:0") == 1
    again, _ = keras_tpu_log(caplog, lambda: keras_tpu.initialize_tpu_system(resolver), logging.DEBUG)
    assert "Found TPU system" not in again and again.count("\n") <= 1  # at most one short debug line
    assert "already initialized" in again
    # Another TPU (address) is announced once too.
    other, _ = keras_tpu_log(caplog, lambda: keras_tpu.initialize_tpu_system(keras_tpu.TPUClusterResolver("local")))
    assert other.count("Found TPU system:") == 1


def test_shutdown_tpu_system_forgets_the_system_and_the_next_start_logs_it_again(caplog):
    first = keras_tpu.initialize_tpu_system(keras_tpu.TPUClusterResolver())
    keras_tpu.shutdown_tpu_system()
    assert _process.STATE.topology is None
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        again = keras_tpu.initialize_tpu_system(keras_tpu.TPUClusterResolver())
    assert "Found TPU system" in caplog.text and again is not first and again.num_cores == 8
    with pytest.raises(TypeError, match="TPUClusterResolver"):
        keras_tpu.shutdown_tpu_system("grpc://10.0.0.2:8470")
