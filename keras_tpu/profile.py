"""TPU profile: what the matrix units do with a model, op by op.

:func:`profile` traces one training step and one inference step of a Keras
model exactly as the simulated TPU runs them (the per-core programs of
:mod:`keras_tpu.replicated_steps`), finds every MXU operation, names it after
its Keras layer and pass, and costs it on one core of the chosen accelerator
with the SCALE-Sim v2 weight-stationary model (:mod:`keras_tpu.mxu.cost`).
Every core runs the same program on its share of the batch, so a Conv2D at
global batch 1024 on a v2-8 is a GEMM with ``M = 128 * out_h * out_w``.

The report prints as a table, converts to rows, plots utilisation and time
per layer, exports SCALE-Sim topology files, and gives the advice of the
Cloud TPU performance guide with the gain the cost model predicts. Times are
the matrix units' time only (a lower bound of a real step).
"""

import csv
import dataclasses
import math

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_tpu import _keras_private, hbm, rewrite
from keras_tpu.cluster import accelerator_spec
from keras_tpu.cores import CoreLayout
from keras_tpu.mxu.program import mxu_ops
from keras_tpu.placement import installed_on
from keras_tpu.replicated_steps import ReplicatedSteps


@dataclasses.dataclass
class OpRow:
    """One MXU operation of a step, on one core."""

    step: str            # "train" or "inference"
    layer: str           # the Keras layer's name
    pass_name: str       # "forward" or "backward"
    kind: str            # "dot" or "conv"
    op: object           # keras_tpu.mxu.MXUOp
    timing: object       # keras_tpu.mxu.Timing of one execution

    @property
    def time_s(self):
        return self.op.repeats * self.timing.time_s

    def as_dict(self):
        cost = self.op.cost
        return {
            "step": self.step, "layer": self.layer, "pass": self.pass_name, "kind": self.kind,
            "m": cost.m, "k": cost.k, "n": cost.n, "groups": cost.count // self.op.precision.passes,
            "padded_m": cost.padded_shape[0], "padded_k": cost.padded_shape[1], "padded_n": cost.padded_shape[2],
            "repeats": self.op.repeats, "folds": cost.folds * self.op.repeats, "cycles": self.op.cycles,
            "macs": self.op.macs, "utilization": cost.utilization, "padding_waste": cost.padding_waste,
            "hbm_bytes": cost.hbm_bytes * self.op.repeats, "bound": self.timing.bound, "time_s": self.time_s,
        }


