"""Models with their own steps, written as keras.io's JAX guides write them (for ``users_code.py``)."""

import jax
import keras
from keras import layers, ops


class OwnTrainStep(keras.Model):
    """keras.io's "Customizing what happens in fit() with JAX": stateless train and test steps."""

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=training)
        return self.compute_loss(x, y, y_pred), (y_pred, non_trainable_variables)

    def _metrics_logs(self, metrics_variables, loss, y, y_pred):
        new_values, logs = [], {}
        for metric in self.metrics:
            values = metrics_variables[len(new_values):len(new_values) + len(metric.variables)]
            values = metric.stateless_update_state(values, loss) if metric.name == "loss" else \
                metric.stateless_update_state(values, y, y_pred)
            logs[metric.name] = metric.stateless_result(values)
            new_values += values
        return logs, new_values

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        logs, metrics_variables = self._metrics_logs(metrics_variables, loss, y, y_pred)
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables)

    def test_step(self, state, data):
        trainable_variables, non_trainable_variables, metrics_variables = state
        x, y = data
        loss, (y_pred, non_trainable_variables) = self.compute_loss_and_updates(
            trainable_variables, non_trainable_variables, x, y)
        logs, metrics_variables = self._metrics_logs(metrics_variables, loss, y, y_pred)
        return logs, (trainable_variables, non_trainable_variables, metrics_variables)


