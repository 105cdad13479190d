"""keras.io examples (github.com/keras-team/keras-io, folder examples/) run on the simulated TPU.

Each test is one example's code in its own order, sections marked ``# ---- <section> ----``,
with only the changes its docstring lists: the model built and compiled under
``keras_tpu.TPUStrategy().scope()`` (or a compiled CPU model converted with
``keras_tpu.keras_to_tpu_model``), the bundled MNIST (``keras_tpu.datasets.mnist``: the
official test split, 8,000 training and 2,000 test digits) or generated data of the
example's shapes instead of downloads, fewer epochs and rows, TensorFlow calls replaced by
their Keras 3 / JAX equivalents, and the checks its user would make in place of prints and
plots.
"""

import contextlib
import logging
import re

import jax
import keras
import numpy as np
import pytest
from keras import layers, ops

import keras_tpu

VIAS = ["TPUStrategy", "keras_to_tpu_model"]


def scope_for(via):
    """Where the example builds and compiles its model: under a TPUStrategy's scope, or (for
    keras_to_tpu_model, which converts the compiled CPU model afterwards) nowhere special."""
    return keras_tpu.TPUStrategy().scope() if via == "TPUStrategy" else contextlib.nullcontext()


def on_tpu(model, via):
    """The model the example trains: the one built under the scope, or the converted CPU model."""
    return model if via == "TPUStrategy" else keras_tpu.keras_to_tpu_model(model)


# =====================================================================================
# examples/vision/mnist_convnet.py
# =====================================================================================


@pytest.mark.slow
@pytest.mark.parametrize("via", ["TPUStrategy"])  # VIAS has both; one each keeps CI short
def test_simple_mnist_convnet(via, tmp_path):
    """examples/vision/mnist_convnet.py ("Simple MNIST convnet"), keras-io commit 02cfe80.

    Changes: ``keras_tpu.datasets.mnist`` for ``keras.datasets.mnist`` (8,000 training
    images, not 60,000); the model built under the strategy's scope, or converted with
    ``keras_to_tpu_model`` after ``compile``; ``compile`` moved into that scope, before
    ``summary``; epochs 15 -> 2; ``verbose=0``; the prints of the test score replaced by
    assertions; the weights saved and loaded into the same architecture built outside any
    scope (``keras.models.clone_model``), which must predict the same.
    """
    keras.utils.set_random_seed(0)
    # ---- Prepare the data ----
    # Model / data parameters
    num_classes = 10
    input_shape = (28, 28, 1)

    # Load the data and split it between train and test sets
    (x_train, y_train), (x_test, y_test) = keras_tpu.datasets.mnist.load_data()

    # Scale images to the [0, 1] range
    x_train = x_train.astype("float32") / 255
    x_test = x_test.astype("float32") / 255
    # Make sure images have shape (28, 28, 1)
    x_train = np.expand_dims(x_train, -1)
    x_test = np.expand_dims(x_test, -1)
    assert x_train.shape == (8000, 28, 28, 1) and x_test.shape == (2000, 28, 28, 1)

    # convert class vectors to binary class matrices
    y_train = keras.utils.to_categorical(y_train, num_classes)
    y_test = keras.utils.to_categorical(y_test, num_classes)

    # ---- Build the model ----
    with scope_for(via):
        model = keras.Sequential(
            [
                keras.Input(shape=input_shape),
                layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
                layers.MaxPooling2D(pool_size=(2, 2)),
                layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
                layers.MaxPooling2D(pool_size=(2, 2)),
                layers.Flatten(),
                layers.Dropout(0.5),
                layers.Dense(num_classes, activation="softmax"),
            ]
        )
        model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    model = on_tpu(model, via)
    model.summary(print_fn=lambda *args, **kwargs: None)

    # ---- Train the model ----
    batch_size = 128
    epochs = 2

    history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, validation_split=0.1,
                        verbose=0).history

    # ---- Evaluate the trained model ----
    score = model.evaluate(x_test, y_test, verbose=0)
    test_loss, test_accuracy = score[0], score[1]

    # What the example's user reads: the loss falls, ~90% after two short epochs (10% is chance).
    assert history["loss"][1] < history["loss"][0]
    assert history["val_accuracy"][-1] > 0.85
    assert test_accuracy > 0.85 and test_loss < 0.5
    # The trained weights serve an ordinary CPU model of the same architecture.
    model.save_weights(str(tmp_path / "mnist_convnet.weights.h5"))
    cpu_model = keras.models.clone_model(model if via == "TPUStrategy" else model.cpu_model)
    cpu_model.load_weights(str(tmp_path / "mnist_convnet.weights.h5"))
    tpu_probabilities = model.predict(x_test, batch_size=batch_size, verbose=0)
    cpu_probabilities = cpu_model.predict(x_test, batch_size=batch_size, verbose=0)
    assert tpu_probabilities.shape == cpu_probabilities.shape == (2000, 10)
    # The TPU multiplies in bfloat16: probabilities agree closely, classes almost everywhere.
    np.testing.assert_allclose(tpu_probabilities, cpu_probabilities, atol=0.05)
    assert np.mean(tpu_probabilities.argmax(1) == cpu_probabilities.argmax(1)) > 0.99


