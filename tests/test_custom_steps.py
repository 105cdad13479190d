"""A model's own train_step/test_step/predict_step (Keras 3's JAX signature) under TPUStrategy.

Written as keras.io's guide "Customizing what happens in fit() with JAX" writes
them: ``train_step(self, state, data) -> (logs, state)`` with
``optimizer.stateless_apply`` and ``metric.stateless_update_state``.
"""

import contextlib
import logging

import jax
import keras
import numpy as np
import pytest
from keras import ops

import keras_tpu
from keras_tpu import _custom_steps as custom_steps
from keras_tpu._custom_steps import cores_for_rows
from keras_tpu._placement import installed_on
from tests.tpu_helpers import compiled_programs


class JaxStyleModel(keras.Model):
    """The guide's first example: a custom train_step and test_step with the compiled loss."""

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=training)
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            this_vars = metrics_variables[len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_vars = metric.stateless_update_state(this_vars, loss)
            else:
                this_vars = metric.stateless_update_state(this_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_vars)
            new_metrics_vars += this_vars
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)

    def test_step(self, state, data):
        trainable_variables, non_trainable_variables, metrics_variables = state
        x, y = data
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=False)
        loss = self.compute_loss(x, y, y_pred)
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            this_vars = metrics_variables[len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
            this_vars = metric.stateless_update_state(this_vars, loss) if metric.name == "loss" else \
                metric.stateless_update_state(this_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_vars)
            new_metrics_vars += this_vars
        return logs, (trainable_variables, non_trainable_variables, new_metrics_vars)


def jax_style_regressor(strategy=None, seed=0, features=5, hidden=16):
    keras.utils.set_random_seed(seed)

    def build():
        inputs = keras.Input((features,))
        model = JaxStyleModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(hidden, activation="tanh")(inputs)))
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
        return model

    if strategy is None:
        return build()
    with strategy.scope():
        return build()


def regression_data(rows, seed=0, features=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features)).astype("float32")
    return x, (x[:, :2].sum(axis=1, keepdims=True) * 0.5).astype("float32")


@pytest.fixture
def steps_on_each_cores_rows(monkeypatch):
    """Own steps run on each core's rows even where the model would run them on the whole batch (a model with
    batch statistics or random layers does): the per-core path, tested on models whose CPU results it equals."""
    monkeypatch.setattr(custom_steps, "runs_on_the_whole_batch", lambda model, mode, *args: False)


def test_a_pod_refuses_steps_without_padding_rows_and_says_why():
    # Steps without padding rows run on the cores of one process; a pod's workers are told which model and why.
    import types

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)], name="counting")
    steps = types.SimpleNamespace(model=model, layout=types.SimpleNamespace(num_devices=2))
    with pytest.raises(ValueError, match=r"^counting sums state over its rows \(counting/total\), which padding "
                                         r"rows would enter: its steps run without padding rows, which keras_tpu "
                                         r"does on the cores of one process; this TPU spans 2 worker processes"):
        custom_steps.CustomSteps(steps, why="sums state over its rows (counting/total), which padding rows would "
                                            "enter")
    with pytest.raises(ValueError, match=r"^Sequential has its own step methods, which keras_tpu runs on the cores"):
        custom_steps.CustomSteps(steps)


def test_cores_for_rows():
    assert [cores_for_rows(r, 8) for r in (1024, 64, 100, 12, 97, 1)] == [8, 8, 5, 6, 1, 1]


def test_a_jax_style_train_step_matches_the_cpu_on_batches_that_split_evenly(caplog, steps_on_each_cores_rows):
    caplog.set_level(logging.INFO, logger="keras_tpu")
    x, y = regression_data(128)
    strategy = keras_tpu.TPUStrategy(precision="highest")
    model, reference = jax_style_regressor(strategy), jax_style_regressor()
    got = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    want = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    for key in want:  # gradients averaged over 8 cores of 4 rows = the gradient of the batch of 32
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)
    assert model.evaluate(x, y, batch_size=32, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=32, verbose=0), rel=2e-5)
    assert ("train", 32, 1) in compiled_programs(caplog)


