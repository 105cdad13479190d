"""A whole TPU step, not just its matrix units: vector unit, HBM, all-reduce, input and host.

:mod:`keras_tpu.mxu._cost` times the matrix products. A real step also runs
everything else on the core's vector unit out of HBM, all-reduces the
gradients across the cores, feeds each core its rows, and is launched by a
host. This module costs those parts from the same traced program and
composes the step:

* **Vector unit and memory** (:func:`vector_kernels`): every operation that is
  not a matrix product, grouped as XLA fuses them. Elementwise, layout and
  broadcast operations fuse into their consumers and never touch HBM on their
  own; a *root* (a reduction, pooling, gather, scatter, a loop's boundary, a
  program result, or an elementwise result that would otherwise keep more
  than ``FUSION_SLACK`` times its size alive) reads the buffers its fused
  inputs come from and writes its result. Within one layer and pass, each
  buffer is read once, and roots reading a common buffer are one kernel: XLA
  fuses sibling reductions over the same operands (BatchNormalization's mean
  and variance, Adam's three updates of one weight) into one multi-output
  kernel. Elementwise work feeding a matrix
  product is fused into it (its HBM traffic is the product's operand read).
  Bytes are counted in the TPU's tiled layouts (:func:`keras_tpu._hbm.array_bytes`);
  vector work in whole ``8 x 128`` vector registers. Per layer and pass the
  time is ``max(vector ops / VPU rate, bytes / HBM bandwidth)`` plus a fixed
  latency per kernel.
* **All-reduce** (:func:`allreduce_time`): the gradients' bytes over a
  bidirectional ring of the slice's chips, ``2 (c - 1) / c`` of the bytes at
  the chip's ICI bandwidth plus ``2 (c - 1)`` hops of latency.
* **Input and host** (:class:`Deployment`): the step's input bytes over the link
  from where the input pipeline runs plus the host's per-core enqueue work,
  and one host call per
  ``steps_per_execution`` (TPUStrategy) or ``iterations_per_loop``
  (TPUEstimator) steps.

Overlap (:class:`StepTime`): one core's kernels run one after another (MXU
ops, vector kernels, then the all-reduce, which XLA of the TPUEstimator era
did not overlap with the backward pass); input is prefetched (infeed) or
pipelined (Keras' numpy feed), so it overlaps the device step; the host's call
waits for its result and does not overlap. Step = ``max(device, input) +
host call / steps per call``.
"""

import dataclasses
import math

import numpy as np
from jax.extend import core as jex_core
from jax.extend import source_info_util

from keras_tpu import _hbm as hbm
from keras_tpu._accelerators import accelerator_spec, system_figures
from keras_tpu._rewrite import sub_jaxprs
from keras_tpu.mxu._primitives import mxu_conv_p, mxu_dot_general_p
from keras_tpu.mxu._program import split_name_stack

# -- constants -------------------------------------------------------------------------------------------------------

#: An elementwise result read by several kernels is stored (a fusion root) when its fused inputs are more than
#: this many times its elements: XLA duplicates a cheap producer into each consumer (BatchNormalization's
#: gradient terms, read by two reductions and the input gradient) but stops a chain from growing without bound
#: (a residual network's running sum). An estimate of XLA's fusion heuristics, not a published figure.
FUSION_SLACK = 3

#: Vector-unit operations per element of each kind of operation (one 8 x 128 register op = 1024 of them).
#: Transcendentals (exp, log, tanh, rsqrt, logistic, ...) are a few ALU operations each (a polynomial or
#: Newton step after a table lookup; an estimate, not a published figure); threefry2x32 (JAX's counter-based
#: random bits, used by Dropout) is 20 rounds of add, rotate and xor on two words.
VPU_OPS_TRANSCENDENTAL = 4
VPU_OPS_THREEFRY = 60

#: Fixed cost of launching one kernel (an MXU op or a fused vector kernel) on a core, in cycles: its first
#: DMA from HBM into the core's vector memory and the pipeline fill before results stream, and the drain
#: after. How chosen: see ``KERNEL_LATENCY_NOTE``.
KERNEL_LATENCY_CYCLES = 2000
KERNEL_LATENCY_NOTE = ("not a published figure: one value for every generation, in cycles, chosen once so "
                       "that tiny steps (tens of kernels of a few microseconds) are not predicted faster than "
                       "a TPU can issue them; see benchmarks/tpu_time_vs_published.py")