class TPUProfile:
    """The MXU report of one training and one inference step; see :func:`profile`."""

    def __init__(self, model_name, accelerator_type, num_cores, global_batch, dataset_size, rows, advice):
        self.model_name = model_name
        self.accelerator_type = accelerator_type
        self.num_cores = num_cores
        self.global_batch = global_batch
        self.per_core_batch = global_batch // num_cores
        self.dataset_size = dataset_size
        self._rows = rows
        self.advice = advice
        self.hbm = None  # the per-core HBM of the step (keras_tpu.hbm.HBMFootprint), set by profile()

    def rows(self, step=None):
        """The ops as dicts with keys ``layer``, ``pass``, ``m``, ``k``, ``n``, ``cycles``,
        ``utilization``, ``time_s`` and more; optionally of one step (``"train"``/``"inference"``)."""
        return [r.as_dict() for r in self._rows if step in (None, r.step)]

    def step_time(self, step):
        """Predicted MXU time of one step on one core (all cores run in parallel)."""
        return sum(r.time_s for r in self._rows if r.step == step)

    def step_cycles(self, step):
        return sum(r.op.cycles for r in self._rows if r.step == step)

    def padding_waste(self, step):
        """Share of the array's cell-cycles idle because operands do not fill whole folds."""
        cycles = self.step_cycles(step)
        return sum(r.op.cycles * r.op.cost.padding_waste for r in self._rows if r.step == step) / max(cycles, 1)

    def utilization(self, step):
        rows, cols = self._array_shape()
        cycles = self.step_cycles(step)
        return sum(r.op.macs for r in self._rows if r.step == step) / max(cycles * rows * cols, 1)

    def _array_shape(self):
        spec, _ = accelerator_spec(self.accelerator_type)
        return spec.mxu_rows, spec.mxu_cols

    def epoch_time(self, step="train"):
        """Predicted MXU time of an epoch over ``dataset_size`` examples."""
        if not self.dataset_size:
            return None
        return math.ceil(self.dataset_size / self.global_batch) * self.step_time(step)

    def layers(self, step):
        """Per layer and pass: summed cycles, MACs and time, in program order."""
        summary = {}
        for r in self._rows:
            if r.step != step:
                continue
            entry = summary.setdefault((r.layer, r.pass_name), {"layer": r.layer, "pass": r.pass_name,
                                                               "cycles": 0, "macs": 0, "time_s": 0.0})
            entry["cycles"] += r.op.cycles
            entry["macs"] += r.op.macs
            entry["time_s"] += r.time_s
        rows, cols = self._array_shape()
        for entry in summary.values():
            entry["utilization"] = entry["macs"] / max(entry["cycles"] * rows * cols, 1)
        return list(summary.values())

    def __str__(self):
        lines = [f"TPU profile of {self.model_name!r} on {self.accelerator_type}: {self.num_cores} cores, "
                 f"global batch {self.global_batch} ({self.per_core_batch} per core); costs per core"]
        header = (f"{'layer':24s} {'pass':8s} {'M':>8s} {'K':>6s} {'N':>6s} {'padded K x N':>13s} {'folds':>6s} "
                  f"{'cycles':>10s} {'MACs':>12s} {'util':>6s} {'HBM MB':>7s} {'bound':>7s} {'time us':>9s}")
        for step in ("train", "inference"):
            rows = [r for r in self._rows if r.step == step]
            if not rows:
                continue
            lines += ["", f"{step} step", header, "-" * len(header)]
            for r in rows:
                d = r.as_dict()
                lines.append(f"{r.layer[:24]:24s} {r.pass_name:8s} {d['m']:8d} {d['k']:6d} {d['n']:6d} "
                             f"{d['padded_k']:>6d}x{d['padded_n']:<6d} {d['folds']:6d} {d['cycles']:10d} "
                             f"{d['macs']:12d} {d['utilization']:6.1%} {d['hbm_bytes'] / 1e6:7.2f} {d['bound']:>7s} "
                             f"{d['time_s'] * 1e6:9.1f}")
            total = (f"{step} step: {self.step_cycles(step)} cycles, {self.step_time(step) * 1e3:.3f} ms per core, "
                     f"MXU utilisation {self.utilization(step):.1%}, {self.padding_waste(step):.1%} of the array "
                     f"idle from padding")
            if self.dataset_size:
                total += (f"; an epoch of {self.dataset_size} examples: "
                          f"{self.epoch_time(step):.3f} s")
            lines += ["-" * len(header), total]
        if self.hbm is not None:
            lines += ["", str(self.hbm)]
        if self.advice:
            lines += ["", "Advice (Cloud TPU performance guide):"] + [f"  * {a}" for a in self.advice]
        return "\n".join(lines)

    def hbm_buffers(self):
        """The largest buffers live at the step's HBM peak, as dicts (``name``, ``kind``, ``shape``,
        ``dtype``, ``bytes``), largest first."""
        return [dataclasses.asdict(b) for b in self.hbm.largest(len(self.hbm.buffers))] if self.hbm else []

    def plot(self, path, step="train"):
        """Save a PNG: utilisation and predicted time per layer and pass."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        entries = self.layers(step)
        labels = [f"{e['layer']} ({e['pass'][0]})" for e in entries]
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.35 * len(entries) + 1.8), sharey=True)
        y = np.arange(len(entries))
        left.barh(y, [100 * e["utilization"] for e in entries], color="tab:blue")
        left.set_xlim(0, 100)
        left.set_xlabel("MXU utilisation (%)")
        left.set_yticks(y, labels)
        left.invert_yaxis()
        right.barh(y, [1e6 * e["time_s"] for e in entries], color="tab:orange")
        right.set_xlabel("predicted time per step (us)")
        fig.suptitle(f"{self.model_name}: {step} step on {self.accelerator_type}, {self.per_core_batch} rows per core")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def to_scalesim_topology(self, path, step="train"):
        """Write the step's MXU ops as a SCALE-Sim v2 GEMM topology (``-i gemm``: M, N, K per row).

        Run it through SCALE-Sim with a weight-stationary config of the same
        array size: each row's "Total Cycles" equals that op's ``cycles`` for
        one execution of one group and pass.
        """
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["Layer Name", "M", "N", "K", ""])
            for i, r in enumerate(r for r in self._rows if r.step == step):
                cost = r.op.cost
                writer.writerow([f"{i}_{r.layer}_{r.pass_name}", cost.m, cost.n, cost.k, ""])
        return path


def _layer_names(model):
    names = {layer.name for layer in _keras_private.all_layers(model)}
    return names | {model.name}


def _layer_of(op, names):
    for scope in reversed(op.scopes):
        if scope in names:
            return scope
    return op.scopes[-1] if op.scopes else "(model)"


def _abstract(value):
    return jax.ShapeDtypeStruct(tuple(value.shape), value.dtype)


def _input_specs(model, per_core_batch):
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError("Profiling needs a model with known inputs (a functional or Sequential model with an "
                         "Input, or a model that has been built by calling it).")
    specs = [jax.ShapeDtypeStruct((per_core_batch,) + tuple(t.shape[1:]), t.dtype) for t in inputs]
    return specs[0] if len(specs) == 1 else specs


def _target_specs(model, per_core_batch):
    """Target shapes for the compiled loss: class indices for sparse losses (one per row and position of
    a sequence output), else the outputs' shapes."""
    outputs = model.outputs
    reductions = getattr(model, "loss", None)
    names = [str(getattr(l, "name", l)) for l in keras.tree.flatten(reductions)] if reductions else []
    sparse = any("sparse" in name.lower() for name in names)
    specs = [jax.ShapeDtypeStruct((per_core_batch,) + tuple(t.shape[1:-1]) + (1,), jnp.int32) if sparse else
             jax.ShapeDtypeStruct((per_core_batch,) + tuple(t.shape[1:]), jnp.float32) for t in outputs]
    return specs[0] if len(specs) == 1 else specs


