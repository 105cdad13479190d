"""TPU profile: a model's step on a TPU, op by op and part by part.

:func:`profile` traces one training step and one inference step of a Keras
model exactly as the simulated TPU runs them (the per-core programs of
:mod:`keras_tpu._replicated_steps`), finds every MXU operation, names it after
its Keras layer and pass, and costs it on one core of the chosen accelerator
with the SCALE-Sim v2 model (:mod:`keras_tpu.mxu._cost`). Every core runs the
same program on its share of the batch, so a Conv2D at global batch 1024 on a
v2-8 is a GEMM with ``M = 128 * out_h * out_w``.

The predicted step is the whole step (:mod:`keras_tpu._step_time`): the MXU
ops, the vector unit's and HBM's work on everything else, the gradients'
all-reduce, the input feed and the host's calls, for a named deployment
(where the input pipeline and the Python loop run). The MXU ops alone are the
*MXU-only lower bound* (:meth:`TPUProfile.mxu_time`).

The report prints as a table, converts to rows, plots the parts per layer,
exports SCALE-Sim topology files, and gives advice with the gain the model
predicts: first for the part that bounds the step, then the Cloud TPU
performance guide's advice on batch and feature sizes.
"""

import csv
import dataclasses
import math

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_tpu import _keras_private, _hbm as hbm, _rewrite as rewrite, _step_time as step_time
from keras_tpu._accelerators import accelerator_spec
from keras_tpu._cores import CoreLayout
from keras_tpu.mxu._program import mxu_ops
from keras_tpu._placement import installed_on
from keras_tpu._replicated_steps import ReplicatedSteps

# Front ends as Placement names them (its ``owner``), for the default deployment of each.
_FRONT_ENDS = {"TPUDistributionStrategy": "keras_to_tpu_model", "TPUEstimator": "estimator",
               "TPUStrategy": "strategy"}


@dataclasses.dataclass
class OpRow:
    """One MXU operation of a step, on one core."""

    step: str            # "train" or "inference"
    layer: str           # the Keras layer's name
    pass_name: str       # "forward" or "backward"
    kind: str            # "dot" or "conv"
    op: object           # keras_tpu.mxu.MXUOp
    timing: object       # keras_tpu.mxu.Timing of one execution (its operands' real HBM bytes)
    hbm_bytes: int = 0   # HBM bytes of one execution: operands read once, result written once
    latency_s: float = 0.0  # the kernel's launch latency (keras_tpu._step_time.KERNEL_LATENCY_CYCLES)

    @property
    def mxu_only_s(self):
        """The op's SCALE-Sim time (compute or HBM, whichever bounds it), no launch latency."""
        return self.op.repeats * self.timing.time_s

    @property
    def time_s(self):
        return self.op.repeats * (self.timing.time_s + self.latency_s)

    @property
    def part(self):
        """The part of the step this op's time counts to: ``"mxu"``, or ``"memory"`` when HBM bounds it."""
        return "mxu" if self.timing.bound == "compute" else "memory"

    def as_dict(self):
        cost = self.op.cost
        parts = dict(mxu_s=0.0, vector_s=0.0, memory_s=0.0)
        parts[self.part + "_s"] = self.time_s
        return {
            "step": self.step, "layer": self.layer, "pass": self.pass_name, "kind": self.kind,
            "m": cost.m, "k": cost.k, "n": cost.n, "groups": cost.count // self.op.precision.passes,
            "padded_m": cost.padded_shape[0], "padded_k": cost.padded_shape[1], "padded_n": cost.padded_shape[2],
            "repeats": self.op.repeats, "folds": cost.folds * self.op.repeats, "cycles": self.op.cycles,
            "macs": self.op.macs, "utilization": cost.utilization, "padding_waste": cost.padding_waste,
            "hbm_bytes": self.hbm_bytes * self.op.repeats, "bound": self.timing.bound, "time_s": self.time_s,
            "dataflow": cost.dataflow, "weight_gradient": self.op.weight_gradient, "vpu_ops": 0.0,
            "kernels": self.op.repeats, **parts,
        }