#: Buffers up to this size (scalars, learning rates, per-channel statistics' tiles) do not make two roots one
#: multi-output kernel by being read by both.
SIBLING_MIN_BYTES = 4096

FUSIBLE = hbm.FUSIBLE | frozenset("add_any pad concatenate rev dynamic_slice squeeze expand_dims clamp iota "
                                    "copy_p random_wrap random_unwrap".split())
EXPENSIVE = hbm.EXPENSIVE
INLINE = hbm.INLINE
_REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin "
                        "cumsum cumprod cummax cumlogsumexp reduce_precision".split())


# -- deployments -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Deployment:
    """Where the input pipeline and the Python loop run, relative to the TPU.

    Attributes:
        name: the setting's name (a key of :data:`DEPLOYMENTS`).
        description: what it is, in a sentence.
        input_over_network: the input crosses the network from a remote client each step
            (else it comes from the TPU's own host over its PCIe link).
        call_s: one host call of the compiled step (a round trip), in seconds.
    """

    name: str
    description: str
    input_over_network: bool
    call_s: float


#: A numpy feed from a remote client through TensorFlow's gRPC session runs at about 117 MB/s:
#: tensorflow/tensorflow#6256 ("grpc worker->client fetch tops out at 120 MB/s": 116.70 MB/s measured for a
#: 128 MB variable through Session("grpc://...")); keras_to_tpu_model's numpy infeed is such a feed
#: (TPUNumpyInfeedManager: per-core placeholders in session.run's feed_dict, TF 1.11-1.15 keras_support.py).
REMOTE_FEED_BYTES_PER_S = 116.7e6

#: One call of a TPU program from a client that reaches the TPU over the network (a Colab VM or a GCE VM
#: talking to a TPU node's gRPC worker, 2018-2021): about 10 ms. How chosen: tensorflow/tpu
#: tools/colab/keras_mnist_tpu.ipynb (TF 2.2, TPUStrategy, one step per call) logs 10-12 ms/step where the
#: device step is ~1 ms; this is the one constant derived from a measured step, and that workload is listed
#: as its calibration in benchmarks/tpu_time_vs_published.py.
REMOTE_CALL_S = 0.010

#: The host's own work per core and step to feed a batch (take it from the input pipeline, enqueue it to that
#: core's infeed), which the host does core after core. How chosen: the one constant set against a step of
#: tiny per-core work, tensorflow/tpu tools/colab/mnist_tpuestimator.ipynb (1.02 ms/step with 8 cores fed per
#: step, of which the model's device time is ~0.5 ms); that workload is listed as its calibration. It is
#: hidden under the device step of any model bigger than a few hundred microseconds per step.
HOST_INFEED_PER_CORE_S = 100e-6

#: One call of a compiled program from Python on the TPU's own host (a TPU VM): JAX's dispatch of a jitted
#: call is tens of microseconds (JAX documentation, "Asynchronous dispatch"; an estimate).
LOCAL_CALL_S = 50e-6

DEPLOYMENTS = {
    "tpu_vm": Deployment(
        "tpu_vm", "input pipeline and Python loop on the TPU's own host (a TPU VM, 2021-): input over PCIe",
        input_over_network=False, call_s=LOCAL_CALL_S),
    "remote_host_input": Deployment(
        "remote_host_input", "Python loop on a remote client (Colab or a GCE VM), input pipeline (tf.data) on "
        "the TPU node's host, as TPUEstimator's input_fn and TPUStrategy's distributed datasets ran it "
        "(2018-2021)", input_over_network=False, call_s=REMOTE_CALL_S),
    "remote_client_input": Deployment(
        "remote_client_input", "Python loop and NumPy data on a remote client (2018-2020 Colab with "
        "keras_to_tpu_model): every batch crosses the network through gRPC", input_over_network=True,
        call_s=REMOTE_CALL_S),
}

