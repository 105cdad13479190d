"""Keras callbacks for training on the simulated TPU."""

import time

import keras

from keras_tpu._profiling import profile


class PredictedTPUTime(keras.callbacks.Callback):
    """Log, after each epoch, the simulated run's time beside the time a real TPU would need.

    Opt-in: pass it to ``fit``. The prediction is the profile's whole training
    step (:func:`keras_tpu.profile`: MXU, vector unit, HBM, all-reduce, input
    and host, for the model's deployment) times the steps of the epoch; the
    part that bounds the step is named.

    Args:
        accelerator_type: the TPU to predict for (default: the model's).
        deployment: where input and loop run (default: the front end's; see
            :data:`keras_tpu._step_time.DEPLOYMENTS`).
        print_fn: where the line goes.

    Example:
        >>> tpu_model.fit(x, y, batch_size=1024, epochs=5,
        ...               callbacks=[keras_tpu.callbacks.PredictedTPUTime()])   # doctest: +SKIP
        Epoch 1: 84.1 s simulated on this CPU; predicted on a TPU v2-8: 5.78 s (49 steps of 118 ms, bound by input)
    """

    def __init__(self, accelerator_type=None, print_fn=print, deployment=None):
        super().__init__()
        self.accelerator_type = accelerator_type
        self.deployment = deployment
        self.print_fn = print_fn
        self.predicted = []

    def on_epoch_begin(self, epoch, logs=None):
        self._started, self._steps = time.perf_counter(), 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        elapsed = time.perf_counter() - self._started
        report = profile(self.model, accelerator_type=self.accelerator_type, advise=False,
                         deployment=self.deployment)
        step = report.step_time("train")
        predicted = self._steps * step
        self.predicted.append(predicted)
        self.print_fn(f"Epoch {epoch + 1}: {elapsed:.1f} s simulated on this CPU; predicted on a TPU "
                      f"{report.accelerator_type}: {predicted:.3f} s ({self._steps} steps of {step * 1e3:.3g} ms, "
                      f"bound by {report.bound('train')})")