# =====================================================================================
# examples/nlp/bidirectional_lstm_imdb.py
# =====================================================================================


def generated_imdb(num_words, rows, seed, min_length=8, max_length=60):
    """Integer "reviews" shaped like ``keras.datasets.imdb.load_data``'s: lists of word indices
    of varying lengths (1 = start, 2 = out of vocabulary, words from 4 on) and 0/1 labels. A
    review is positive when it holds more of the 50 "positive" words (4..53) than of the 50
    "negative" ones (54..103); the rest of its words are neutral."""
    rng = np.random.default_rng(seed)
    reviews, labels = [], []
    for _ in range(rows):
        length = int(rng.integers(min_length, max_length + 1))
        words = rng.integers(104, num_words, length)
        label = int(rng.integers(0, 2))
        majority, minority = (4, 54) if label else (54, 4)
        count = int(rng.integers(2, 5))
        places = rng.choice(length, size=count + 1, replace=False)
        words[places[:count]] = rng.integers(majority, majority + 50, count)
        if rng.random() < 0.5:
            words[places[count]] = rng.integers(minority, minority + 50)
        reviews.append([1] + words.tolist())
        labels.append(label)
    return reviews, np.array(labels)


@pytest.mark.slow
@pytest.mark.parametrize("via", ["keras_to_tpu_model"])  # VIAS has both; one each keeps CI short
def test_bidirectional_lstm_imdb(via, tmp_path, caplog):
    """examples/nlp/bidirectional_lstm_imdb.py ("Bidirectional LSTM on IMDB"), keras-io commit
    0a4be8b: variable-length inputs, ``keras.Input(shape=(None,), dtype="int32")``.

    Changes: generated integer reviews of 8 to 60 words (``generated_imdb``, the shapes and
    index conventions of ``keras.datasets.imdb.load_data``) for the IMDB download, 2,048
    training and 512 validation reviews; ``maxlen`` 200 -> 48 (the longer reviews are cut, as
    in the example); the model built under the strategy's scope, or converted with
    ``keras_to_tpu_model`` after ``compile``; ``compile`` moved into that scope; epochs kept at
    2, ``verbose=0``; prints replaced by assertions: the validation accuracy, the same model
    fed sequences of another length (what ``shape=(None,)`` is for), and the weights loaded
    into the same architecture built outside any scope.
    """
    caplog.set_level(logging.INFO, logger="keras_tpu")
    keras.utils.set_random_seed(0)
    # ---- Setup ----
    max_features = 20000  # Only consider the top 20k words
    maxlen = 48  # Only consider the first 48 words of each movie review

    # ---- Build the model ----
    with scope_for(via):
        # Input for variable-length sequences of integers
        inputs = keras.Input(shape=(None,), dtype="int32")
        # Embed each integer in a 128-dimensional vector
        x = layers.Embedding(max_features, 128)(inputs)
        # Add 2 bidirectional LSTMs
        x = layers.Bidirectional(layers.LSTM(64, return_sequences=True))(x)
        x = layers.Bidirectional(layers.LSTM(64))(x)
        # Add a classifier
        outputs = layers.Dense(1, activation="sigmoid")(x)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    model = on_tpu(model, via)
    model.summary(print_fn=lambda *args, **kwargs: None)

    # ---- Load the IMDB movie review sentiment data ----
    (x_train, y_train), (x_val, y_val) = (generated_imdb(max_features, 2048, seed=1),
                                          generated_imdb(max_features, 512, seed=2))
    assert len(x_train) == 2048 and len(x_val) == 512
    raw_val = x_val
    # Use pad_sequence to standardize sequence length:
    # this will truncate sequences longer than 48 words and zero-pad sequences shorter than 48 words.
    x_train = keras.preprocessing.sequence.pad_sequences(x_train, maxlen=maxlen)
    x_val = keras.preprocessing.sequence.pad_sequences(x_val, maxlen=maxlen)

    # ---- Train and evaluate the model ----
    history = model.fit(x_train, y_train, batch_size=32, epochs=2, validation_data=(x_val, y_val),
                        verbose=0).history

    assert history["loss"][1] < history["loss"][0]
    assert history["val_accuracy"][-1] > 0.8  # chance is 0.5
    # The model takes reviews of any length: the same reviews padded to 64 words, and a batch of
    # short ones, each run through the TPU program for its own length.
    longer = keras.preprocessing.sequence.pad_sequences(raw_val, maxlen=64)
    shorter = keras.preprocessing.sequence.pad_sequences(raw_val[:40], maxlen=16)
    predictions = {name: model.predict(x, batch_size=32, verbose=0) for name, x in
                   (("48", x_val), ("64", longer), ("16", shorter))}
    assert predictions["48"].shape == (512, 1) and predictions["64"].shape == (512, 1)
    assert predictions["16"].shape == (40, 1)
    for p in predictions.values():
        assert np.all((p >= 0) & (p <= 1))
    for length in (48, 64, 16):  # one TPU program per length (batches padded to the global batch of 32)
        assert re.search(rf"TPU predict program .*inputs \(32, {length}\)", caplog.text), length
    # The trained weights serve an ordinary CPU model of the same architecture, at every length.
    model.save_weights(str(tmp_path / "bidirectional_lstm_imdb.weights.h5"))
    cpu_model = keras.models.clone_model(model if via == "TPUStrategy" else model.cpu_model)
    cpu_model.load_weights(str(tmp_path / "bidirectional_lstm_imdb.weights.h5"))
    for name, x in (("48", x_val), ("64", longer), ("16", shorter)):
        cpu = cpu_model.predict(x, batch_size=32, verbose=0)
        np.testing.assert_allclose(predictions[name], cpu, atol=0.05)  # bfloat16 products on the MXU
        assert np.mean((predictions[name] > 0.5) == (cpu > 0.5)) > 0.98