#: The default deployment per front end: keras_to_tpu_model only ever ran against TPU nodes with NumPy input;
#: TPUEstimator ran its input_fn on the TPU host from a remote client; anything else (TPUStrategy today, a
#: plain Keras model) on a TPU VM.
DEFAULT_DEPLOYMENT = {"keras_to_tpu_model": "remote_client_input", "estimator": "remote_host_input",
                      "strategy": "tpu_vm", None: "tpu_vm"}


def deployment(name):
    """The :class:`Deployment` called ``name`` (one of :data:`DEPLOYMENTS`).

    Example:
        >>> deployment("remote_client_input").input_over_network
        True
    """
    if isinstance(name, Deployment):
        return name
    if name not in DEPLOYMENTS:
        raise ValueError(f"Unknown deployment {name!r}; known: {', '.join(DEPLOYMENTS)}.")
    return DEPLOYMENTS[name]


# -- vector unit and memory ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class VectorKernels:
    """The non-MXU work of one layer and pass on one core, per step.

    Attributes:
        layer, pass_name: where it comes from (the Keras layer, "forward"/"backward").
        vpu_ops: vector-unit element operations (in whole 8 x 128 registers).
        hbm_bytes: bytes read and written in HBM by its fused kernels.
        kernels: how many fused kernels (launches).
    """

    layer: str
    pass_name: str
    vpu_ops: float = 0.0
    hbm_bytes: float = 0.0
    kernels: int = 0

    def timing(self, accelerator):
        """``(vector_s, memory_s, latency_s)`` on one core of ``accelerator``."""
        spec, _ = accelerator_spec(accelerator) if isinstance(accelerator, str) else (accelerator, None)
        figures = system_figures(spec.generation)
        vector_s = self.vpu_ops / (figures.vpu_ops_per_cycle * spec.clock_hz)
        memory_s = self.hbm_bytes / spec.hbm_bytes_per_second_per_core
        return vector_s, memory_s, self.kernels * KERNEL_LATENCY_CYCLES / spec.clock_hz


class _Value:
    __slots__ = ("bytes", "slots", "sources", "id")

    def __init__(self, nbytes, slots, sources=None, ident=None):
        self.bytes, self.slots = nbytes, slots
        self.sources = sources        # None: stored in HBM; else the stored values it is computed from
        self.id = ident

    def roots(self):
        return (self,) if self.sources is None else self.sources


