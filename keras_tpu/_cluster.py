"""The simulated Cloud TPU system: accelerator types, the cluster resolver and the topology.

This mirrors TensorFlow's ``TPUClusterResolver`` and
``tf.tpu.experimental.initialize_tpu_system``. Addresses such as
``grpc://10.0.0.2:8470`` are accepted so that notebooks run unchanged, but no
connection is made: the TPU is simulated in this process on JAX devices.
"""

import collections
import dataclasses
import math
import os
import re

from keras_tpu import _host as host, _validation as validation
from keras_tpu import _process
from keras_tpu._accelerators import DEFAULT_ACCELERATOR_TYPE, GIB, AcceleratorSpec, accelerator_spec
from keras_tpu._logging import logger


class ClusterSpec:
    """The jobs and task addresses of a cluster, shaped like ``tf.train.ClusterSpec``.

    Example:
        >>> spec = ClusterSpec({"worker": ["10.0.0.2:8470", "10.0.0.3:8470"]})
        >>> spec.as_dict()
        {'worker': ['10.0.0.2:8470', '10.0.0.3:8470']}
        >>> spec.num_tasks("worker"), spec.task_address("worker", 1)
        (2, '10.0.0.3:8470')
    """

    def __init__(self, cluster):
        self._cluster = {job: list(tasks) for job, tasks in cluster.items()}

    @property
    def jobs(self):
        """The job names, in order."""
        return list(self._cluster)

    def as_dict(self):
        """``{job name: [task address, ...]}``, a copy."""
        return {job: list(tasks) for job, tasks in self._cluster.items()}

    def num_tasks(self, job_name):
        """How many tasks ``job_name`` has."""
        return len(self._cluster[job_name])

    def task_address(self, job_name, task_index):
        """The address (``host:port``) of task ``task_index`` of ``job_name``."""
        return self._cluster[job_name][task_index]

    def __eq__(self, other):
        return isinstance(other, ClusterSpec) and self._cluster == other._cluster

    def __repr__(self):
        return f"ClusterSpec({self._cluster!r})"


_LOCAL_NAMES = (None, "", "local")

# The worker address the local simulated TPU reports (a Cloud TPU serves gRPC on port 8470).
LOCAL_WORKER_ADDRESS = "localhost:8470"


# A TPU's name (Cloud TPU node names; a full resource path "projects/p/locations/z/nodes/n" too).
_TPU_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./-]*")


DeviceAttributes = collections.namedtuple("DeviceAttributes", ["name", "device_type", "memory_limit_bytes"])
DeviceAttributes.__doc__ = "One device of :class:`TPUSystemMetadata`, named as TensorFlow names it."

TPUSystemMetadata = collections.namedtuple(
    "TPUSystemMetadata", ["num_cores", "num_hosts", "num_of_cores_per_host", "topology", "devices"])
TPUSystemMetadata.__doc__ = ("What :meth:`TPUClusterResolver.get_tpu_system_metadata` returns "
                             "(``tf.tpu.experimental.TPUSystemMetadata``).")


