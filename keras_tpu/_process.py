"""What keras_tpu keeps for the whole process, in one place.

Like Keras' ``global_state``, keras_tpu has a little process-wide state: the
TPU system this process started (and whether its "Found TPU system" block was
logged), the pod it joined, and whether the host was prepared.
Each is set by the module that performs that step (:mod:`keras_tpu._cluster`,
:mod:`keras_tpu._pod`, :mod:`keras_tpu._host`) and kept here, nowhere else.
:func:`reset_tpu_system` forgets the TPU system, as ``keras.backend.clear_session``
forgets Keras' state (``keras_tpu.shutdown_tpu_system`` calls it); a pod and JAX's
devices cannot be undone in a running process and stay. (The active
``TPUStrategy`` scope is per thread, in :mod:`keras_tpu._strategy`.)
"""

import dataclasses


@dataclasses.dataclass
class ProcessState:
    """keras_tpu's process-wide state (one instance, :data:`STATE`)."""

    #: the :class:`keras_tpu.Topology` that ``initialize_tpu_system`` started, or None
    topology: object = None
    #: ``(topology id, address, job)`` whose "Found TPU system" block was logged -> that topology
    #: (kept alive so that its id is not reused)
    announced: dict = dataclasses.field(default_factory=dict)
    #: ``(workers, task index)`` of the pod this process joined, or None
    pod: tuple = None
    #: whether :func:`keras_tpu._host.prepare_host` ran (a pod is joined once)
    host_prepared: bool = False


STATE = ProcessState()


def reset_tpu_system():
    """Forget the started TPU system: the next ``initialize_tpu_system`` starts it (and logs it) again.

    Example:
        >>> reset_tpu_system()
        >>> STATE.topology is None
        True
    """
    STATE.topology = None
    STATE.announced.clear()
