"""Keras callbacks for training on the simulated TPU."""

import time

import keras

from keras_tpu.profile import profile


class PredictedTPUTime(keras.callbacks.Callback):
    """Log, after each epoch, the simulated run's time beside the MXU time a real TPU would need.

    Opt-in: pass it to ``fit``. The prediction is the profile's MXU time per
    training step (:func:`keras_tpu.profile`) times the steps of the epoch.

    Example:
        >>> tpu_model.fit(x, y, batch_size=1024, epochs=5,
        ...               callbacks=[keras_tpu.callbacks.PredictedTPUTime()])   # doctest: +SKIP
        Epoch 1: 84.1 s simulated on this CPU; predicted MXU time on a TPU v2-8: 0.241 s (49 steps)
    """

    def __init__(self, accelerator_type=None, print_fn=print):
        super().__init__()
        self.accelerator_type = accelerator_type
        self.print_fn = print_fn
        self.predicted = []

    def on_epoch_begin(self, epoch, logs=None):
        self._started, self._steps = time.perf_counter(), 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        elapsed = time.perf_counter() - self._started
        report = profile(self.model, accelerator_type=self.accelerator_type, advise=False)
        predicted = self._steps * report.step_time("train")
        self.predicted.append(predicted)
        self.print_fn(f"Epoch {epoch + 1}: {elapsed:.1f} s simulated on this CPU; predicted MXU time on a TPU "
                      f"{report.accelerator_type}: {predicted:.3f} s ({self._steps} steps)")