class TPUClusterResolver:
    """Finds the (simulated) TPU, in the shape of TensorFlow's ``TPUClusterResolver``.

    Args:
        tpu: ``None``, ``""`` or ``"local"`` for the local simulated TPU; a
            ``"grpc://host:port"`` address or a TPU name (accepted and
            reported; the TPU is still simulated locally); or, for a pod, a
            list or comma-separated string of ``host:port`` worker addresses,
            the first being the coordinator. When ``None``, the environment
            variables ``KERAS_TPU_WORKERS``, ``COLAB_TPU_ADDR`` and
            ``TPU_NAME`` are read, in that order; with none of them set it
            is the local simulated TPU. (TensorFlow raises
            ``ValueError("Please provide a TPU Name to connect to.")`` there
            when not on Google Cloud. The simulated TPU is always present, so
            the usual ``try: TPUClusterResolver() except ValueError:``
            detection finds it, as it finds the TPU of a Colab TPU runtime.)
        zone, project: kept as attributes; no effect (there is no Cloud TPU
            API to ask).
        job_name: the job name in :meth:`cluster_spec` (``"worker"``), also
            :attr:`task_type`.
        coordinator_name, coordinator_address: with both, :meth:`cluster_spec`
            lists the coordinator job ``{coordinator_name: [coordinator_address]}``,
            as TensorFlow's does. (TensorFlow starts a local server when only
            the name is given; nothing needs coordinating here, so no job is added.)
        credentials, service, discovery_url: no effect (Google Cloud API
            access; no API is called).
        accelerator_type: the simulated TPU type, e.g. ``"v2-8"`` (default),
            ``"v3-8"``, ``"v4-8"``, ``"v5litepod-8"``. In a pod, a named type
            must have as many cores as the pod simulates.
        task_index: this process's index among the workers of a pod
            (default: ``KERAS_TPU_TASK_INDEX`` or 0).

    Example:
        >>> resolver = TPUClusterResolver("grpc://10.0.0.2:8470")
        >>> resolver.master(), resolver.num_accelerators()
        ('grpc://10.0.0.2:8470', {'TPU': 8})
    """

    def __init__(self, tpu=None, zone=None, project=None, job_name="worker", coordinator_name=None,
                 coordinator_address=None, credentials="default", service=None, discovery_url=None, *,
                 accelerator_type=None, task_index=None):
        self.zone = zone
        self.project = project
        self.job_name = job_name
        self.coordinator_name = coordinator_name
        self.coordinator_address = coordinator_address
        self.credentials, self.service, self.discovery_url = credentials, service, discovery_url
        self.task_type = job_name  # TensorFlow's task of a TPU resolver: the first worker
        self.task_id = 0
        self.rpc_layer = "grpc"
        self.accelerator_type_given = accelerator_type is not None  # a pod must then simulate that many cores
        self.spec, self.total_cores = accelerator_spec(accelerator_type or DEFAULT_ACCELERATOR_TYPE)
        self.accelerator_type = f"{self.spec.generation}-{self.total_cores}"
        self.tpu, self.workers = self._resolve_workers(tpu)
        if task_index is None:  # the environment names this process's place in a pod
            task_index = os.environ.get("KERAS_TPU_TASK_INDEX", "0") if len(self.workers) > 1 else 0
        self.task_index = validation.check_task_index(task_index, len(self.workers))

    @staticmethod
    def connect(tpu=None, zone=None, project=None, **keras_tpu_kwargs):
        """Make a resolver, connect to its TPU and initialize it; return the resolver (TensorFlow 2's
        ``TPUClusterResolver.connect``). Extra keywords (``accelerator_type``, ``task_index``) go to
        the constructor.

        Example:
            >>> TPUClusterResolver.connect("grpc://10.0.0.2:8470").master()
            'grpc://10.0.0.2:8470'
        """
        resolver = TPUClusterResolver(tpu, zone, project, **keras_tpu_kwargs)
        experimental_connect_to_cluster(resolver)
        initialize_tpu_system(resolver)
        return resolver

    def __enter__(self):
        return self

    def __exit__(self, type, value, traceback):  # noqa: A002  (TensorFlow's argument names)
        return None

    @property
    def environment(self):
        """The environment TensorFlow runs in: ``""`` (not Google's internal one)."""
        return ""

    @staticmethod
    def _resolve_workers(tpu):
        if tpu is None:
            tpu = (os.environ.get("KERAS_TPU_WORKERS") or os.environ.get("COLAB_TPU_ADDR")
                   or os.environ.get("TPU_NAME"))
            if tpu and os.environ.get("COLAB_TPU_ADDR") == tpu:
                tpu = "grpc://" + tpu
        if isinstance(tpu, (list, tuple)):
            workers = validation.check_worker_list(tpu)
            return ",".join(workers), workers
        if not isinstance(tpu, (str, type(None))):
            raise TypeError(f"`tpu` must be a string, a list of worker addresses or None; got {tpu!r}.")
        if tpu in _LOCAL_NAMES:
            return "local", []
        parts = [p.strip() for p in tpu.strip().rstrip(",").split(",")]  # a trailing comma is harmless
        if len(parts) > 1:  # a pod's comma-separated worker list ("a:8470,b:8470")
            return tpu, validation.check_worker_list(parts)
        if "://" in tpu or ":" in tpu:  # one address
            return tpu, [validation.check_address(tpu)]
        if not _TPU_NAME.fullmatch(tpu.strip()):
            raise ValueError(f"tpu={tpu!r} is neither a TPU name (letters, digits, '-', '_', '.' and '/') nor an "
                             f"address 'grpc://host:port'. Pass None for the local TPU.")
        return tpu, []  # a TPU name: nothing to resolve here

    @property
    def num_workers(self):
        """How many worker processes the TPU has (1 but for a pod)."""
        return max(1, len(self.workers))

    @property
    def is_local(self):
        """Whether the TPU is this process's own (no other worker)."""
        return not self.workers

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """The address of the TPU (the coordinator of a pod); ``""`` for the local TPU.

        As TensorFlow's: with both ``task_type`` and ``task_id`` the address of that task in
        :meth:`cluster_spec`, otherwise that of :attr:`task_type`/:attr:`task_id` (the first worker).
        """
        if not self.workers:
            return ""
        if task_type is None or task_id is None:
            task_type, task_id = self.task_type, self.task_id
        address = self.cluster_spec().task_address(task_type, task_id)
        return f"{rpc_layer or self.rpc_layer or 'grpc'}://{address}"

    def get_master(self):
        """The same as :meth:`master` (TensorFlow 1's name)."""
        return self.master()

    def get_job_name(self):
        """The job the TPU's tasks run in (``"worker"``, as Cloud TPU names it)."""
        return self.job_name

    def get_coordination_service_leader(self):
        """Where TensorFlow's coordination service runs: the first task of the job (``"/job:worker/task:0"``).

        Example:
            >>> TPUClusterResolver().get_coordination_service_leader()
            '/job:worker/task:0'
        """
        return f"/job:{self.job_name}/task:0"

    def cluster_spec(self):
        """All workers, as ``ClusterSpec({"worker": [...]})``.

        The local simulated TPU (and a TPU given by name) is one worker at
        ``localhost:8470``, the port of a Cloud TPU's gRPC endpoint, so that
        ``resolver.cluster_spec().as_dict()["worker"]`` works as on a real TPU.

        Example:
            >>> TPUClusterResolver("local").cluster_spec().as_dict()
            {'worker': ['localhost:8470']}
        """
        cluster = {self.job_name: list(self.workers) or [LOCAL_WORKER_ADDRESS]}
        if self.coordinator_name and self.coordinator_address:
            cluster[self.coordinator_name] = [self.coordinator_address]
        return ClusterSpec(cluster)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """TPU cores per worker, as TensorFlow reports them: ``{"TPU": 8}``."""
        return {"TPU": self.cores_per_worker}

    def get_tpu_system_metadata(self):
        """The TPU's cores, hosts and devices, as TensorFlow 2's ``get_tpu_system_metadata``
        (``topology`` is ``None``, as TensorFlow's query leaves it; :func:`initialize_tpu_system`
        returns the :class:`Topology`).

        Example:
            >>> metadata = TPUClusterResolver().get_tpu_system_metadata()
            >>> metadata.num_cores, metadata.num_hosts, metadata.num_of_cores_per_host
            (8, 1, 8)
        """
        per_host, hosts = self.cores_per_worker, self.num_workers
        devices = []
        for host_index in range(hosts):
            prefix = f"/job:{self.job_name}/replica:0/task:{host_index}/device:"
            devices.append(DeviceAttributes(prefix + "CPU:0", "CPU", 0))
            devices += [DeviceAttributes(f"{prefix}TPU:{core}", "TPU", self.spec.hbm_bytes_per_core)
                        for core in range(per_host)]
        return TPUSystemMetadata(per_host * hosts, hosts, per_host, None, devices)

    @property
    def cores_per_worker(self):
        """How many cores each worker holds."""
        return self.total_cores // self.num_workers if self.workers else host.cores_per_worker()

    def __repr__(self):
        return (f"TPUClusterResolver(tpu={self.tpu!r}, accelerator_type={self.accelerator_type!r}, "
                f"workers={self.num_workers})")


