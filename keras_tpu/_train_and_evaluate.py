"""``train_and_evaluate``: TensorFlow's local loop that trains an estimator and evaluates each new checkpoint.

TensorFlow's ``tf.estimator.train_and_evaluate(estimator, train_spec,
eval_spec)`` in its local mode (one process, no ``TF_CONFIG`` cluster): it
trains up to ``train_spec.max_steps``, and each time training writes a
checkpoint (``RunConfig.save_checkpoints_steps``/``_secs``) it evaluates that
checkpoint on ``eval_spec.input_fn`` for ``eval_spec.steps`` batches, unless
the last evaluation is less than ``eval_spec.throttle_secs`` old; the last
checkpoint is always evaluated. After each evaluation the ``exporters`` export
the checkpoint to ``model_dir/export/<exporter name>``. Returns
``(eval_result, export_results)`` of the last evaluation, as TensorFlow 1.13
and later do.

Example:
    >>> from keras_tpu import estimator as tpu_estimator
    >>> train_spec = tpu_estimator.TrainSpec(input_fn=lambda params: (x, y), max_steps=100)  # doctest: +SKIP
    >>> eval_spec = tpu_estimator.EvalSpec(input_fn=lambda params: (x_test, y_test), steps=None,
    ...                                    throttle_secs=0)                                     # doctest: +SKIP
    >>> metrics, exports = tpu_estimator.train_and_evaluate(estimator, train_spec, eval_spec)  # doctest: +SKIP
"""

import dataclasses
import numbers
import os
import shutil
import time