def test_large_weights_mean_gradient_over_the_cores_matches_the_cpu(steps_on_each_cores_rows):
    # A 96 x 128 kernel: the cores' gradients are averaged by adding them row by row (keras_tpu._vector_unit),
    # not by XLA's reduction over the core axis (YNNPACK's, up to 90x slower): the same numbers.
    x, y = regression_data(64, features=96)
    strategy = keras_tpu.TPUStrategy(precision="highest")
    model = jax_style_regressor(strategy, features=96, hidden=128)
    reference = jax_style_regressor(features=96, hidden=128)
    got = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    want = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_a_partial_batch_runs_on_the_cores_that_split_it_without_padding(caplog, steps_on_each_cores_rows):
    caplog.set_level(logging.INFO, logger="keras_tpu")
    x, y = regression_data(100)  # batches of 32, 32, 32 and 4 rows: the last on 4 cores of one row
    strategy = keras_tpu.TPUStrategy(precision="highest")
    model, reference = jax_style_regressor(strategy), jax_style_regressor()
    got = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    want = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    # Every step's gradient is the mean over cores of equal rows: the gradient of the whole batch, with no
    # padding row in any loss, so the weights follow the CPU's exactly.
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)
    assert ("train", 4, 1) in compiled_programs(caplog) and "on 4 core(s): 4 rows do not split evenly" in caplog.text
    # The loss tracker is updated with the step's loss (one value per step): the step on 4 cores counts as one
    # step, as on the CPU, not as half of one; "mae" is updated per row and counts the 4 rows.
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, err_msg=key)
    # Evaluation of a batch of 100 runs on 5 cores of 20 rows; of batches of 32, the last on 4 cores: exact.
    for batch_size in (100, 32):
        got = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
        want = reference.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=2e-5), (batch_size, key)


class VAE(keras.Model):
    """keras.io's VAE (examples/generative/vae.py), its train_step in the JAX style, small."""

    def __init__(self, latent_dim=2, **kwargs):
        super().__init__(**kwargs)
        self.encoder_hidden = keras.layers.Dense(32, activation="relu")
        self.z_mean = keras.layers.Dense(latent_dim)
        self.z_log_var = keras.layers.Dense(latent_dim)
        self.decoder_hidden = keras.layers.Dense(32, activation="relu")
        self.decoder_out = keras.layers.Dense(16, activation="sigmoid")
        self.sampler = keras.random.SeedGenerator(7)
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    def call(self, x):
        h = self.encoder_hidden(x)
        z_mean, z_log_var = self.z_mean(h), self.z_log_var(h)
        z = z_mean + ops.exp(0.5 * z_log_var) * keras.random.normal(ops.shape(z_mean), seed=self.sampler)
        return self.decoder_out(self.decoder_hidden(z)), z_mean, z_log_var

    def losses_of(self, trainable, non_trainable, x):
        (reconstruction, z_mean, z_log_var), non_trainable = self.stateless_call(trainable, non_trainable, x)
        reconstruction_loss = ops.mean(ops.sum(keras.losses.binary_crossentropy(x[..., None], reconstruction[..., None]),
                                               axis=1))
        kl = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
        kl_loss = ops.mean(ops.sum(kl, axis=1))
        return reconstruction_loss + kl_loss, (reconstruction_loss, kl_loss, non_trainable)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x = data[0] if isinstance(data, tuple) else data
        (total, (reconstruction_loss, kl_loss, non_trainable)), grads = jax.value_and_grad(
            self.losses_of, has_aux=True)(trainable, non_trainable, x)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        logs, new_metrics = {}, []
        for tracker, value in ((self.total_loss_tracker, total), (self.reconstruction_loss_tracker,
                                                                   reconstruction_loss),
                               (self.kl_loss_tracker, kl_loss)):
            start = len(new_metrics)
            values = tracker.stateless_update_state(metrics_variables[start:start + len(tracker.variables)], value)
            logs[tracker.name] = tracker.stateless_result(values)
            new_metrics += values
        return logs, (trainable, non_trainable, optimizer_variables, new_metrics)

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]


