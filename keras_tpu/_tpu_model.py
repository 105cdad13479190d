"""``keras_to_tpu_model``: a Keras model that trains, evaluates and predicts on the simulated TPU.

This is TensorFlow 1.x's ``tf.contrib.tpu.keras_to_tpu_model`` on Keras 3:

.. code-block:: python

    tpu_model = keras_tpu.keras_to_tpu_model(
        cpu_model,
        strategy=keras_tpu.TPUDistributionStrategy(keras_tpu.TPUClusterResolver(tpu)))
    tpu_model.fit(x, y, batch_size=128 * 8, epochs=10)
    tpu_model.save_weights("model.h5")       # INFO ... Copying TPU weights to the CPU

The TPU model is a ``keras.Model`` that shares the CPU model's layers and
variables and keeps its compile settings; Keras' own ``fit``, ``evaluate`` and
``predict`` loops drive it (callbacks, progress bar, ``History``, data
adapters), while each step runs as one program on the TPU's cores
(:mod:`keras_tpu._replicated_steps`).

Weights move lazily: the first TPU step copies them to the cores, where they
stay between calls; ``sync_to_cpu``, ``get_weights`` and ``save_weights``
copy them back to the CPU model.
"""

import collections
import collections.abc
import itertools

import keras
import numpy as np
from keras import tree

from keras_tpu import _keras_private, _pod as pod, _weights as weights
from keras_tpu._logging import logger
from keras_tpu._placement import Placement, installed_on
from keras_tpu._profiling import profile as _profile
from keras_tpu._custom_steps import custom_step_methods


TPUAssignment = collections.namedtuple("TPUAssignment", ["worker_name", "num_towers"])
TPUAssignment.__doc__ = "The TPU job and the number of cores (towers) a :class:`KerasTPUModel` runs on."


class TPUDistributionStrategy:
    """How a model is spread over the TPU (TF 1.x's ``TPUDistributionStrategy``).

    Args:
        tpu_cluster_resolver: a :class:`TPUClusterResolver` (default: the
            local simulated v2-8).
        using_single_core: run on one core instead of all of them.
        precision: the MXU precision of the model's matrix products:
            ``"default"`` (one bfloat16 pass, as on a TPU), ``"high"``
            (bf16_3x) or ``"highest"`` (bf16_6x, close to float32).

    Example:
        >>> from keras_tpu import TPUClusterResolver
        >>> strategy = TPUDistributionStrategy(TPUClusterResolver("grpc://10.0.0.2:8470"))
        >>> strategy.num_cores
        8
    """

    def __init__(self, tpu_cluster_resolver=None, using_single_core=False, precision="default"):
        self.placement = Placement(tpu_cluster_resolver, precision, num_cores=1 if using_single_core else None,
                                   owner="TPUDistributionStrategy")
        self.using_single_core = bool(using_single_core)

    @property
    def resolver(self):
        """The :class:`TPUClusterResolver` of the TPU this strategy runs on."""
        return self.placement.resolver

    @property
    def topology(self):
        """The :class:`Topology` :func:`initialize_tpu_system` found."""
        return self.placement.topology

    @property
    def layout(self):
        """The :class:`CoreLayout`: where the cores live on this host."""
        return self.placement.layout

    @property
    def precision(self):
        """The MXU's precision for float32 products (``"default"``: one bf16 pass)."""
        return self.placement.precision

    @property
    def num_cores(self):
        """How many cores the model's steps run on."""
        return self.placement.num_cores

    def __repr__(self):
        return (f"TPUDistributionStrategy({self.topology.accelerator_type}, cores={self.num_cores}, "
                f"precision={self.precision.name.lower()!r})")