@dataclasses.dataclass
class VectorRow:
    """The vector-unit and HBM work of one layer and pass of a step, on one core."""

    step: str
    layer: str
    pass_name: str
    work: object         # keras_tpu._step_time.VectorKernels
    vector_s: float
    memory_s: float
    latency_s: float
    kind: str = "vector"

    @property
    def time_s(self):
        return max(self.vector_s, self.memory_s) + self.latency_s

    @property
    def part(self):
        return "vector" if self.vector_s >= self.memory_s else "memory"

    def as_dict(self):
        parts = dict(mxu_s=0.0, vector_s=0.0, memory_s=0.0)
        parts[self.part + "_s"] = self.time_s
        return {
            "step": self.step, "layer": self.layer, "pass": self.pass_name, "kind": self.kind,
            "m": 0, "k": 0, "n": 0, "groups": 0, "padded_m": 0, "padded_k": 0, "padded_n": 0,
            "repeats": 1, "folds": 0, "cycles": 0, "macs": 0, "utilization": 0.0, "padding_waste": 0.0,
            "hbm_bytes": int(self.work.hbm_bytes), "bound": "vector" if self.part == "vector" else "memory",
            "time_s": self.time_s, "dataflow": "", "weight_gradient": False, "vpu_ops": self.work.vpu_ops,
            "kernels": self.work.kernels, **parts,
        }


