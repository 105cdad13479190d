"""The eight-core layout: where the simulated TPU cores live and how they talk.

Each core runs the same per-core program on its own slice of the global batch
(TPU replication). Cores are JAX devices arranged in a one-axis mesh; when JAX
has fewer devices than cores, each device holds several cores, vectorised
with ``jax.vmap``. Cross-core collectives (sum, mean, gather) work the same in
both arrangements, in core order, so results do not depend on it.
"""

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from keras_tpu import host

DEVICE_AXIS = "tpu_device"
CORE_AXIS = "tpu_core"


class CoreLayout:
    """``num_cores`` simulated TPU cores placed on JAX devices.

    Inside a function run by :meth:`per_core`, use :meth:`core_index`,
    :meth:`psum`, :meth:`pmean` and :meth:`all_gather` to talk across cores.

    Example:
        >>> layout = CoreLayout(8)
        >>> def core_fn(x):          # x: this core's rows
        ...     return layout.psum(x.sum())
        >>> total = layout.per_core(core_fn, sharded_args=(True,), sharded_outputs=False)(np.ones((16, 3)))
    """

    def __init__(self, num_cores, devices=None):
        if devices is None:
            devices, cores_per_device = host.devices_for_cores(num_cores)
        else:
            if num_cores % len(devices):
                raise ValueError(f"{num_cores} cores cannot be spread evenly over {len(devices)} devices.")
            cores_per_device = num_cores // len(devices)
        self.num_cores = num_cores
        self.devices = list(devices)
        self.cores_per_device = cores_per_device
        self.mesh = Mesh(np.array(self.devices), (DEVICE_AXIS,))

    @classmethod
    def for_tracing(cls, num_cores):
        """A layout with one core per (imaginary) device, to trace a per-core program with
        ``jax.make_jaxpr(fn, axis_env=layout.axis_env())`` without any devices."""
        layout = cls.__new__(cls)
        layout.num_cores, layout.devices, layout.cores_per_device, layout.mesh = num_cores, [], 1, None
        return layout

    def axis_env(self):
        """Axis sizes for tracing a per-core function outside :meth:`per_core`."""
        return [(DEVICE_AXIS, self.num_cores)] + ([(CORE_AXIS, self.cores_per_device)]
                                                  if self.cores_per_device > 1 else [])

    @property
    def num_devices(self):
        return len(self.devices)

    def describe(self):
        if self.cores_per_device == 1:
            return f"{self.num_devices} JAX {self.devices[0].platform.upper()} devices, one core each"
        return (f"{self.num_devices} JAX {self.devices[0].platform.upper()} device(s), "
                f"{self.cores_per_device} cores each")

    def core_devices(self):
        """The device that holds each core, in core order."""
        return [d for d in self.devices for _ in range(self.cores_per_device)]

    # -- inside a per-core function -------------------------------------------------

    def core_index(self):
        """This core's index, 0 .. num_cores - 1 (only inside :meth:`per_core`)."""
        index = lax.axis_index(DEVICE_AXIS) * self.cores_per_device
        if self.cores_per_device > 1:
            index = index + lax.axis_index(CORE_AXIS)
        return index

    def psum(self, tree):
        """Sum over all cores."""
        def total(x):
            if self.cores_per_device > 1:
                x = lax.psum(x, CORE_AXIS)
            return lax.psum(x, DEVICE_AXIS)
        return jax.tree.map(total, tree)

    def pmean(self, tree):
        """Mean over all cores."""
        return jax.tree.map(lambda x: x / self.num_cores, self.psum(tree))

    def all_gather(self, tree):
        """Concatenate every core's value along axis 0, in core order (scalars are stacked)."""
        def gather(x):
            if x.ndim == 0:
                x = x[None]
            if self.cores_per_device > 1:
                x = lax.all_gather(x, CORE_AXIS, axis=0, tiled=True)
            return lax.all_gather(x, DEVICE_AXIS, axis=0, tiled=True)
        return jax.tree.map(gather, tree)

    # -- running per-core programs ----------------------------------------------------

    def batch_sharding(self):
        """The sharding of a global batch: rows split over the devices, in core order."""
        return NamedSharding(self.mesh, PartitionSpec(DEVICE_AXIS))

    def replicated_sharding(self):
        return NamedSharding(self.mesh, PartitionSpec())

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
        cpd = self.cores_per_device

        def per_device(*args):
            if cpd == 1:
                outputs = core_fn(*args)
                return (outputs,) if single_output else tuple(outputs)
            split = [
                jax.tree.map(lambda a: a.reshape((cpd, a.shape[0] // cpd) + a.shape[1:]), arg) if s else arg
                for arg, s in zip(args, sharded_args)
            ]

            def wrapped(*core_args):
                outputs = core_fn(*core_args)
                return (outputs,) if single_output else tuple(outputs)

            outputs = jax.vmap(wrapped, in_axes=tuple(0 if s else None for s in sharded_args),
                               axis_name=CORE_AXIS)(*split)
            # Cores on one device are stacked on axis 0: merge them back into rows,
            # or keep the first copy of values that are the same on every core.
            return tuple(
                jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), out) if s
                else jax.tree.map(lambda a: a[0], out)
                for out, s in zip(outputs, out_flags)
            )

        spec = lambda s: PartitionSpec(DEVICE_AXIS) if s else PartitionSpec()
        mapped = jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=tuple(spec(s) for s in sharded_args),
            out_specs=tuple(spec(s) for s in out_flags),
            # Replicated outputs are identical on every core by construction
            # (all-reduced gradients, identical updates); see step.py.
            check_vma=False,
        )

        def run(*args):
            outputs = mapped(*args)
            return outputs[0] if single_output else outputs

        return run
