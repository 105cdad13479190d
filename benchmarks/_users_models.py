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
