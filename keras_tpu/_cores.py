"""The eight-core layout: where the simulated TPU cores live and how they talk.

Each core runs the same program on its own slice of the global batch (TPU
replication). How the cores are laid onto this host is a simulation choice,
not part of what is simulated:

* **One process (the default): every core on one JAX device.** A TPU needs
  eight copies of the weights because it has eight HBMs; one host does not.
  The cores' per-row work (forward and backward passes, BatchNormalization
  statistics, dropout streams) is mapped over a *core axis* inside one device
  program, while the replicated state (weights, optimizer slots) exists once
  and is updated once. The cross-core all-reduce of the gradients becomes one
  contraction over all rows (:mod:`keras_tpu._replicated_steps`), so no
  cross-device collective is left to wait on: eight XLA:CPU devices meeting in
  collectives on two host cores could starve past XLA's rendezvous timeout
  and abort the process.
* **A pod (several processes): one device per process**, holding that
  worker's cores the same way; the processes meet in JAX's collectives.

Any other arrangement (several devices per process, as for experiments: ask
JAX for them before it starts, e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)
works too, with identical results; programs on such layouts bound how many of
them are in flight (see :attr:`CoreLayout.max_programs_in_flight`).

Inside a per-device program, :meth:`CoreLayout.map_cores` maps a function
over the device's cores and :meth:`CoreLayout.device_sum` /
:meth:`CoreLayout.device_gather` combine across devices. Inside a per-core
function (:meth:`CoreLayout.per_core`, used by ``TPUStrategy.run``),
:meth:`core_index`, :meth:`psum`, :meth:`pmean` and :meth:`all_gather` talk
across cores as on a TPU.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from keras_tpu import _host as host

DEVICE_AXIS = "tpu_device"
CORE_AXIS = "tpu_core"

#: PartitionSpecs of per-device program arguments: split by rows, or the same everywhere.
ROWS = PartitionSpec(DEVICE_AXIS)
REPLICATED = PartitionSpec()


class ProgramsInFlight:
    """The outputs of programs dispatched and not yet waited for: at most ``limit`` of them.

    JAX returns from a call before its program has run; :meth:`add` waits for
    the oldest program once more than ``limit`` are queued.

    Example:
        >>> in_flight = ProgramsInFlight(2)
        >>> for step in range(5):
        ...     in_flight.add(jnp.full(3, step))   # waits for step - 2's program
        >>> len(in_flight)
        2
    """

    def __init__(self, limit):
        self.limit = limit
        self._outputs = collections.deque()

    def add(self, outputs):
        """Note a dispatched program's ``outputs`` (not its donated state: all outputs are ready together)."""
        self._outputs.append(outputs)
        while len(self._outputs) > self.limit:
            jax.block_until_ready(self._outputs.popleft())

    def __len__(self):
        return len(self._outputs)


def same_arrays(leaves, others):
    """Whether two lists of arrays hold the very same array objects (a step's state handed back by Keras).

    Example:
        >>> a = jnp.ones(3)
        >>> same_arrays([a], [a]), same_arrays([a], [jnp.ones(3)])
        (True, False)
    """
    return len(leaves) == len(others) and all(a is b for a, b in zip(leaves, others))


