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
(:func:`heartbeat_timeout_s`) or as soon as a collective fails, and stop with
an error; restarting all workers resumes from the last checkpoint. A worker
that never joins (dead before it started, or unreachable) stops the others
with :class:`WorkerLostError` after the start-up timeout (:func:`startup_timeout_s`).
"""

import os
import random
import threading
import zlib

import jax
import numpy as np

from keras_tpu import _process, _validation as validation
from keras_tpu._logging import logger

def heartbeat_timeout_s():
    """Seconds without a heartbeat after which the coordinator declares a worker dead
    (``KERAS_TPU_HEARTBEAT_TIMEOUT``, 10 by default; read when the pod is joined)."""
    return validation.check_environment_integer(
        "KERAS_TPU_HEARTBEAT_TIMEOUT", os.environ.get("KERAS_TPU_HEARTBEAT_TIMEOUT", "10"))


def startup_timeout_s():
    """Seconds a worker waits for every worker of the pod to join it (``KERAS_TPU_STARTUP_TIMEOUT``,
    120 by default; read when the pod is joined)."""
    return validation.check_environment_integer(
        "KERAS_TPU_STARTUP_TIMEOUT", os.environ.get("KERAS_TPU_STARTUP_TIMEOUT", "120"))


class WorkerLostError(RuntimeError):
    """Raised when a TPU worker (process) of a pod stopped.

    Every worker's step fails with it; restart all workers, and training resumes from the last checkpoint.

    Example:
        >>> try:                                                            # doctest: +SKIP
        ...     tpu_model.fit(x, y, epochs=10, callbacks=[keras.callbacks.BackupAndRestore("backup")])
        ... except keras_tpu.WorkerLostError as error:
        ...     print("restart the pod's workers:", error)
    """


def workers_from_environment():
    """``(workers, task_index)`` from ``KERAS_TPU_WORKERS`` and ``KERAS_TPU_TASK_INDEX``."""
    raw = os.environ.get("KERAS_TPU_WORKERS", "")
    if not raw.strip():
        return [], 0
    workers = validation.check_worker_list(raw.strip().rstrip(",").split(","), "KERAS_TPU_WORKERS")
    task_index = validation.check_task_index(os.environ.get("KERAS_TPU_TASK_INDEX", "0"), len(workers),
                                             "KERAS_TPU_TASK_INDEX")
    return workers, task_index


def start(workers, task_index):
    """Join the pod: start (or connect to) JAX's multi-process runtime. Safe to call again.

    Must run before JAX starts its backend (importing keras_tpu with
    ``KERAS_TPU_WORKERS`` set does it then).
    """
    key = (tuple(workers), int(task_index))
    joined = _process.STATE.pod
    if joined is not None:
        if joined != key:
            raise RuntimeError(f"This process already joined the pod {list(joined[0])} as task {joined[1]} "
                               f"(from KERAS_TPU_WORKERS/KERAS_TPU_TASK_INDEX or an earlier resolver); it cannot "
                               f"join {list(workers)} as task {task_index}. Give the resolver the same workers and "
                               f"task index, or TPUClusterResolver() with none to use the environment's.")
        return
    if len(workers) < 2:
        return
    if not 0 <= task_index < len(workers):
        raise ValueError(f"Task index {task_index} is out of range for {len(workers)} workers.")
    heartbeat, startup = heartbeat_timeout_s(), startup_timeout_s()
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's own limit is a backstop (it ends the process without naming anyone): _join_within's comes first.
        _join_within(startup, workers, task_index, lambda: jax.distributed.initialize(
            coordinator_address=workers[0], num_processes=len(workers), process_id=int(task_index),
            heartbeat_timeout_seconds=heartbeat, initialization_timeout=startup + 60))
    except WorkerLostError:
        raise
    except RuntimeError as error:
        if "before" in str(error) or "already" in str(error):
            raise RuntimeError(
                "A TPU pod must be joined before JAX starts: set KERAS_TPU_WORKERS (and KERAS_TPU_TASK_INDEX) "
                "before `import keras_tpu`, or call keras_tpu.initialize_tpu_system(resolver) before building "
                "any model or JAX array.") from error
        raise
    _process.STATE.pod = key
    _check_workers_agree(workers, task_index)
    _agree_on_host_seed()
    logger.info("Joined the TPU pod as worker %d of %d (coordinator %s).", task_index, len(workers), workers[0])


def _join_within(timeout, workers, task_index, join):
    """Run ``join()`` (JAX's connection to the pod, which waits for every worker) for at most ``timeout``
    seconds; past that raise :class:`WorkerLostError`. (JAX's wait cannot be interrupted: it goes on in
    a daemon thread, and only its error, if it fails first, is raised here.)"""
    done, failure = threading.Event(), []

    def run():
        try:
            join()
        except BaseException as error:  # handed to the waiting thread
            failure.append(error)
        finally:
            done.set()

    threading.Thread(target=run, name="keras-tpu-join-pod", daemon=True).start()
    if not done.wait(timeout):
        others = [f"{i} ({address})" for i, address in enumerate(workers) if i != task_index]
        who = f"worker {others[0]}" if len(others) == 1 else "one or more of workers " + ", ".join(others)
        raise WorkerLostError(
            f"Worker {task_index} of the TPU pod waited {timeout} s (KERAS_TPU_STARTUP_TIMEOUT) for the other "
            f"workers to join, but {who} did not (not started, stopped during start-up, or unable to reach the "
            f"coordinator {workers[0]}). Start (or restart) every worker with the same KERAS_TPU_WORKERS; raise "
            f"KERAS_TPU_STARTUP_TIMEOUT if workers start far apart.")
    if failure:
        raise failure[0]


def _check_workers_agree(workers, task_index):
    """Fail fast, on every worker, when the workers were started with different worker lists or
    core counts: they would otherwise compute different layouts and wait in a collective forever."""
    # host.cores_per_worker() reads the same variable (host imports this module, so not imported here).
    cores = validation.check_environment_integer("KERAS_TPU_CORES_PER_WORKER",
                                                 os.environ.get("KERAS_TPU_CORES_PER_WORKER", "8"))
    mine = np.array([zlib.crc32(",".join(workers).encode()) & 0x7FFFFFFF, cores], np.int32)
    everyone = _gather_one_row_per_worker(mine)
    if len({int(v) for v in everyone[:, 0]}) > 1 or len(everyone) != len(workers):
        differ = [i for i in range(len(everyone)) if everyone[i, 0] != everyone[0, 0]]
        raise RuntimeError(f"The workers of this pod were given different worker lists: worker(s) {differ} "
                           f"disagree with worker 0 (this is worker {task_index}, with {workers}). Give every "
                           f"worker the same KERAS_TPU_WORKERS (or resolver list), in the same order.")
    cores = [int(v) for v in everyone[:, 1]]
    if len(set(cores)) > 1:
        raise RuntimeError(f"The workers of this pod simulate different numbers of cores: "
                           f"KERAS_TPU_CORES_PER_WORKER is {cores} on workers 0..{len(cores) - 1}. Set the same "
                           f"value on every worker.")


def _gather_one_row_per_worker(row):
    """Every worker's ``row``, stacked in worker order. It runs on one device per worker (as the
    cores' programs do), so workers that disagree on their device counts still meet here;
    ``multihost_utils.process_allgather`` spans all devices and would fail obscurely."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    first = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        first.setdefault(device.process_index, device)
    devices = [first[p] for p in sorted(first)]
    mesh = Mesh(np.array(devices), ("workers",))
    local = jax.device_put(np.asarray(row)[None], first[jax.process_index()])
    stacked = jax.make_array_from_single_device_arrays((len(devices),) + np.shape(row),
                                                       NamedSharding(mesh, PartitionSpec("workers")), [local])
    gathered = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))(stacked)
    return np.asarray(gathered.addressable_data(0))


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

        try:
            multihost_utils.sync_global_devices(name)
        # The collective with a worker that is gone failed. With one device per worker JAX's all-gather
        # reports Gloo's "Connection closed by peer" as a ValueError, with more as a JaxRuntimeError.
        except (jax.errors.JaxRuntimeError, ValueError) as error:
            raise WorkerLostError(
                f"Worker {jax.process_index()} of the TPU pod stopped waiting for the others at {name!r} because "
                f"a worker stopped ({error}). Restart all workers; training resumes from the last checkpoint."
            ) from error