# =====================================================================================
# examples/generative/vae.py, its train_step in the JAX style
# =====================================================================================


@pytest.mark.slow
@pytest.mark.parametrize("via", ["keras_to_tpu_model"])  # VIAS has both; one each keeps CI short
def test_variational_autoencoder(via, tmp_path):
    """examples/generative/vae.py ("Variational AutoEncoder"), keras-io commit cca4efb.

    The example's ``train_step`` uses TensorFlow's ``tf.GradientTape``; here it is written the
    JAX way of keras.io's guide guides/custom_train_step_in_jax.py:
    ``train_step(self, state, data)`` takes and returns the state lists, the loss is a function
    of the trainable values (``compute_losses``: the example's lines, run in a
    ``keras.StatelessScope`` that maps the model's variables to the state's values, so
    ``self.encoder(data)`` and ``self.decoder(z)`` read them), ``jax.value_and_grad`` replaces
    the tape, ``optimizer.stateless_apply`` ``apply_gradients`` and
    ``tracker.stateless_update_state`` ``update_state``. ``Sampling`` draws from a
    ``keras.random.SeedGenerator`` (as the example's Keras 3 version does), whose state travels
    in the non-trainable state; ``tf.*`` calls are ``keras.ops``.

    Other changes: ``self.built = True`` in ``VAE.__init__`` (Keras 3 builds a model by calling
    it, and this one has no ``call``; plain Keras 3.15 refuses to fit it otherwise);
    ``keras_tpu.datasets.mnist`` (10,000 digits) for ``keras.datasets.mnist``, of which 3,072
    train; epochs 30 -> 3; the model built and compiled under the strategy's scope, or
    converted with ``keras_to_tpu_model`` after ``compile``; the encoder and decoder built in a
    function (``build_encoder_and_decoder``) so that the CPU copies are the same code;
    ``plot_latent_space`` decodes its grid in one ``predict`` call (n = 10, not 30) and returns
    the figure instead of showing it, ``plot_label_clusters`` returns the latent means of 4,000
    digits instead of plotting them. Then assertions: the losses fall, the decoded grid lies in
    [0, 1], digits of different classes land in different places of the latent space, the
    encoder's and decoder's weights serve the same architectures built outside any scope, and
    the logged loss is the sum of its two logged parts.
    """
    keras.utils.set_random_seed(0)

    # ---- Create a sampling layer ----
    class Sampling(layers.Layer):
        """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed_generator = keras.random.SeedGenerator(1337)

        def call(self, inputs):
            z_mean, z_log_var = inputs
            batch = ops.shape(z_mean)[0]
            dim = ops.shape(z_mean)[1]
            epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
            return z_mean + ops.exp(0.5 * z_log_var) * epsilon

    def build_encoder_and_decoder():
        # ---- Build the encoder ----
        latent_dim = 2

        encoder_inputs = keras.Input(shape=(28, 28, 1))
        x = layers.Conv2D(32, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
        x = layers.Conv2D(64, 3, activation="relu", strides=2, padding="same")(x)
        x = layers.Flatten()(x)
        x = layers.Dense(16, activation="relu")(x)
        z_mean = layers.Dense(latent_dim, name="z_mean")(x)
        z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
        z = Sampling()([z_mean, z_log_var])
        encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

        # ---- Build the decoder ----
        latent_inputs = keras.Input(shape=(latent_dim,))
        x = layers.Dense(7 * 7 * 64, activation="relu")(latent_inputs)
        x = layers.Reshape((7, 7, 64))(x)
        x = layers.Conv2DTranspose(64, 3, activation="relu", strides=2, padding="same")(x)
        x = layers.Conv2DTranspose(32, 3, activation="relu", strides=2, padding="same")(x)
        decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
        decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
        return encoder, decoder

    # ---- Define the VAE as a `Model` with a custom `train_step` ----
    class VAE(keras.Model):
        def __init__(self, encoder, decoder, **kwargs):
            super(VAE, self).__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")
            self.built = True  # Keras 3 builds a model by calling it; this one has no call(), its parts are built

        @property
        def metrics(self):
            return [
                self.total_loss_tracker,
                self.reconstruction_loss_tracker,
                self.kl_loss_tracker,
            ]

        def compute_losses(self, trainable_variables, non_trainable_variables, data):
            # JAX: the model's variables read the state's values; the sampler's seed advances in it.
            state_mapping = list(zip(self.trainable_variables, trainable_variables)) + list(
                zip(self.non_trainable_variables, non_trainable_variables))
            with keras.StatelessScope(state_mapping=state_mapping) as scope:
                z_mean, z_log_var, z = self.encoder(data)
                reconstruction = self.decoder(z)
                reconstruction_loss = ops.mean(
                    ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
                )
                kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
                kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
                total_loss = reconstruction_loss + kl_loss
            non_trainable_variables = [scope.get_current_value(v) for v in self.non_trainable_variables]
            return total_loss, (reconstruction_loss, kl_loss, non_trainable_variables)

        def train_step(self, state, data):
            trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
            if isinstance(data, tuple):  # fit(x) gives Keras' (x,) here
                data = data[0]
            (total_loss, (reconstruction_loss, kl_loss, non_trainable_variables)), grads = jax.value_and_grad(
                self.compute_losses, has_aux=True)(trainable_variables, non_trainable_variables, data)
            trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables)
            new_metrics_variables, logs = [], {}
            for tracker, value in ((self.total_loss_tracker, total_loss),
                                   (self.reconstruction_loss_tracker, reconstruction_loss),
                                   (self.kl_loss_tracker, kl_loss)):
                start = len(new_metrics_variables)
                tracker_variables = tracker.stateless_update_state(
                    metrics_variables[start:start + len(tracker.variables)], value)
                new_metrics_variables += tracker_variables
                logs[tracker.name] = tracker.stateless_result(tracker_variables)
            logs["loss"] = logs.pop("total_loss")  # the example's log names
            return logs, (trainable_variables, non_trainable_variables, optimizer_variables,
                          new_metrics_variables)

    # ---- Train the VAE ----
    (x_train, _), (x_test, _) = keras_tpu.datasets.mnist.load_data()
    mnist_digits = np.concatenate([x_train, x_test], axis=0)
    mnist_digits = np.expand_dims(mnist_digits, -1).astype("float32") / 255
    mnist_digits = mnist_digits[:3072]

    with scope_for(via):
        encoder, decoder = build_encoder_and_decoder()
        vae = VAE(encoder, decoder)
        vae.compile(optimizer=keras.optimizers.Adam())
    vae = on_tpu(vae, via)
    history = vae.fit(mnist_digits, epochs=3, batch_size=128, verbose=0).history

    assert history["loss"][-1] < history["loss"][0] < 600  # 784 pixels x ln 2 ~ 543 for a blank guess
    assert history["reconstruction_loss"][-1] < history["reconstruction_loss"][0]

    # ---- Display a grid of sampled digits ----
    def plot_latent_space(vae, n=30, figsize=15):
        # display a n*n 2D manifold of digits
        digit_size = 28
        scale = 1.0
        figure = np.zeros((digit_size * n, digit_size * n))
        # linearly spaced coordinates corresponding to the 2D plot
        # of digit classes in the latent space
        grid_x = np.linspace(-scale, scale, n)
        grid_y = np.linspace(-scale, scale, n)[::-1]

        # One predict call for the grid instead of n*n (same images, far fewer device calls).
        z_samples = np.array([[xi, yi] for yi in grid_y for xi in grid_x])
        x_decoded = vae.decoder.predict(z_samples, verbose=0)
        for k, (i, j) in enumerate((i, j) for i in range(n) for j in range(n)):
            digit = x_decoded[k].reshape(digit_size, digit_size)
            figure[
                i * digit_size : (i + 1) * digit_size,
                j * digit_size : (j + 1) * digit_size,
            ] = digit
        return figure, z_samples, x_decoded

    figure, z_samples, x_decoded = plot_latent_space(vae, n=10)
    assert figure.shape == (280, 280) and 0 <= figure.min() and figure.max() <= 1
    assert figure.std() > 0.1  # digits on a dark background, not a uniform grey

    # ---- Display how the latent space clusters different digit classes ----
    def plot_label_clusters(vae, data, labels):
        # display a 2D plot of the digit classes in the latent space
        z_mean, _, _ = vae.encoder.predict(data, verbose=0)
        return z_mean

    (x_train, y_train), _ = keras_tpu.datasets.mnist.load_data()
    x_train = np.expand_dims(x_train, -1).astype("float32") / 255

    x_train, y_train = x_train[:4000], y_train[:4000]  # half of them suffice to see the clusters
    z_mean = plot_label_clusters(vae, x_train, y_train)
    assert z_mean.shape == (4000, 2) and np.isfinite(z_mean).all()
    # What the scatter plot shows: classes occupy their own regions. Nearest class centre in the
    # 2-D latent space, fitted on half the digits, scored on the other half (chance: ~10%).
    centres = np.stack([z_mean[:2000][y_train[:2000] == c].mean(axis=0) for c in range(10)])
    nearest = np.argmin(((z_mean[2000:, None, :] - centres[None]) ** 2).sum(-1), axis=1)
    assert np.mean(nearest == y_train[2000:]) > 0.2

    # The trained encoder and decoder serve ordinary CPU models of the same architecture.
    vae_encoder = vae.encoder if via == "TPUStrategy" else vae.cpu_model.encoder
    vae_decoder = vae.decoder if via == "TPUStrategy" else vae.cpu_model.decoder
    vae_decoder.save_weights(str(tmp_path / "decoder.weights.h5"))
    vae_encoder.save_weights(str(tmp_path / "encoder.weights.h5"))
    cpu_encoder, cpu_decoder = build_encoder_and_decoder()
    cpu_encoder.load_weights(str(tmp_path / "encoder.weights.h5"))
    cpu_decoder.load_weights(str(tmp_path / "decoder.weights.h5"))
    np.testing.assert_allclose(cpu_decoder.predict(z_samples, verbose=0), x_decoded, atol=0.03)
    cpu_z_mean, _, _ = cpu_encoder.predict(x_train, verbose=0)
    np.testing.assert_allclose(cpu_z_mean, z_mean, atol=0.05 * (1 + np.abs(z_mean).max()))
    # The logged loss is the total of its two parts, every epoch, as on one device (checked last
    # only so that a failure here does not hide the checks above).
    for total, reconstruction, kl in zip(history["loss"], history["reconstruction_loss"], history["kl_loss"]):
        assert total == pytest.approx(reconstruction + kl, rel=1e-4)


# =====================================================================================
# examples/generative/dcgan_overriding_train_step.py, its train_step in the JAX style
# =====================================================================================


class OptimizerPair(keras.optimizers.Optimizer):
    """Keras' JAX trainer carries one optimizer's variables in a train_step's ``state``
    (``model.optimizer.variables``): this one is the GAN's two, so both optimizers' slots (Adam's
    moments and step counts) travel from step to step. It applies nothing itself."""

    def __init__(self, first, second):
        super().__init__(learning_rate=0.0, name="optimizer_pair")
        self.first, self.second = first, second

    def build(self, var_list):  # each optimizer is built on its own network's weights
        self.built = True

    @property
    def variables(self):
        return self.first.variables + self.second.variables


@pytest.mark.slow
@pytest.mark.parametrize("via", ["TPUStrategy"])  # VIAS has both; one each keeps CI short
def test_dcgan_overriding_train_step(via, tmp_path):
    """examples/generative/dcgan_overriding_train_step.py ("GAN overriding Model.train_step", the
    MNIST DCGAN), keras-io commit 0d5f327. (The file's later versions train on CelebA faces at
    64x64 with a 512-channel generator, too heavy for two CPU cores.)

    The example's ``train_step`` uses TensorFlow's ``tf.GradientTape`` and two
    ``apply_gradients``; here it is written the JAX way of guides/custom_train_step_in_jax.py:
    ``train_step(self, state, data)``, each network run by ``stateless_call`` on its slice of the
    trainable values, ``jax.value_and_grad`` for each tape, ``d_optimizer.stateless_apply`` and
    then ``g_optimizer.stateless_apply`` (the generator trained through the just-updated
    discriminator, as in the example). Random numbers come from a ``keras.random.SeedGenerator``
    (the example's Keras 3 versions do the same) whose state travels in the non-trainable state,
    read in a ``keras.StatelessScope``. ``GAN.compile`` builds the two optimizers on their
    networks and hands Keras an ``OptimizerPair``, so both Adam states travel in the state too.
    ``tf.random.*`` calls are ``keras.random.*``, other ``tf.*`` calls ``keras.ops``;
    ``LeakyReLU(alpha=...)`` is Keras 3's ``negative_slope``.

    Other changes: ``self.built = True`` in ``GAN.__init__`` (as for the VAE: no ``call``);
    ``keras_tpu.datasets.mnist`` (10,000 digits) for ``keras.datasets.mnist``, of which 384
    train; the ``tf.data`` pipeline becomes ``fit(all_digits, batch_size=64)`` (Keras
    shuffles); epochs 30 -> 2; the networks built in a function
    (``build_discriminator_and_generator``) so that the CPU copy is the same code; the model
    built and compiled under the strategy's scope, or converted with ``keras_to_tpu_model``
    after ``compile``; ``GANMonitor`` writes its PNGs under ``tmp_path`` with
    ``keras.utils.array_to_img`` and ``ops.convert_to_numpy``. Instead of displaying them: the
    images exist with the right size, the losses are finite, both optimizers stepped once per
    batch and kept their Adam state, the samples lie in [0, 1], the discriminator tells fakes
    from digits, and the generator's weights serve the same architecture built outside any
    scope.
    """
    keras.utils.set_random_seed(0)
    # ---- Prepare MNIST data ----
    # We use both the training & test MNIST digits.
    batch_size = 64
    (x_train, _), (x_test, _) = keras_tpu.datasets.mnist.load_data()
    all_digits = np.concatenate([x_train, x_test])
    all_digits = all_digits.astype("float32") / 255
    all_digits = np.reshape(all_digits, (-1, 28, 28, 1))
    all_digits = all_digits[:384]

    latent_dim = 128

    def build_discriminator_and_generator():
        # ---- Create the discriminator ----
        discriminator = keras.Sequential(
            [
                keras.Input(shape=(28, 28, 1)),
                layers.Conv2D(64, (3, 3), strides=(2, 2), padding="same"),
                layers.LeakyReLU(negative_slope=0.2),
                layers.Conv2D(128, (3, 3), strides=(2, 2), padding="same"),
                layers.LeakyReLU(negative_slope=0.2),
                layers.GlobalMaxPooling2D(),
                layers.Dense(1),
            ],
            name="discriminator",
        )

        # ---- Create the generator ----
        generator = keras.Sequential(
            [
                keras.Input(shape=(latent_dim,)),
                # We want to generate 128 coefficients to reshape into a 7x7x128 map
                layers.Dense(7 * 7 * 128),
                layers.LeakyReLU(negative_slope=0.2),
                layers.Reshape((7, 7, 128)),
                layers.Conv2DTranspose(128, (4, 4), strides=(2, 2), padding="same"),
                layers.LeakyReLU(negative_slope=0.2),
                layers.Conv2DTranspose(128, (4, 4), strides=(2, 2), padding="same"),
                layers.LeakyReLU(negative_slope=0.2),
                layers.Conv2D(1, (7, 7), padding="same", activation="sigmoid"),
            ],
            name="generator",
        )
        return discriminator, generator

    # ---- Override `train_step` ----
    class GAN(keras.Model):
        def __init__(self, discriminator, generator, latent_dim):
            super(GAN, self).__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.seed_generator = keras.random.SeedGenerator(1337)
            self.built = True  # Keras 3 builds a model by calling it; this one has no call(), its parts are built

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            d_optimizer.build(self.discriminator.trainable_variables)
            g_optimizer.build(self.generator.trainable_variables)
            super(GAN, self).compile(optimizer=OptimizerPair(d_optimizer, g_optimizer))
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn

        def train_step(self, state, data):
            trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
            real_images = data[0] if isinstance(data, tuple) else data  # fit(x) gives Keras' (x,)
            # JAX: each network's slice of the state (the GAN holds the discriminator, then the generator).
            d_count = len(self.discriminator.trainable_variables)
            d_vars, g_vars = trainable_variables[:d_count], trainable_variables[d_count:]
            d_opt_count = len(self.d_optimizer.variables)
            d_opt_vars, g_opt_vars = optimizer_variables[:d_opt_count], optimizer_variables[d_opt_count:]
            seeds = keras.StatelessScope(state_mapping=list(zip(self.non_trainable_variables,
                                                                non_trainable_variables)))
            with seeds:
                # Sample random points in the latent space
                batch_size = ops.shape(real_images)[0]
                random_latent_vectors = keras.random.normal(
                    shape=(batch_size, self.latent_dim), seed=self.seed_generator)

                # Decode them to fake images
                generated_images, _ = self.generator.stateless_call(g_vars, [], random_latent_vectors)

                # Combine them with real images
                combined_images = ops.concatenate([generated_images, real_images], axis=0)

                # Assemble labels discriminating real from fake images
                labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
                # Add random noise to the labels - important trick!
                labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)

                # Train the discriminator
                def d_loss_fn(d_vars):
                    predictions, _ = self.discriminator.stateless_call(d_vars, [], combined_images)
                    return self.loss_fn(labels, predictions)

                d_loss, grads = jax.value_and_grad(d_loss_fn)(d_vars)
                d_vars, d_opt_vars = self.d_optimizer.stateless_apply(d_opt_vars, grads, d_vars)

                # Sample random points in the latent space
                random_latent_vectors = keras.random.normal(
                    shape=(batch_size, self.latent_dim), seed=self.seed_generator)

                # Assemble labels that say "all real images"
                misleading_labels = ops.zeros((batch_size, 1))

                # Train the generator (note that we should *not* update the weights
                # of the discriminator)!
                def g_loss_fn(g_vars):
                    fake_images, _ = self.generator.stateless_call(g_vars, [], random_latent_vectors)
                    predictions, _ = self.discriminator.stateless_call(d_vars, [], fake_images)
                    return self.loss_fn(misleading_labels, predictions)

                g_loss, grads = jax.value_and_grad(g_loss_fn)(g_vars)
                g_vars, g_opt_vars = self.g_optimizer.stateless_apply(g_opt_vars, grads, g_vars)
            non_trainable_variables = [seeds.get_current_value(v) for v in self.non_trainable_variables]
            return {"d_loss": d_loss, "g_loss": g_loss}, (
                d_vars + g_vars, non_trainable_variables, d_opt_vars + g_opt_vars, metrics_variables)

    # ---- Create a callback that periodically saves generated images ----
    class GANMonitor(keras.callbacks.Callback):
        def __init__(self, num_img=3, latent_dim=128):
            self.num_img = num_img
            self.latent_dim = latent_dim

        def on_epoch_end(self, epoch, logs=None):
            random_latent_vectors = keras.random.normal(shape=(self.num_img, self.latent_dim))
            generated_images = self.model.generator(random_latent_vectors)
            generated_images *= 255
            generated_images = ops.convert_to_numpy(generated_images)
            for i in range(self.num_img):
                img = keras.utils.array_to_img(generated_images[i])
                img.save(str(tmp_path / "generated_img_{i}_{epoch}.png".format(i=i, epoch=epoch)))

    # ---- Train the end-to-end model ----
    epochs = 2

    with scope_for(via):
        discriminator, generator = build_discriminator_and_generator()
        gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
        gan.compile(
            d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
            g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
        )
    gan = on_tpu(gan, via)

    history = gan.fit(
        all_digits, batch_size=batch_size, epochs=epochs,
        callbacks=[GANMonitor(num_img=3, latent_dim=latent_dim)], verbose=0,
    ).history

    # ---- Display the last generated images ----
    for i in range(3):
        image = keras.utils.load_img(str(tmp_path / f"generated_img_{i}_{epochs - 1}.png"))
        assert image.size == (28, 28)
    assert all(np.isfinite(history[key]).all() and len(history[key]) == epochs for key in ("d_loss", "g_loss"))
    # Both optimizers stepped once per batch, and kept their Adam state across steps.
    steps = epochs * len(all_digits) // batch_size
    cpu_gan = gan if via == "TPUStrategy" else gan.cpu_model
    assert int(cpu_gan.d_optimizer.iterations) == int(cpu_gan.g_optimizer.iterations) == steps
    assert all(float(np.abs(v.numpy()).max()) > 0 for v in cpu_gan.d_optimizer.variables[2:])
    # Generated digits: the right shape, pixel values in [0, 1] (the generator ends in a sigmoid).
    noise = ops.convert_to_numpy(keras.random.normal((16, latent_dim), seed=3))
    samples = cpu_gan.generator.predict(noise, verbose=0)
    assert samples.shape == (16, 28, 28, 1) and samples.min() >= 0 and samples.max() <= 1
    assert samples.std() > 0.01  # not a constant image
    # The trained generator serves an ordinary CPU model of the same architecture.
    cpu_gan.generator.save_weights(str(tmp_path / "generator.weights.h5"))
    _, cpu_generator = build_discriminator_and_generator()
    cpu_generator.load_weights(str(tmp_path / "generator.weights.h5"))
    np.testing.assert_allclose(cpu_generator.predict(noise, verbose=0), samples, atol=0.03)
    # The discriminator learnt its job: fakes are labelled 1 and real digits 0 in this example.
    d_real = cpu_gan.discriminator.predict(all_digits[:256], verbose=0)
    fakes = cpu_gan.generator.predict(ops.convert_to_numpy(keras.random.normal((256, latent_dim), seed=4)),
                                      verbose=0)
    d_fake = cpu_gan.discriminator.predict(fakes, verbose=0)
    assert d_fake.mean() > d_real.mean()