class KerasTPUModel(keras.Model):
    """A Keras model running on the simulated TPU; create it with :func:`keras_to_tpu_model`.

    It shares the CPU model's variables: ``fit``, ``evaluate`` and ``predict`` run on the TPU's cores,
    ``save_weights`` writes files a plain CPU model loads.

    Example:
        >>> import keras
        >>> cpu_model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> cpu_model.compile("sgd", "mse")
        >>> tpu_model = keras_to_tpu_model(cpu_model)
        >>> isinstance(tpu_model, KerasTPUModel), tpu_model.predict(np.ones((8, 4)), verbose=0).shape
        (True, (8, 2))
    """

    def __init__(self, cpu_model, strategy):
        super().__init__(name=cpu_model.name)
        self._cpu_model = cpu_model
        self._strategy = strategy
        # A model with its own steps, compute_loss or compute_metrics runs them itself, on the TPU's programs
        # (see _keras_method); others run Keras' steps on this wrapper, which shares the CPU model's variables.
        self._own_methods = custom_step_methods(cpu_model) + _keras_private.overridden_methods(
            cpu_model, ("compute_loss", "compute_metrics"))
        self._tpu_functions = {}
        strategy.placement.install(self, user_model=cpu_model)
        if cpu_model.built:
            self.built = True
        if _keras_private.overridden_methods(cpu_model, ("compile",)):
            # A model with a compile() of its own arguments (keras.io's Distiller and GANs: compile(optimizer,
            # metrics, student_loss_fn, ...)) is compiled by it, as TF 1.x code compiles the TPU model.
            object.__setattr__(self, "compile", self._compile_as_the_model_does)
        self._compile_like_the_cpu_model()

    def _compile_like_the_cpu_model(self):
        compile_args = _keras_private.compile_arguments(self._cpu_model)
        if compile_args:
            compile_args.pop("run_eagerly", None)  # the CPU model's own debugging choice; the TPU runs programs
            KerasTPUModel.compile(self, **compile_args)

    def _compile_as_the_model_does(self, *args, **kwargs):
        """``compile`` of a TPU model whose CPU model has its own: the CPU model's, with its arguments (it sets
        what its steps read); this model then compiles as the CPU model did."""
        self._cpu_model.compile(*args, **kwargs)
        self._compile_like_the_cpu_model()

    # -- the CPU model's face ------------------------------------------------------------

    @property
    def cpu_model(self):
        """The CPU model this TPU model was made from (its weights are synced by :meth:`sync_to_cpu`)."""
        return self._cpu_model

    @property
    def strategy(self):
        """The :class:`TPUDistributionStrategy` the model runs on."""
        return self._strategy

    def call(self, inputs, training=None):
        """The CPU model's own forward pass (its layers and weights)."""
        return self._cpu_model(inputs, training=training)

    @property
    def layers(self):
        """The CPU model's layers."""
        return self._cpu_model.layers

    def get_layer(self, name=None, index=None):
        """The CPU model's layer of ``name`` or ``index``."""
        return self._cpu_model.get_layer(name=name, index=index)

    def __getattr__(self, name):
        # Only reached for attributes the TPU model lacks: use the CPU model's (inputs, outputs, ...).
        cpu_model = self.__dict__.get("_cpu_model")
        if name.startswith("_") or cpu_model is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(cpu_model, name)

    def summary(self, *args, **kwargs):
        """The CPU model's summary."""
        self._cpu_model.summary(*args, **kwargs)
        (kwargs.get("print_fn") or print)(f"Runs on: {self._strategy.placement.describe()}")

    # -- TF 1.x's compile, fit, evaluate and predict arguments, on Keras 3's -----------------

    def compile(self, optimizer="rmsprop", loss=None, metrics=None, loss_weights=None, sample_weight_mode=None,
                weighted_metrics=None, target_tensors=None, **kwargs):
        """Compile for the TPU, with TF 1.x ``KerasTPUModel.compile``'s arguments in its order.

        ``optimizer``, ``loss``, ``metrics``, ``loss_weights`` and ``weighted_metrics``
        are Keras 3's (TensorFlow refused ``weighted_metrics`` on a TPU; Keras 3 and
        keras_tpu support it, padding rows excluded). ``sample_weight_mode`` may be
        ``None`` or ``"temporal"`` and has no effect: Keras 3 weighs per time step
        when ``sample_weight`` has a time axis. ``target_tensors`` is refused: pass
        the targets as ``y``. Other keywords go to Keras 3's ``compile``
        (``steps_per_execution``, ``jit_compile``, ``auto_scale_loss``);
        ``run_eagerly=True`` and ``distribute`` are refused.
        """
        modes = sample_weight_mode.values() if isinstance(sample_weight_mode, dict) else \
            sample_weight_mode if isinstance(sample_weight_mode, (list, tuple)) else [sample_weight_mode]
        if any(mode not in (None, "temporal") for mode in modes):
            raise ValueError(f"sample_weight_mode must be None or 'temporal'; got {sample_weight_mode!r}. (Keras 3 "
                             f"has no sample_weight_mode: give sample_weight of shape (batch, timesteps) to weigh "
                             f"time steps.)")
        if target_tensors is not None:
            raise ValueError("compile(target_tensors=...) is not supported (TensorFlow refused it on TPUs too, and "
                             "Keras 3 has no target tensors): pass the targets as y to fit/evaluate.")
        if kwargs.get("run_eagerly"):
            raise ValueError("run_eagerly=True: the TPU runs compiled programs only. Debug eagerly on the CPU "
                             "model (tpu_model.cpu_model.compile(..., run_eagerly=True)).")
        kwargs.pop("run_eagerly", None)
        if kwargs.pop("distribute", None) is not None:
            raise ValueError("compile(distribute=...): this model is already distributed over the TPU's cores by "
                             "keras_to_tpu_model; for a strategy of your own build the model under "
                             "keras_tpu.TPUStrategy().scope().")
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, loss_weights=loss_weights,
                        weighted_metrics=weighted_metrics, **kwargs)

    def _keras_method(self, name):
        """Keras' ``fit``/``evaluate``/``predict``/``*_on_batch`` for this TPU model.

        Usually Keras' own method of this wrapper. For a CPU model with its own
        ``train_step``/``test_step``/``predict_step``, ``compute_loss`` or
        ``compute_metrics``, those methods index the model's *own* state (its
        metrics, optimizers, variables); so the model itself runs the call, with
        the TPU's programs installed for its duration (its own functions, if it
        has any, are put back afterwards: the CPU model stays a CPU model).
        """
        if not self._own_methods:
            return getattr(super(), name)

        def on_the_tpu(*args, **kwargs):
            cpu_model, names = self._cpu_model, ("train_function", "test_function", "predict_function")
            own_functions = {key: getattr(cpu_model, key, None) for key in names}
            self._strategy.placement.install(cpu_model)
            for key in names:
                setattr(cpu_model, key, self._tpu_functions.get(key))  # compiled programs are kept between calls
            try:
                return getattr(cpu_model, name)(*args, **kwargs)
            finally:
                self._tpu_functions = {key: getattr(cpu_model, key, None) for key in names}
                self._strategy.placement.uninstall(cpu_model)
                for key, function in own_functions.items():
                    setattr(cpu_model, key, function)

        return on_the_tpu

    def _input_fn_batches(self, input_fn, what):
        """TF 1.x's ``fit(x=function)``: the function returns a dataset of **per-core** batches; each step
        takes one per core (the global batch), and the dataset is made again when it ends."""
        cores = self._strategy.num_cores

        def batches():
            while True:
                iterator, produced = iter(input_fn()), False
                while True:
                    parts = list(itertools.islice(iterator, cores))
                    if len(parts) < cores:
                        break  # a partial step at the end: dropped, as drop_remainder=True does
                    produced = True
                    yield tree.map_structure(lambda *a: np.concatenate([np.asarray(p) for p in a]), *parts)
                if not produced:
                    raise ValueError(f"The dataset function given as {what} produced fewer than {cores} per-core "
                                     f"batches: each step takes one per core.")

        return batches()

    def _resolve_data(self, x, y, steps, steps_name, what):
        if callable(x) and not hasattr(x, "__iter__") and not hasattr(x, "__getitem__"):
            if y is not None:
                raise ValueError(f"When {what} is a function returning a dataset, y must be None (the dataset "
                                 f"gives (x, y) pairs).")
            if steps is None:
                raise ValueError(f"When {what} is a function returning a dataset, {steps_name} is required (as in "
                                 f"TensorFlow 1).")
            return self._input_fn_batches(x, what), None
        return x, y

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None, validation_split=0.0,
            validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
            steps_per_epoch=None, validation_steps=None, validation_freq=1, max_queue_size=10, workers=1,
            use_multiprocessing=False, validation_batch_size=None, **kwargs):
        """Keras 3's ``fit`` on the TPU's programs, with TF 1.x's arguments.

        ``x`` may also be a function returning an iterable of **per-core**
        ``(x, y)`` batches (TF 1.x's ``KerasTPUModel``: each step takes one per
        core; ``steps_per_epoch`` required), and so may ``validation_data``
        (``validation_steps`` required). ``nb_epoch`` is Keras 1's name of
        ``epochs``. ``max_queue_size``, ``workers``, ``use_multiprocessing`` and
        ``_pipeline`` have no effect (Keras 3 takes the first three from a
        ``keras.utils.PyDataset``; there is no separate pipelined loop).
        """
        if "nb_epoch" in kwargs:
            nb_epoch = kwargs.pop("nb_epoch")
            if epochs not in (1, nb_epoch):
                raise ValueError(f"nb_epoch={nb_epoch} is the old name of epochs={epochs}; pass only epochs.")
            epochs = nb_epoch
        kwargs.pop("_pipeline", None)
        if kwargs:
            raise TypeError(f"fit() got unexpected keyword arguments {sorted(kwargs)}.")
        x, y = self._resolve_data(x, y, steps_per_epoch, "steps_per_epoch", "x")
        if callable(validation_data) and not hasattr(validation_data, "__iter__"):
            validation_data, _ = self._resolve_data(validation_data, None, validation_steps, "validation_steps",
                                                    "validation_data")
        history = self._keras_method("fit")(
            x, y, batch_size=batch_size, epochs=epochs, verbose=verbose, callbacks=callbacks,
            validation_split=validation_split, validation_data=validation_data, shuffle=shuffle,
            class_weight=class_weight, sample_weight=sample_weight, initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq)
        history.history = TF1MetricNames(history.history)
        return history

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, steps=None,
                 callbacks=None, max_queue_size=10, workers=1, use_multiprocessing=False, return_dict=False,
                 **kwargs):
        """Keras 3's ``evaluate`` on the TPU's programs, with TF 1.x's arguments (``x`` may be a function
        returning per-core batches, with ``steps``; ``max_queue_size``, ``workers`` and
        ``use_multiprocessing`` have no effect)."""
        x, y = self._resolve_data(x, y, steps, "steps", "x")
        return self._keras_method("evaluate")(x, y, batch_size=batch_size, verbose=verbose, sample_weight=sample_weight,
                                steps=steps, callbacks=callbacks, return_dict=return_dict, **kwargs)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, max_queue_size=10, workers=1,
                use_multiprocessing=False, callbacks=None):
        """Keras 3's ``predict`` on the TPU's programs, one row per input, with TF 1.x's arguments
        (``max_queue_size``, ``workers`` and ``use_multiprocessing`` have no effect)."""
        return self._keras_method("predict")(x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks)

    def _keep_metrics(self, reset_metrics, method, *args, **kwargs):
        """Run Keras 3's ``*_on_batch`` (which resets the metrics first) keeping them if ``reset_metrics`` is
        False, as TF 1.x's ``reset_metrics=False`` does."""
        if reset_metrics:
            return method(*args, **kwargs)
        runner = self._cpu_model if self._own_methods else self  # the model whose metrics the call resets
        runner.__dict__["reset_metrics"] = lambda: None  # shadows the class method for this call only
        try:
            return method(*args, **kwargs)
        finally:
            del runner.__dict__["reset_metrics"]

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, reset_metrics=True,
                       return_dict=False):
        """One training step on the TPU. ``reset_metrics=False`` accumulates the metrics over calls."""
        return self._keep_metrics(reset_metrics, self._keras_method("train_on_batch"), x, y,
                                  sample_weight=sample_weight,
                                  class_weight=class_weight, return_dict=return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, reset_metrics=True, return_dict=False):
        """One evaluation step on the TPU. ``reset_metrics=False`` accumulates the metrics over calls."""
        return self._keep_metrics(reset_metrics, self._keras_method("test_on_batch"), x, y, sample_weight=sample_weight,
                                  return_dict=return_dict)

    def predict_on_batch(self, x):
        """Predictions for one batch, on the TPU."""
        return self._keras_method("predict_on_batch")(x)

    # -- TF 1.x's model properties -----------------------------------------------------------

    @property
    def cpu_optimizer(self):
        """The CPU model's optimizer (TF 1.x's ``KerasTPUModel.cpu_optimizer``)."""
        return self._cpu_model.optimizer

    @property
    def stateful(self):
        """Whether any layer is stateful (a stateful RNN), as TF 1.x's ``Model.stateful``."""
        return any(getattr(layer, "stateful", False) for layer in _keras_private.all_layers(self._cpu_model))

    def reset_states(self):
        """Reset the states of the stateful layers (TF 1.x's ``Model.reset_states``)."""
        self.jax_state_sync()
        for layer in _keras_private.all_layers(self._cpu_model):
            if getattr(layer, "stateful", False) and callable(getattr(layer, "reset_states", None)):
                layer.reset_states()

    def get_config(self):
        """TF 1.x's ``KerasTPUModel.get_config``: ``{"cpu_model", "tpu_name_or_address", "tpu_assignment"}``
        (not a Keras serialization: save the CPU model, or use :meth:`to_json`)."""
        resolver = self._strategy.resolver
        return {"cpu_model": self._cpu_model, "tpu_name_or_address": resolver.master() or resolver.tpu,
                "tpu_assignment": TPUAssignment(resolver.job_name, self._strategy.num_cores)}

    def to_json(self, **kwargs):
        """The CPU model's architecture as JSON (``keras.models.model_from_json`` rebuilds it)."""
        return self._cpu_model.to_json(**kwargs)

    def to_yaml(self, **kwargs):
        """Refused, as in TensorFlow 2: use ``to_json()``."""
        raise RuntimeError("to_yaml() was removed from Keras (TensorFlow 2.x refuses it too: YAML loading can run "
                           "arbitrary code). Use to_json() instead.")

    # -- TF 1.x Keras' generator methods, on Keras 3's fit/evaluate/predict ----------------

    @staticmethod
    def _as_tuples(generator, inputs_only=False):
        """TF 1.x's generators may yield bare input batches or lists; Keras 3 takes tuples only.

        A list is ``[x, y]`` for training and evaluation, as TF 1.x read it,
        and the inputs of a model with several (``inputs_only``, for
        prediction: TF 1.x's ``predict_generator`` took any non-tuple as ``x``).
        """
        if not isinstance(generator, collections.abc.Iterator):
            return generator  # a keras.utils.PyDataset, or anything else Keras 3 reads as it is
        return (item if isinstance(item, tuple) else
                tuple(item) if isinstance(item, list) and not inputs_only else (item,)
                for item in generator)

    def fit_generator(self, generator, steps_per_epoch=None, epochs=1, verbose=1, callbacks=None,
                      validation_data=None, validation_steps=None, validation_freq=1, class_weight=None,
                      max_queue_size=10, workers=1, use_multiprocessing=False, shuffle=True, initial_epoch=0):
        """TF 1.x's ``fit_generator``: ``fit`` on a generator or ``keras.utils.PyDataset`` of batches.

        ``max_queue_size``, ``workers`` and ``use_multiprocessing`` have no
        effect here (Keras 3 takes them from a ``PyDataset``'s constructor).

        Example:
            >>> history = tpu_model.fit_generator(batches(), steps_per_epoch=10, epochs=2)   # doctest: +SKIP
        """
        # As in TF 1.x, shuffle applies to a PyDataset (Sequence) only: a generator's order is its own.
        shuffle = shuffle and not isinstance(generator, collections.abc.Iterator)
        return self.fit(self._as_tuples(generator), steps_per_epoch=steps_per_epoch, epochs=epochs,
                        verbose=verbose, callbacks=callbacks, validation_data=validation_data,
                        validation_steps=validation_steps, validation_freq=validation_freq,
                        class_weight=class_weight, shuffle=shuffle, initial_epoch=initial_epoch)

    def evaluate_generator(self, generator, steps=None, callbacks=None, max_queue_size=10, workers=1,
                           use_multiprocessing=False, verbose=0):
        """TF 1.x's ``evaluate_generator``: ``evaluate`` on a generator of ``(x, y)`` batches (``max_queue_size``,
        ``workers`` and ``use_multiprocessing`` have no effect)."""
        return self.evaluate(self._as_tuples(generator), steps=steps, callbacks=callbacks, verbose=verbose)

    def predict_generator(self, generator, steps=None, callbacks=None, max_queue_size=10, workers=1,
                          use_multiprocessing=False, verbose=0):
        """TF 1.x's ``predict_generator``: ``predict`` on a generator of input batches (bare arrays or ``(x,)``
        tuples, as in TF 1.x; ``max_queue_size``, ``workers`` and ``use_multiprocessing`` have no effect)."""
        return self.predict(self._as_tuples(generator, inputs_only=True), steps=steps, callbacks=callbacks,
                            verbose=verbose)

    # -- weights --------------------------------------------------------------------------

    def _host_variables(self):
        variables = list(self._cpu_model.variables)
        optimizer = getattr(self, "optimizer", None)  # (a model converted for inference is never compiled)
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        return variables

    def sync_to_cpu(self):
        """Copy the weights (and optimizer state) from the TPU cores back to the CPU model; return it.

        Example:
            >>> cpu_model = tpu_model.sync_to_cpu()      # doctest: +SKIP
        """
        self.jax_state_sync()
        layout = self._strategy.layout
        on_cores = [v for v in self._host_variables() if layout.holds(v.value)]
        if on_cores:
            logger.info("Copying TPU weights to the CPU")
            for variable, value in zip(on_cores, pod.to_host([v.value for v in on_cores])):
                variable.assign(value)
        return self._cpu_model

    def get_weights(self):
        """The trained weights (synced to the CPU model first), as its ``get_weights()`` gives them."""
        self.sync_to_cpu()
        return self._cpu_model.get_weights()

    def set_weights(self, weights_list):
        """Set the weights, as the CPU model's ``set_weights()`` does."""
        self._cpu_model.set_weights(weights_list)  # copied to the cores by the next TPU step

    def save_weights(self, filepath, overwrite=True, save_format=None):
        """Save the weights: ``"x.h5"`` in tf.keras' HDF5 layout, ``"x.weights.h5"`` in Keras 3's.

        Either loads into the plain CPU model with ``model.load_weights``.
        ``save_format``: ``None`` or ``"h5"`` (both HDF5, by the file name);
        ``"tf"`` (a TensorFlow checkpoint) is refused.
        """
        _check_save_format(save_format, filepath, ("h5", "hdf5"), "a weights file name ending in '.h5' (tf.keras' "
                           "layout) or '.weights.h5' (Keras 3's)")
        self.sync_to_cpu()
        weights.save_weights(self._cpu_model, filepath, overwrite=overwrite)

    def load_weights(self, filepath, by_name=False, skip_mismatch=False, **kwargs):
        """Load weights from a ``.h5`` (tf.keras 2.x or Keras 3, weights or whole model), ``.weights.h5``
        or ``.keras`` file. ``by_name=True`` matches layers by name (``.h5`` files only, as in
        TensorFlow); ``skip_mismatch`` skips layers whose weights do not fit."""
        if by_name:
            kwargs["by_name"] = True
        weights.load_weights(self._cpu_model, filepath, skip_mismatch=skip_mismatch, **kwargs)

    def profile(self, batch_size=None, accelerator_type=None, dataset_size=None, **kwargs):
        """The :class:`keras_tpu.TPUProfile` of this model on its TPU (see :func:`keras_tpu.profile`).

        Defaults: the global batch of the last ``fit`` (else 128 per core), this strategy's
        accelerator type, and the deployment of TF 1.x's ``keras_to_tpu_model`` (numpy fed from
        a remote client); ``deployment``, ``steps_per_execution`` and ``input_dtype`` go to
        :func:`keras_tpu.profile`.
        """
        return _profile(self, batch_size=batch_size, accelerator_type=accelerator_type, dataset_size=dataset_size,
                        **kwargs)

    def export(self, path):
        """Write the inference function (MXU numerics, any batch size) and its weights with
        ``jax.export``; load it with :func:`keras_tpu.load_exported`, no model code needed."""
        from keras_tpu._export import export_model

        self.sync_to_cpu()
        if pod.is_chief():
            export_model(self._cpu_model, path, self._strategy.precision)
        return path

    def save(self, filepath, overwrite=True, include_optimizer=True, save_format=None, signatures=None,
             options=None, **kwargs):
        """Save the CPU model (with the trained weights) as ``model.save`` does: ``"x.keras"`` or legacy
        ``"x.h5"``. ``save_format="tf"``, ``signatures`` and ``options`` (a TensorFlow SavedModel) are
        refused: :meth:`export` writes the servable model."""
        _check_save_format(save_format, filepath, ("h5", "keras"), "'name.keras' or 'name.h5' (and "
                           "tpu_model.export(path) for a servable model)")
        if signatures is not None or options is not None:
            raise ValueError("save(signatures=..., options=...) belong to TensorFlow's SavedModel, which keras_tpu "
                             "does not write. Use tpu_model.export(path) for a servable model (keras_tpu."
                             "load_exported loads it), or save 'name.keras'.")
        self.sync_to_cpu()
        weights.save_model(self._cpu_model, filepath, overwrite=overwrite, include_optimizer=include_optimizer,
                           **kwargs)