@pytest.mark.slow
def test_a_vae_with_loss_trackers_trains_on_the_tpu():
    rng = np.random.default_rng(0)
    prototypes = rng.random((4, 16)) > 0.5
    x = (prototypes[rng.integers(0, 4, 256)] ^ (rng.random((256, 16)) > 0.9)).astype("float32")
    keras.utils.set_random_seed(0)
    with keras_tpu.TPUStrategy().scope():
        vae = VAE()
        vae.compile(optimizer=keras.optimizers.Adam(0.01))
    history = vae.fit(x, epochs=6, batch_size=64, verbose=0).history
    assert set(history) == {"total_loss", "reconstruction_loss", "kl_loss"}
    assert history["total_loss"][-1] < history["total_loss"][0]
    for a, b, c in zip(history["total_loss"], history["reconstruction_loss"], history["kl_loss"]):
        assert a == pytest.approx(b + c, rel=1e-4)  # the trackers combine across cores consistently
    reconstruction, _, _ = vae.predict(x[:10], verbose=0)
    assert reconstruction.shape == (10, 16) and 0 <= reconstruction.min() and reconstruction.max() <= 1


class GAN(keras.Model):
    """keras.io's GAN pattern in the JAX style: two optimizers in one train_step, the generator trained
    through the discriminator's just-updated weights. (SGD without momentum keeps no slots, so the two
    optimizers' own state need not travel in Keras' state tuple.) Data: x = noise (what the model's call
    takes, so Keras can build it), y = real samples."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                                           keras.layers.Dense(8)], name="generator")
        self.discriminator = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                               keras.layers.Dense(1)], name="discriminator")
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

        def g_loss_fn(g_vars):  # through the discriminator just updated
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


def gan(strategy=None):
    keras.utils.set_random_seed(0)
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        model = GAN()
        model.compile(keras.optimizers.SGD(0.05), keras.optimizers.SGD(0.05))
    return model


@pytest.mark.slow
def test_a_gan_with_two_optimizers_in_one_train_step_matches_the_cpu():
    rng = np.random.default_rng(0)
    real = (rng.standard_normal((128, 8)) * 0.3 + 1.0).astype("float32")
    noise = rng.standard_normal((128, 4)).astype("float32")
    model, reference = gan(keras_tpu.TPUStrategy(precision="highest")), gan()
    got = model.fit(noise, real, epochs=3, batch_size=64, shuffle=False, verbose=0).history
    want = reference.fit(noise, real, epochs=3, batch_size=64, shuffle=False, verbose=0).history
    for key in ("d_loss", "g_loss"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    samples = model.predict(noise[:16], verbose=0)
    assert samples.shape == (16, 8) and np.isfinite(samples).all()


class Distiller(keras.Model):
    """keras.io's knowledge distillation (examples/vision/knowledge_distillation.py): a frozen teacher
    and a custom compute_loss."""

    def __init__(self, student, teacher):
        super().__init__()
        self.student, self.teacher = student, teacher
        self.teacher.trainable = False

    def call(self, x):
        return self.student(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)
        distillation_loss = keras.losses.kl_divergence(ops.softmax(teacher_pred / 3.0), ops.softmax(y_pred / 3.0))
        return ops.mean(0.1 * student_loss + 0.9 * distillation_loss * 9.0)


def distiller(strategy=None):
    keras.utils.set_random_seed(0)
    teacher = keras.Sequential([keras.Input((6,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(3)])
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        student = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                    keras.layers.Dense(3)])
        model = Distiller(student, teacher)
        model.compile(keras.optimizers.Adam(0.01), metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model


@pytest.mark.slow
def test_knowledge_distillation_with_a_custom_compute_loss_and_a_partial_batch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((100, 6)).astype("float32")  # batches of 32, 32, 32 and a partial 4
    y = x[:, :3].argmax(axis=1)
    model, reference = distiller(keras_tpu.TPUStrategy(precision="highest")), distiller()
    got = model.fit(x, y, epochs=2, batch_size=32, shuffle=False, verbose=0).history
    want = reference.fit(x, y, epochs=2, batch_size=32, shuffle=False, verbose=0).history
    # The user's compute_loss ignores sample weights: no padding row may reach it.
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5)
    for a, b in zip(model.student.get_weights(), reference.student.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)


# ----------------------------------------------------------------------------------------------------------
# The same models converted with keras_to_tpu_model (TF 1.x's way): the CPU model's own methods run on the TPU.
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_keras_to_tpu_model_runs_a_gans_own_train_step_like_the_cpu(caplog):
    rng = np.random.default_rng(0)
    real = (rng.standard_normal((128, 8)) * 0.3 + 1.0).astype("float32")
    noise = rng.standard_normal((128, 4)).astype("float32")
    cpu_model, reference = gan(), gan()
    tpu = keras_tpu.keras_to_tpu_model(cpu_model, keras_tpu.TPUDistributionStrategy(precision="highest"))
    got = tpu.fit(noise, real, epochs=3, batch_size=64, shuffle=False, verbose=0).history
    want = reference.fit(noise, real, epochs=3, batch_size=64, shuffle=False, verbose=0).history
    for key in ("d_loss", "g_loss"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4)
    for a, b in zip(tpu.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert tpu.predict(noise[:16], verbose=0).shape == (16, 8)
    # The CPU model stays a CPU model: its own fit runs Keras' loop on the CPU, from the trained weights.
    assert installed_on(cpu_model) is None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="keras_tpu"):
        cpu_model.fit(noise, real, epochs=1, batch_size=64, shuffle=False, verbose=0)
    assert "Compiled the TPU" not in caplog.text


@pytest.mark.slow
def test_keras_to_tpu_model_runs_a_custom_compute_loss_on_partial_batches():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((100, 6)).astype("float32")
    y = x[:, :3].argmax(axis=1)
    model, reference = distiller(), distiller()
    tpu = keras_tpu.keras_to_tpu_model(model, keras_tpu.TPUDistributionStrategy(precision="highest"))
    got = tpu.fit(x, y, epochs=2, batch_size=32, shuffle=False, verbose=0).history
    want = reference.fit(x, y, epochs=2, batch_size=32, shuffle=False, verbose=0).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5)
    for a, b in zip(model.student.get_weights(), reference.student.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)
    np.testing.assert_allclose(tpu.evaluate(x, y, batch_size=32, verbose=0),
                               reference.evaluate(x, y, batch_size=32, verbose=0), rtol=2e-5)


class TrackedUnderAnotherName(keras.Model):
    """keras.io's VAE pattern: a tracker named "total_loss" logged under the key "loss"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.total_tracker = keras.metrics.Mean(name="total_loss")

    @property
    def metrics(self):
        return [self.total_tracker]

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        loss, grads = jax.value_and_grad(
            lambda t: ops.mean((self.stateless_call(t, non_trainable, x)[0] - y) ** 2))(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        metrics_variables = self.total_tracker.stateless_update_state(metrics_variables, loss)
        return ({"loss": self.total_tracker.stateless_result(metrics_variables)},
                (trainable, non_trainable, optimizer_variables, metrics_variables))


def test_a_metric_logged_under_another_key_is_combined_across_cores():
    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = TrackedUnderAnotherName(inputs, keras.layers.Dense(1)(inputs))
        model.compile(keras.optimizers.SGD(0.1))
        return model

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype("float32")
    with keras_tpu.TPUStrategy(precision="highest").scope():
        tpu = build()
    got = tpu.fit(x, 3 * x[:, :1], batch_size=16, shuffle=False, verbose=0).history["loss"]
    want = build().fit(x, 3 * x[:, :1], batch_size=16, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_own_steps_at_the_default_precision_read_weight_copies_with_the_same_numbers(monkeypatch):
    """A model's own steps multiply bfloat16 copies of the weights (a training step with few rows per product
    returns those of the weights it wrote, rounded once for the whole fit): the numbers of rounding each weight
    in every product."""
    from keras_tpu import _rounded_weights
    from tests.tpu_helpers import WithoutWeightCopies, record_weight_copies

    x, y = regression_data(128)

    def run():
        model = jax_style_regressor(keras_tpu.TPUStrategy())
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
        model.set_weights([w * 0.9 for w in model.get_weights()])   # weights the last step did not return
        history2 = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0).history
        return history["loss"] + history2["loss"], model.get_weights(), model.evaluate(x, y, batch_size=32, verbose=0)

    copied = record_weight_copies(monkeypatch)
    with_copies = run()
    # The two kernels: for the first fit, again for the weights set by hand, and for the evaluation.
    assert copied == [[(5, 16), (16, 1)]] * 3
    monkeypatch.setattr(_rounded_weights, "reading_rounded_weights", WithoutWeightCopies)
    without = run()
    np.testing.assert_allclose(with_copies[0], without[0], rtol=1e-5)
    for a, b in zip(with_copies[1], without[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(with_copies[2], without[2], rtol=1e-5)


class OwnPredictStep(keras.Model):
    """A predict_step in Keras 3's JAX signature: it returns ``(outputs, non_trainable_variables)``, here a dict."""

    def predict_step(self, state, data):
        trainable_variables, non_trainable_variables = state
        x = data[0] if isinstance(data, tuple) else data
        y, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                         training=False)
        return {"score": y, "double": 2.0 * y}, non_trainable_variables


@pytest.mark.parametrize("front_end", ["TPUStrategy", "keras_to_tpu_model"])
def test_an_own_predict_step_returns_its_outputs_as_on_the_cpu(front_end):
    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        h = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
        model = OwnPredictStep(inputs, keras.layers.Dense(2)(h))
        model.compile("sgd", "mse")
        return model

    x = np.random.default_rng(0).standard_normal((20, 4)).astype("float32")  # 20 rows: a partial batch of 4
    want = build().predict(x, batch_size=16, verbose=0)
    if front_end == "TPUStrategy":
        with keras_tpu.TPUStrategy(precision="highest").scope():
            tpu = build()
    else:
        tpu = keras_tpu.keras_to_tpu_model(build(), keras_tpu.TPUDistributionStrategy(precision="highest"))
    got = tpu.predict(x, batch_size=16, verbose=0)
    assert isinstance(got, dict) and sorted(got) == ["double", "score"]
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)


class DistillerWithItsOwnCompile(keras.Model):
    """keras.io's knowledge distillation (examples/vision/knowledge_distillation.py): a compile() of its own
    arguments, and the loss it computes from them."""

    def __init__(self, student, teacher):
        super().__init__()
        self.student, self.teacher = student, teacher

    def call(self, x):
        return self.student(x)

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
        self.alpha, self.temperature = alpha, temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        teacher = self.teacher(x, training=False)
        distillation = self.distillation_loss_fn(ops.softmax(teacher / self.temperature, axis=1),
                                                  ops.softmax(y_pred / self.temperature, axis=1))
        return self.alpha * self.student_loss_fn(y, y_pred) + (1 - self.alpha) * distillation * self.temperature ** 2


def test_a_model_with_its_own_compile_is_compiled_by_it_after_keras_to_tpu_model():
    """TF 1.x code converts first and compiles the TPU model: a model's own compile() takes its own arguments."""
    x = np.random.default_rng(0).standard_normal((40, 8)).astype("float32")  # a partial last batch
    y = np.random.default_rng(1).integers(0, 4, 40)

    def distiller():
        keras.utils.set_random_seed(0)
        return DistillerWithItsOwnCompile(keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)]),
                         keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)]))

    def arguments():
        return (keras.optimizers.Adam(0.01), [keras.metrics.SparseCategoricalAccuracy()],
                keras.losses.SparseCategoricalCrossentropy(from_logits=True), keras.losses.KLDivergence())

    strategy = keras_tpu.TPUDistributionStrategy(precision="highest")
    on_cpu = distiller()
    on_cpu.compile(*arguments(), alpha=0.2, temperature=5)
    expected = on_cpu.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history
    positional = keras_tpu.keras_to_tpu_model(distiller(), strategy)
    positional.compile(*arguments(), 0.2, 5)
    optimizer, metrics, student_loss, distillation_loss = arguments()
    by_keyword = keras_tpu.keras_to_tpu_model(distiller(), strategy)
    by_keyword.compile(optimizer=optimizer, metrics=metrics, student_loss_fn=student_loss,
                       distillation_loss_fn=distillation_loss, alpha=0.2, temperature=5)
    for tpu_model in (positional, by_keyword):
        assert tpu_model.cpu_model.temperature == 5
        history = tpu_model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history
        for key, values in expected.items():
            np.testing.assert_allclose(history[key], values, rtol=1e-5)


