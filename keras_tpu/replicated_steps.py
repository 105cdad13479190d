"""The distributed step builder: a compiled Keras model's steps as one replicated TPU program.

For each mode (train, test, predict) this builds one program that every core
runs on its share of the global batch, with every matrix product on the MXU.
The programs plug into Keras' own ``fit``/``evaluate``/``predict`` loops: they
take and return Keras' state lists (trainable, non-trainable, optimizer and
metric variables), so callbacks, the progress bar and ``History`` work as
usual.

What a train step does on each core (TPU replication):

1. Forward and backward pass on the core's rows with Keras'
   ``compute_loss_and_updates`` (the model's own loss, regularisers and
   ``compute_loss``).
2. Gradients are averaged over the cores (an all-reduce), and every core
   applies the same optimizer update, so the weights stay identical.
3. Padding rows (see :mod:`keras_tpu.batching`) get sample weight 0, and the
   real rows a weight chosen so that the mean over cores equals the loss of
   the real rows alone: ``global_rows / real_rows`` for losses averaged over
   the batch (``sum_over_batch_size``), ``cores`` for ``sum``. Losses with
   ``mean_with_sample_weight`` are averaged per core, as on a TPU.
4. **BatchNormalization** normalises each core's rows with that core's batch
   statistics (as on a real TPU); the moving statistics are then averaged
   over the cores, weighted by each core's real rows (a core holding only
   padding does not contribute).
5. **Dropout** and other seeded random layers draw a different stream on each
   core (the core index is folded into the seed); the seed state advances
   identically everywhere.
6. Metrics are computed on the whole global batch, gathered from the cores,
   so every Keras metric gets exactly what it gets on the CPU.

Test and predict steps have no cross-core interaction (rows are independent
in inference, and metrics use the gathered batch), so on a single host they
run all cores' rows as one batch on the first device: the results are the
same, and XLA:CPU's forward convolutions run about 10% faster on one large
batch than on eight concurrent small ones (benchmarks/cifar10_speed.py).
Training keeps one device per core, where the backward convolutions are
several times faster on the cores' small batches.
"""

import time

import jax
import jax.numpy as jnp
import keras
from jax import lax
from keras import tree

from keras_tpu import _keras_private, pod, rewrite
from keras_tpu._logging import logger
from keras_tpu.batching import BatchStacker, unstack_outputs
from keras_tpu.cores import CoreLayout
from keras_tpu.mxu.numerics import canonical_precision
from keras_tpu.mxu.routing import mxu_rule
from keras_tpu.vector_unit import vector_unit_rule

# Golden-ratio stride separating the per-core random streams of a seed generator.
SEED_STRIDE = 0x9E3779B1

# XLA:CPU options per program. XLA:CPU's YNNPACK convolution kernels are several
# times slower than its default ones for the weight-gradient convolutions of a
# training step, and faster for inference (benchmarks/cifar10_speed.py).
XLA_CPU_OPTIONS = {
    "train": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "test": {},
    "predict": {},
}

_STEP_METHODS = ("train_step", "test_step", "predict_step")


def custom_step_methods(model):
    """Names of Keras step methods that ``model``'s class replaces (those cannot be split over cores)."""
    return _keras_private.overridden_methods(model, _STEP_METHODS)


def _is_seed_state(variable):
    return variable.path.endswith("seed_generator_state") and "int" in str(variable.dtype)