class DCGAN(keras.Model):
    """keras.io's DCGAN on 28x28 images, its train_step in the JAX style: fit(noise, real_images)."""

    def __init__(self, latent_dim=128, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.Sequential([
            keras.Input((latent_dim,)), layers.Dense(7 * 7 * 128), layers.LeakyReLU(0.2), layers.Reshape((7, 7, 128)),
            layers.Conv2DTranspose(128, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
            layers.Conv2DTranspose(128, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
            layers.Conv2D(1, 7, padding="same", activation="sigmoid")], name="generator")
        self.discriminator = keras.Sequential([
            keras.Input((28, 28, 1)), layers.Conv2D(64, 3, strides=2, padding="same"), layers.LeakyReLU(0.2),
            layers.Conv2D(128, 3, strides=2, padding="same"), layers.LeakyReLU(0.2), layers.GlobalMaxPooling2D(),
            layers.Dense(1)], name="discriminator")
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def call(self, z):
        return self.generator(z)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        d_optimizer.build(self.discriminator.trainable_variables)
        g_optimizer.build(self.generator.trainable_variables)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        z, real = data
        split = len(self.generator.trainable_variables)
        g_vars, d_vars = list(trainable[:split]), list(trainable[split:])
        d_opt = [v.value for v in self.d_optimizer.variables]
        g_opt = [v.value for v in self.g_optimizer.variables]
        bce = keras.losses.BinaryCrossentropy(from_logits=True)

        def d_loss_fn(d_vars):
            fake, _ = self.generator.stateless_call(g_vars, [], z)
            logits_real, _ = self.discriminator.stateless_call(d_vars, [], real)
            logits_fake, _ = self.discriminator.stateless_call(d_vars, [], fake)
            return bce(ops.ones_like(logits_real), logits_real) + bce(ops.zeros_like(logits_fake), logits_fake)

        d_loss, d_grads = jax.value_and_grad(d_loss_fn)(d_vars)
        d_vars, _ = self.d_optimizer.stateless_apply(d_opt, d_grads, d_vars)

        def g_loss_fn(g_vars):
            fake, _ = self.generator.stateless_call(g_vars, [], z)
            logits, _ = self.discriminator.stateless_call(d_vars, [], fake)
            return bce(ops.ones_like(logits), logits)

        g_loss, g_grads = jax.value_and_grad(g_loss_fn)(g_vars)
        g_vars, _ = self.g_optimizer.stateless_apply(g_opt, g_grads, g_vars)
        d_metric = self.d_loss_tracker.stateless_update_state(metrics_variables[:2], d_loss)
        g_metric = self.g_loss_tracker.stateless_update_state(metrics_variables[2:], g_loss)
        return ({"d_loss": self.d_loss_tracker.stateless_result(d_metric),
                 "g_loss": self.g_loss_tracker.stateless_result(g_metric)},
                (g_vars + d_vars, non_trainable, optimizer_variables, d_metric + g_metric))


def guide_model(filters=32):
    """TensorFlow's "Use TPUs" guide's ``create_model`` (its 256 filters cut to ``filters``: a CPU benchmark)."""
    regularizer = keras.regularizers.L2(1e-5)
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        layers.Conv2D(filters, 3, activation="relu", kernel_regularizer=regularizer),
        layers.Conv2D(filters, 3, activation="relu", kernel_regularizer=regularizer),
        layers.Flatten(),
        layers.Dense(256, activation="relu", kernel_regularizer=regularizer),
        layers.Dense(128, activation="relu", kernel_regularizer=regularizer),
        layers.Dense(10, kernel_regularizer=regularizer)])


def guide_custom_loop(tpu_strategy=None, filters=32):
    """The guide's custom training loop: ``(step(images, labels) -> None, variables to wait on)``.

    With ``tpu_strategy`` (a ``keras_tpu.TPUStrategy``), the guide's own form: the model, optimizer and
    metrics under its scope and ``strategy.run(step_fn)``, each replica's loss scaled by the global batch.
    Without, what the same loop is on one device with Keras 3 on JAX: one jitted step of the whole batch
    (``stateless_call``, ``jax.value_and_grad``, ``stateless_apply``, the metrics' stateless updates).
    """
    if tpu_strategy is not None:
        with tpu_strategy.scope():
            model = guide_model(filters)
            optimizer = keras.optimizers.Adam()
            training_loss = keras.metrics.Mean("training_loss")
            training_accuracy = keras.metrics.SparseCategoricalAccuracy("training_accuracy")
        replicas = tpu_strategy.num_replicas_in_sync

        def step(images, labels):
            (inputs,) = tpu_strategy.experimental_distribute_dataset([(images, labels)])

            def step_fn(inputs):   # defined inside the step, as the guide's train_step does
                images, labels = inputs

                def loss_fn(trainable):
                    logits, _, model_losses = model.stateless_call(trainable, [], images, training=True,
                                                                   return_losses=True)
                    per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
                    loss = ops.sum(per_example) / (ops.shape(per_example)[0] * replicas)
                    return loss + ops.sum(ops.stack(model_losses)) / replicas, logits

                (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                    [v.value for v in model.trainable_variables])
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                training_loss.update_state(loss * replicas)
                training_accuracy.update_state(labels, logits)

            tpu_strategy.run(step_fn, args=(inputs,))

        return step, model.trainable_variables

    model = guide_model(filters)
    optimizer = keras.optimizers.Adam()
    training_loss = keras.metrics.Mean("training_loss")
    training_accuracy = keras.metrics.SparseCategoricalAccuracy("training_accuracy")
    optimizer.build(model.trainable_variables)

    @jax.jit
    def jitted(state, images, labels):
        trainable, optimizer_values, loss_values, accuracy_values = state

        def loss_fn(trainable):
            logits, _, model_losses = model.stateless_call(trainable, [], images, training=True, return_losses=True)
            per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            return ops.mean(per_example) + ops.sum(ops.stack(model_losses)), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        trainable, optimizer_values = optimizer.stateless_apply(optimizer_values, grads, trainable)
        loss_values = training_loss.stateless_update_state(loss_values, loss)
        accuracy_values = training_accuracy.stateless_update_state(accuracy_values, labels, logits)
        return trainable, optimizer_values, loss_values, accuracy_values

    state = [[v.value for v in variables] for variables in (
        model.trainable_variables, optimizer.variables, training_loss.variables, training_accuracy.variables)]

    def step(images, labels):
        state[:] = jitted(state, images, labels)

    return step, state