class SummedLossModel(keras.Model):
    """A step whose loss is summed over the rows (as ``tape.gradient`` of a per-row loss vector was in the TF
    examples keras.io ported), with ``Sum`` metrics of the rows seen and of the squared errors."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.rows_seen = keras.metrics.Sum(name="rows_seen")
        self.squared_errors = keras.metrics.Sum(name="squared_errors")

    def call(self, x):
        return self.dense(x)

    @property
    def metrics(self):
        return [self.rows_seen, self.squared_errors]

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def summed_loss(trainable):
            y_pred, _ = self.stateless_call(trainable, non_trainable, x)
            return ops.sum(ops.square(y_pred - y))

        loss, grads = jax.value_and_grad(summed_loss)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        rows = self.rows_seen.stateless_update_state(metrics_variables[:1], ops.cast(ops.shape(x)[0], "float32"))
        errors = self.squared_errors.stateless_update_state(metrics_variables[1:], loss)
        return ({"rows_seen": self.rows_seen.stateless_result(rows),
                 "squared_errors": self.squared_errors.stateless_result(errors)},
                (trainable, non_trainable, optimizer_variables, rows + errors))


def summed_loss_model(strategy=None):
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = SummedLossModel()
        model(np.zeros((1, 3), "float32"))
        model.compile(keras.optimizers.SGD(0.01))
    return model


def test_a_loss_summed_over_the_rows_trains_as_on_the_cpu(caplog):
    # The model has no batch statistics and no random layer: its step runs on the whole batch, as on the CPU.
    # Run on each core's rows, the optimizer got the cores' mean of their sums: 1/8 of the CPU's gradient on a
    # full batch, the whole of it on a batch of 13 rows (one core).
    caplog.set_level(logging.INFO, logger="keras_tpu")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((45, 3)).astype("float32"), rng.standard_normal((45, 1)).astype("float32")
    model, reference = summed_loss_model(keras_tpu.TPUStrategy(precision="highest")), summed_loss_model()
    got = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history   # 16, 16 and 13 rows
    want = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert got["rows_seen"] == want["rows_seen"] == [45.0, 45.0]
    np.testing.assert_allclose(got["squared_errors"], want["squared_errors"], rtol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert "(the model's own train_step on the 8 cores' rows as one batch); inputs (13, 3)" in caplog.text


class SqueezedPairLoss(keras.losses.Loss):
    """keras.io's supervised contrastive loss: ``npairs_loss(squeeze(labels), logits)`` over the batch's pairs of
    rows; at one row, ``squeeze`` leaves a scalar and the loss cannot be computed."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        features = y_pred / ops.norm(y_pred, axis=1, keepdims=True)
        logits = ops.matmul(features, ops.transpose(features)) / 0.5
        labels = ops.expand_dims(ops.squeeze(y_true), -1)
        same = ops.cast(ops.equal(labels, ops.transpose(labels)), "float32")
        same = same / ops.sum(same, axis=1, keepdims=True)
        return ops.mean(keras.losses.categorical_crossentropy(same, logits, from_logits=True))