class TPUProfile:
    """The report of one training and one inference step; see :func:`profile`.

    Example:
        >>> model = keras.Sequential([keras.Input((300,)), keras.layers.Dense(100)])
        >>> model.compile("adam", "mse")
        >>> report = profile(model, batch_size=1024)
        >>> report.num_cores, report.step_cycles("train"), round(report.utilization("train"), 2)
        (8, 2210, 0.21)
    """

    def __init__(self, model_name, accelerator_type, num_cores, global_batch, dataset_size, rows, advice,
                 vector_rows=(), step_times=None, deployment="tpu_vm", steps_per_execution=1):
        self.model_name = model_name
        self.accelerator_type = accelerator_type
        self.num_cores = num_cores
        self.global_batch = global_batch
        self.per_core_batch = global_batch // num_cores
        self.dataset_size = dataset_size
        self._rows = rows
        self._vector_rows = list(vector_rows)
        self.step_times = dict(step_times or {})  # {"train": keras_tpu._step_time.StepTime, ...}
        self.deployment = deployment
        self.steps_per_execution = steps_per_execution
        self.advice = advice
        self.hbm = None  # the per-core HBM of the step (keras_tpu._hbm.HBMFootprint), set by profile()

    def rows(self, step=None):
        """The step's kernels as dicts: the MXU ops (``kind`` ``"dot"``/``"conv"``, with ``m``, ``k``, ``n``,
        ``cycles``, ``utilization``, ``dataflow``, ...) and, per layer and pass, the vector-unit work (``kind``
        ``"vector"``); each with ``time_s`` and its split ``mxu_s``/``vector_s``/``memory_s``. Optionally of one
        step (``"train"``/``"inference"``)."""
        return [r.as_dict() for r in self._all_rows() if step in (None, r.step)]

    def _all_rows(self):
        return list(self._rows) + self._vector_rows

    def parts(self, step):
        """The :class:`keras_tpu._step_time.StepTime` of one step: MXU, vector, memory, all-reduce, input, host."""
        return self.step_times[step]

    def step_time(self, step):
        """Predicted time of one whole step (all cores run in parallel; input and host included)."""
        return self.step_times[step].total if step in self.step_times else self.mxu_time(step)

    def device_time(self, step):
        """The core's own time: its MXU and vector kernels and the all-reduce."""
        return self.step_times[step].device

    def mxu_time(self, step):
        """The MXU-only lower bound: the SCALE-Sim time of the step's MXU ops alone (the profile's figure
        before the whole-step model)."""
        return sum(r.mxu_only_s for r in self._rows if r.step == step)

    def bound(self, step):
        """The part that bounds the step: ``"mxu"``, ``"vector"``, ``"memory"``, ``"allreduce"``,
        ``"input"`` or ``"host"``."""
        return self.step_times[step].bound

    def summary(self, step):
        """A few lines: the step's total, its parts and their shares, and the MXU-only lower bound."""
        parts = self.step_times[step]
        exposed = parts.exposed()
        lines = [f"{step} step on {self.accelerator_type} ({self.deployment}, {parts.steps_per_call} step(s) per "
                 f"call): {parts.describe()}"]
        for part in step_time.PARTS:
            raw = getattr(parts, part)
            if raw <= 0:
                continue
            note = "" if exposed[part] > 0 or part == "host" else " (overlapped)"
            lines.append(f"  {step_time.PART_NAMES[part]:12s} {raw * 1e3:10.3f} ms{note}")
        lines.append(f"  MXU-only lower bound: {self.mxu_time(step) * 1e3:.3f} ms")
        return "\n".join(lines)

    def step_cycles(self, step):
        """MXU cycles of one core's ``step`` (``"train"``/``"inference"``): its products, one after another."""
        return sum(r.op.cycles for r in self._rows if r.step == step)

    def padding_waste(self, step):
        """Share of the array's cell-cycles idle because operands do not fill whole folds."""
        cycles = self.step_cycles(step)
        return sum(r.op.cycles * r.op.cost.padding_waste for r in self._rows if r.step == step) / max(cycles, 1)

    def utilization(self, step):
        """Share of the MXU's cell-cycles of ``step`` that do a useful multiply-accumulate."""
        rows, cols = self._array_shape()
        cycles = self.step_cycles(step)
        return sum(r.op.macs for r in self._rows if r.step == step) / max(cycles * rows * cols, 1)

    def _array_shape(self):
        spec, _ = accelerator_spec(self.accelerator_type)
        return spec.mxu_rows, spec.mxu_cols

    def epoch_time(self, step="train"):
        """Predicted time of an epoch over ``dataset_size`` examples."""
        if not self.dataset_size:
            return None
        return math.ceil(self.dataset_size / self.global_batch) * self.step_time(step)

    def layers(self, step):
        """Per layer and pass: summed cycles, MACs, time and its parts (``mxu_s``, ``vector_s``, ``memory_s``),
        in program order."""
        summary = {}
        for r in self._all_rows():
            if r.step != step:
                continue
            entry = summary.setdefault((r.layer, r.pass_name), {"layer": r.layer, "pass": r.pass_name,
                                                               "cycles": 0, "macs": 0, "time_s": 0.0,
                                                               "mxu_s": 0.0, "vector_s": 0.0, "memory_s": 0.0})
            d = r.as_dict()
            entry["cycles"] += d["cycles"]
            entry["macs"] += d["macs"]
            entry["time_s"] += r.time_s
            for part in ("mxu_s", "vector_s", "memory_s"):
                entry[part] += d[part]
        rows, cols = self._array_shape()
        for entry in summary.values():
            entry["utilization"] = entry["macs"] / max(entry["cycles"] * rows * cols, 1)
        return list(summary.values())

    def __str__(self):
        lines = [f"TPU profile of {self.model_name!r} on {self.accelerator_type}: {self.num_cores} cores, "
                 f"global batch {self.global_batch} ({self.per_core_batch} per core); costs per core"]
        header = (f"{'layer':24s} {'pass':8s} {'kind':6s} {'M':>8s} {'K':>6s} {'N':>6s} {'padded K x N':>13s} "
                  f"{'flow':>4s} {'cycles':>10s} {'util':>6s} {'HBM MB':>7s} {'bound':>7s} {'time us':>9s}")
        for step in ("train", "inference"):
            rows = [r for r in self._all_rows() if r.step == step]
            if not rows:
                continue
            lines += ["", f"{step} step", header, "-" * len(header)]
            for r in rows:
                d = r.as_dict()
                if r.kind == "vector":
                    shape = f"{d['vpu_ops'] / 1e6:8.2f}M vector ops, {d['kernels']} kernel(s)"
                    lines.append(f"{r.layer[:24]:24s} {r.pass_name:8s} {'vector':6s} {shape:>45s} "
                                 f"{'':>6s} {d['hbm_bytes'] / 1e6:7.2f} {d['bound']:>7s} {d['time_s'] * 1e6:9.1f}")
                    continue
                lines.append(f"{r.layer[:24]:24s} {r.pass_name:8s} {r.kind:6s} {d['m']:8d} {d['k']:6d} {d['n']:6d} "
                             f"{d['padded_k']:>6d}x{d['padded_n']:<6d} {d['dataflow']:>4s} {d['cycles']:10d} "
                             f"{d['utilization']:6.1%} {d['hbm_bytes'] / 1e6:7.2f} {d['bound']:>7s} "
                             f"{d['time_s'] * 1e6:9.1f}")
            total = (f"MXU: {self.step_cycles(step)} cycles, utilisation {self.utilization(step):.1%}, "
                     f"{self.padding_waste(step):.1%} of the array idle from padding")
            lines += ["-" * len(header), total]
            if step in self.step_times:
                lines += self.summary(step).splitlines()
            if self.dataset_size:
                lines.append(f"  an epoch of {self.dataset_size} examples: {self.epoch_time(step):.3f} s")
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
        """Save a PNG: MXU utilisation, and the predicted time per layer and pass stacked by part (MXU,
        vector unit, HBM); the all-reduce, input and host parts of the step are in the title."""
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
        left_edge = np.zeros(len(entries))
        for part, color in (("mxu_s", "tab:blue"), ("vector_s", "tab:green"), ("memory_s", "tab:orange")):
            widths = np.array([1e6 * e[part] for e in entries])
            right.barh(y, widths, left=left_edge, color=color, label=part[:-2])
            left_edge += widths
        right.legend(loc="lower right")
        right.set_xlabel("predicted time per step (us)")
        title = f"{self.model_name}: {step} step on {self.accelerator_type}, {self.per_core_batch} rows per core"
        if step in self.step_times:
            parts = self.step_times[step]
            title += (f"\n{parts.total * 1e3:.2f} ms per step, bound by {step_time.PART_NAMES[parts.bound]}; "
                      f"all-reduce {parts.allreduce * 1e3:.2f} ms, input {parts.input * 1e3:.2f} ms, "
                      f"host {parts.host * 1e3:.2f} ms")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def to_scalesim_topology(self, path, step="train", dataflow=None):
        """Write the step's MXU ops as a SCALE-Sim v2 GEMM topology (``-i gemm``: M, N, K per row).

        Run it through SCALE-Sim with a config of the same array size and the
        op's dataflow (``rows()``' ``dataflow``: ``"ws"`` for all but the weight
        gradients the profile maps otherwise): each row's "Total Cycles" equals
        that op's ``cycles`` for one execution of one group and pass.
        ``dataflow`` writes only the ops of that dataflow (one SCALE-Sim run).
        """
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["Layer Name", "M", "N", "K", ""])
            ops = [r for r in self._rows if r.step == step and dataflow in (None, r.op.cost.dataflow)]
            for i, r in enumerate(ops):
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
    return mxu_ops(closed, rows, cols), closed


