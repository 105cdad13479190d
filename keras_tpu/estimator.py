"""``TPUEstimator``: TensorFlow 1's ``model_fn``/``input_fn`` workflow on the simulated TPU.

.. code-block:: python

    from keras_tpu import estimator as tpu_estimator

    def model_fn(features, labels, mode, params):
        logits = keras.layers.Dense(10)(keras.layers.Flatten()(features))
        loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        optimizer = tpu_estimator.CrossShardOptimizer(keras.optimizers.SGD(0.01))
        return tpu_estimator.TPUEstimatorSpec(mode=mode, loss=loss, train_op=optimizer)

    estimator = tpu_estimator.TPUEstimator(
        model_fn=model_fn, config=tpu_estimator.RunConfig(model_dir="/tmp/mnist",
            tpu_config=tpu_estimator.TPUConfig(iterations_per_loop=50, num_shards=8)),
        train_batch_size=128, eval_batch_size=128)
    estimator.train(input_fn=train_input_fn, max_steps=1000)

``model_fn(features, labels, mode, params)`` builds the model with Keras
layers and ``keras.ops`` on symbolic inputs; the estimator turns that graph
into a Keras model and runs it with the same replicated TPU programs as
:func:`keras_tpu.keras_to_tpu_model` (:mod:`keras_tpu.replicated_steps`).
Each call of ``model_fn`` creates new layers, as TensorFlow 1 rebuilt its
graph per mode; the modes share weights through the checkpoints in
``model_dir``, matched in the order the layers create them.

Data: ``input_fn(params)`` gets ``params["batch_size"]``, the per-core batch
(global batch / cores), and returns either whole arrays ``(features,
labels)``, which the estimator batches at the global batch size (shuffled for
training, the last batch padded for evaluation and prediction), or an
iterable (generator, ``keras.utils.PyDataset``) of batches of
``params["batch_size"]`` rows, of which each step takes one per core.

Evaluation runs the graph one example at a time (vectorised), so the loss is
the mean of per-example losses over the real examples, exact with a padded
last batch for losses that average over the batch; ``metric_fn`` is called
once, on the concatenated metric tensors of all real evaluation examples.
"""

import dataclasses
import inspect
import itertools
import os
import time

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import tree

from keras_tpu import checkpoints
from keras_tpu._logging import logger
from keras_tpu.cluster import TPUClusterResolver, initialize_tpu_system
from keras_tpu.cores import CoreLayout
from keras_tpu.replicated_steps import ReplicatedSteps