@pytest.mark.parametrize("rows, batch_size", [(100, 24), (32, 8)])  # a last batch of 4 rows; 1 row per core
def test_a_loss_that_cannot_take_one_cores_rows_trains_on_the_whole_batch_as_on_the_cpu(rows, batch_size, caplog):
    """A loss over the batch's pairs of rows runs on the whole batch; the HBM estimate of one core's share cannot
    trace it at one row (the squeeze), so it counts the whole batch instead of failing the step."""
    caplog.set_level(logging.INFO, logger="keras_tpu")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((rows, 6)).astype("float32"), rng.integers(0, 3, (rows, 1))

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
        model.compile(keras.optimizers.SGD(0.1), loss=SqueezedPairLoss())
        return model

    with keras_tpu.TPUStrategy(precision="highest").scope():
        model = build()
    reference = build()
    got = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history["loss"]
    want = reference.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert "counts the whole batch of 4 rows" in caplog.text if rows == 100 else "of 8 rows" in caplog.text


def test_a_sum_metric_of_one_value_per_step_adds_what_the_cores_add(steps_on_each_cores_rows):
    # On each core's rows (as a model with batch statistics runs them), a Sum of the rows seen is the batch's
    # rows, also for a step on fewer cores (44 rows: 32, then 12 on 6 cores), not scaled up as a Mean tracker's
    # per-step value is.
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((44, 3)).astype("float32"), rng.standard_normal((44, 1)).astype("float32")
    model = summed_loss_model(keras_tpu.TPUStrategy(precision="highest"))
    assert model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0).history["rows_seen"] == [44.0]
    assert model.fit(x, y, batch_size=44, epochs=1, shuffle=False, verbose=0).history["rows_seen"] == [44.0]