from keras_tpu import _validation as validation
from keras_tpu._logging import logger


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """What ``train_and_evaluate`` trains on (``tf.estimator.TrainSpec``, same arguments in the same order).

    Example:
        >>> TrainSpec(input_fn=lambda params: None, max_steps=1000).max_steps
        1000
    """

    input_fn: object
    max_steps: int = None
    hooks: tuple = ()
    saving_listeners: tuple = ()

    def __post_init__(self):
        if not callable(self.input_fn):
            raise TypeError(f"`input_fn` must be callable, given: {self.input_fn!r}")
        validation.check_positive_integer(self.max_steps, "max_steps", "the global step training stops at",
                                          call="TrainSpec")
        object.__setattr__(self, "hooks", tuple(self.hooks or ()))
        object.__setattr__(self, "saving_listeners", tuple(self.saving_listeners or ()))


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What and how often ``train_and_evaluate`` evaluates (``tf.estimator.EvalSpec``, same arguments in the
    same order).

    ``steps`` batches per evaluation (``None``: all of ``input_fn``'s data);
    ``exporters`` (one or a list, each with a unique ``name``) run after each
    evaluation. ``start_delay_secs`` is TensorFlow's delay of a separate
    evaluator process; the local loop has none, so it has no effect.

    Example:
        >>> EvalSpec(input_fn=lambda params: None, steps=None, throttle_secs=0).throttle_secs
        0
    """

    input_fn: object
    steps: int = 100
    name: str = None
    hooks: tuple = ()
    exporters: tuple = ()
    start_delay_secs: float = 120
    throttle_secs: float = 600

    def __post_init__(self):
        if not callable(self.input_fn):
            raise TypeError(f"`input_fn` must be callable, given: {self.input_fn!r}")
        validation.check_positive_integer(self.steps, "steps", "batches per evaluation; None: all", call="EvalSpec")
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"`name` must be a string, given: {self.name!r}")
        for argument in ("start_delay_secs", "throttle_secs"):
            value = getattr(self, argument)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
                raise ValueError(f"Must specify {argument} >= 0, given: {value}")
        exporters = self.exporters
        exporters = () if exporters is None else (exporters,) if isinstance(exporters, Exporter) else tuple(exporters)
        names = [getattr(exporter, "name", None) for exporter in exporters]
        for exporter, name in zip(exporters, names):
            if not callable(getattr(exporter, "export", None)) or not isinstance(name, str) or not name:
                raise TypeError(f"Each exporter must have a name and an export() method (an Exporter); "
                                f"got {exporter!r}.")
        if len(set(names)) != len(names):
            raise ValueError(f"`exporters` must have unique names; got {names}.")
        object.__setattr__(self, "exporters", exporters)
        object.__setattr__(self, "hooks", tuple(self.hooks or ()))


class Exporter:
    """Exports a checkpoint after an evaluation (``tf.estimator.Exporter``): subclasses define ``export``.

    Example:
        >>> class PrintExporter(Exporter):
        ...     name = "print"
        ...     def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
        ...         print(checkpoint_path, eval_result["loss"])
        >>> EvalSpec(input_fn=lambda params: None, exporters=PrintExporter()).exporters[0].name
        'print'
    """

    @property
    def name(self):
        """The directory under ``model_dir/export`` this exporter writes to."""
        raise NotImplementedError

    def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
        """Export ``checkpoint_path`` under ``export_path``; return the export's path (or ``None``)."""
        raise NotImplementedError


class LatestExporter(Exporter):
    """Exports the PREDICT graph of every evaluated checkpoint and keeps the newest ``exports_to_keep``
    (``tf.estimator.LatestExporter``; ``None`` keeps all).

    Example:
        >>> LatestExporter("serving", lambda: None).name
        'serving'
    """

    def __init__(self, name, serving_input_receiver_fn, assets_extra=None, as_text=False, exports_to_keep=5):
        if not name:
            raise ValueError("An exporter needs a name.")
        validation.check_positive_integer(exports_to_keep, "exports_to_keep", "exports kept; None: all",
                                          call="LatestExporter")
        self._name = name
        self._serving_input_receiver_fn = serving_input_receiver_fn
        self._assets_extra = assets_extra
        self._as_text = as_text
        self._exports_to_keep = exports_to_keep

    @property
    def name(self):
        return self._name

    def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
        path = estimator.export_saved_model(export_path, self._serving_input_receiver_fn,
                                            assets_extra=self._assets_extra, as_text=self._as_text,
                                            checkpoint_path=checkpoint_path)
        if self._exports_to_keep is not None:
            # Exports are named by their timestamp (seconds): the smallest are the oldest.
            stamps = sorted((int(entry), entry) for entry in os.listdir(export_path) if entry.isdigit())
            for _, old in stamps[:-self._exports_to_keep]:
                shutil.rmtree(os.path.join(export_path, old), ignore_errors=True)
        return path


class FinalExporter(LatestExporter):
    """Exports only the last checkpoint of training, the one at ``TrainSpec.max_steps``
    (``tf.estimator.FinalExporter``).

    Example:
        >>> FinalExporter("final", lambda: None).name
        'final'
    """

    def __init__(self, name, serving_input_receiver_fn, assets_extra=None, as_text=False):
        super().__init__(name, serving_input_receiver_fn, assets_extra, as_text, exports_to_keep=None)

    def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
        if not is_the_final_export:
            return None
        return super().export(estimator, export_path, checkpoint_path, eval_result, is_the_final_export)


class _EvaluateNewCheckpoints:
    """A saving listener: evaluates (and exports) a checkpoint training has just written, at most once per
    ``throttle_secs``, and the last one when training ends (TensorFlow's ``_NewCheckpointListenerForEvaluate``)."""

    def __init__(self, estimator, eval_spec, max_steps):
        self._estimator, self._eval_spec, self._max_steps = estimator, eval_spec, max_steps
        self._evaluated_at = None  # (time, global step) of the last evaluation
        self.eval_result, self.export_results = None, None

    def after_save(self, session, global_step_value):
        if self._evaluated_at is not None and time.monotonic() - self._evaluated_at[0] < self._eval_spec.throttle_secs:
            logger.info("Skip the current checkpoint eval due to throttle secs (%s secs).",
                        self._eval_spec.throttle_secs)
            return False
        self._evaluate(global_step_value)
        return False

    def end(self, session, global_step_value):
        if self._evaluated_at is None or self._evaluated_at[1] != global_step_value:
            self._evaluate(global_step_value)

    def _evaluate(self, global_step_value):
        estimator, spec = self._estimator, self._eval_spec
        checkpoint = estimator.latest_checkpoint()
        self.eval_result = estimator.evaluate(spec.input_fn, steps=spec.steps, hooks=list(spec.hooks),
                                              checkpoint_path=checkpoint, name=spec.name)
        self._evaluated_at = time.monotonic(), global_step_value
        final = self._max_steps is not None and self.eval_result["global_step"] >= self._max_steps
        export_base = os.path.join(estimator.model_dir, "export")
        self.export_results = [
            exporter.export(estimator=estimator, export_path=os.path.join(export_base, exporter.name),
                            checkpoint_path=checkpoint, eval_result=self.eval_result, is_the_final_export=final)
            for exporter in spec.exporters]


def train_and_evaluate(estimator, train_spec, eval_spec):
    """Train ``estimator`` on ``train_spec``, evaluating each new checkpoint on ``eval_spec``
    (``tf.estimator.train_and_evaluate``, local mode; see the module's documentation).

    Returns ``(eval_result, export_results)`` of the last evaluation
    (``(None, None)`` when training had nothing left to do: the checkpoint in
    ``model_dir`` is at ``max_steps`` already, as TensorFlow returns).

    Example:
        >>> train_and_evaluate(estimator, TrainSpec(train_input_fn, max_steps=1000),
        ...                    EvalSpec(eval_input_fn, steps=10, throttle_secs=0))   # doctest: +SKIP
        ({'loss': 0.31, 'accuracy': 0.91, 'global_step': 1000}, [])
    """
    if not isinstance(train_spec, TrainSpec):
        raise TypeError(f"`train_spec` must have type `TrainSpec`. Got: {type(train_spec)}")
    if not isinstance(eval_spec, EvalSpec):
        raise TypeError(f"`eval_spec` must have type `EvalSpec`. Got: {type(eval_spec)}")
    if not all(callable(getattr(estimator, method, None)) for method in ("train", "evaluate", "latest_checkpoint")):
        raise TypeError(f"`estimator` must be a TPUEstimator; got {type(estimator).__name__}.")
    config = estimator.config
    logger.info("Start train and evaluate loop. The evaluate will happen after every checkpoint. Checkpoint "
                "frequency is determined based on RunConfig arguments: save_checkpoints_steps %s or "
                "save_checkpoints_secs %s.", config.save_checkpoints_steps, config.save_checkpoints_secs)
    listener = _EvaluateNewCheckpoints(estimator, eval_spec, train_spec.max_steps)
    estimator.train(train_spec.input_fn, hooks=list(train_spec.hooks), max_steps=train_spec.max_steps,
                    saving_listeners=list(train_spec.saving_listeners) + [listener])
    return listener.eval_result, listener.export_results