def _aval_bytes_and_slots(aval):
    shape = tuple(getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", np.float32)
    try:
        nbytes = hbm.array_bytes(shape, dtype)
    except TypeError:
        nbytes = 8 * max(1, math.prod(shape))
    # Vector registers hold 32-bit words: a bf16 element takes a 32-bit slot on v2/v3's VPU.
    slots = hbm.array_bytes(shape, np.float32) // 4 if shape else 1
    return nbytes, slots


def _layer_and_pass(stack, layer_names):
    scopes, transforms = split_name_stack(stack)
    layer = next((s for s in reversed(scopes) if s in layer_names), scopes[-1] if scopes else "(step)")
    return layer, ("backward" if "transpose" in transforms else "forward")


class _Walker:
    def __init__(self, layer_names):
        self.layer_names = layer_names
        self.groups = {}
        self._ids = 0
        self._read = {}        # (layer, pass, level) -> ids of stored buffers already read there
        self._sibling = {}     # (layer, pass, level) -> source sets of roots already launched there

    def group(self, layer, pass_name):
        key = (layer, pass_name)
        if key not in self.groups:
            self.groups[key] = VectorKernels(layer, pass_name)
        return self.groups[key]

    def stored(self, aval):
        nbytes, slots = _aval_bytes_and_slots(aval)
        self._ids += 1
        return _Value(nbytes, slots, None, self._ids)

    def root(self, group, level, inputs, out_bytes, repeats):
        """A fusion root in ``group``: reads its inputs' stored buffers (once per layer and pass), writes out."""
        key = (group.layer, group.pass_name, level)
        seen = self._read.setdefault(key, set())
        sources = {}
        for value in inputs:
            for root in value.roots():
                sources[root.id] = root
        fresh = [r for i, r in sources.items() if i not in seen]
        seen.update(sources)
        group.hbm_bytes += repeats * (sum(r.bytes for r in fresh) + out_bytes)
        # Roots reading a common (non-trivial) buffer share one multi-output kernel.
        shared = {i for i, r in sources.items() if r.bytes > SIBLING_MIN_BYTES}
        clusters = self._sibling.setdefault(key, [])
        touching = [c for c in clusters if c & shared]
        if not shared and clusters:
            return  # an epilogue on small values (a reduction's scaling, a scalar) fuses into a kernel here
        if not touching:
            clusters.append(set(shared))
            group.kernels += repeats
            return
        merged = set(shared).union(*touching)
        for c in touching:
            clusters.remove(c)
        clusters.append(merged)
        group.kernels -= repeats * (len(touching) - 1)

    def run(self, jaxpr, env, prefix, repeats, level, program_outputs):
        uses, casts = {}, {}
        for eqn in jaxpr.eqns:
            for atom in eqn.invars:
                if not isinstance(atom, jex_core.Literal):
                    uses[atom] = uses.get(atom, 0) + 1
                    if eqn.primitive.name == "convert_element_type":
                        casts.setdefault(atom, []).append(eqn.outvars[0].aval)
        narrowed = {var: avals[0] for var, avals in casts.items()
                    if len(avals) == uses.get(var) and all(a.dtype == avals[0].dtype for a in avals)
                    and np.dtype(avals[0].dtype).itemsize < np.dtype(var.aval.dtype).itemsize}
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            stack = prefix + eqn.source_info.name_stack
            subs = sub_jaxprs(eqn)
            inputs = [env[a] for a in eqn.invars if not isinstance(a, jex_core.Literal) and a in env]
            if name in INLINE and len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
                sub = subs[0]
                sub_env = {v: env[a] for v, a in zip(sub.invars, eqn.invars)
                           if not isinstance(a, jex_core.Literal) and a in env}
                sub_env.update((v, self.stored(v.aval)) for v in sub.constvars)
                self.run(sub, sub_env, stack, repeats, level, ())
                for outer, inner in zip(eqn.outvars, sub.outvars):
                    found = None if isinstance(inner, jex_core.Literal) else sub_env.get(inner)
                    env[outer] = found if found is not None else self.stored(outer.aval)
                continue
            layer, pass_name = _layer_and_pass(stack, self.layer_names)
            group = self.group(layer, pass_name)
            if eqn.primitive in (mxu_dot_general_p, mxu_conv_p):
                # Timed by the MXU model, operand reads and result write included; fused producers are free.
                # A float32 result cast straight to a narrower type (a bfloat16 layer's output) is stored narrow:
                # XLA fuses the cast into the product's output.
                for var in eqn.outvars:
                    env[var] = self.stored(narrowed.get(var, var.aval))
                continue
            if subs:  # a loop or a branch: its operands are stored, its body runs as its own level
                times = eqn.params.get("length", 1) if name == "scan" else 1
                self.root(group, level, inputs, 0, repeats)
                for sub in subs:
                    sub_env = {v: self.stored(v.aval) for v in list(sub.invars) + list(sub.constvars)}
                    self._ids += 1
                    self.run(sub, sub_env, stack, repeats * times, (level, self._ids), tuple(sub.outvars))
                for var in eqn.outvars:
                    env[var] = self.stored(var.aval)
                continue
            out_slots = sum(_aval_bytes_and_slots(v.aval)[1] for v in eqn.outvars)
            in_slots = sum(v.slots for v in inputs) or out_slots
            if name in FUSIBLE:
                group.vpu_ops += repeats * out_slots * (VPU_OPS_TRANSCENDENTAL if name in EXPENSIVE else 1)
                for var in eqn.outvars:
                    own_bytes, own_slots = _aval_bytes_and_slots(var.aval)
                    roots = {}
                    for value in inputs:
                        for root in value.roots():
                            roots[root.id] = root
                    value = _Value(own_bytes, own_slots, tuple(roots.values()))
                    # Read by several kernels, it is computed once and stored if recomputing it in each would
                    # read more than it (XLA does not duplicate such a producer into its consumers).
                    # (Counted in elements, so that a cast to a narrower type is not taken for a reduction.)
                    too_wide = uses.get(var, 0) > 1 and (
                        name in EXPENSIVE or sum(r.slots for r in roots.values()) > FUSION_SLACK * max(own_slots, 1))
                    if too_wide or var in program_outputs:
                        self.root(group, level, inputs, own_bytes, repeats)
                        value = self.stored(var.aval)
                    env[var] = value
                continue
            # A fusion root: a reduction, pooling and its gradient, gather/scatter, random bits, a sort, ...
            if name in ("reduce_window", "reduce_window_max", "reduce_window_sum", "select_and_scatter_add",
                        "select_and_gather_add"):
                window = math.prod(eqn.params.get("window_dimensions", (1,)))
                ops = window * max(in_slots, out_slots)
            elif name == "threefry2x32":
                ops = VPU_OPS_THREEFRY * out_slots
            elif name in _REDUCTIONS:
                ops = in_slots
            else:
                ops = max(in_slots, out_slots)
            group.vpu_ops += repeats * ops
            out_bytes = sum(_aval_bytes_and_slots(v.aval)[0] for v in eqn.outvars)
            self.root(group, level, inputs, out_bytes, repeats)
            for var in eqn.outvars:
                env[var] = self.stored(var.aval)
        for atom in program_outputs:  # results of a loop body not yet stored: written at the end of each trip
            value = env.get(atom) if not isinstance(atom, jex_core.Literal) else None
            if value is not None and value.sources is not None:
                self.root(self.group("(step)", "forward"), level, [value], value.bytes, repeats)


def vector_kernels(closed_jaxpr, layer_names=()):
    """The vector-unit and HBM work of a routed program, per layer and pass (module docstring).

    Args:
        closed_jaxpr: one core's step (``jax.make_jaxpr`` of the MXU-routed step).
        layer_names: Keras layer names, to name the groups after the innermost one on each name stack.

    Returns:
        a list of :class:`VectorKernels` in program order.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> closed = jax.make_jaxpr(lambda x: jnp.sum(jax.nn.relu(x * 2.0)))(jnp.ones((128, 256)))
        >>> [(k.vpu_ops, k.hbm_bytes, k.kernels) for k in vector_kernels(closed)]
        [(98304.0, 132096.0, 1)]
    """
    walker = _Walker(set(layer_names))
    jaxpr = closed_jaxpr.jaxpr
    env = {v: walker.stored(v.aval) for v in list(jaxpr.invars) + list(jaxpr.constvars)}
    walker.run(jaxpr, env, source_info_util.new_name_stack(), 1, 0, tuple(jaxpr.outvars))
    return [g for g in walker.groups.values() if g.vpu_ops or g.hbm_bytes or g.kernels]


# -- all-reduce, input, host -----------------------------------------------------------------------------------------


def allreduce_time(gradient_bytes, accelerator, num_cores):
    """Seconds to all-reduce ``gradient_bytes`` per core across ``num_cores`` cores of ``accelerator``.

    The cores of one chip first combine through HBM (read twice, written once);
    the chips then run a bidirectional ring: each chip sends and receives
    ``2 (c - 1) / c`` of the bytes at its all-reduce ICI bandwidth, over
    ``2 (c - 1)`` steps of one hop's latency.

    Example:
        >>> round(allreduce_time(100e6, "v2-8", 8) * 1e3, 2)     # 100 MB of float32 gradients
        1.47
    """
    spec, _ = accelerator_spec(accelerator) if isinstance(accelerator, str) else (accelerator, None)
    if num_cores <= 1 or gradient_bytes <= 0:
        return 0.0
    figures = system_figures(spec.generation)
    on_chip = min(num_cores, spec.cores_per_chip)
    chips = max(1, num_cores // spec.cores_per_chip)
    seconds = 0.0
    if on_chip > 1:
        seconds += 3 * gradient_bytes / spec.hbm_bytes_per_second_per_core
    if chips > 1:
        seconds += 2 * (chips - 1) / chips * gradient_bytes / figures.ici_allreduce_bytes_per_second_per_chip
        seconds += 2 * (chips - 1) * figures.ici_hop_latency_s
    return seconds


def input_time(input_bytes_per_step, accelerator, num_cores, where):
    """Seconds to bring one step's input (all cores of one host) from where the pipeline runs.

    Example:
        >>> round(input_time(1024 * 32 * 32 * 3 * 4, "v2-8", 8, "remote_client_input") * 1e3, 1)
        108.6
    """
    spec, _ = accelerator_spec(accelerator) if isinstance(accelerator, str) else (accelerator, None)
    where = deployment(where)
    figures = system_figures(spec.generation)
    host_cores = min(num_cores, figures.cores_per_host)
    enqueue = host_cores * HOST_INFEED_PER_CORE_S
    if where.input_over_network:
        return input_bytes_per_step / REMOTE_FEED_BYTES_PER_S + enqueue
    chips = max(1, math.ceil(host_cores / spec.cores_per_chip))
    return input_bytes_per_step / (chips * figures.host_link_bytes_per_second_per_chip) + enqueue


# -- the step --------------------------------------------------------------------------------------------------------

PARTS = ("mxu", "vector", "memory", "allreduce", "input", "host")
PART_NAMES = {"mxu": "MXU", "vector": "vector unit", "memory": "HBM", "allreduce": "all-reduce",
              "input": "input", "host": "host"}


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The parts of one step on one core, in seconds, and how they combine.

    ``mxu``, ``vector`` and ``memory`` are the core's kernels (each kernel's
    time goes to the part that bounds it, its launch latency included);
    ``allreduce`` follows them; ``input`` overlaps the device step; ``host`` is
    the per-call cost already divided by the steps per call.

    Example:
        >>> t = StepTime(mxu=3e-3, vector=1e-3, memory=2e-3, allreduce=0.0, input=0.1, host=0.01)
        >>> round(t.total, 3), t.bound
        (0.11, 'input')
    """

    mxu: float
    vector: float
    memory: float
    allreduce: float
    input: float
    host: float
    input_bytes: float = 0.0
    call_s: float = 0.0
    steps_per_call: int = 1
    deployment: str = "tpu_vm"

    @property
    def device(self):
        """The core's own time: its kernels and the all-reduce."""
        return self.mxu + self.vector + self.memory + self.allreduce

    @property
    def total(self):
        """Predicted time of one step: ``max(device, input) + host``."""
        return max(self.device, self.input) + self.host

    def exposed(self):
        """Each part's share of :attr:`total` on the critical path, in seconds (they sum to ``total``)."""
        if self.input > self.device:
            hidden = dict(mxu=0.0, vector=0.0, memory=0.0, allreduce=0.0)
            return dict(hidden, input=self.input, host=self.host)
        return dict(mxu=self.mxu, vector=self.vector, memory=self.memory, allreduce=self.allreduce,
                    input=0.0, host=self.host)

    @property
    def bound(self):
        """The part with the largest exposed time."""
        exposed = self.exposed()
        return max(PARTS, key=lambda p: exposed[p])

    def shares(self):
        """Exposed share of the step per part."""
        total = self.total or 1.0
        return {p: t / total for p, t in self.exposed().items()}

    def replaced(self, accelerator, num_cores, deployment_name=None, steps_per_call=None):
        """The same step with another deployment or steps per call (the device parts unchanged)."""
        where = deployment(deployment_name or self.deployment)
        steps = steps_per_call or self.steps_per_call
        return dataclasses.replace(
            self, input=input_time(self.input_bytes, accelerator, num_cores, where), host=where.call_s / steps,
            call_s=where.call_s, steps_per_call=steps, deployment=where.name)

    def describe(self):
        """One line: the total, the bound and each part's share."""
        shares = self.shares()
        parts = ", ".join(f"{PART_NAMES[p]} {shares[p]:.0%}" for p in PARTS if shares[p] >= 0.005)
        return f"{self.total * 1e3:.3f} ms per step, bound by {PART_NAMES[self.bound]} ({parts})"


__all__ = ["DEFAULT_DEPLOYMENT", "DEPLOYMENTS", "Deployment", "HOST_INFEED_PER_CORE_S", "KERNEL_LATENCY_CYCLES",
           "LOCAL_CALL_S", "PARTS",
           "REMOTE_CALL_S", "REMOTE_FEED_BYTES_PER_S", "StepTime", "VectorKernels", "allreduce_time", "deployment",
           "input_time", "vector_kernels"]