def _mxu_op_bytes(op):
    """HBM bytes of one execution of an MXU op: its operands read and its result written once, in the
    TPU's tiled layout (a convolution reads its input, not its im2col matrix; several bf16 passes read
    their operand once)."""
    return sum(hbm.array_bytes(shape, dtype) for shape, dtype in
               zip((op.lhs_shape, op.rhs_shape, op.out_shape), op.dtypes))


def _input_bytes(spec_tree, input_dtype=None):
    """Bytes of one core's batch, with ``input_dtype`` (the fed arrays' type) replacing the model's."""
    total = 0
    for spec in jax.tree.leaves(spec_tree):
        dtype = np.dtype(input_dtype) if input_dtype is not None and jnp.issubdtype(spec.dtype, jnp.floating) \
            else np.dtype(spec.dtype)
        total += math.prod(spec.shape) * dtype.itemsize
    return total


#: steps_per_execution (TPUStrategy) / iterations_per_loop (TPUEstimator) the advice proposes.
ADVISED_STEPS_PER_CALL = 32


def _bound_advice(report, step):
    """Advice on the part that bounds ``step``, with the predicted step time after the fix."""
    parts = report.step_times.get(step)
    if parts is None:
        return []
    accelerator, cores = report.accelerator_type, report.num_cores
    bound = parts.bound
    now = f"{parts.total * 1e3:.3g} ms"
    if bound in ("input", "host"):
        fixes, fixed = [], parts
        if step_time.deployment(parts.deployment).input_over_network and parts.input > parts.device:
            fixes.append("feed from the TPU host (a tf.data input pipeline that runs on the TPU's host)")
            fixed = fixed.replaced(accelerator, cores, deployment_name="remote_host_input")
        if fixed.steps_per_call < ADVISED_STEPS_PER_CALL and fixed.host > 0.05 * fixed.total:
            fixes.append(f"use steps_per_execution={ADVISED_STEPS_PER_CALL} (TPUEstimator: iterations_per_loop)")
            fixed = fixed.replaced(accelerator, cores, steps_per_call=ADVISED_STEPS_PER_CALL)
        if not fixes:
            return [f"The {step} step is bound by its input ({parts.input * 1e3:.3g} ms to bring a step's "
                    f"{parts.input_bytes / 1e6:.3g} MB): feed fewer bytes (uint8 or bfloat16 images, cast on "
                    f"the TPU) or a larger accelerator type with more hosts."]
        return [f"The {step} step is bound by the {step_time.PART_NAMES[bound]} ({parts.shares()[bound]:.0%} of "
                f"it): {' / '.join(fixes)}: {now} -> {fixed.total * 1e3:.3g} ms per step."]
    if bound in ("memory", "vector"):
        return [f"The {step} step is bound by the {step_time.PART_NAMES[bound]} ({parts.shares()[bound]:.0%}): "
                f"the non-matrix work (BatchNormalization, activations, pooling, the loss, the optimizer update) "
                f"moves its operands through HBM; bfloat16 activations (keras.mixed_precision."
                f"set_global_policy('mixed_bfloat16')) halve those bytes, and larger layers do more MXU work per "
                f"byte."]
    if bound == "allreduce":
        return [f"The {step} step is bound by the gradients' all-reduce ({parts.allreduce * 1e3:.3g} ms): a "
                f"larger per-core batch does more work per all-reduce."]
    return []