class PairwiseStatisticModel(keras.Model):
    """A test step that reduces over pairs of rows, as keras.io's DDIM computes its KID."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.tracker = keras.metrics.Mean(name="pairwise")

    def call(self, x):
        return self.dense(x)

    @property
    def metrics(self):
        return [self.tracker]

    def test_step(self, state, data):
        trainable, non_trainable, metrics_variables = state
        x = data[0] if isinstance(data, tuple) else data
        features, _ = self.stateless_call(trainable, non_trainable, x)
        rows = ops.shape(features)[0]
        kernel = features @ ops.transpose(features)
        pairs = ops.cast(rows * (rows - 1), "float32")
        value = ops.sum(kernel * (1.0 - ops.eye(rows))) / pairs     # the mean over pairs of distinct rows
        metrics_variables = self.tracker.stateless_update_state(metrics_variables, value)
        return {"pairwise": self.tracker.stateless_result(metrics_variables)}, (trainable, non_trainable,
                                                                                metrics_variables)


def test_a_statistic_over_the_batchs_rows_is_the_cpus():
    # On each core's rows it was each core's statistic, and 0/0 on cores of one row (any batch of 8 rows or less).
    def build(strategy=None):
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = PairwiseStatisticModel()
            model(np.zeros((1, 4), "float32"))
            model.compile("sgd")
        return model

    x = np.random.default_rng(0).standard_normal((20, 4)).astype("float32")
    model, reference = build(keras_tpu.TPUStrategy(precision="highest")), build()
    for rows in (20, 16, 4):
        got = model.evaluate(x[:rows], batch_size=rows, verbose=0)
        assert np.isfinite(got) and got == pytest.approx(reference.evaluate(x[:rows], batch_size=rows, verbose=0),
                                                         rel=1e-5, abs=1e-6)


class Sampling(keras.layers.Layer):
    """keras.io VAE's sampling layer: a layer of the user's own that draws in every call."""

    def __init__(self):
        super().__init__()
        self.seed_generator = keras.random.SeedGenerator(1)

    def call(self, x):
        return x + keras.random.normal(ops.shape(x), seed=self.seed_generator)


@pytest.mark.parametrize("layer, train, test", [
    (lambda: keras.layers.Dense(2), True, True),
    (lambda: keras.layers.LSTM(2, return_sequences=True), True, True),     # its seed generator idle at rate 0
    (lambda: keras.layers.BatchNormalization(), False, True),               # batch statistics in training
    (lambda: keras.layers.Dense(2, activity_regularizer="l2"), False, True),
    (lambda: keras.layers.Dropout(0.5), False, True),                      # Keras' own: draws in training only
    (lambda: keras.layers.LSTM(2, dropout=0.1, return_sequences=True), False, True),
    (Sampling, False, False),                                               # the user's own: may draw at any time
    (lambda: keras.layers.Conv1D(2, 2), False, True),                       # trains faster on each core's rows
    (lambda: keras.layers.GaussianNoise(0.1), False, True),
    (lambda: keras.layers.RandomZoom(0.2), False, True),                    # a generator and no rate: it draws
])
def test_which_own_steps_run_on_the_whole_batch(layer, train, test):
    model = keras.Sequential([keras.Input((3, 2)), layer()])
    assert (custom_steps.runs_on_the_whole_batch(model, "train"), custom_steps.runs_on_the_whole_batch(model, "test"),
            custom_steps.runs_on_the_whole_batch(model, "predict")) == (train, test, test)
