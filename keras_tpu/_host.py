"""Prepare this process before JAX starts (Keras on JAX and a pod's runtime), and keep its memory small.

``keras_tpu`` runs :func:`prepare_host` when it is imported: Keras must use
its JAX backend, and a pod's workers must join JAX's multi-process runtime
before its backend starts. A process holds all its simulated cores on one
JAX device (:func:`devices_for_cores`), so JAX keeps its default of one CPU
device and nothing is lost if JAX was already running when ``keras_tpu``
was imported.

JAX is deliberately *not* given a virtual device per core: XLA:CPU sizes
its intra-op thread pool to the larger of the host's cores and the devices,
so eight virtual devices on a two-core host meant eight threads contending
for two cores. Measured here (2 cores), one device against eight: the
CIFAR-10 CNN's train step 0.93 s against 1.01 s, the MLP's 23 ms against
26 ms, and the MLP's peak memory after 60 steps 694 MiB against 805 (freed
buffers scattered over more threads' malloc arenas). Experiments that lay
the cores over several devices of one process
(:class:`keras_tpu._cores.CoreLayout`) ask JAX for them before it starts
(``XLA_FLAGS=--xla_force_host_platform_device_count=8`` or
``jax.config.update("jax_num_cpu_devices", 8)``).

XLA:CPU compiles the process's programs with LLVM at ``-O2`` instead of its
default ``-O3`` (:func:`quicker_code_generation`), unless ``XLA_FLAGS`` sets
a level: keras-tpu's own programs ask for it per program
(``keras_tpu.mxu._kernels.compiler_options``), and Keras' programs (a
model's weight initializers, the CPU model's steps) get it from the flags.

Each compile ends with :func:`release_freed_memory`: the compiler's freed
scratch goes back to the operating system instead of staying in the process,
and tracing a program runs with Python's cyclic garbage collector paused
(:func:`collection_paused`).
"""

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os
import re
import sys

from keras_tpu import _process

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


#: LLVM's optimization level for the XLA:CPU programs of a process that runs keras-tpu (see
#: :func:`quicker_code_generation`).
LLVM_OPTIMIZATION_LEVEL = 2


def llvm_level_in_xla_flags(flags=None):
    """The LLVM optimization level XLA's flags set (``--xla_backend_optimization_level``; the last one counts),
    or ``None``; ``flags``: the flags to read (default: the ``XLA_FLAGS`` environment variable).

    Example:
        >>> llvm_level_in_xla_flags("--xla_cpu_enable_fast_math=false --xla_backend_optimization_level=1")
        1
        >>> llvm_level_in_xla_flags("--xla_cpu_enable_fast_math=false") is None
        True
    """
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    levels = re.findall(r"--xla_backend_optimization_level=(\d+)", flags)
    return int(levels[-1]) if levels else None


def quicker_code_generation():
    """Have XLA:CPU compile every program of the process with LLVM at :data:`LLVM_OPTIMIZATION_LEVEL` (``-O2``)
    instead of ``-O3``, unless ``XLA_FLAGS`` sets a level (that one is kept: ``=3`` restores XLA's default).

    keras-tpu's own programs ask for the level per program (see ``keras_tpu.mxu._kernels``, where the run
    time of each zoo model's steps was measured the same at both levels); the others take it from the flags,
    which XLA reads when JAX's backend starts, so it applies if that is after ``import keras_tpu``. What it
    changes is Keras' own programs: building a model compiles a random-number program for each shape of its
    weights (JAX's ``_uniform``), 0.35-0.9 s each at ``-O3`` against 0.15 s at ``-O2`` here, and runs them
    as fast. Building ResNet-20 took 5.3-5.8 s against 2.0-2.3 s, the README's CIFAR-10 CNN 3.7-3.9 s
    against 1.55 s; from Python's start to the end of the CIFAR CNN's first ``fit``, 9.8-10.0 s against 7.9.
    """
    if llvm_level_in_xla_flags() is None:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level={LLVM_OPTIMIZATION_LEVEL}".strip()


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


def prepare_host():
    """Make Keras use JAX, have XLA:CPU compile at LLVM ``-O2`` (:func:`quicker_code_generation`) and join the
    pod this worker belongs to (if any).

    Called on ``import keras_tpu``; safe to call again.

    Example:
        >>> from keras_tpu import _host as host
        >>> host.prepare_host()
    """
    _require_keras_on_jax()
    quicker_code_generation()
    if not _process.STATE.host_prepared:
        cores_per_worker()  # a malformed KERAS_TPU_CORES_PER_WORKER is reported now
        from keras_tpu import _pod as pod

        workers, task_index = pod.workers_from_environment()
        pod.heartbeat_timeout_s()  # read again when a pod is joined; a malformed value is reported now
        pod.startup_timeout_s()
        _process.STATE.host_prepared = True
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


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` where the C library has none (macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_freed_memory():
    """Give the C heap's free pages back to the operating system (glibc's ``malloc_trim``); ``False`` where
    there is no such call.

    XLA frees its compiler's scratch memory when a compile ends, but glibc keeps
    those pages in the process, where they count in its resident memory until
    they are reused. Called after each compile: measured here, the zoo's
    embedding model (benchmarks/zoo.py) held 480 MiB after compiling its
    training program and 410 MiB after the trim, and its peak over a fit and
    an evaluate fell from 516 to 470 MiB (plain Keras: 485-508). The trim
    costs a few milliseconds.

    Example:
        >>> release_freed_memory() in (True, False)
        True
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@contextlib.contextmanager
def collection_paused():
    """Python's cyclic garbage collector paused for the block, and enabled again after it if it was enabled
    before (a collector its caller disabled stays disabled).

    Tracing a program allocates hundreds of thousands of objects (tracers,
    equations, jaxprs) that live until the trace ends, and almost none of
    them are cyclic garbage; each full collection triggered meanwhile walks
    every object of the process (about 340,000 once a ResNet-20 is built), to
    free next to nothing. keras-tpu traces more than plain Keras does (the
    cores' loop, the MXU's routing, the per-core HBM estimate): measured
    here, ResNet-20's first ``fit`` ran two full collections, 0.31 s of its
    compile, and freed 44 objects; with the collector paused while its
    programs were traced and compiled, the first fit took 4.7-5.7 s (median
    5.0) against 5.0-6.2 s (median 5.4), eight runs each, alternately.
    Cyclic garbage left by the block is collected by the collector's next
    runs once it is enabled again.

    Example:
        >>> import gc
        >>> with collection_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