class ModeKeys:
    """The three modes ``model_fn`` is called in (TensorFlow's ``tf.estimator.ModeKeys``)."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"


@dataclasses.dataclass
class TPUEstimatorSpec:
    """What ``model_fn`` returns.

    Args:
        mode: the ``ModeKeys`` value ``model_fn`` was called with.
        loss: a scalar symbolic tensor (TRAIN and EVAL).
        train_op: the optimizer, a :class:`CrossShardOptimizer` (TRAIN).
        eval_metrics: ``(metric_fn, tensors)`` where ``tensors`` is a list or
            dict of symbolic tensors with one row per example (EVAL).
        predictions: a symbolic tensor or dict of them (PREDICT).
        export_outputs: accepted for compatibility.
    """

    mode: str
    loss: object = None
    train_op: object = None
    eval_metrics: tuple = None
    predictions: object = None
    export_outputs: object = None


class CrossShardOptimizer:
    """Wraps a Keras optimizer so that each core's gradients are combined across all cores.

    Args:
        optimizer: any ``keras.optimizers.Optimizer``.
        reduction: ``"mean"`` (the default) averages the cores' gradients,
            ``"sum"`` adds them.

    Example:
        >>> CrossShardOptimizer(keras.optimizers.SGD(0.01)).reduction
        'mean'
    """

    def __init__(self, optimizer, reduction="mean"):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"CrossShardOptimizer wraps a keras.optimizers.Optimizer; got {type(optimizer).__name__}.")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum'; got {reduction!r}.")
        self.optimizer = optimizer
        self.reduction = reduction


@dataclasses.dataclass
class TPUConfig:
    """TPU settings of a :class:`RunConfig`: steps per device call and number of cores."""

    iterations_per_loop: int = 2
    num_shards: int = None
    per_host_input_for_training: bool = True


@dataclasses.dataclass
class RunConfig:
    """Where the estimator runs and keeps its checkpoints."""

    master: str = None
    model_dir: str = None
    tpu_config: TPUConfig = None
    save_checkpoints_steps: int = None
    keep_checkpoint_max: int = 5
    log_step_count_steps: int = None
    tf_random_seed: int = None
    cluster: TPUClusterResolver = None


class _GraphModel(keras.Model):
    """The graph ``model_fn`` built, as a Keras model whose loss is one of its outputs."""

    def __init__(self, graph, per_example, loss_scale=1.0):
        super().__init__(name=f"{graph.name}_model")
        self.graph = graph
        self.per_example = per_example
        self.loss_scale = loss_scale
        self.built = True  # the functional graph holds every variable already

    def call(self, inputs, training=False):
        if not self.per_example:
            return self.graph(inputs, training=training)

        def one(example):  # a batch of one: per-example losses and metric tensors
            out = self.graph(tree.map_structure(lambda t: t[None], example), training=False)
            return tree.map_structure(lambda t: t[0] if jnp.ndim(t) else t, out)

        return jax.vmap(one)(inputs)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return y_pred["loss"] * self.loss_scale


def _call_model_fn(model_fn, features, labels, mode, params, config):
    accepted = inspect.signature(model_fn).parameters
    kwargs = {name: value for name, value in (("mode", mode), ("params", params), ("config", config))
              if name in accepted}
    spec = model_fn(features, labels, **kwargs)
    if not isinstance(spec, TPUEstimatorSpec):
        raise TypeError(f"model_fn must return a TPUEstimatorSpec; got {type(spec).__name__}.")
    return spec


def _symbolic(example, name):
    """Keras inputs shaped like one batch of ``example`` (an array or dict of arrays)."""
    if isinstance(example, dict):
        return {key: keras.Input(shape=np.shape(value)[1:], dtype=str(np.asarray(value).dtype), name=key)
                for key, value in example.items()}
    array = np.asarray(example)
    return keras.Input(shape=array.shape[1:], dtype=str(array.dtype), name=name)


def _rows(data):
    return int(np.shape(tree.flatten(data)[0])[0])


def _take(data, index):
    return tree.map_structure(lambda a: np.asarray(a)[index], data)


class TPUEstimator:
    """Train, evaluate and predict a ``model_fn`` on the simulated TPU (TensorFlow 1's ``TPUEstimator``).

    Args:
        model_fn: ``model_fn(features, labels, mode, params)`` returning a
            :class:`TPUEstimatorSpec`.
        model_dir: where checkpoints go (or ``config.model_dir``).
        config: a :class:`RunConfig`.
        params: a dict passed to ``model_fn`` and ``input_fn``.
        use_tpu: False runs the same program on the CPU, float32, one core,
            with the same global batch.
        train_batch_size, eval_batch_size, predict_batch_size: global batch sizes.
    """

    def __init__(self, model_fn, model_dir=None, config=None, params=None, use_tpu=True, train_batch_size=None,
                 eval_batch_size=None, predict_batch_size=None):
        self.model_fn = model_fn
        self.config = config or RunConfig()
        self.model_dir = model_dir or self.config.model_dir
        if not self.model_dir:
            raise ValueError("TPUEstimator needs a model_dir (argument or RunConfig) to keep its checkpoints.")
        self.params = dict(params or {})
        self.use_tpu = bool(use_tpu)
        tpu_config = self.config.tpu_config or TPUConfig()
        self.iterations_per_loop = int(tpu_config.iterations_per_loop)
        if self.use_tpu:
            resolver = self.config.cluster or TPUClusterResolver(self.config.master)
            topology = initialize_tpu_system(resolver)
            shards = tpu_config.num_shards or topology.num_cores
            self.layout = topology.layout if shards == topology.num_cores else \
                CoreLayout(shards, devices=topology.layout.devices[:shards] if shards <= topology.layout.num_devices
                           else None)
        else:
            self.layout = CoreLayout(1, devices=jax.local_devices()[:1])
        self.batch_sizes = {ModeKeys.TRAIN: train_batch_size, ModeKeys.EVAL: eval_batch_size,
                            ModeKeys.PREDICT: predict_batch_size or eval_batch_size}
        for mode, size in self.batch_sizes.items():
            if size is not None and size % self.layout.num_cores:
                raise ValueError(f"The {mode} batch size {size} must be a multiple of the {self.layout.num_cores} "
                                 f"cores (TPUEstimator gives each core params['batch_size'] = global / cores).")

    # -- plumbing --------------------------------------------------------------------------

    def _global_batch(self, mode):
        size = self.batch_sizes[mode]
        if size is None:
            raise ValueError(f"Pass {mode}_batch_size to TPUEstimator to {mode}." if mode != ModeKeys.PREDICT
                             else "Pass predict_batch_size (or eval_batch_size) to TPUEstimator to predict.")
        return size

    def _input(self, input_fn, mode):
        global_batch = self._global_batch(mode)
        params = dict(self.params, batch_size=global_batch // self.layout.num_cores if self.use_tpu else global_batch)
        accepted = inspect.signature(input_fn).parameters
        data = input_fn(params) if "params" in accepted or len(accepted) == 1 else input_fn()
        return data, params["batch_size"]

    def _batches(self, data, per_core_rows, mode):
        """Global batches of ``(features, labels)`` from what ``input_fn`` returned."""
        global_batch = self._global_batch(mode)
        if isinstance(data, (tuple, list)) and len(data) == 2 and not _is_iterable_source(data[0]):
            features, labels = data
        elif isinstance(data, (np.ndarray, dict)) or hasattr(data, "__array__"):
            features, labels = data, None
        else:
            yield from self._batches_from_iterable(data, per_core_rows, mode)
            return
        rows = _rows(features)
        if mode == ModeKeys.TRAIN:  # shuffled epochs, full batches only, as long as needed
            rng = np.random.default_rng(self.config.tf_random_seed)
            order = itertools.chain.from_iterable(rng.permutation(rows) for _ in itertools.count())
            while True:
                index = np.fromiter(itertools.islice(order, global_batch), dtype=np.int64, count=global_batch)
                yield _take(features, index), None if labels is None else _take(labels, index)
        else:
            for start in range(0, rows, global_batch):
                index = np.arange(start, min(start + global_batch, rows))
                yield _take(features, index), None if labels is None else _take(labels, index)

    def _batches_from_iterable(self, source, per_core_rows, mode):
        cores = self.layout.num_cores if self.use_tpu else 1
        if isinstance(source, keras.utils.PyDataset):
            indices = itertools.cycle(range(len(source))) if mode == ModeKeys.TRAIN else range(len(source))
            iterator = (source[i] for i in indices)
        else:
            iterator = iter(source)
        while True:
            parts = list(itertools.islice(iterator, cores))
            if not parts:
                return
            parts = [p if isinstance(p, (tuple, list)) and len(p) == 2 else (p, None) for p in parts]
            if mode == ModeKeys.TRAIN and (len(parts) < cores or any(_rows(f) != per_core_rows for f, _ in parts)):
                raise ValueError(f"Training batches from input_fn must have params['batch_size'] = {per_core_rows} "
                                 f"rows each (one per core per step); drop the remainder.")
            features = tree.map_structure(lambda *a: np.concatenate(a), *[f for f, _ in parts])
            labels = None if parts[0][1] is None else np.concatenate([np.asarray(l) for _, l in parts])
            yield features, labels

    def _build(self, mode, features, labels):
        keras_features = _symbolic(features, "features")
        keras_labels = None if labels is None else _symbolic(labels, "labels")
        spec = _call_model_fn(self.model_fn, keras_features, keras_labels, mode, self.params, self.config)
        inputs = [keras_features] if keras_labels is None else [keras_features, keras_labels]
        if mode == ModeKeys.TRAIN:
            if spec.loss is None or spec.train_op is None:
                raise ValueError("In TRAIN mode model_fn must return a TPUEstimatorSpec with loss and train_op.")
            outputs = {"loss": spec.loss}
        elif mode == ModeKeys.EVAL:
            if spec.loss is None:
                raise ValueError("In EVAL mode model_fn must return a TPUEstimatorSpec with a loss.")
            outputs = {"loss": spec.loss}
            if spec.eval_metrics is not None:
                _, tensors = spec.eval_metrics
                items = tensors.items() if isinstance(tensors, dict) else enumerate(tensors)
                outputs.update({f"metric/{key}": tensor for key, tensor in items})
        else:
            if spec.predictions is None:
                raise ValueError("In PREDICT mode model_fn must return a TPUEstimatorSpec with predictions.")
            outputs = spec.predictions if isinstance(spec.predictions, dict) else {"predictions": spec.predictions}
        graph = keras.Model(inputs=inputs, outputs=outputs, name=f"model_fn_{mode}")
        return graph, spec

    def _graph_model(self, mode, features, labels):
        graph, spec = self._build(mode, features, labels)
        loss_scale = 1.0
        if mode == ModeKeys.TRAIN:
            optimizer = spec.train_op
            if isinstance(optimizer, CrossShardOptimizer):
                # Cores' gradients are averaged; summing them is averaging `cores` times the loss.
                loss_scale = float(self.layout.num_cores) if optimizer.reduction == "sum" else 1.0
                optimizer = optimizer.optimizer
            elif self.use_tpu:
                raise ValueError("With use_tpu=True, train_op must be a CrossShardOptimizer(optimizer) so that the "
                                 "cores' gradients are combined.")
            if not isinstance(optimizer, keras.optimizers.Optimizer):
                raise TypeError(f"train_op must be a Keras optimizer or CrossShardOptimizer; got {type(optimizer)}.")
        model = _GraphModel(graph, per_example=mode != ModeKeys.TRAIN, loss_scale=loss_scale)
        model.compile(optimizer=optimizer if mode == ModeKeys.TRAIN else None, jit_compile=True)
        return model, spec

    def _steps(self, model):
        return ReplicatedSteps(model, self.layout, "default", on_mxu=self.use_tpu)

    def _restore(self, model, with_optimizer):
        """Load the newest checkpoint into ``model``; return its global step (None if there is none)."""
        found = checkpoints.latest(self.model_dir)
        if found is None:
            return None
        step, arrays, header = found
        variables = list(model.trainable_variables) + list(model.non_trainable_variables)
        if with_optimizer:
            model.optimizer.build(model.trainable_variables)
            variables += list(model.optimizer.variables)
        if header.get("model_variables") != len(model.trainable_variables) + len(model.non_trainable_variables):
            raise ValueError(f"The checkpoint in {self.model_dir} does not fit this model_fn: it holds "
                             f"{header.get('model_variables')} model variables, the model has "
                             f"{len(model.trainable_variables) + len(model.non_trainable_variables)}.")
        for variable, value in zip(variables, arrays):
            if tuple(variable.shape) != tuple(value.shape):
                raise ValueError(f"The checkpoint in {self.model_dir} does not fit this model_fn: variable "
                                 f"{variable.path} has shape {tuple(variable.shape)}, the checkpoint {value.shape}.")
            variable.assign(value)
        return step

    def _save(self, model, step):
        model_variables = list(model.trainable_variables) + list(model.non_trainable_variables)
        arrays = [np.asarray(v.value) for v in model_variables + list(model.optimizer.variables)]
        path = checkpoints.save(self.model_dir, step, arrays, {"model_variables": len(model_variables)},
                                keep=self.config.keep_checkpoint_max)
        logger.info("Saving checkpoints for %d into %s.", step, path)

    def export_saved_model(self, export_dir_base, serving_input_receiver_fn):
        """Export the PREDICT graph with the latest checkpoint's weights (see :mod:`keras_tpu.export`).

        ``serving_input_receiver_fn()`` returns example features (an array or a
        dict of arrays, any batch size) giving the inputs' shapes and dtypes.
        Writes ``export_dir_base/<timestamp>`` and returns that path.
        """
        from keras_tpu import pod
        from keras_tpu.export import export_model

        features = serving_input_receiver_fn()
        graph, _ = self._build(ModeKeys.PREDICT, features, None)
        model = _GraphModel(graph, per_example=False)
        if self._restore(model, with_optimizer=False) is None:
            raise ValueError(f"Could not find a trained model in {self.model_dir}: train first.")
        path = os.path.join(export_dir_base, str(int(time.time())))
        if pod.is_chief():
            export_model(graph, path, "default" if self.use_tpu else "highest")
        return path

    def latest_checkpoint(self):
        """The global step of the newest checkpoint in ``model_dir``, or ``None``."""
        found = checkpoints.latest(self.model_dir)
        return None if found is None else found[0]

    # -- the three modes -------------------------------------------------------------------

    def train(self, input_fn, steps=None, max_steps=None):
        """Train for ``steps`` more steps or up to ``max_steps``, resuming from ``model_dir``.

        Runs ``iterations_per_loop`` steps per device call, logs the loss and
        global step after each, and writes checkpoints to ``model_dir``.
        Returns the estimator.
        """
        if (steps is None) == (max_steps is None):
            raise ValueError("Pass exactly one of steps or max_steps.")
        saved_step = self.latest_checkpoint()
        if max_steps is not None and saved_step is not None and saved_step >= max_steps:
            logger.info("Skipping training: the checkpoint in %s is at step %d, max_steps is %d.",
                        self.model_dir, saved_step, max_steps)
            return self
        if self.config.tf_random_seed is not None:
            keras.utils.set_random_seed(self.config.tf_random_seed)
        data, per_core_rows = self._input(input_fn, ModeKeys.TRAIN)
        batches = self._batches(data, per_core_rows, ModeKeys.TRAIN)
        first = next(batches)
        model, _ = self._graph_model(ModeKeys.TRAIN, *first)
        global_step = self._restore(model, with_optimizer=True) or 0
        if global_step:
            logger.info("Restored the checkpoint of step %d from %s.", global_step, self.model_dir)
        target = global_step + steps if steps is not None else max_steps
        batches = itertools.chain([first], batches)
        model.optimizer.build(model.trainable_variables)
        model.optimizer.iterations.assign(global_step)
        train_function = self._steps(model).train_function(self.iterations_per_loop)
        state = tuple([v.value for v in vs] for vs in (model.trainable_variables, model.non_trainable_variables,
                                                        model.optimizer.variables, model.metrics_variables))
        save_every = self.config.save_checkpoints_steps or max(self.iterations_per_loop, 100)
        last_saved, started = global_step, time.perf_counter()
        while global_step < target:
            loop_steps = min(self.iterations_per_loop, target - global_step)
            loop = ((list(batch), None, None) for batch in itertools.islice(batches, loop_steps))
            metrics = [jnp.zeros_like(v) for v in state[3]]  # the loss logged is this loop's mean
            logs, state = train_function(state[:3] + (metrics,), loop)
            global_step += loop_steps
            elapsed, started = time.perf_counter() - started, time.perf_counter()
            logger.info("loss = %.6f, step = %d (%.3f sec)", float(logs["loss"]), global_step, elapsed)
            if global_step - last_saved >= save_every or global_step >= target:
                self._assign(model, state)
                self._save(model, global_step)
                last_saved = global_step
        return self

    @staticmethod
    def _assign(model, state):
        for variables, values in zip((model.trainable_variables, model.non_trainable_variables,
                                      model.optimizer.variables), state):
            for variable, value in zip(variables, values):
                variable.assign(np.asarray(value))

    def _run_per_example(self, mode, input_fn, steps):
        data, per_core_rows = self._input(input_fn, mode)
        batches = self._batches(data, per_core_rows, mode)
        if steps is not None:
            batches = itertools.islice(batches, steps)
        first = next(batches, None)
        if first is None:
            raise ValueError(f"input_fn gave no data to {mode}.")
        model, spec = self._graph_model(mode, first[0], first[1] if mode == ModeKeys.EVAL else None)
        global_step = self._restore(model, with_optimizer=False)
        if global_step is None:
            raise ValueError(f"Could not find a trained model in {self.model_dir}: train first.")
        predict_function = self._steps(model).predict_function(self.iterations_per_loop)
        state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])
        inputs = (((f, l) if mode == ModeKeys.EVAL else (f,)) for f, l in itertools.chain([first], batches))
        feed = ((list(x), None, None) for x in inputs)
        outputs = []
        while True:
            try:
                result, state = predict_function(state, feed)
            except StopIteration:
                break
            outputs.append(result)
        merged = {key: np.concatenate([np.asarray(o[key]) for o in outputs]) for key in outputs[0]}
        return merged, spec, global_step

    def evaluate(self, input_fn, steps=None):
        """Evaluate the latest checkpoint on ``steps`` global batches (all of the data if None).

        Returns ``{"loss": ..., <metrics>..., "global_step": ...}``.
        """
        outputs, spec, global_step = self._run_per_example(ModeKeys.EVAL, input_fn, steps)
        results = {"loss": float(np.mean(outputs["loss"]))}
        if spec.eval_metrics is not None:
            metric_fn, tensors = spec.eval_metrics
            if isinstance(tensors, dict):
                values = metric_fn(**{key: outputs[f"metric/{key}"] for key in tensors})
            else:
                values = metric_fn(*[outputs[f"metric/{i}"] for i in range(len(tensors))])
            for name, value in values.items():
                value = value.result() if isinstance(value, keras.metrics.Metric) else value
                results[name] = float(np.asarray(value))
        results["global_step"] = global_step
        logger.info("Saving dict for global step %d: %s", global_step,
                    ", ".join(f"{k} = {v:.6g}" for k, v in results.items()))
        return results

    def predict(self, input_fn):
        """Yield one dict of predictions per example (padding removed, the partial last batch included)."""
        outputs, _, _ = self._run_per_example(ModeKeys.PREDICT, input_fn, None)
        for i in range(len(next(iter(outputs.values())))):
            yield {key: value[i] for key, value in outputs.items()}


def _is_iterable_source(value):
    return isinstance(value, keras.utils.PyDataset) or inspect.isgenerator(value)