@dataclasses.dataclass(frozen=True)
class Topology:
    """What :func:`initialize_tpu_system` found: the simulated TPU's shape and speeds.

    Example:
        >>> topology = initialize_tpu_system(TPUClusterResolver())
        >>> topology.accelerator_type, topology.num_cores, topology.num_chips, topology.mxu_shape
        ('v2-8', 8, 4, (128, 128))
        >>> round(topology.peak_flops_per_core / 1e12, 1), topology.hbm_bytes_per_core // 2**30   # TFLOP/s, GiB
        (22.9, 8)
    """

    accelerator_type: str
    spec: AcceleratorSpec
    num_workers: int
    cores_per_worker: int
    layout: "object"  # keras_tpu._cores.CoreLayout

    @property
    def num_cores(self):
        """All cores: workers x cores per worker."""
        return self.num_workers * self.cores_per_worker

    @property
    def num_chips(self):
        """How many chips hold the cores."""
        return math.ceil(self.num_cores / self.spec.cores_per_chip)

    @property
    def mxus_per_core(self):
        """MXUs in each core (1 on v2, 2 on v3)."""
        return self.spec.mxus_per_core

    @property
    def mxu_shape(self):
        """An MXU's (rows, columns): (128, 128)."""
        return (self.spec.mxu_rows, self.spec.mxu_cols)

    @property
    def clock_hz(self):
        """The cores' clock."""
        return self.spec.clock_hz

    @property
    def hbm_bytes_per_core(self):
        """Each core's HBM."""
        return self.spec.hbm_bytes_per_core

    @property
    def hbm_bytes_per_second_per_core(self):
        """Each core's HBM bandwidth."""
        return self.spec.hbm_bytes_per_second_per_core

    @property
    def peak_flops_per_core(self):
        """A core's bf16 peak: two flops per multiply-accumulate, every MXU cell every cycle."""
        return self.spec.peak_flops_per_core

    @property
    def mesh(self):
        """The JAX device mesh the cores run on (axis ``"tpu_device"``)."""
        return self.layout.mesh

    def describe(self):
        """A multi-line human-readable summary."""
        rows, cols = self.mxu_shape
        return "\n".join([
            f"TPU {self.accelerator_type}: {self.num_chips} chips x {self.spec.cores_per_chip} cores "
            f"= {self.num_cores} cores on {self.num_workers} worker(s)",
            f"  per core: {self.mxus_per_core} MXU(s) of {rows}x{cols} at {self.clock_hz / 1e6:.0f} MHz "
            f"({self.peak_flops_per_core / 1e12:.1f} TFLOP/s bf16), "
            f"{self.hbm_bytes_per_core / GIB:.1f} GiB HBM at {self.hbm_bytes_per_second_per_core / 1e9:.0f} GB/s",
            f"  simulated on {self.layout.describe()}",
        ])