def _step_ops(model, steps, step, per_core_batch, rows, cols, x_spec, y_spec):
    """The MXU ops of one core's training or inference step (``steps`` runs on one abstract core)."""
    state_parts = [model.trainable_variables, model.non_trainable_variables]
    if step == "train":
        model.optimizer.build(model.trainable_variables)
        state_parts += [model.optimizer.variables, model.metrics_variables]
        state = tuple([_abstract(v) for v in part] for part in state_parts)
        batch = (x_spec, y_spec, None)
        mask = jax.ShapeDtypeStruct((per_core_batch,), jnp.float32)
        fn = lambda state, batch, mask: steps.train_step(state, batch, mask, jnp.int32(per_core_batch))
        args = (state, batch, mask)
    else:
        state = tuple([_abstract(v) for v in part] for part in state_parts)
        kwargs = _keras_private.inference_kwargs(model)
        fn = lambda state, x: model.stateless_call(state[0], state[1], x, **kwargs)[0]
        args = (state, x_spec)
    closed = jax.make_jaxpr(rewrite.transform(fn, steps.rule))(*args)
    return mxu_ops(closed, rows, cols)


def _advice(profile_at, report):
    """The Cloud TPU performance guide's advice, with the cost model's predicted gains."""
    advice = []
    per_core = report.per_core_batch
    if per_core < 128 and any(r.step == "train" for r in report._rows):
        better = profile_at(128 * report.num_cores)
        now = report.step_time("train") / report.global_batch
        then = better.step_time("train") / better.global_batch
        advice.append(f"The per-core batch is {per_core}, below the MXU's 128 rows: a global batch of "
                      f"{128 * report.num_cores} (128 per core) would cut the MXU time per example by "
                      f"{1 - then / now:.0%} (utilisation {report.utilization('train'):.0%} -> "
                      f"{better.utilization('train'):.0%}).")
    elif per_core % 8:
        advice.append(f"The per-core batch ({per_core}) is not a multiple of 8; XLA pads it to one.")
    # Feature sizes are judged once per layer, on its forward ops.
    forward = [r for r in report._rows if r.step == "inference"] or [r for r in report._rows if not r.op.backward]
    seen = set()
    for r in forward:
        cost = r.op.cost
        inputs = "input features x kernel positions" if r.kind == "conv" else "input features"
        for axis, size, meaning, lines in (("K", cost.k, inputs, "rows"), ("N", cost.n, "output features", "columns")):
            if size % 128 == 0 or (r.layer, axis) in seen:
                continue
            seen.add((r.layer, axis))
            padded = math.ceil(size / 128) * 128
            note = "" if size % 8 == 0 else " It is not a multiple of 8 either, which XLA also pads in memory."
            advice.append(f"{r.layer}: {axis} = {size} ({meaning}) uses {size / padded:.0%} of the array's {lines} "
                          f"over its {padded // 128} fold(s); {padded} would take the same MXU time and do "
                          f"{padded / size:.2f}x the work.{note}")
    return advice