class TF1MetricNames(dict):
    """A ``History.history`` that also answers to TF 1.x's names of the accuracy logs: ``metrics=["accuracy"]``
    logged ``acc`` and ``val_acc`` there, ``accuracy`` and ``val_accuracy`` in Keras 3. TF 1.x notebooks plot
    ``history.history["acc"]`` right after ``fit``.

    Example:
        >>> logs = TF1MetricNames({"accuracy": [0.5], "val_accuracy": [0.4]})
        >>> logs["acc"], "val_acc" in logs, list(logs)
        ([0.5], True, ['accuracy', 'val_accuracy'])
    """

    NAMES = {"acc": "accuracy", "val_acc": "val_accuracy"}

    def __missing__(self, key):
        if key in self.NAMES and self.NAMES[key] in self:
            return self[self.NAMES[key]]
        raise KeyError(key)

    def __contains__(self, key):
        return super().__contains__(key) or (key in self.NAMES and super().__contains__(self.NAMES[key]))

    def get(self, key, default=None):
        return self[key] if key in self else default


def _check_save_format(save_format, filepath, formats, alternative):
    if save_format is None:
        return
    if str(save_format).lower() not in formats:
        raise ValueError(f"save_format={save_format!r}: keras_tpu writes no TensorFlow checkpoints or SavedModels. "
                         f"Save to {alternative}.")


