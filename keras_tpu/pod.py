"""TPU pods: several worker processes forming one TPU, on JAX's own multi-process runtime.

Each worker is one process (one host of a pod slice) simulating
``KERAS_TPU_CORES_PER_WORKER`` cores (8 by default). The first worker's
``host:port`` is the coordinator of ``jax.distributed``; cross-core
collectives between processes run over gloo (JAX's CPU collectives). Every
worker runs the same script on the same data: the global batch stays the
global batch, and each worker feeds only the rows that belong to its cores.
Weights stay identical on every worker, and files (weights, checkpoints,
exports) are written by the first worker only. Workers shuffle alike: when
the pod starts they seed NumPy's and Python's global random generators (which
Keras' data adapters use) with the first worker's seed.

If a worker dies, the others notice within the heartbeat timeout
(:data:`HEARTBEAT_TIMEOUT_S`) or as soon as a collective fails, and stop with
an error; restarting all workers resumes from the last checkpoint.
"""

import os
import random

import jax
import numpy as np

from keras_tpu._logging import logger

#: Seconds without a heartbeat after which the coordinator declares a worker dead.
HEARTBEAT_TIMEOUT_S = int(os.environ.get("KERAS_TPU_HEARTBEAT_TIMEOUT", "10"))


class WorkerLostError(RuntimeError):
    """Raised when a TPU worker (process) of a pod stopped."""


def workers_from_environment():
    """``(workers, task_index)`` from ``KERAS_TPU_WORKERS`` and ``KERAS_TPU_TASK_INDEX``."""
    workers = [w.strip() for w in os.environ.get("KERAS_TPU_WORKERS", "").split(",") if w.strip()]
    workers = [w[len("grpc://"):] if w.startswith("grpc://") else w for w in workers]
    return workers, int(os.environ.get("KERAS_TPU_TASK_INDEX", "0"))


_started = None


def start(workers, task_index):
    """Join the pod: start (or connect to) JAX's multi-process runtime. Safe to call again.

    Must run before JAX starts its backend (importing keras_tpu with
    ``KERAS_TPU_WORKERS`` set does it then).
    """
    global _started
    key = (tuple(workers), int(task_index))
    if _started is not None:
        if _started != key:
            raise RuntimeError(f"This process already joined the pod {_started[0]} as task {_started[1]}; "
                               f"it cannot join {list(workers)} as task {task_index}.")
        return
    if len(workers) < 2:
        return
    if not 0 <= task_index < len(workers):
        raise ValueError(f"Task index {task_index} is out of range for {len(workers)} workers.")
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=workers[0], num_processes=len(workers),
                                   process_id=int(task_index), heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                                   initialization_timeout=120)
    except RuntimeError as error:
        if "before" in str(error) or "already" in str(error):
            raise RuntimeError(
                "A TPU pod must be joined before JAX starts: set KERAS_TPU_WORKERS (and KERAS_TPU_TASK_INDEX) "
                "before `import keras_tpu`, or call keras_tpu.initialize_tpu_system(resolver) before building "
                "any model or JAX array.") from error
        raise
    _started = key
    _agree_on_host_seed()
    logger.info("Joined the TPU pod as worker %d of %d (coordinator %s).", task_index, len(workers), workers[0])


def _agree_on_host_seed():
    from jax.experimental import multihost_utils

    proposal = np.int64(np.random.SeedSequence().entropy % (2**31))
    seed = int(multihost_utils.broadcast_one_to_all(proposal))
    np.random.seed(seed)
    random.seed(seed)


def is_multi_worker():
    return jax.process_count() > 1


def num_workers():
    return jax.process_count()


def is_chief():
    """Whether this process writes files (the first worker)."""
    return jax.process_index() == 0


def to_host(tree):
    """Arrays that may span several processes, as host NumPy arrays with their full global value."""
    from jax.experimental import multihost_utils

    def fetch(a):
        if not isinstance(a, jax.Array) or a.is_fully_addressable or a.is_fully_replicated:
            return np.asarray(a.addressable_data(0) if isinstance(a, jax.Array) and not a.is_fully_addressable
                              else a)
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(fetch, tree)


def global_array(value, sharding):
    """Place a value that every process holds in full (the same everywhere) onto ``sharding``;
    each process transfers only the rows of its own devices."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def barrier(name):
    """Wait until every worker of the pod reaches this point (a no-op on one worker)."""
    if is_multi_worker():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)