class ReplicatedSteps:
    """Builds the train, test and predict programs of a compiled Keras model for a core layout.

    Args:
        model: the compiled Keras model whose steps run on the cores.
        layout: a :class:`keras_tpu.cores.CoreLayout`.
        precision: the MXU's default precision for the model's matrix products.
        on_mxu: False runs the same programs with float32 matrix products
            (the CPU baseline of ``TPUEstimator(use_tpu=False)``).

    Example:
        >>> steps = ReplicatedSteps(model, keras_tpu.CoreLayout(8), "default")   # doctest: +SKIP
        >>> model.train_function = steps.train_function(steps_per_execution=1)   # doctest: +SKIP
    """

    def __init__(self, model, layout, precision="default", on_mxu=True):
        custom = custom_step_methods(model)
        if custom:
            raise ValueError(
                f"{type(model).__name__} replaces Keras' {', '.join(custom)}, which keras_tpu cannot split over "
                f"the TPU cores. Put the custom logic in `compute_loss` (or in layers) and keep Keras' steps."
            )
        self.model = model
        self.layout = layout
        self.precision = canonical_precision(precision)
        self.rule = rewrite.compose(mxu_rule(self.precision), vector_unit_rule()) if on_mxu else vector_unit_rule()
        self.last_programs = {}
        self._on_mxu = on_mxu
        self._inference = None

    def _inference_steps(self):
        """The builder that runs test and predict steps (see the module docstring)."""
        if self._inference is None:
            if self.layout.num_devices <= 1 or pod.is_multi_worker():
                self._inference = self
            else:
                one_device = CoreLayout(1, devices=self.layout.devices[:1])
                self._inference = ReplicatedSteps(self.model, one_device, self.precision, self._on_mxu)
                self._inference.last_programs = self.last_programs
        return self._inference

    # -- functions for Keras' loops -------------------------------------------------

    def train_function(self, steps_per_execution=1):
        """``(state, iterator) -> (logs, state)``, for ``model.train_function``."""
        program = _Program("train", self, steps_per_execution, self._core_train,
                           sharded_outputs=(False, False))
        return program.run_for_logs

    def test_function(self, steps_per_execution=1):
        """``(state, iterator) -> (logs, state)``, for ``model.test_function``."""
        steps = self._inference_steps()
        program = _Program("test", steps, steps_per_execution, steps._core_test, sharded_outputs=(False, False))
        return program.run_for_logs

    def predict_function(self, steps_per_execution=1):
        """``(state, iterator) -> (outputs, state)``, for ``model.predict_function``."""
        steps = self._inference_steps()
        program = _Program("predict", steps, steps_per_execution, steps._core_predict,
                           sharded_outputs=(True, False))
        return program.run_for_outputs

    # -- what one core runs ------------------------------------------------------------

    def _scan_steps(self, step, state, data, mask, real_rows, active):
        """Run ``step`` for each stacked step (axis 1 of this core's arrays), skipping inactive ones."""
        per_step = tree.map_structure(lambda a: jnp.moveaxis(a, 1, 0), (data, mask), none_is_leaf=False)
        if mask.shape[1] == 1:
            batch, step_mask = tree.map_structure(lambda a: a[0], per_step, none_is_leaf=False)
            return step(state, batch, step_mask, real_rows[0])

        def body(state, inputs):
            (batch, step_mask), rows, on = inputs
            return lax.cond(on, step, lambda s, *_: s, state, batch, step_mask, rows), None

        return lax.scan(body, state, (per_step, real_rows, active))[0]

    def _core_train(self, state, data, mask, real_rows, active):
        state = self._scan_steps(self._train_step, state, data, mask, real_rows, active)
        return _keras_private.metrics_result(self.model, state[3]), state

    def _core_test(self, state, data, mask, real_rows, active):
        state = self._scan_steps(self._test_step, state, data, mask, real_rows, active)
        return _keras_private.metrics_result(self.model, state[2]), state

    def _core_predict(self, state, data, mask, real_rows, active):
        trainable, non_trainable = state
        kwargs = _keras_private.inference_kwargs(self.model)

        def predict(x):
            return self.model.stateless_call(trainable, non_trainable, x, **kwargs)[0]

        x_steps = tree.map_structure(lambda a: jnp.moveaxis(a, 1, 0),
                                     keras.utils.unpack_x_y_sample_weight(data)[0], none_is_leaf=False)
        outputs = lax.map(predict, x_steps)  # (steps, rows, ...)
        return tree.map_structure(lambda a: jnp.moveaxis(a, 0, 1), outputs), state

    def _sample_weights(self, mask, sample_weight, real_rows):
        """Per-row weights for the loss (padding excluded, rescaled) and for the metrics (padding excluded)."""
        global_rows = mask.shape[0] * self.layout.num_cores
        reductions = set(_keras_private.loss_reductions(self.model))
        if reductions and reductions <= {"sum"}:
            scale = jnp.float32(self.layout.num_cores)
        elif reductions == {"mean_with_sample_weight"}:
            scale = jnp.float32(1.0)
        else:
            scale = global_rows / jnp.maximum(real_rows, 1).astype(jnp.float32)

        def weigh(sw, factor):
            if sw is None:
                return mask * factor
            sw = jnp.asarray(sw, jnp.float32)
            return sw * (mask * factor).reshape(mask.shape + (1,) * (sw.ndim - 1))

        if sample_weight is None or not tree.is_nested(sample_weight):
            return weigh(sample_weight, scale), weigh(sample_weight, 1.0)
        return (tree.map_structure(lambda sw: weigh(sw, scale), sample_weight),
                tree.map_structure(lambda sw: weigh(sw, 1.0), sample_weight))

    def _seed_offsets(self, values, sign):
        core = self.layout.core_index().astype(jnp.uint32)
        out = list(values)
        for i, variable in enumerate(self.model.non_trainable_variables):
            if _is_seed_state(variable):
                offset = (core * jnp.uint32(SEED_STRIDE)).astype(values[i].dtype)
                out[i] = values[i].at[0].set(values[i][0] + offset if sign > 0 else values[i][0] - offset)
        return out

    def _combine_non_trainable(self, before, after, weight):
        """Average float state (moving statistics) over cores, weighted by each core's real rows."""
        combined = []
        for old, new in zip(before, after):
            if jnp.issubdtype(new.dtype, jnp.floating):
                delta = self.layout.psum(weight.astype(new.dtype) * (new - old))
                combined.append((old + delta).astype(old.dtype))
            else:
                combined.append(new)
        return combined

    def _update_metrics(self, metrics_values, loss, real_rows, x, y, y_pred, mask, metric_weight, loss_weight):
        gathered = self.layout.all_gather((x, y, y_pred, mask, metric_weight, loss_weight))
        _, new_values = _keras_private.update_metrics(self.model, metrics_values, loss, real_rows, *gathered)
        return new_values

    def _train_step(self, state, batch, mask, real_rows):
        model = self.model
        trainable, non_trainable, optimizer_values, metrics_values = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        loss_weight, metric_weight = self._sample_weights(mask, sample_weight, real_rows)
        grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
        (_, aux), grads = grad_fn(trainable, self._seed_offsets(non_trainable, +1), metrics_values, x, y,
                                  loss_weight, training=True, optimizer_variables=optimizer_values)
        unscaled_loss, y_pred, new_non_trainable, _ = aux
        grads = self.layout.pmean(grads)
        trainable, optimizer_values = model.optimizer.stateless_apply(optimizer_values, grads, trainable)
        core_share = jnp.sum(mask) / jnp.maximum(real_rows, 1).astype(jnp.float32)
        new_non_trainable = self._combine_non_trainable(
            non_trainable, self._seed_offsets(new_non_trainable, -1), core_share)
        metrics_values = self._update_metrics(metrics_values, self.layout.pmean(unscaled_loss), real_rows,
                                              x, y, y_pred, mask, metric_weight, loss_weight)
        return (trainable, new_non_trainable, optimizer_values, metrics_values)

    def _test_step(self, state, batch, mask, real_rows):
        trainable, non_trainable, metrics_values = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        loss_weight, metric_weight = self._sample_weights(mask, sample_weight, real_rows)
        _, (unscaled_loss, y_pred, _, _) = self.model.compute_loss_and_updates(
            trainable, non_trainable, metrics_values, x, y, loss_weight, training=False)
        metrics_values = self._update_metrics(metrics_values, self.layout.pmean(unscaled_loss), real_rows,
                                              x, y, y_pred, mask, metric_weight, loss_weight)
        return (trainable, non_trainable, metrics_values)


