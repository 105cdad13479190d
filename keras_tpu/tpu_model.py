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
(:mod:`keras_tpu.replicated_steps`).

Weights move lazily: the first TPU step copies them to the cores, where they
stay between calls; ``sync_to_cpu``, ``get_weights`` and ``save_weights``
copy them back to the CPU model.
"""

import keras

from keras_tpu import _keras_private, pod, weights
from keras_tpu._logging import logger
from keras_tpu.placement import Placement, installed_on
from keras_tpu.profile import profile as _profile
from keras_tpu.replicated_steps import check_steps_supported


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
        return self.placement.resolver

    @property
    def topology(self):
        return self.placement.topology

    @property
    def layout(self):
        return self.placement.layout

    @property
    def precision(self):
        return self.placement.precision

    @property
    def num_cores(self):
        return self.placement.num_cores

    def __repr__(self):
        return (f"TPUDistributionStrategy({self.topology.accelerator_type}, cores={self.num_cores}, "
                f"precision={self.precision.name.lower()!r})")


def _check_fixed_shapes(model):
    tensors = []
    for kind in ("inputs", "outputs"):
        try:
            tensors += [(kind, t) for t in (getattr(model, kind, None) or [])]
        except (AttributeError, ValueError):
            pass
    for kind, tensor in tensors:
        shape = tuple(tensor.shape)
        if any(dim is None for dim in shape[1:]):
            raise ValueError(
                f"The TPU runs programs of fixed shapes, but the model's {kind[:-1]} {tensor.name!r} has shape "
                f"{shape}: only the batch dimension may be None. Give keras.Input(shape=...) fixed sizes "
                f"(pad variable-length data to a fixed length)."
            )


class KerasTPUModel(keras.Model):
    """A Keras model running on the simulated TPU; create it with :func:`keras_to_tpu_model`."""

    def __init__(self, cpu_model, strategy):
        super().__init__(name=cpu_model.name)
        self._cpu_model = cpu_model
        self._strategy = strategy
        strategy.placement.install(self, user_model=cpu_model)
        if cpu_model.built:
            self.built = True
        compile_args = _keras_private.compile_arguments(cpu_model)
        if compile_args:
            self.compile(**compile_args)

    # -- the CPU model's face ------------------------------------------------------------

    @property
    def cpu_model(self):
        """The CPU model this TPU model was made from (its weights are synced by :meth:`sync_to_cpu`)."""
        return self._cpu_model

    @property
    def strategy(self):
        return self._strategy

    def call(self, inputs, training=None):
        return self._cpu_model(inputs, training=training)

    @property
    def layers(self):
        return self._cpu_model.layers

    def get_layer(self, name=None, index=None):
        return self._cpu_model.get_layer(name=name, index=index)

    def __getattr__(self, name):
        # Only reached for attributes the TPU model lacks: use the CPU model's (inputs, outputs, ...).
        cpu_model = self.__dict__.get("_cpu_model")
        if name.startswith("_") or cpu_model is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(cpu_model, name)

    def summary(self, *args, **kwargs):
        self._cpu_model.summary(*args, **kwargs)
        (kwargs.get("print_fn") or print)(f"Runs on: {self._strategy.placement.describe()}")

    # -- TF 1.x Keras' generator methods, on Keras 3's fit/evaluate/predict ----------------

    def fit_generator(self, generator, steps_per_epoch=None, epochs=1, verbose=1, callbacks=None,
                      validation_data=None, validation_steps=None, validation_freq=1, class_weight=None,
                      max_queue_size=10, workers=1, use_multiprocessing=False, shuffle=True, initial_epoch=0):
        """TF 1.x's ``fit_generator``: ``fit`` on a generator or ``keras.utils.PyDataset`` of batches.

        ``max_queue_size``, ``workers`` and ``use_multiprocessing`` have no
        effect here (Keras 3 takes them from a ``PyDataset``'s constructor).

        Example:
            >>> history = tpu_model.fit_generator(batches(), steps_per_epoch=10, epochs=2)   # doctest: +SKIP
        """
        return self.fit(generator, steps_per_epoch=steps_per_epoch, epochs=epochs, verbose=verbose,
                        callbacks=callbacks, validation_data=validation_data, validation_steps=validation_steps,
                        validation_freq=validation_freq, class_weight=class_weight, shuffle=shuffle,
                        initial_epoch=initial_epoch)

    def evaluate_generator(self, generator, steps=None, callbacks=None, max_queue_size=10, workers=1,
                           use_multiprocessing=False, verbose=0):
        """TF 1.x's ``evaluate_generator``: ``evaluate`` on a generator of ``(x, y)`` batches."""
        return self.evaluate(generator, steps=steps, callbacks=callbacks, verbose=verbose)

    def predict_generator(self, generator, steps=None, callbacks=None, max_queue_size=10, workers=1,
                          use_multiprocessing=False, verbose=0):
        """TF 1.x's ``predict_generator``: ``predict`` on a generator of input batches."""
        return self.predict(generator, steps=steps, callbacks=callbacks, verbose=verbose)

    # -- weights --------------------------------------------------------------------------

    def _host_variables(self):
        variables = list(self._cpu_model.variables)
        if self.optimizer is not None and self.optimizer.built:
            variables += list(self.optimizer.variables)
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
        self.sync_to_cpu()
        return self._cpu_model.get_weights()

    def set_weights(self, weights_list):
        self._cpu_model.set_weights(weights_list)  # copied to the cores by the next TPU step

    def save_weights(self, filepath, overwrite=True):
        """Save the weights: ``"x.h5"`` in tf.keras' HDF5 layout, ``"x.weights.h5"`` in Keras 3's.

        Either loads into the plain CPU model with ``model.load_weights``.
        """
        self.sync_to_cpu()
        weights.save_weights(self._cpu_model, filepath, overwrite=overwrite)

    def load_weights(self, filepath, **kwargs):
        """Load weights from a ``.h5`` (tf.keras 2.x or Keras 3, weights or whole model), ``.weights.h5``
        or ``.keras`` file."""
        weights.load_weights(self._cpu_model, filepath, **kwargs)

    def profile(self, batch_size=None, accelerator_type=None, dataset_size=None):
        """The :class:`keras_tpu.TPUProfile` of this model on its TPU (see :func:`keras_tpu.profile`).

        Defaults: the global batch of the last ``fit`` (else 128 per core) and this strategy's
        accelerator type.
        """
        return _profile(self, batch_size=batch_size, accelerator_type=accelerator_type, dataset_size=dataset_size)

    def export(self, path):
        """Write the inference function (MXU numerics, any batch size) and its weights with
        ``jax.export``; load it with :func:`keras_tpu.load_exported`, no model code needed."""
        from keras_tpu.export import export_model

        self.sync_to_cpu()
        if pod.is_chief():
            export_model(self._cpu_model, path, self._strategy.precision)
        return path

    def save(self, filepath, overwrite=True, **kwargs):
        """Save the CPU model (with the trained weights) as ``model.save`` does."""
        self.sync_to_cpu()
        weights.save_model(self._cpu_model, filepath, overwrite=overwrite, **kwargs)


def keras_to_tpu_model(model, strategy=None):
    """Make a TPU model from a Keras model, keeping its layers, weights and compile settings.

    Args:
        model: a ``keras.Model`` (Sequential, functional or subclassed) whose
            inputs have fixed shapes apart from the batch size.
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
        raise ValueError("This model already runs on the TPU.")
    check_steps_supported(model)
    own = _keras_private.overridden_methods(model, ("compute_loss", "compute_metrics"))
    if own:
        raise ValueError(
            f"{type(model).__name__} defines its own {', '.join(own)}, which the TPU model made by "
            f"keras_to_tpu_model would not call (it runs the compiled loss and metrics). Build the model under "
            f"keras_tpu.TPUStrategy().scope() instead: the model then runs on the TPU with its own methods."
        )
    _check_fixed_shapes(model)
    if strategy is None:
        strategy = TPUDistributionStrategy()
    if not isinstance(strategy, TPUDistributionStrategy):
        raise TypeError(f"strategy must be a keras_tpu.TPUDistributionStrategy; got {type(strategy).__name__}.")
    return KerasTPUModel(model, strategy)