def _advice(profile_at, report):
    """Advice on the bounding part, then the Cloud TPU performance guide's, with predicted gains."""
    advice = _bound_advice(report, "train" if "train" in report.step_times else "inference")
    per_core = report.per_core_batch
    if per_core < 128 and any(r.step == "train" for r in report._rows):
        better = profile_at(128 * report.num_cores)
        now = report.mxu_time("train") / report.global_batch
        then = better.mxu_time("train") / better.global_batch
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
            advise=True, deployment=None, steps_per_execution=None, input_dtype=None):
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
        deployment: where the input pipeline and the Python loop run, one of
            :data:`keras_tpu._step_time.DEPLOYMENTS`: ``"tpu_vm"``,
            ``"remote_host_input"``, ``"remote_client_input"`` (default: per
            front end, :data:`keras_tpu._step_time.DEFAULT_DEPLOYMENT`).
        steps_per_execution: steps per host call (default: the model's
            ``steps_per_execution``, TPUEstimator's ``iterations_per_loop``).
        input_dtype: the type of the fed floating-point arrays, if not the
            model's inputs' (``keras_to_tpu_model`` feeds float32).

    Returns:
        a :class:`TPUProfile`.

    Example:
        >>> model = keras.Sequential([keras.Input((300,)), keras.layers.Dense(100)])   # doctest: +SKIP
        >>> model.compile("adam", "mse")                                               # doctest: +SKIP
        >>> print(profile(model, batch_size=1024))                                     # doctest: +SKIP
    """
    installed = installed_on(model)
    front_end = None
    if installed is not None:  # a model on the TPU: its own settings are the defaults
        placement = installed.placement
        if precision == "default":
            precision = placement.precision
        accelerator_type = accelerator_type or placement.accelerator_type
        num_cores = num_cores or placement.num_cores
        batch_size = batch_size or (installed.steps.global_batch if installed.steps else None)
        front_end = _FRONT_ENDS.get(placement.owner)
        steps_per_execution = steps_per_execution or getattr(model, "steps_per_execution", None) \
            or getattr(placement, "steps_per_execution", None)
        model = installed.user_model
    where = step_time.deployment(deployment or step_time.DEFAULT_DEPLOYMENT[front_end])
    steps_per_execution = int(steps_per_execution or getattr(model, "steps_per_execution", None) or 1)
    accelerator_type = accelerator_type or "v2-8"
    if not isinstance(model, keras.Model):
        raise TypeError(f"profile needs a Keras model; got {type(model).__name__}.")
    spec, type_cores = accelerator_spec(accelerator_type)
    num_cores = num_cores or min(type_cores, 8)
    batch_size = batch_size or 128 * num_cores
    if batch_size % num_cores:
        raise ValueError(f"The global batch {batch_size} must be a multiple of the {num_cores} cores.")

    latency_s = step_time.KERNEL_LATENCY_CYCLES / spec.clock_hz
    cores_per_host = min(num_cores, 8)
    gradient_bytes = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in model.trainable_variables)

    def profile_at(global_batch, with_advice=False):
        per_core = global_batch // num_cores
        steps = ReplicatedSteps(model, CoreLayout.abstract(1), precision)  # one core's step
        x_spec = _input_specs(model, per_core)
        names = _layer_names(model)
        rows, vector_rows, step_times = [], [], {}
        modes = ["train", "inference"] if model.compiled and model.optimizer is not None else ["inference"]
        for step in modes:
            y_spec = _target_specs(model, per_core) if step == "train" else None
            ops, closed = _step_ops(model, steps, step, per_core, spec.mxu_rows, spec.mxu_cols, x_spec, y_spec)
            step_rows = []
            for op in ops:
                nbytes = _mxu_op_bytes(op)
                step_rows.append(OpRow(step, _layer_of(op, names), op.pass_name, op.kind, op,
                                       op.cost.timing(spec, hbm_bytes=nbytes), nbytes, latency_s))
            step_vectors = []
            for work in step_time.vector_kernels(closed, names):
                vector_s, memory_s, kernel_latency = work.timing(spec)
                step_vectors.append(VectorRow(step, work.layer, work.pass_name, work, vector_s, memory_s,
                                              kernel_latency))
            parts = {"mxu": 0.0, "vector": 0.0, "memory": 0.0}
            for r in step_rows + step_vectors:
                parts[r.part] += r.time_s
            batch_bytes = _input_bytes((x_spec, y_spec) if y_spec is not None else x_spec, input_dtype)
            host_bytes = batch_bytes * cores_per_host
            allreduce = step_time.allreduce_time(gradient_bytes, spec, num_cores) if step == "train" else 0.0
            step_times[step] = step_time.StepTime(
                **parts, allreduce=allreduce, input=step_time.input_time(host_bytes, spec, num_cores, where),
                host=where.call_s / steps_per_execution, input_bytes=host_bytes, call_s=where.call_s,
                steps_per_call=steps_per_execution, deployment=where.name)
            rows += step_rows
            vector_rows += step_vectors
        report = TPUProfile(model.name, f"{spec.generation}-{type_cores}", num_cores, global_batch,
                            dataset_size, rows, [], vector_rows, step_times, where.name, steps_per_execution)
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