class _Program:
    """One compiled program (a mode and a number of steps per call) and its feeding."""

    def __init__(self, mode, builder, steps_per_execution, core_fn, sharded_outputs):
        self.mode = mode
        self.layout = builder.layout
        self.stacker = BatchStacker(self.layout.num_cores, int(steps_per_execution))
        routed = rewrite.transform(core_fn, builder.rule)
        self._jitted = jax.jit(
            self.layout.per_core(routed, sharded_args=(False, True, True, False, False),
                                 sharded_outputs=sharded_outputs),
            donate_argnums=0, compiler_options=XLA_CPU_OPTIONS[mode] or None)
        self._executables = {}
        builder.last_programs[mode] = self

    def _place(self, state, stacked):
        replicated, by_rows = self.layout.replicated_sharding(), self.layout.batch_sharding()
        on_cores = lambda a: isinstance(a, jax.Array) and a.sharding == replicated
        if not all(on_cores(a) for a in jax.tree.leaves(state)):
            logger.debug("Copying weights to the TPU cores.")
        if pod.is_multi_worker():  # each worker places only its own cores' share
            put = lambda tree, sharding: jax.tree.map(lambda a: a if on_cores(a) and sharding == replicated
                                                      else pod.global_array(a, sharding), tree)
        else:
            put = jax.device_put
        return (put(state, replicated), put(stacked.data, by_rows), put(stacked.mask, by_rows),
                put(stacked.real_rows, replicated), put(stacked.active, replicated))

    def _executable(self, args):
        key = jax.tree.structure(args), tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args))
        executable = self._executables.get(key)
        if executable is None:
            started = time.perf_counter()
            executable = self._jitted.lower(*args).compile()
            self._executables[key] = executable
            logger.info("Compiled the TPU %s program (global batch %d, %d step(s) per call) in %.1f s.",
                        self.mode, self.stacker.global_batch, self.stacker.steps, time.perf_counter() - started)
        return executable

    def _call(self, state, iterator):
        batches = []
        for _ in range(self.stacker.steps):
            try:
                batches.append(next(iterator))
            except StopIteration:
                break
        if not batches:
            raise StopIteration
        if self.mode == "predict":
            batches = [(keras.utils.unpack_x_y_sample_weight(b)[0], None, None) for b in batches]
        stacked = self.stacker.stack(batches)
        args = self._place(state, stacked)
        executable = self._executable(args)
        if not pod.is_multi_worker():
            return executable(*args), stacked
        try:
            return jax.block_until_ready(executable(*args)), stacked
        except Exception as error:  # a collective with a worker that is gone
            raise pod.WorkerLostError(
                f"The TPU {self.mode} step failed because a worker of the pod stopped ({error}). Restart all "
                f"workers; training resumes from the last checkpoint.") from error

    def run_for_logs(self, state, iterator):
        (logs, state), _ = self._call(state, iterator)
        return (pod.to_host(logs) if pod.is_multi_worker() else logs), state

    def run_for_outputs(self, state, iterator):
        (outputs, state), stacked = self._call(state, iterator)
        if pod.is_multi_worker():
            outputs = pod.to_host(outputs)
        return unstack_outputs(outputs, stacked), state