def profile(model, batch_size=None, accelerator_type=None, num_cores=None, dataset_size=None, precision="default",
            advise=True):
    """Profile one training step and one inference step of ``model`` on a simulated TPU.

    Args:
        model: a Keras model (compiled, for the training step), or a model
            on the TPU (``keras_to_tpu_model``'s, or one built under
            ``TPUStrategy().scope()``), whose settings are then the defaults.
        batch_size: the global batch (default: the last ``fit``'s, else 128 per core).
        accelerator_type: e.g. ``"v2-8"`` (the default), ``"v3-8"``, ``"v4-8"``, ``"v5litepod-8"``.
        num_cores: cores the batch is split over (default: the type's, at most 8 per host).
        dataset_size: examples per epoch, for per-epoch totals.
        precision: MXU precision of the model's matrix products.

    Returns:
        a :class:`TPUProfile`.

    Example:
        >>> model = keras.Sequential([keras.Input((300,)), keras.layers.Dense(100)])   # doctest: +SKIP
        >>> model.compile("adam", "mse")                                               # doctest: +SKIP
        >>> print(profile(model, batch_size=1024))                                     # doctest: +SKIP
    """
    installed = installed_on(model)
    if installed is not None:  # a model on the TPU: its own settings are the defaults
        placement = installed.placement
        if precision == "default":
            precision = placement.precision
        accelerator_type = accelerator_type or placement.accelerator_type
        num_cores = num_cores or placement.num_cores
        batch_size = batch_size or (installed.steps.global_batch if installed.steps else None)
        model = installed.user_model
    accelerator_type = accelerator_type or "v2-8"
    if not isinstance(model, keras.Model):
        raise TypeError(f"profile needs a Keras model; got {type(model).__name__}.")
    spec, type_cores = accelerator_spec(accelerator_type)
    num_cores = num_cores or min(type_cores, 8)
    batch_size = batch_size or 128 * num_cores
    if batch_size % num_cores:
        raise ValueError(f"The global batch {batch_size} must be a multiple of the {num_cores} cores.")

    def profile_at(global_batch, with_advice=False):
        per_core = global_batch // num_cores
        steps = ReplicatedSteps(model, CoreLayout.abstract(1), precision)  # one core's step
        x_spec = _input_specs(model, per_core)
        names = _layer_names(model)
        rows = []
        modes = ["train", "inference"] if model.compiled and model.optimizer is not None else ["inference"]
        for step in modes:
            y_spec = _target_specs(model, per_core) if step == "train" else None
            for op in _step_ops(model, steps, step, per_core, spec.mxu_rows, spec.mxu_cols, x_spec, y_spec):
                rows.append(OpRow(step, _layer_of(op, names), op.pass_name, op.kind, op, op.cost.timing(spec)))
        report = TPUProfile(model.name, f"{spec.generation}-{type_cores}", num_cores, global_batch,
                            dataset_size, rows, [])
        report.hbm = hbm.per_core_footprint(model, global_batch, accelerator_type=report.accelerator_type,
                                            num_cores=num_cores, mode="train" if modes[0] == "train" else "predict")
        if with_advice:
            report.advice = _advice(profile_at, report)
            if not report.hbm.fits:
                report.advice.insert(0, f"The training step does not fit a core's HBM ({report.hbm.describe()}): "
                                        f"on a TPU it fails with ResourceExhaustedError. Use a smaller batch, "
                                        f"bfloat16, or a larger accelerator type.")
        return report

    return profile_at(batch_size, with_advice=advise)