def keras_to_tpu_model(model, strategy=None):
    """Make a TPU model from a Keras model, keeping its layers, weights and compile settings.

    Args:
        model: a ``keras.Model`` (Sequential, functional or subclassed; with
            its own steps, ``compute_loss`` or ``compute_metrics`` too), compiled.
            Inputs of variable length (``keras.Input(shape=(None,))``) compile one
            program per shape.
        strategy: a :class:`TPUDistributionStrategy` (default: all cores of
            the local simulated v2-8).

    Example:
        >>> import keras
        >>> cpu_model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> cpu_model.compile("adam", "mse")
        >>> tpu = keras_to_tpu_model(cpu_model)
        >>> history = tpu.fit(np.ones((16, 4)), np.ones((16, 2)), batch_size=8, verbose=0)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"keras_to_tpu_model needs a Keras model (keras.Model, keras.Sequential or a subclass); "
                        f"got {type(model).__module__}.{type(model).__name__}.")
    if isinstance(model, KerasTPUModel) or installed_on(model) is not None:
        raise ValueError("This model already runs on the TPU (it was created under a TPUStrategy scope, or converted "
                         "before): call its fit, evaluate, predict, save_weights and export directly.")
    if strategy is None:
        strategy = TPUDistributionStrategy()
    if not isinstance(strategy, TPUDistributionStrategy):
        raise TypeError(f"strategy must be a keras_tpu.TPUDistributionStrategy; got {type(strategy).__name__}.")
    return KerasTPUModel(model, strategy)