def experimental_connect_to_cluster(cluster_spec_or_resolver, job_name="localhost", task_index=0, protocol=None,
                                    make_master_device_default=True, cluster_device_filters=None):
    """``tf.config.experimental_connect_to_cluster``: accepted and logged; the other arguments have no
    effect (the simulated TPU is in this process: there is no remote cluster, server or device filter).

    Example:
        >>> experimental_connect_to_cluster(TPUClusterResolver())
    """
    resolver = cluster_spec_or_resolver
    if isinstance(resolver, TPUClusterResolver) and not resolver.is_local:
        logger.info("Connecting to %s (the TPU is simulated in this process).", resolver.master())


def _check_pod_matches_type(resolver, workers, cores_per_worker):
    """A pod simulates ``workers x KERAS_TPU_CORES_PER_WORKER`` cores; an accelerator type the user named must
    have as many (a v2-32 is 4 hosts of 8 cores). The default type is only a default: a pod of another size
    keeps v2's per-core figures, with a warning."""
    simulated = workers * cores_per_worker
    if simulated == resolver.total_cores:
        return
    if resolver.accelerator_type_given:
        per_worker, rest = divmod(resolver.total_cores, workers)
        fix = f"set KERAS_TPU_CORES_PER_WORKER={per_worker} on every worker" if per_worker and not rest else \
            f"run {resolver.total_cores // cores_per_worker or 1} workers"
        raise ValueError(
            f"accelerator_type={resolver.accelerator_type!r} has {resolver.total_cores} cores, but this pod "
            f"simulates {simulated} ({workers} workers x KERAS_TPU_CORES_PER_WORKER={cores_per_worker}). To "
            f"simulate a {resolver.accelerator_type}, {fix}; otherwise pass the accelerator type of "
            f"{simulated} cores.")
    logger.warning("This pod simulates %d cores (%d workers x KERAS_TPU_CORES_PER_WORKER=%d), not the default "
                   "accelerator type's %d; pass accelerator_type= to the resolver to name the TPU it stands for.",
                   simulated, workers, cores_per_worker, resolver.total_cores)


