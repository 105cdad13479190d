"""Exporting a trained model's inference function with ``jax.export``.

An export is a directory holding:

* ``inference.jaxexport``: the inference step, serialized by ``jax.export``
  (StableHLO), with the MXU's numerics built in and a batch dimension of any
  size;
* ``weights.npz``: the weights it takes as arguments;
* ``meta.json``: input names, shapes and dtypes, output names, precision.

:func:`load_exported` needs only JAX and NumPy, not the model's Python code
or Keras: the artifact runs in a fresh process on the CPU and gives the same
predictions as the TPU model, for any batch size.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from keras_tpu import _files
from keras_tpu.mxu import _kernels as kernels

ARTIFACT = "inference.jaxexport"
WEIGHTS = "weights.npz"
META = "meta.json"


def _input_structure(model):
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError("Exporting needs a model with known inputs (functional or Sequential with an Input).")
    return [(getattr(t, "name", f"input_{i}"), tuple(t.shape[1:]), str(t.dtype)) for i, t in enumerate(inputs)]


def export_model(model, path, precision="default", pod_sync=False):
    """Export ``model``'s inference function (on the MXU at ``precision``) to the directory ``path``.

    The directory is written under a temporary name and swapped in when complete:
    ``path`` holds the previous export or the new one, never a half-written one.
    In a pod, ``pod_sync=True`` (for callers running on every worker) has the chief
    write while every worker waits; the default is for callers that already run
    on the chief only.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> export_model(model, "/tmp/exported_example")
        '/tmp/exported_example'
        >>> load_exported("/tmp/exported_example")(np.ones((3, 4), np.float32)).shape
        (3, 2)
    """
    from keras_tpu import _keras_private
    from keras_tpu.mxu._routing import route

    inputs = _input_structure(model)
    trainable = [np.asarray(v.value) for v in model.trainable_variables]
    non_trainable = [np.asarray(v.value) for v in model.non_trainable_variables]
    kwargs = _keras_private.inference_kwargs(model)
    single = len(inputs) == 1

    def infer(trainable, non_trainable, *xs):
        outputs, _ = model.stateless_call(trainable, non_trainable, xs[0] if single else list(xs), **kwargs)
        return outputs

    (batch,) = jax.export.symbolic_shape("batch")
    specs = [jax.ShapeDtypeStruct((batch,) + shape, dtype) for _, shape, dtype in inputs]
    weight_specs = [[jax.ShapeDtypeStruct(w.shape, w.dtype) for w in ws] for ws in (trainable, non_trainable)]
    exported = jax.export.export(jax.jit(route(infer, precision)), platforms=["cpu"])(*weight_specs, *specs)
    output_names = list(getattr(model, "output_names", None) or [])

    def write(staging):
        with open(os.path.join(staging, ARTIFACT), "wb") as f:
            f.write(exported.serialize())
        np.savez(os.path.join(staging, WEIGHTS), **{f"t{i}": w for i, w in enumerate(trainable)},
                 **{f"n{i}": w for i, w in enumerate(non_trainable)})
        with open(os.path.join(staging, META), "w") as f:
            json.dump({"format": "keras_tpu._export/1", "model": model.name, "precision": str(precision),
                       "inputs": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in inputs],
                       "outputs": output_names, "trainable": len(trainable), "non_trainable": len(non_trainable)},
                      f, indent=2)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _files.save_directory(path, write, pod_sync=pod_sync)
    return path


def _rows_merged_under_vmap(call):
    """``call(trainable, non_trainable, *inputs)`` (an exported inference function, any batch size), which
    ``jax.vmap`` (``strategy.run``'s cores) maps by running it once on every core's rows together: JAX has no
    batching rule for an exported function, and its batch axis takes the cores' rows as they are."""
    mapped = jax.custom_batching.custom_vmap(call)

    @mapped.def_vmap
    def rule(axis_size, in_batched, trainable, non_trainable, *inputs):
        if any(jax.tree.leaves(in_batched[:2])):
            raise ValueError("An exported model maps over the cores with the same weights on every core only.")
        def merged(a, batched):  # (cores, rows, ...) -> (cores * rows, ...)
            a = a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
            return a.reshape((-1,) + a.shape[2:])

        out = call(trainable, non_trainable, *[merged(a, batched) for a, batched in zip(inputs, in_batched[2:])])
        return (jax.tree.map(lambda a: a.reshape((axis_size, -1) + a.shape[1:]), out),
                jax.tree.map(lambda _: True, out))

    return mapped


class ExportedModel:
    """A loaded export: call it with input arrays (any batch size) to get predictions."""

    def __init__(self, path):
        for name in (ARTIFACT, WEIGHTS, META):
            if not os.path.exists(os.path.join(path, name)):
                raise FileNotFoundError(f"{path!r} is not a keras_tpu export: {name} is missing.")
        with open(os.path.join(path, META)) as f:
            self.meta = json.load(f)
        with open(os.path.join(path, ARTIFACT), "rb") as f:
            self.exported = jax.export.deserialize(bytearray(f.read()))
        # Compiled as keras-tpu's own programs are: XLA's default would let it drop the MXU's bf16 roundings
        # where it fuses them with a reduction (see keras_tpu.mxu._kernels.compiler_options).
        self._predict = jax.jit(self.exported.call, compiler_options=kernels.compiler_options("predict"))
        self._traced_call = _rows_merged_under_vmap(self.exported.call)
        with np.load(os.path.join(path, WEIGHTS)) as weights:
            self.trainable = [weights[f"t{i}"] for i in range(self.meta["trainable"])]
            self.non_trainable = [weights[f"n{i}"] for i in range(self.meta["non_trainable"])]

    @property
    def input_names(self):
        return [spec["name"] for spec in self.meta["inputs"]]

    def __call__(self, *inputs):
        specs = self.meta["inputs"]
        if len(inputs) == 1 and isinstance(inputs[0], dict):
            inputs = [inputs[0][name] for name in self.input_names]
        if len(inputs) != len(specs):
            raise ValueError(f"This export takes {len(specs)} input(s) {self.input_names}; got {len(inputs)}.")
        # Traced (strategy.run, the user's jax.jit): the exported function is traced into that program.
        traced = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(inputs))
        arrays = []
        for array, spec in zip(inputs, specs):
            array = (jnp.asarray if traced else np.asarray)(array, dtype=spec["dtype"])
            if tuple(array.shape[1:]) != tuple(spec["shape"]):
                raise ValueError(f"Input {spec['name']!r} must have shape (batch, {', '.join(map(str, spec['shape']))})"
                                 f"; got {array.shape}.")
            arrays.append(array)
        if traced:
            return self._traced_call(self.trainable, self.non_trainable, *arrays)
        return jax.tree.map(np.asarray, self._predict(self.trainable, self.non_trainable, *arrays))


def load_exported(path):
    """Load an export written by ``tpu_model.export`` (or the estimator's ``export_saved_model``).

    Example:
        >>> predict = load_exported("/tmp/exported_example")     # doctest: +SKIP
        >>> predict(np.zeros((5, 4), np.float32)).shape          # doctest: +SKIP
        (5, 2)
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No export directory at {path!r}.")
    return ExportedModel(path)
