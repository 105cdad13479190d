"""Prepare this process before JAX starts: Keras on JAX, virtual devices, and a pod's runtime.

``keras_tpu`` runs :func:`prepare_host` when it is imported: Keras must use
its JAX backend, a pod's workers must join JAX's multi-process runtime
before its backend starts, and JAX is asked for one virtual CPU device per
simulated core (experiments may lay the cores over several devices of one
process, see :class:`keras_tpu._cores.CoreLayout`). The default layout needs
only one device per process (:func:`devices_for_cores`), so nothing is lost
if JAX was already running when ``keras_tpu`` was imported.
"""

import os
import re
import sys

from keras_tpu import _process
from keras_tpu._logging import logger

#: Cores per worker (one host of a TPU board); a pod test may use fewer.
DEFAULT_CORES_PER_WORKER = 8


def cores_per_worker():
    """The number of TPU cores this process simulates (``KERAS_TPU_CORES_PER_WORKER``, default 8)."""
    raw = os.environ.get("KERAS_TPU_CORES_PER_WORKER", str(DEFAULT_CORES_PER_WORKER))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"KERAS_TPU_CORES_PER_WORKER must be a positive integer; got {raw!r}."
        ) from None
    if value < 1:
        raise ValueError(f"KERAS_TPU_CORES_PER_WORKER must be >= 1; got {value}.")
    return value


def _require_keras_on_jax():
    requested = os.environ.get("KERAS_BACKEND")
    if "keras" in sys.modules:
        import keras

        active = keras.backend.backend()
        if active != "jax":
            raise ImportError(
                f"keras_tpu runs Keras on its JAX backend, but Keras was imported with the "
                f"{active!r} backend. Set the environment variable KERAS_BACKEND=jax before "
                f"Python starts (or import keras_tpu before keras)."
            )
        return
    if requested not in (None, "", "jax"):
        raise ImportError(
            f"keras_tpu runs Keras on its JAX backend, but KERAS_BACKEND={requested!r}. "
            f"Unset it or set KERAS_BACKEND=jax."
        )
    os.environ["KERAS_BACKEND"] = "jax"


def _xla_flag_device_count():
    match = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(match.group(1)) if match else None


def _request_virtual_devices(count):
    """Ask JAX for ``count`` CPU devices. Returns False if JAX has already started."""
    import jax

    current = jax.config.jax_num_cpu_devices
    flagged = _xla_flag_device_count()
    if current >= count or (current < 0 and flagged is not None and flagged >= count):
        return True  # the user already arranged enough devices
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        return False
    return True


def prepare_host():
    """Make Keras use JAX and give JAX one virtual CPU device per simulated core.

    Called on ``import keras_tpu``; safe to call again.

    Example:
        >>> from keras_tpu import _host as host
        >>> host.prepare_host()
    """
    _require_keras_on_jax()
    if _process.STATE.devices_requested is None:
        _process.STATE.devices_requested = _request_virtual_devices(cores_per_worker())
        if not _process.STATE.devices_requested:
            logger.debug("JAX was already running when keras_tpu was imported.")
        from keras_tpu import _pod as pod

        workers, task_index = pod.workers_from_environment()
        pod.heartbeat_timeout_s()  # read again when a pod is joined; a malformed value is reported now
        pod.startup_timeout_s()
        if len(workers) > 1:
            pod.start(workers, task_index)


def devices_for_cores(num_cores):
    """The JAX devices that hold ``num_cores`` simulated cores: one per process.

    One process holds all its cores on one device (see :mod:`keras_tpu._cores`
    for why); in a pod every worker process contributes its first device,
    in worker order, and the cores are spread evenly over the workers.

    Example:
        >>> devices = devices_for_cores(8)
        >>> len(devices)
        1
    """
    import jax

    if jax.process_count() > 1:  # a pod: one device of each worker, in worker order
        first = {}
        for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
            first.setdefault(device.process_index, device)
        devices = [first[p] for p in sorted(first)]
        if num_cores % len(devices):
            raise ValueError(f"The pod has {len(devices)} workers, which cannot hold {num_cores} cores evenly; "
                             f"set KERAS_TPU_CORES_PER_WORKER to the cores of each worker.")
        return devices
    return jax.local_devices()[:1]