def initialize_tpu_system(cluster_resolver=None):
    """Start the simulated TPU and return its :class:`Topology`.

    Logs what it found, as TensorFlow does, once per system: calling it again
    for the same TPU (as ``TPUStrategy`` and ``TPUEstimator`` do) returns the
    same topology and logs only a debug line.

    Example:
        >>> topology = initialize_tpu_system(TPUClusterResolver(tpu="grpc://10.0.0.2:8470"))
        >>> topology.num_cores
        8
    """
    from keras_tpu._cores import CoreLayout

    resolver = cluster_resolver
    if resolver is None:
        resolver = TPUClusterResolver()
    if not isinstance(resolver, TPUClusterResolver):
        raise TypeError(f"initialize_tpu_system expects a TPUClusterResolver; got {type(resolver).__name__}.")
    from keras_tpu import _pod as pod

    if resolver.num_workers > 1:
        pod.start(resolver.workers, resolver.task_index)
    workers, cores_per_worker = resolver.num_workers, resolver.cores_per_worker
    if pod.is_multi_worker():  # this process belongs to a pod: the pod is the TPU
        workers, cores_per_worker = pod.num_workers(), host.cores_per_worker()
        _check_pod_matches_type(resolver, workers, cores_per_worker)
    where = resolver.master() or "local"
    started = _process.STATE.topology
    if started is not None and started.accelerator_type == resolver.accelerator_type \
            and started.num_workers == workers:
        topology = started
    else:
        layout = CoreLayout(cores_per_worker * workers)
        topology = Topology(resolver.accelerator_type, resolver.spec, workers, cores_per_worker, layout)
        _process.STATE.topology = topology
    announced = (id(topology), where, resolver.job_name)
    if announced in _process.STATE.announced:  # TPUStrategy and the estimator call this again for one system
        logger.debug("The TPU system %s is already initialized.", where)
        return topology
    _process.STATE.announced[announced] = topology
    logger.info("Initializing the TPU system: %s (simulated in this process).", where)
    logger.info("Found TPU system:")
    logger.info("*** Num TPU Cores: %d", topology.num_cores)
    logger.info("*** Num TPU Workers: %d", topology.num_workers)
    logger.info("*** Num TPU Cores Per Worker: %d", topology.cores_per_worker)
    for core, device in enumerate(topology.layout.core_devices()):
        logger.info("*** Available Device: /job:%s/replica:0/task:%d/device:TPU:%d -> %s",
                    resolver.job_name, core // topology.cores_per_worker, core, device)
    return topology


def shutdown_tpu_system(cluster_resolver=None):
    """``tf.tpu.experimental.shutdown_tpu_system``: forget the started TPU system.

    The next :func:`initialize_tpu_system` starts it again, with its log lines.
    Models already on the TPU keep running on their cores. (A pod that this
    process joined stays joined: JAX's multi-process runtime cannot be left.)

    Example:
        >>> shutdown_tpu_system()
        >>> initialize_tpu_system(TPUClusterResolver()).num_cores
        8
    """
    if cluster_resolver is not None and not isinstance(cluster_resolver, TPUClusterResolver):
        raise TypeError(f"shutdown_tpu_system expects a TPUClusterResolver; got {type(cluster_resolver).__name__}.")
    _process.reset_tpu_system()