class CoreLayout:
    """``num_cores`` simulated TPU cores placed on JAX devices, ``cores_per_device`` on each.

    Args:
        num_cores: the TPU cores to simulate.
        devices: the JAX devices to hold them (default: one device per
            process, see the module docstring). ``num_cores`` must be a
            multiple of their number.

    Example:
        >>> layout = CoreLayout(8)
        >>> layout.num_devices, layout.cores_per_device
        (1, 8)
        >>> def core_fn(x):          # x: this core's rows
        ...     return layout.psum(x.sum())
        >>> total = layout.per_core(core_fn, sharded_args=(True,), sharded_outputs=False)(np.ones((16, 3)))
        >>> float(total)
        48.0
    """

    def __init__(self, num_cores, devices=None):
        if devices is None:
            devices = host.devices_for_cores(num_cores)
        devices = list(devices)
        if not devices or num_cores % len(devices):
            raise ValueError(f"{num_cores} cores cannot be spread evenly over {len(devices)} devices.")
        self.num_cores = int(num_cores)
        self.devices = devices
        self.cores_per_device = self.num_cores // len(devices)
        self.mesh = Mesh(np.array(devices), (DEVICE_AXIS,))

    @classmethod
    def abstract(cls, num_cores, num_devices=1):
        """A layout without devices, to trace programs (``jax.make_jaxpr``) for any core count.

        Example:
            >>> CoreLayout.abstract(8).cores_per_device
            8
        """
        if num_cores % num_devices:
            raise ValueError(f"{num_cores} cores cannot be spread evenly over {num_devices} devices.")
        layout = cls.__new__(cls)
        layout.num_cores, layout.devices = int(num_cores), None
        layout.cores_per_device = layout.num_cores // num_devices
        layout.mesh = AbstractMesh((num_devices,), (DEVICE_AXIS,))
        return layout

    def sub_layout(self, num_cores):
        """The first ``num_cores`` cores of this layout (e.g. ``using_single_core`` or ``num_shards``).

        Example:
            >>> CoreLayout(8).sub_layout(1).num_cores
            1
        """
        if not 1 <= num_cores <= self.num_cores:
            raise ValueError(f"A layout of {self.num_cores} cores has no sub-layout of {num_cores} cores.")
        if self.devices is None:
            return CoreLayout.abstract(num_cores, 1)
        devices = self.devices[:max(1, num_cores // self.cores_per_device)]
        if num_cores % len(devices):
            devices = devices[:1]
        return CoreLayout(num_cores, devices=devices)

    @property
    def num_devices(self):
        """How many JAX devices hold the cores (one per process; a pod's workers one each)."""
        return self.num_cores // self.cores_per_device  # (cheaper than asking the mesh, on every step)

    @property
    def is_abstract(self):
        """Whether the layout has no devices (shapes only: the HBM estimate and the TPU profile)."""
        return self.devices is None

    @property
    def max_programs_in_flight(self):
        """How many programs may be dispatched before the oldest must finish (see :class:`ProgramsInFlight`).

        Two: the host prepares the next step while one runs. More queued
        programs only hold their batches: the 784-1024-1024-10 MLP's 30-step
        fit at batch 1024 peaked at 720 MiB with no bound, 614 with two (plain
        Keras: 665), equally fast; across devices of one process, XLA:CPU
        collectives wait for every device's thread, and with many programs
        queued on few host cores a starved device can miss XLA's 40 s
        rendezvous timeout.
        """
        return 2

    def describe(self):
        """Where the cores live, in words: ``"1 JAX CPU device(s), 8 cores each"``."""
        kind = "abstract" if self.is_abstract else self.devices[0].platform.upper()
        if self.cores_per_device == 1:
            return f"{self.num_devices} JAX {kind} devices, one core each"
        return f"{self.num_devices} JAX {kind} device(s), {self.cores_per_device} cores each"

    def core_devices(self):
        """The device that holds each core, in core order."""
        return [d for d in (self.devices or [None] * self.num_devices) for _ in range(self.cores_per_device)]

    def __repr__(self):
        return f"CoreLayout({self.num_cores} cores on {self.describe()})"

    def holds(self, value):
        """Whether ``value`` is an array placed on this layout's cores (a TPU program's input or output)."""
        sharding = getattr(value, "sharding", None)
        return isinstance(value, jax.Array) and isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh

    # -- inside a per-device program (see per_device) ------------------------------------

    def local_core_ids(self):
        """The global indices of this device's cores, int32 ``(cores_per_device,)``."""
        if self.num_devices == 1:  # also outside a per-device program (tracing one device's step)
            return jnp.arange(self.cores_per_device, dtype=jnp.int32)
        first = lax.axis_index(DEVICE_AXIS) * self.cores_per_device
        return (first + jnp.arange(self.cores_per_device)).astype(jnp.int32)

    def split_cores(self, tree):
        """This device's rows ``(rows, ...)`` as ``(cores_per_device, rows // cores_per_device, ...)``."""
        cores = self.cores_per_device
        return jax.tree.map(lambda a: a.reshape((cores, a.shape[0] // cores) + a.shape[1:]), tree)

    def merge_cores(self, tree):
        """Inverse of :meth:`split_cores`: per-core rows back to this device's rows, in core order."""
        return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), tree)

    def map_cores(self, fn, in_axes, looped=False):
        """Map ``fn`` over this device's cores, like ``jax.vmap`` over a core axis.

        Arguments with ``in_axes`` 0 carry a leading core axis; ``None``
        arguments are shared by all cores (the replicated weights: one copy,
        and autodiff sums their gradients over the cores in one contraction).
        Outputs get a leading core axis.

        ``looped`` runs the cores one after another in a loop (``lax.map``)
        instead of as one vectorised batch: each layer then runs at the core's
        own batch size, which some XLA:CPU kernels (convolutions) run faster,
        from one compiled copy of ``fn``. The results are the same. Inside
        ``fn``, :meth:`core_index` and the cross-core collectives work only
        when vectorised. To differentiate a loop over the cores, see
        :meth:`value_and_grad_over_cores`.

        Example:
            >>> layout = CoreLayout.abstract(8)
            >>> square = layout.map_cores(lambda w, x: w * x ** 2, in_axes=(None, 0), looped=True)
            >>> square(2.0, jnp.arange(8.0)).tolist()[:3]
            [0.0, 2.0, 8.0]
        """
        cores = self.cores_per_device
        if not looped or cores == 1:
            # axis_size: every argument may be shared (a replica function given the same inputs on every core).
            return jax.vmap(fn, in_axes=in_axes, axis_name=CORE_AXIS, axis_size=cores)

        def each_core(*args):
            axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
            if all(axis is None for axis in axes):
                return lax.map(lambda _: fn(*args), jnp.arange(cores))
            mapped = [None if axis is None else a for a, axis in zip(args, axes)]
            return lax.map(lambda core: fn(*(a if axis is None else c for a, c, axis in zip(args, core, axes))),
                           mapped)

        return each_core

    def value_and_grad_over_cores(self, fn, params, *per_core, has_aux=False, carry=None, value_and_grad=None):
        """``jax.value_and_grad`` of ``sum over cores of fn(params, *core's args)``, the cores run in a loop.

        ``per_core`` arguments carry a leading core axis (this device's cores).
        Returns ``(values, grads)``: ``fn``'s outputs (the value, or
        ``(value, aux)`` with ``has_aux``) stacked over the cores, and the
        gradient with respect to ``params`` summed over them. Each core's
        forward and backward pass run in one loop iteration at the core's own
        batch size, from one compiled copy of the program: unlike
        differentiating :meth:`map_cores` with ``looped``, the loop keeps no
        per-core activations for a backward loop (which XLA would allocate and
        zero for all cores), only the running sum of the gradients.

        With ``carry`` (and ``has_aux``), ``fn(params, carry, *args)`` returns
        ``(value, (aux, carry))``: a value threaded from core to core (not
        differentiated), such as a running sum that would otherwise be stacked
        over the cores and reduced after the loop. Returns ``(values, grads,
        carry)`` then. ``value_and_grad``, if given, computes one core's
        ``jax.value_and_grad(fn, has_aux=has_aux)`` (e.g. from a trace kept for reuse).

        Example:
            >>> layout = CoreLayout.abstract(8)
            >>> values, grads = layout.value_and_grad_over_cores(lambda w, x: w * x ** 2, 2.0, jnp.arange(8.0))
            >>> float(grads) == float(jnp.sum(jnp.arange(8.0) ** 2))
            True
            >>> _, grads, cores = layout.value_and_grad_over_cores(   # a count threaded through the cores
            ...     lambda w, n, x: (w * x, (x, n + 1)), 2.0, jnp.arange(8.0), has_aux=True, carry=0)
            >>> float(grads), int(cores)
            (28.0, 8)
        """
        value_and_grad = value_and_grad or jax.value_and_grad(fn, has_aux=has_aux)
        if self.cores_per_device == 1:  # one core: the same without a loop
            stacked = lambda tree: jax.tree.map(lambda a: a[None], tree)
            args = jax.tree.map(lambda a: a[0], per_core)
            if carry is None:
                values, grads = value_and_grad(params, *args)
                return stacked(values), grads
            (value, (aux, carry)), grads = value_and_grad(params, carry, *args)
            return stacked((value, aux)), grads, carry

        if carry is None:
            def core(summed, args):
                values, grads = value_and_grad(params, *args)
                return jax.tree.map(jnp.add, summed, grads), values

            summed = jax.tree.map(jnp.zeros_like, params)
            summed, values = lax.scan(core, summed, per_core)
            return values, summed

        def core_with_carry(state, args):
            summed, threaded = state
            (value, (aux, threaded)), grads = value_and_grad(params, threaded, *args)
            return (jax.tree.map(jnp.add, summed, grads), threaded), (value, aux)

        (summed, carry), values = lax.scan(core_with_carry, (jax.tree.map(jnp.zeros_like, params), carry), per_core)
        return values, summed, carry

    def device_sum(self, tree):
        """Sum over the devices of the layout (nothing to do on one device)."""
        if self.num_devices == 1:
            return tree
        return jax.tree.map(lambda x: lax.psum(x, DEVICE_AXIS), tree)

    def device_gather(self, tree):
        """Concatenate every device's rows along axis 0, in core order (nothing to do on one device)."""
        if self.num_devices == 1:
            return tree
        return jax.tree.map(lambda x: lax.all_gather(x, DEVICE_AXIS, axis=0, tiled=True), tree)

    def device_shapes(self, args, specs):
        """What one device's program sees of ``args`` (global arrays, one :data:`ROWS` or :data:`REPLICATED` spec
        each): ``jax.ShapeDtypeStruct`` pytrees, :data:`ROWS` arguments' rows divided over the devices.

        With :meth:`axis_env`, for tracing a device program abstractly outside :meth:`per_device`.

        Example:
            >>> CoreLayout.abstract(8, num_devices=2).device_shapes((np.ones((16, 3)),), (ROWS,))[0].shape
            (8, 3)
        """
        def local(a, spec):
            shape = tuple(np.shape(a))
            if spec == ROWS:
                shape = (shape[0] // self.num_devices,) + shape[1:]
            # As a jitted program sees it: NumPy's int64 labels arrive as int32 unless x64 is on.
            return jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(a.dtype))

        return tuple(jax.tree.map(lambda a, spec=spec: local(a, spec), arg) for arg, spec in zip(args, specs))

    def axis_env(self):
        """The collective axes of a device program, for :func:`jax.make_jaxpr`'s ``axis_env``."""
        return [(DEVICE_AXIS, self.num_devices)]

    def per_device(self, device_fn, in_specs, out_specs):
        """Turn ``device_fn`` (one device's program) into a function of global arrays.

        ``in_specs``/``out_specs``: one :data:`ROWS` or :data:`REPLICATED` per
        argument/output. :data:`ROWS` arguments are split by rows over the
        devices, in core order; :data:`REPLICATED` values are whole on every
        device (outputs: identical on every device by construction).
        """
        return jax.shard_map(device_fn, mesh=self.mesh, in_specs=tuple(in_specs), out_specs=tuple(out_specs),
                             # Replicated outputs are identical on every device by construction (summed
                             # gradients, one update rule), which JAX cannot prove: skip its check.
                             check_vma=False)

    # -- inside a per-core function (see per_core) -------------------------------------

    def core_index(self):
        """This core's index, 0 .. num_cores - 1 (only inside :meth:`per_core` or :meth:`map_cores`)."""
        return lax.axis_index(DEVICE_AXIS) * self.cores_per_device + lax.axis_index(CORE_AXIS)

    def psum(self, tree):
        """Sum over all cores."""
        return self.device_sum(jax.tree.map(lambda x: lax.psum(x, CORE_AXIS), tree))

    def pmean(self, tree):
        """Mean over all cores."""
        return jax.tree.map(lambda x: x / self.num_cores, self.psum(tree))

    def all_gather(self, tree):
        """Concatenate every core's value along axis 0, in core order (scalars are stacked)."""
        def gather(x):
            x = x[None] if x.ndim == 0 else x
            return lax.all_gather(x, CORE_AXIS, axis=0, tiled=True)
        return self.device_gather(jax.tree.map(gather, tree))

    # -- placing arrays and running per-core functions ------------------------------------

    def batch_sharding(self):
        """The sharding of a global batch: rows split over the devices, in core order."""
        return NamedSharding(self.mesh, ROWS)

    def replicated_sharding(self):
        """The sharding of a value every core holds whole (weights, optimizer state)."""
        return NamedSharding(self.mesh, REPLICATED)

    def per_core(self, core_fn, sharded_args, sharded_outputs):
        """Turn ``core_fn`` (one core's program) into a function of global arrays.

        Args:
            core_fn: called once per core. Arguments marked sharded receive
                this core's rows (axis 0 split evenly over the cores, in
                order); the others receive the whole value.
            sharded_args: one bool per positional argument.
            sharded_outputs: a bool, or a tuple of bools (one per output of
                ``core_fn``): True for per-core rows to concatenate, False for
                values that are identical on every core.

        Returns a function to be called (typically under ``jax.jit``) with
        global arrays.
        """
        sharded_args = tuple(sharded_args)
        single_output = isinstance(sharded_outputs, bool)
        out_flags = (sharded_outputs,) if single_output else tuple(sharded_outputs)

        def wrapped(*core_args):
            outputs = core_fn(*core_args)
            return (outputs,) if single_output else tuple(outputs)

        def device_fn(*args):
            split = [self.split_cores(arg) if s else arg for arg, s in zip(args, sharded_args)]
            outputs = self.map_cores(wrapped, tuple(0 if s else None for s in sharded_args))(*split)
            # Per-core rows back to the device's rows; values equal on every core: the first copy.
            return tuple(self.merge_cores(out) if s else jax.tree.map(lambda a: a[0], out)
                         for out, s in zip(outputs, out_flags))

        spec = lambda s: ROWS if s else REPLICATED
        mapped = self.per_device(device_fn, [spec(s) for s in sharded_args], [spec(s) for s in out_flags])

        def run(*args):
            outputs = mapped(*args)
            return outputs[0] if single_output else outputs

        return run
