"""TensorFlow's TPU and distribution guides (github.com/tensorflow/docs, site/en/), ported with mechanical changes only.

Each test is one notebook: its code cells in order (``# ---- cell N ----``: the notebook's N-th code cell, the licence
cell being cell 1), with ``tf.distribute.X`` / ``tf.tpu.experimental.X`` / ``tf.config.experimental_connect_to_cluster``
-> ``keras_tpu.X``, ``tf.keras`` -> ``keras``, ``tensorflow_datasets`` and ``tf.data`` pipelines -> NumPy arrays
(``keras_tpu.datasets.mnist.load_data()``) and generators, ``tf.GradientTape`` -> ``jax.value_and_grad`` of
``model.stateless_call`` (Keras 3's JAX style) and ``@tf.function`` dropped (``strategy.run`` compiles its own
program). Plots, TensorBoard and shell commands are left out; every other change is listed in the test's docstring.
Epochs and steps are shortened. After the notebook's code, each test asserts what the notebook's user looks at.

MNIST is the bundled copy (``keras_tpu.datasets.mnist``: MNIST's official 10,000-image test split, its first 8,000
digits as the training set and its last 2,000 as the test set), not TensorFlow Datasets' 60,000 and 10,000.
"""

import glob
import math
import os
import re

import keras
import numpy as np
import pytest

from keras_tpu._placement import installed_on

# The `colab` fixture (COLAB_TPU_ADDR, a fresh directory, seeded RNGs) is in tests/conftest.py.


class Batches(keras.utils.PyDataset):
    """``tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch_size)`` (a partial last batch kept), with
    ``.shuffle(buffer)`` before the batching if ``shuffle`` (here always with a buffer that holds the whole split: a
    new full permutation each epoch), as a ``keras.utils.PyDataset``, which ``fit`` and ``evaluate`` iterate again
    on every epoch and call, as they do a ``tf.data`` dataset (a generator is read once)."""

    def __init__(self, images, labels, batch_size, shuffle=False):
        super().__init__()
        self.images, self.labels, self.batch_size, self.shuffle = images, labels, batch_size, shuffle
        self.on_epoch_end()

    def __len__(self):
        return math.ceil(len(self.images) / self.batch_size)

    def __getitem__(self, index):
        rows = self.order[index * self.batch_size:(index + 1) * self.batch_size]
        return self.images[rows], self.labels[rows]

    def on_epoch_end(self):
        self.order = np.random.permutation(len(self.images)) if self.shuffle else np.arange(len(self.images))

    def __iter__(self):  # a plain pass (strategy.experimental_distribute_dataset's), reshuffled after it
        for index in range(len(self)):
            yield self[index]
        self.on_epoch_end()


class Checkpoint:
    """``tf.train.Checkpoint(optimizer=..., model=...)`` for Keras 3 objects. ``save(file_prefix)`` writes
    ``<file_prefix>-<n>.weights.h5`` (the model's weights, Keras' own file) and ``<file_prefix>-<n>.optimizer.npz``
    (the optimizer's variables: its step, learning rate and slots), ``n`` counting this object's saves from 1 as
    TensorFlow's ``save_counter`` does, and returns ``<file_prefix>-<n>``; ``restore(save_path)`` loads both back
    (building the optimizer on the model's trainable variables first: TensorFlow restores slots as they are
    created)."""

    def __init__(self, optimizer, model):
        self.optimizer, self.model, self.save_counter = optimizer, model, 0

    def save(self, file_prefix):
        self.save_counter += 1
        save_path = f"{file_prefix}-{self.save_counter}"
        os.makedirs(os.path.dirname(save_path) or ".", exist_ok=True)
        self.model.save_weights(save_path + ".weights.h5")
        np.savez(save_path + ".optimizer.npz", *[np.asarray(v.value) for v in self.optimizer.variables])
        return save_path

    def restore(self, save_path):
        self.model.load_weights(save_path + ".weights.h5")
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)
        with np.load(save_path + ".optimizer.npz") as saved:
            for i, variable in enumerate(self.optimizer.variables):
                variable.assign(saved[f"arr_{i}"])


def latest_checkpoint(checkpoint_dir):
    """``tf.train.latest_checkpoint``: the save path of the newest :meth:`Checkpoint.save` in ``checkpoint_dir``."""
    paths = glob.glob(os.path.join(checkpoint_dir, "*-*.weights.h5"))
    return max((p[:-len(".weights.h5")] for p in paths), key=lambda p: int(p.rsplit("-", 1)[1]), default=None)


# --------------------------------------------------------------------------------------------------------------
# 1. Use TPUs (site/en/guide/tpu.ipynb)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_guide_tpu(colab, capsys):
    """tensorflow/docs ``site/en/guide/tpu.ipynb`` ("Use TPUs") at commit 48a1db29 (2024-09-04, its newest): TPU
    initialisation (its ``strategy.run`` of a matrix product is left out, see below), a Keras MNIST classifier
    trained with ``fit`` under ``TPUStrategy.scope()`` (with validation data, then again with
    ``steps_per_execution``), and the same model trained by a custom loop over ``distribute_datasets_from_function``,
    one step per call and then several steps per call.

    Changes:

    * cell 2: ``tensorflow``, ``tensorflow_datasets`` -> ``numpy``, ``keras``, ``keras_tpu``, ``jax``;
    * cell 3: ``tf.distribute.cluster_resolver.TPUClusterResolver``, ``tf.config.experimental_connect_to_cluster``,
      ``tf.tpu.experimental.initialize_tpu_system`` -> ``keras_tpu.``; ``tf.config.list_logical_devices('TPU')``
      -> the ``Topology`` that ``initialize_tpu_system`` returns (``describe()``);
    * cell 4 (manual device placement): ``with tf.device('/TPU:0'): c = tf.matmul(a, b)`` and its prints are left
      out: placing an op on one core by device name is TensorFlow's runtime, which keras_tpu has no counterpart
      of;
    * cell 5: ``tf.distribute.TPUStrategy`` -> ``keras_tpu.TPUStrategy``;
    * cell 6 (``strategy.run(matmul_fn, args=(a, b))``: every core gets the same two matrices): cell 4's
      ``tf.constant`` -> ``keras.ops.convert_to_tensor``, ``@tf.function`` dropped, ``tf.matmul`` ->
      ``keras.ops.matmul``;
    * cell 7: ``tf.keras`` -> ``keras``; ``Conv2D(..., input_shape=(28, 28, 1), ...)`` -> ``keras.Input((28, 28,
      1))`` then ``Conv2D(...)`` (Keras 3 layers take no ``input_shape``); **shrunk**: the two ``Conv2D`` layers have
      ``FILTERS = 8`` filters instead of 256 (32 filters already take 0.4 s per training step of 200 digits
      here, and 256 make the second convolution 64 times that work; 8 reach 90% accuracy in 15 steps); the dense
      layers (256, 128, 10) and the L2 regularizers are the guide's;
    * cell 8, ``tensorflow_datasets`` -> NumPy: ``tfds.load(name='mnist', split=..., as_supervised=True)`` ->
      ``keras_tpu.datasets.mnist.load_data()`` (8,000 training and 2,000 test digits instead of 60,000 and 10,000),
      images given their channel axis (tfds' ``(28, 28, 1)``) and labels as int64 (tfds'); ``dataset.map(scale)``
      -> ``scale`` on the arrays (``tf.cast`` -> ``astype``); ``shuffle(10000).repeat().batch(batch_size)`` -> a
      generator of shuffled batches that repeats (the buffer of 10,000 holds all 8,000 digits: a full shuffle per
      pass); the test split's ``batch(batch_size)`` -> a generator of its batches in order that repeats (a
      ``tf.data`` dataset is iterated again for each epoch's validation, a generator is not; ``validation_steps``
      covers the split exactly, so each epoch validates on the same 2,000 digits);
    * cells 9 and 10: ``tf.keras.losses`` -> ``keras.losses``; ``steps_per_epoch = 60000 // batch_size`` ->
      ``8000 // batch_size`` and ``validation_steps = 10000 // batch_size`` -> ``2000 // batch_size`` (the bundled
      splits); shortened: 2 epochs of 5 steps instead of 5 of 300 (batch size 200 kept);
      ``steps_per_execution = 50`` -> ``5`` ("anything between 2 and ``steps_per_epoch``", as the guide's comment
      says: with fewer steps per epoch than steps per execution, Keras 3 runs 50 steps per epoch on a generator,
      plain Keras on the CPU as well);
    * cell 11: ``tf.keras.optimizers``/``metrics`` -> ``keras.``; ``dtype=tf.float32`` -> ``"float32"``;
      ``@tf.function`` dropped. ``tf.GradientTape`` -> ``jax.value_and_grad`` of the loss as a function of the
      trainable variables' values: ``model(images, training=True)`` and ``model.losses`` -> ``model.stateless_call(
      trainable, non_trainable, images, training=True, return_losses=True)``; ``tape.gradient`` -> the gradient it
      returns; ``tf.nn.compute_average_loss(per_example_loss)`` -> its formula, the sum of the per-example losses
      divided by the global batch size (``per_example_loss``'s rows times ``num_replicas_in_sync``);
      ``tf.nn.scale_regularization_loss(tf.add_n(model_losses))`` -> the sum of ``model_losses`` divided by
      ``num_replicas_in_sync``; ``tf.keras.losses`` -> ``keras.losses``;
      ``train_step`` defines a new ``step_fn`` on every call, as the guide's does (there ``@tf.function`` traced
      it once); ``strategy.run`` runs one compiled program for them all, as they close over the same objects;
    * cell 12: shortened: 2 epochs instead of 5 (of ``steps_per_epoch``, 5 here); ``steps_per_eval = 10000 //
      batch_size`` -> ``2000 // batch_size`` (the bundled test split; unused, as in the guide);
      ``optimizer.iterations.numpy()`` -> ``int(optimizer.iterations.value)``; ``reset_states()`` ->
      ``reset_state()`` (Keras 3);
    * cell 13: ``@tf.function`` dropped and ``for _ in tf.range(steps)`` -> ``for _ in range(steps)``;
      ``tf.convert_to_tensor(steps_per_epoch)`` -> ``steps_per_epoch`` (nothing is retraced: the loop is Python's);
      the gradient as in cell 11 (its ``step_fn`` stays nested: one ``train_multiple_steps`` call runs the same
      ``step_fn`` for all its steps). Each ``strategy.run`` is its own TPU program here, so the loop does not fuse
      the steps into one program as the guide's ``tf.function`` does: same results, not the guide's speed-up.
    """
    # ---- cell 2 ----
    import numpy as np
    import keras
    import keras_tpu
    import jax

    # ---- cell 3 ----
    resolver = keras_tpu.TPUClusterResolver(tpu='local')
    keras_tpu.experimental_connect_to_cluster(resolver)
    # This is the TPU initialization code that has to be at the beginning.
    topology = keras_tpu.initialize_tpu_system(resolver)
    print("All devices: ", topology.describe())  # tf.config.list_logical_devices('TPU')

    # ---- cell 4 ---- (manual device placement, with tf.device('/TPU:0'), left out: see the docstring)

    # ---- cell 5 ----
    strategy = keras_tpu.TPUStrategy(resolver)

    # ---- cell 6 ----
    a = keras.ops.convert_to_tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # from cell 4
    b = keras.ops.convert_to_tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])

    def matmul_fn(x, y):
      z = keras.ops.matmul(x, y)
      return z

    z = strategy.run(matmul_fn, args=(a, b))
    print(z)

    # ---- cell 7 ----
    FILTERS = 8  # the guide: 256 (see the docstring)

    def create_model():
      regularizer = keras.regularizers.L2(1e-5)
      return keras.Sequential(
          [keras.Input(shape=(28, 28, 1)),
           keras.layers.Conv2D(FILTERS, 3,
                               activation='relu',
                               kernel_regularizer=regularizer),
           keras.layers.Conv2D(FILTERS, 3,
                               activation='relu',
                               kernel_regularizer=regularizer),
           keras.layers.Flatten(),
           keras.layers.Dense(256,
                              activation='relu',
                              kernel_regularizer=regularizer),
           keras.layers.Dense(128,
                              activation='relu',
                              kernel_regularizer=regularizer),
           keras.layers.Dense(10,
                              kernel_regularizer=regularizer)])

    # ---- cell 8 ----
    def get_dataset(batch_size, is_training=True):
      (x_train, y_train), (x_test, y_test) = keras_tpu.datasets.mnist.load_data()  # tfds.load(name='mnist', ...)
      image, label = (x_train, y_train) if is_training else (x_test, y_test)
      image, label = image[..., np.newaxis], label.astype(np.int64)  # as_supervised: (28, 28, 1) images, int64

      # Normalize the input data.
      def scale(image, label):
        image = image.astype(np.float32)
        image /= 255.0
        return image, label

      image, label = scale(image, label)  # dataset.map(scale)

      # Only shuffle and repeat the dataset in training. The advantage of having an
      # infinite dataset for training is to avoid the potential last partial batch
      # in each epoch, so that you don't need to think about scaling the gradients
      # based on the actual batch size.
      def dataset():
        while True:  # training: shuffle(10000), repeat(); test: each epoch's validation iterates it again
          order = np.random.permutation(len(image)) if is_training else np.arange(len(image))
          for start in range(0, len(image), batch_size):  # batch(batch_size)
            index = order[start:start + batch_size]
            yield image[index], label[index]

      return dataset()

    # ---- cell 9 ----
    with strategy.scope():
      model = create_model()
      model.compile(optimizer='adam',
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=['sparse_categorical_accuracy'])

    batch_size = 200
    steps_per_epoch = 8000 // batch_size  # the guide: 60000 // batch_size
    validation_steps = 2000 // batch_size  # the guide: 10000 // batch_size
    steps_per_epoch, EPOCHS = 5, 2  # shortened: the guide runs 5 epochs of steps_per_epoch

    train_dataset = get_dataset(batch_size, is_training=True)
    test_dataset = get_dataset(batch_size, is_training=False)

    history = model.fit(train_dataset,
                        epochs=EPOCHS,
                        steps_per_epoch=steps_per_epoch,
                        validation_data=test_dataset,
                        validation_steps=validation_steps)

    # ---- cell 10 ----
    with strategy.scope():
      model = create_model()
      model.compile(optimizer='adam',
                    # Anything between 2 and `steps_per_epoch` could help here.
                    steps_per_execution = 5,  # the guide: 50
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=['sparse_categorical_accuracy'])

    history_spe = model.fit(train_dataset,
                            epochs=EPOCHS,
                            steps_per_epoch=steps_per_epoch,
                            validation_data=test_dataset,
                            validation_steps=validation_steps)
    model_spe = model

    # ---- cell 11 ----
    # Create the model, optimizer and metrics inside the `tf.distribute.Strategy`
    # scope, so that the variables can be mirrored on each device.
    with strategy.scope():
      model = create_model()
      optimizer = keras.optimizers.Adam()
      training_loss = keras.metrics.Mean('training_loss', dtype="float32")
      training_accuracy = keras.metrics.SparseCategoricalAccuracy(
          'training_accuracy', dtype="float32")

    # Calculate per replica batch size, and distribute the `tf.data.Dataset`s
    # on each TPU worker.
    per_replica_batch_size = batch_size // strategy.num_replicas_in_sync

    train_dataset = strategy.distribute_datasets_from_function(
        lambda _: get_dataset(per_replica_batch_size, is_training=True))

    def train_step(iterator):
      """The step function for one training step."""

      def step_fn(inputs):
        """The computation to run on each TPU device."""
        images, labels = inputs

        def loss_fn(trainable_variables):  # with tf.GradientTape() as tape:
          logits, _, model_losses = model.stateless_call(
              trainable_variables, [v.value for v in model.non_trainable_variables], images, training=True,
              return_losses=True)
          per_example_loss = keras.losses.sparse_categorical_crossentropy(
              labels, logits, from_logits=True)
          # tf.nn.compute_average_loss(per_example_loss): divided by the global batch size
          loss = keras.ops.sum(per_example_loss) / (
              keras.ops.shape(per_example_loss)[0] * strategy.num_replicas_in_sync)
          if model_losses:
            # tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            loss += keras.ops.sum(keras.ops.stack(model_losses)) / strategy.num_replicas_in_sync
          return loss, logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            [v.value for v in model.trainable_variables])  # tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(list(zip(grads, model.trainable_variables)))
        training_loss.update_state(loss * strategy.num_replicas_in_sync)
        training_accuracy.update_state(labels, logits)

      strategy.run(step_fn, args=(next(iterator),))

    # ---- cell 12 ----
    steps_per_eval = 2000 // batch_size  # the guide: 10000 // batch_size

    printed = []  # what the loop prints, for the checks below
    train_iterator = iter(train_dataset)
    for epoch in range(EPOCHS):  # the guide: range(5)
      print('Epoch: {}/5'.format(epoch))

      for step in range(steps_per_epoch):
        train_step(train_iterator)
      print('Current step: {}, training loss: {}, training accuracy: {}%'.format(
          int(optimizer.iterations.value),
          round(float(training_loss.result()), 4),
          round(float(training_accuracy.result()) * 100, 2)))
      printed.append((int(optimizer.iterations.value), float(training_loss.result()),
                      float(training_accuracy.result())))
      training_loss.reset_state()
      training_accuracy.reset_state()

    # ---- cell 13 ----
    def train_multiple_steps(iterator, steps):
      """The step function for one training step."""

      def step_fn(inputs):
        """The computation to run on each TPU device."""
        images, labels = inputs

        def loss_fn(trainable_variables):  # with tf.GradientTape() as tape:
          logits, _, model_losses = model.stateless_call(
              trainable_variables, [v.value for v in model.non_trainable_variables], images, training=True,
              return_losses=True)
          per_example_loss = keras.losses.sparse_categorical_crossentropy(
              labels, logits, from_logits=True)
          # tf.nn.compute_average_loss(per_example_loss): divided by the global batch size
          loss = keras.ops.sum(per_example_loss) / (
              keras.ops.shape(per_example_loss)[0] * strategy.num_replicas_in_sync)
          if model_losses:
            # tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            loss += keras.ops.sum(keras.ops.stack(model_losses)) / strategy.num_replicas_in_sync
          return loss, logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            [v.value for v in model.trainable_variables])  # tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(list(zip(grads, model.trainable_variables)))
        training_loss.update_state(loss * strategy.num_replicas_in_sync)
        training_accuracy.update_state(labels, logits)

      for _ in range(steps):  # tf.range(steps)
        strategy.run(step_fn, args=(next(iterator),))

    # Convert `steps_per_epoch` to `tf.Tensor` so the `tf.function` won't get
    # retraced if the value changes.
    train_multiple_steps(train_iterator, steps_per_epoch)  # tf.convert_to_tensor(steps_per_epoch)

    print('Current step: {}, training loss: {}, training accuracy: {}%'.format(
          int(optimizer.iterations.value),
          round(float(training_loss.result()), 4),
          round(float(training_accuracy.result()) * 100, 2)))
    printed.append((int(optimizer.iterations.value), float(training_loss.result()),
                    float(training_accuracy.result())))

    # ---- what the notebook's user checks ----
    out = capsys.readouterr().out
    assert topology.num_cores == 8 and strategy.num_replicas_in_sync == 8 and "8 cores" in out
    # Cell 6: every core multiplied the same two matrices.
    assert z.num_replicas == 8 and all(np.allclose(v, [[22.0, 28.0], [49.0, 64.0]], rtol=1e-2) for v in z.values)
    # One compiled program for the custom loop's steps (cell 11's step_fn, defined anew on each step) and one for
    # cell 13's (cell 6's matmul_fn is the third).
    assert len(strategy._run_programs) == 3
    # Model.fit, without and with steps_per_execution: the loss falls, validation accuracy far above chance.
    for h in (history, history_spe):
        assert h.history["loss"][-1] < h.history["loss"][0], h.history
        assert h.history["val_sparse_categorical_accuracy"][-1] > 0.7, h.history  # 0.85-0.87 at the seed
    assert model_spe.steps_per_execution == 5 and int(model_spe.optimizer.iterations.value) == 10
    # The custom loop: 5 optimizer steps per epoch, loss falling, accuracy rising and far above chance.
    assert [p[0] for p in printed] == [5, 10, 15] and "Current step: 15, training loss: " in out, printed
    assert printed[-1][1] < printed[0][1] and printed[-1][2] > printed[0][2] and printed[-1][2] > 0.6, printed
    assert steps_per_eval == validation_steps == 10
    # The custom loop computes what plain Keras computes: one more step of the guide's step_fn (cell 11) on a new
    # batch reports the loss (mean cross-entropy + the L2 terms, with the weights before the update) that plain
    # Keras computes for the same weights and batch on the CPU. (bf16 products on the MXU: agreement to 2e-3, 3e-4
    # at the seed, not float32's; a precision="highest" strategy would take two more compiles of step_fn, about
    # 7 s, over this test's budget.)
    reference = create_model()
    reference.set_weights(model.get_weights())
    images, labels = next(get_dataset(batch_size, is_training=True))
    logits = reference(images)
    expected_loss = float(keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
                          + keras.ops.sum(keras.ops.stack(reference.losses)))
    expected_accuracy = float(np.mean(np.argmax(np.asarray(logits), axis=1) == labels))
    training_loss.reset_state()
    training_accuracy.reset_state()
    train_step(iter(strategy.experimental_distribute_dataset([(images, labels)])))
    assert float(training_loss.result()) == pytest.approx(expected_loss, rel=2e-3)
    assert float(training_accuracy.result()) == pytest.approx(expected_accuracy, abs=0.011)
    assert int(optimizer.iterations.value) == 3 * steps_per_epoch + 1


# --------------------------------------------------------------------------------------------------------------
# 2. Distributed training with Keras (site/en/tutorials/distribute/keras.ipynb), on the TPU
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tutorial_distributed_training_with_keras(colab, capsys):
    """tensorflow/docs ``site/en/tutorials/distribute/keras.ipynb`` ("Distributed training with Keras") at commit
    9555b660 (2024-09-11, its newest), written for ``MirroredStrategy``, run with ``keras_tpu.TPUStrategy``: a
    small MNIST convnet built and compiled under the strategy's scope, trained with ``fit`` and the callbacks
    ``ModelCheckpoint`` (weights per epoch), ``LearningRateScheduler`` and a custom ``PrintLR``; the latest
    checkpoint loaded and evaluated; the model saved as ``.keras`` and loaded without and with the scope.

    Changes:

    * cell 2: ``tensorflow_datasets``, ``tensorflow`` -> ``numpy``, ``keras``, ``keras_tpu``; ``%load_ext
      tensorboard`` left out; cell 3: ``tf.__version__`` -> ``keras.__version__``;
    * cell 4, ``tensorflow_datasets`` -> NumPy: ``tfds.load(name='mnist', with_info=True, as_supervised=True)`` ->
      ``keras_tpu.datasets.mnist.load_data()`` (8,000 training and 2,000 test digits instead of 60,000 and 10,000),
      each split an ``(images, labels)`` pair with tfds' shapes and dtypes (``(28, 28, 1)`` uint8 images, int64
      labels); cell 7: ``info.splits[...].num_examples`` -> the splits' lengths;
    * cell 5, **the strategy**: ``tf.distribute.MirroredStrategy()`` -> ``keras_tpu.TPUStrategy()`` (the local
      simulated v2-8: 8 replicas, so ``BATCH_SIZE`` is 64 * 8 = 512);
    * cell 8: ``tf.cast(image, tf.float32)`` -> ``image.astype(np.float32)``; cell 9: ``.map(scale)`` -> ``scale``
      on the arrays, ``.cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)`` and ``.batch(BATCH_SIZE)`` -> the module's
      :class:`Batches` (a ``keras.utils.PyDataset``; ``BUFFER_SIZE`` = 10,000 holds all 8,000 training digits, so
      the shuffle is a full one each epoch; partial last batches kept: 8,000 = 15 * 512 + 320 and 2,000 = 3 * 512
      + 464);
    * cell 10: ``tf.keras`` -> ``keras``; ``Conv2D(32, 3, ..., input_shape=(28, 28, 1))`` -> ``keras.Input((28, 28,
      1))`` then ``Conv2D(32, 3, ...)`` (Keras 3 layers take no ``input_shape``);
    * cells 13-14: ``tf.keras.callbacks`` -> ``keras.callbacks``; ``tf.keras.callbacks.TensorBoard(log_dir=
      './logs')`` left out (TensorBoard's event files are TensorFlow's), as are cells 18-19 (``%tensorboard``, ``!ls
      -sh ./logs``);
    * cell 15, shortened: ``EPOCHS = 4`` instead of 12 (the schedule's first change, 1e-3 -> 1e-4 at epoch 3, is
      in them; the second, at epoch 7, is not);
    * cell 16: ``!ls {checkpoint_dir}`` -> ``print(sorted(os.listdir(checkpoint_dir)))``;
    * cells 17, 22, 23: each ``evaluate``'s ``(eval_loss, eval_acc)`` is also noted in ``evals`` for the checks;
      cells 22-23: ``tf.keras.models``/``losses``/``optimizers`` -> ``keras.``.
    """
    # ---- cell 2 ----
    import numpy as np
    import keras
    import keras_tpu

    import os

    # ---- cell 3 ----
    print(keras.__version__)

    # ---- cell 4 ----
    datasets = keras_tpu.datasets.mnist.load_data()  # tfds.load(name='mnist', with_info=True, as_supervised=True)
    datasets = [(images[..., np.newaxis], labels.astype(np.int64)) for images, labels in datasets]

    mnist_train, mnist_test = datasets

    # ---- cell 5 ----
    strategy = keras_tpu.TPUStrategy()  # tf.distribute.MirroredStrategy()

    # ---- cell 6 ----
    print('Number of devices: {}'.format(strategy.num_replicas_in_sync))

    # ---- cell 7 ----
    # You can also do info.splits.total_num_examples to get the total
    # number of examples in the dataset.

    num_train_examples = len(mnist_train[0])  # info.splits['train'].num_examples
    num_test_examples = len(mnist_test[0])  # info.splits['test'].num_examples

    BUFFER_SIZE = 10000

    BATCH_SIZE_PER_REPLICA = 64
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

    # ---- cell 8 ----
    def scale(image, label):
      image = image.astype(np.float32)
      image /= 255

      return image, label

    # ---- cell 9 ----
    assert BUFFER_SIZE >= num_train_examples  # .shuffle(BUFFER_SIZE): a full shuffle, as Batches does
    train_dataset = Batches(*scale(*mnist_train), BATCH_SIZE, shuffle=True)  # .map(scale).cache().shuffle().batch()
    eval_dataset = Batches(*scale(*mnist_test), BATCH_SIZE)  # mnist_test.map(scale).batch(BATCH_SIZE)

    # ---- cell 10 ----
    with strategy.scope():
      model = keras.Sequential([
          keras.Input(shape=(28, 28, 1)),
          keras.layers.Conv2D(32, 3, activation='relu'),
          keras.layers.MaxPooling2D(),
          keras.layers.Flatten(),
          keras.layers.Dense(64, activation='relu'),
          keras.layers.Dense(10)
      ])

      model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    optimizer=keras.optimizers.Adam(learning_rate=0.001),
                    metrics=['accuracy'])

    # ---- cell 11 ----
    # Define the checkpoint directory to store the checkpoints.
    checkpoint_dir = './training_checkpoints'
    # Define the name of the checkpoint files.
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch:04d}.weights.h5")

    # ---- cell 12 ----
    # Define a function for decaying the learning rate.
    # You can define any decay function you need.
    def decay(epoch):
      if epoch < 3:
        return 1e-3
      elif epoch >= 3 and epoch < 7:
        return 1e-4
      else:
        return 1e-5

    # ---- cell 13 ----
    # Define a callback for printing the learning rate at the end of each epoch.
    class PrintLR(keras.callbacks.Callback):
      def on_epoch_end(self, epoch, logs=None):
        print('\nLearning rate for epoch {} is {}'.format(epoch + 1, model.optimizer.learning_rate.numpy()))

    # ---- cell 14 ----
    # Put all the callbacks together.
    callbacks = [
        # keras.callbacks.TensorBoard(log_dir='./logs'): left out (TensorFlow's event files)
        keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix,
                                        save_weights_only=True),
        keras.callbacks.LearningRateScheduler(decay),
        PrintLR()
    ]

    # ---- cell 15 ----
    EPOCHS = 4  # the tutorial: 12

    history = model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks)

    # ---- cell 16 ----
    # Check the checkpoint directory.
    print(sorted(os.listdir(checkpoint_dir)))  # !ls {checkpoint_dir}

    # ---- cell 17 ----
    import pathlib
    latest_checkpoint = sorted(pathlib.Path(checkpoint_dir).glob('*'))[-1]

    model.load_weights(latest_checkpoint)

    eval_loss, eval_acc = model.evaluate(eval_dataset)

    print('Eval loss: {}, Eval accuracy: {}'.format(eval_loss, eval_acc))
    evals = {"checkpoint": (eval_loss, eval_acc)}  # for the checks below

    # ---- cell 20 ----
    path = 'my_model.keras'

    # ---- cell 21 ----
    model.save(path)

    # ---- cell 22 ----
    unreplicated_model = keras.models.load_model(path)

    unreplicated_model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.Adam(),
        metrics=['accuracy'])

    eval_loss, eval_acc = unreplicated_model.evaluate(eval_dataset)

    print('Eval loss: {}, Eval Accuracy: {}'.format(eval_loss, eval_acc))
    evals["unreplicated"] = (eval_loss, eval_acc)  # for the checks below

    # ---- cell 23 ----
    with strategy.scope():
      replicated_model = keras.models.load_model(path)
      replicated_model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                               optimizer=keras.optimizers.Adam(),
                               metrics=['accuracy'])

      eval_loss, eval_acc = replicated_model.evaluate(eval_dataset)
      print ('Eval loss: {}, Eval Accuracy: {}'.format(eval_loss, eval_acc))
      evals["replicated"] = (eval_loss, eval_acc)  # for the checks below

    # ---- what the notebook's user checks ----
    out = capsys.readouterr().out
    assert strategy.num_replicas_in_sync == 8 and "Number of devices: 8" in out and BATCH_SIZE == 512
    assert (num_train_examples, num_test_examples) == (8000, 2000) and len(train_dataset) == 16
    # The schedule, as LearningRateScheduler set it and PrintLR printed it at each epoch's end.
    assert history.history["learning_rate"] == pytest.approx([1e-3, 1e-3, 1e-3, 1e-4])
    printed_rates = [(int(epoch), float(rate))
                     for epoch, rate in re.findall(r"Learning rate for epoch (\d+) is (\S+)", out)]
    assert printed_rates == [(1, pytest.approx(1e-3)), (2, pytest.approx(1e-3)), (3, pytest.approx(1e-3)),
                             (4, pytest.approx(1e-4))], printed_rates
    assert int(model.optimizer.iterations.value) == EPOCHS * 16
    # Training: the loss falls epoch by epoch, the accuracy rises far above chance (10%).
    losses = history.history["loss"]
    assert all(b < a for a, b in zip(losses, losses[1:])) and history.history["accuracy"][-1] > 0.85, history.history
    # One weights checkpoint per epoch; the latest holds the trained weights and loads into plain Keras as well.
    names = ['ckpt_0001.weights.h5', 'ckpt_0002.weights.h5', 'ckpt_0003.weights.h5', 'ckpt_0004.weights.h5']
    assert sorted(os.listdir(checkpoint_dir)) == names and str(names) in out and latest_checkpoint.name == names[-1]
    plain = keras.models.clone_model(unreplicated_model)
    plain.load_weights(latest_checkpoint)
    for trained, loaded in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(trained, loaded)
    first = keras.models.clone_model(unreplicated_model)
    first.load_weights(os.path.join(checkpoint_dir, names[0]))
    assert not np.array_equal(first.get_weights()[0], plain.get_weights()[0])  # each epoch's own weights
    # The evaluation: far above chance, on the TPU and on the CPU alike (CPU float32 against the MXU's bf16
    # products: the same to 1e-2, 5e-4 at the seed), and the model loaded under the scope runs on the TPU and
    # evaluates as the trained one.
    assert installed_on(model) is not None and installed_on(replicated_model) is not None
    assert installed_on(unreplicated_model) is None
    for trained, loaded in zip(model.get_weights(), unreplicated_model.get_weights()):
        np.testing.assert_array_equal(trained, loaded)
    checkpoint_loss, checkpoint_acc = evals["checkpoint"]
    assert checkpoint_acc > 0.85 and checkpoint_loss < 0.5, evals
    assert evals["unreplicated"][0] == pytest.approx(checkpoint_loss, rel=1e-2), evals
    assert evals["unreplicated"][1] == pytest.approx(checkpoint_acc, abs=2e-3), evals
    # (The same TPU numerics; float32 sums in another order: the first evaluate timed both of keras_tpu's test
    # programs, the cores in a loop and as one batch, and kept the faster.)
    assert evals["replicated"][0] == pytest.approx(checkpoint_loss, rel=1e-4), evals
    assert evals["replicated"][1] == pytest.approx(checkpoint_acc, abs=1e-6), evals


# --------------------------------------------------------------------------------------------------------------
# 3. Custom training with tf.distribute.Strategy (site/en/tutorials/distribute/custom_training.ipynb), on the TPU
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tutorial_custom_training(colab, capsys):
    """tensorflow/docs ``site/en/tutorials/distribute/custom_training.ipynb`` ("Custom training with
    tf.distribute.Strategy") at commit d742984f (2023-10-17, its newest), written for ``MirroredStrategy``, run with
    ``keras_tpu.TPUStrategy``: a convnet with L2 regularizers trained by a custom loop (``strategy.run`` of a
    ``train_step`` whose loss is ``compute_average_loss`` plus the scaled regularization, ``strategy.reduce(SUM)``
    of the replicas' losses), a test loop updating metrics, checkpoints restored into a model without the strategy,
    and the tutorial's two other ways of iterating (an iterator for a number of steps, a whole epoch in one
    function).

    Changes:

    * cell 2: ``tensorflow`` -> ``keras``, ``keras_tpu``, ``jax``; ``tf.__version__`` -> ``keras.__version__``;
    * cell 3, **MNIST for Fashion-MNIST** (not available here): ``tf.keras.datasets.fashion_mnist`` ->
      ``keras_tpu.datasets.mnist`` (the same shapes and dtypes); **a slice**: its first 2,000 training and 1,000
      test digits (4 and 2 global batches of 512, the last of each partial, as the tutorial's are: its 60,000 and
      10,000 rows do not divide by 512 either), instead of Fashion-MNIST's 60,000 and 10,000. A partial batch
      splits over the replicas as TensorFlow splits it (464 rows: seven replicas of 64 and one of 16), each
      replica computing on its own rows, ``compute_average_loss``'s divisor included (16 * 8 on the last);
    * cell 4, **the strategy**: ``tf.distribute.MirroredStrategy()`` -> ``keras_tpu.TPUStrategy()`` (8 replicas:
      ``GLOBAL_BATCH_SIZE`` is 64 * 8 = 512);
    * cell 6, shortened: ``EPOCHS = 2`` instead of 10;
    * cell 7: ``tf.data.Dataset.from_tensor_slices(...).shuffle(BUFFER_SIZE).batch(GLOBAL_BATCH_SIZE)`` and
      ``...batch(GLOBAL_BATCH_SIZE)`` -> the module's :class:`Batches` (reshuffled after each pass; ``BUFFER_SIZE``
      is the split's length, so a full shuffle), which ``strategy.experimental_distribute_dataset`` iterates again
      on every ``for``, as a ``tf.data`` dataset;
    * cell 8: ``tf.keras`` -> ``keras``; **shrunk**: ``Conv2D`` layers of 8 and 16 filters instead of 32 and 64
      (with 32 and 64 this test takes 37 s here, 10 s more: ``strategy.run`` runs a convolution's gradient on the
      8 cores as one batched convolution, several times slower on XLA:CPU than ``fit``'s step; the dense layers
      and regularizers are the tutorial's); **not mechanical**: ``keras.Input(shape=(28, 28, 1))`` first, so that the
      model has its variables before the first step (TensorFlow builds the model at its first call inside the
      tape; Keras 3's JAX style differentiates with respect to the variables' values, which must exist);
    * cell 10: ``reduction=tf.keras.losses.Reduction.NONE`` -> ``reduction=None`` (Keras 3);
      ``tf.nn.compute_average_loss(per_example_loss)`` -> its formula, the sum of the per-example losses divided by
      the global batch size (``per_example_loss``'s rows times ``num_replicas_in_sync``);
      ``tf.nn.scale_regularization_loss(tf.add_n(model_losses))`` -> the sum of ``model_losses`` divided by
      ``num_replicas_in_sync``;
    * cell 12, **not mechanical**: ``tf.train.Checkpoint(optimizer=..., model=...)`` (TensorFlow's object-based
      checkpoints, which Keras 3 has no counterpart of) -> the module's :class:`Checkpoint`, which saves the model's
      weights as a Keras ``.weights.h5`` file and the optimizer's variables as ``.npz``; cell 17:
      ``tf.train.latest_checkpoint`` -> the module's :func:`latest_checkpoint`;
    * cell 13: ``tf.GradientTape`` -> ``jax.value_and_grad`` of the loss as a function of the trainable variables'
      values: ``model(images, training=True)`` and ``model.losses`` -> ``model.stateless_call(trainable,
      non_trainable, images, training=True, return_losses=True)``; ``tape.gradient`` -> the gradient it returns;
    * cells 14, 16, 19: ``@tf.function`` dropped (``strategy.run`` compiles its own program; a ``jax.jit`` around a
      replica function that updates variables is refused, and ``eval_step`` updates a metric);
      ``tf.distribute.ReduceOp.SUM`` -> ``keras_tpu.ReduceOp.SUM``; ``reset_states()`` -> ``reset_state()``;
      ``tf.cast(num_batches, dtype=tf.float32)`` -> ``float(num_batches)``;
    * cell 15: ``tf.data.Dataset.from_tensor_slices(...).batch(GLOBAL_BATCH_SIZE)`` -> :class:`Batches`;
    * cell 18, shortened: 2 steps per epoch instead of 10 (the slice has 4 batches).
    """
    # ---- cell 2 ----
    # Import Keras, keras_tpu and JAX
    import keras
    import keras_tpu
    import jax

    # Helper libraries
    import numpy as np
    import os

    print(keras.__version__)

    # ---- cell 3 ----
    fashion_mnist = keras_tpu.datasets.mnist  # keras.datasets.fashion_mnist: not available, MNIST stands in

    (train_images, train_labels), (test_images, test_labels) = fashion_mnist.load_data()
    (train_images, train_labels), (test_images, test_labels) = (  # a slice: 4 and 2 global batches, the last partial
        (train_images[:2000], train_labels[:2000]), (test_images[:1000], test_labels[:1000]))

    # Add a dimension to the array -> new shape == (28, 28, 1)
    # This is done because the first layer in our model is a convolutional
    # layer and it requires a 4D input (batch_size, height, width, channels).
    # batch_size dimension will be added later on.
    train_images = train_images[..., None]
    test_images = test_images[..., None]

    # Scale the images to the [0, 1] range.
    train_images = train_images / np.float32(255)
    test_images = test_images / np.float32(255)

    # ---- cell 4 ----
    # If the list of devices is not specified in
    # `tf.distribute.MirroredStrategy` constructor, they will be auto-detected.
    strategy = keras_tpu.TPUStrategy()  # tf.distribute.MirroredStrategy()

    # ---- cell 5 ----
    print('Number of devices: {}'.format(strategy.num_replicas_in_sync))

    # ---- cell 6 ----
    BUFFER_SIZE = len(train_images)

    BATCH_SIZE_PER_REPLICA = 64
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

    EPOCHS = 2  # the tutorial: 10

    # ---- cell 7 ----
    assert BUFFER_SIZE >= len(train_images)  # .shuffle(BUFFER_SIZE): a full shuffle, as Batches does
    train_dataset = Batches(train_images, train_labels, GLOBAL_BATCH_SIZE, shuffle=True)
    test_dataset = Batches(test_images, test_labels, GLOBAL_BATCH_SIZE)

    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    # ---- cell 8 ----
    def create_model():
      regularizer = keras.regularizers.L2(1e-5)
      model = keras.Sequential([
          keras.Input(shape=(28, 28, 1)),  # not in the tutorial: see the docstring
          keras.layers.Conv2D(8, 3,  # the tutorial: 32 (see the docstring)
                              activation='relu',
                              kernel_regularizer=regularizer),
          keras.layers.MaxPooling2D(),
          keras.layers.Conv2D(16, 3,  # the tutorial: 64
                              activation='relu',
                              kernel_regularizer=regularizer),
          keras.layers.MaxPooling2D(),
          keras.layers.Flatten(),
          keras.layers.Dense(64,
                             activation='relu',
                             kernel_regularizer=regularizer),
          keras.layers.Dense(10, kernel_regularizer=regularizer)
        ])

      return model

    # ---- cell 9 ----
    # Create a checkpoint directory to store the checkpoints.
    checkpoint_dir = './training_checkpoints'
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

    # ---- cell 10 ----
    with strategy.scope():
      # Set reduction to `NONE` so you can do the reduction yourself.
      loss_object = keras.losses.SparseCategoricalCrossentropy(
          from_logits=True,
          reduction=None)
      def compute_loss(labels, predictions, model_losses):
        per_example_loss = loss_object(labels, predictions)
        # tf.nn.compute_average_loss(per_example_loss): divided by the global batch size
        loss = keras.ops.sum(per_example_loss) / (
            keras.ops.shape(per_example_loss)[0] * strategy.num_replicas_in_sync)
        if model_losses:
          # tf.nn.scale_regularization_loss(tf.add_n(model_losses))
          loss += keras.ops.sum(keras.ops.stack(model_losses)) / strategy.num_replicas_in_sync
        return loss

    # ---- cell 11 ----
    with strategy.scope():
      test_loss = keras.metrics.Mean(name='test_loss')

      train_accuracy = keras.metrics.SparseCategoricalAccuracy(
          name='train_accuracy')
      test_accuracy = keras.metrics.SparseCategoricalAccuracy(
          name='test_accuracy')

    # ---- cell 12 ----
    # A model, an optimizer, and a checkpoint must be created under `strategy.scope`.
    with strategy.scope():
      model = create_model()

      optimizer = keras.optimizers.Adam(learning_rate=0.001)

      checkpoint = Checkpoint(optimizer=optimizer, model=model)  # tf.train.Checkpoint

    # ---- cell 13 ----
    def train_step(inputs):
      images, labels = inputs

      def loss_fn(trainable_variables):  # with tf.GradientTape() as tape:
        predictions, _, model_losses = model.stateless_call(
            trainable_variables, [v.value for v in model.non_trainable_variables], images, training=True,
            return_losses=True)
        loss = compute_loss(labels, predictions, model_losses)
        return loss, predictions

      (loss, predictions), gradients = jax.value_and_grad(loss_fn, has_aux=True)(
          [v.value for v in model.trainable_variables])  # tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(gradients, model.trainable_variables))

      train_accuracy.update_state(labels, predictions)
      return loss

    def test_step(inputs):
      images, labels = inputs

      predictions = model(images, training=False)
      t_loss = loss_object(labels, predictions)

      test_loss.update_state(t_loss)
      test_accuracy.update_state(labels, predictions)

    # ---- cell 14 ----
    # `run` replicates the provided computation and runs it
    # with the distributed input.
    def distributed_train_step(dataset_inputs):
      per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
      return strategy.reduce(keras_tpu.ReduceOp.SUM, per_replica_losses,
                             axis=None)

    def distributed_test_step(dataset_inputs):
      return strategy.run(test_step, args=(dataset_inputs,))

    for epoch in range(EPOCHS):
      # TRAIN LOOP
      total_loss = 0.0
      num_batches = 0
      for x in train_dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
      train_loss = total_loss / num_batches

      # TEST LOOP
      for x in test_dist_dataset:
        distributed_test_step(x)

      if epoch % 2 == 0:
        checkpoint.save(checkpoint_prefix)

      template = ("Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, "
                  "Test Accuracy: {}")
      print(template.format(epoch + 1, train_loss,
                             train_accuracy.result() * 100, test_loss.result(),
                             test_accuracy.result() * 100))

      test_loss.reset_state()
      train_accuracy.reset_state()
      test_accuracy.reset_state()

    # ---- cell 15 ----
    eval_accuracy = keras.metrics.SparseCategoricalAccuracy(
          name='eval_accuracy')

    new_model = create_model()
    new_optimizer = keras.optimizers.Adam()

    test_dataset = Batches(test_images, test_labels, GLOBAL_BATCH_SIZE)

    # ---- cell 16 ----
    def eval_step(images, labels):
      predictions = new_model(images, training=False)
      eval_accuracy(labels, predictions)

    # ---- cell 17 ----
    checkpoint = Checkpoint(optimizer=new_optimizer, model=new_model)
    checkpoint.restore(latest_checkpoint(checkpoint_dir))

    for images, labels in test_dataset:
      eval_step(images, labels)

    print('Accuracy after restoring the saved model without strategy: {}'.format(
        eval_accuracy.result() * 100))

    # ---- cell 18 ----
    for _ in range(EPOCHS):
      total_loss = 0.0
      num_batches = 0
      train_iter = iter(train_dist_dataset)

      for _ in range(2):  # the tutorial: range(10)
        total_loss += distributed_train_step(next(train_iter))
        num_batches += 1
      average_train_loss = total_loss / num_batches

      template = ("Epoch {}, Loss: {}, Accuracy: {}")
      print(template.format(epoch + 1, average_train_loss, train_accuracy.result() * 100))
      train_accuracy.reset_state()

    # ---- cell 19 ----
    def distributed_train_epoch(dataset):
      total_loss = 0.0
      num_batches = 0
      for x in dataset:
        per_replica_losses = strategy.run(train_step, args=(x,))
        total_loss += strategy.reduce(
          keras_tpu.ReduceOp.SUM, per_replica_losses, axis=None)
        num_batches += 1
      return total_loss / float(num_batches)

    for epoch in range(EPOCHS):
      train_loss = distributed_train_epoch(train_dist_dataset)

      template = ("Epoch {}, Loss: {}, Accuracy: {}")
      print(template.format(epoch + 1, train_loss, train_accuracy.result() * 100))

      train_accuracy.reset_state()

    # ---- what the notebook's user checks ----
    out = capsys.readouterr().out
    assert strategy.num_replicas_in_sync == 8 and "Number of devices: 8" in out and GLOBAL_BATCH_SIZE == 512
    number = r"([-+0-9.e]+)"
    epochs = [tuple(map(float, m)) for m in re.findall(
        rf"Epoch \d+, Loss: {number}, Accuracy: {number}, Test Loss: {number}, Test Accuracy: {number}", out)]
    later = [tuple(map(float, m)) for m in re.findall(rf"Epoch \d+, Loss: {number}, Accuracy: {number}\n", out)]
    assert len(epochs) == EPOCHS and len(later) == 2 * EPOCHS, out
    # Cell 14: the training loss falls, the test accuracy is far above chance (10%).
    assert epochs[-1][0] < epochs[0][0] and epochs[-1][3] > 25, epochs  # 41% at the seed
    # Cells 18 and 19 train on: the loss keeps falling.
    losses = [epochs[0][0], epochs[-1][0]] + [loss for loss, _ in later]
    assert losses[-1] < losses[1] and losses[-1] < 0.9 * losses[0], losses  # 2.27 -> 1.79 at the seed
    # Every step applied one update from all 8 replicas: 4 + 4 (cell 14), 2 + 2 (cell 18), 4 + 4 (cell 19).
    assert int(optimizer.iterations.value) == 20
    # The checkpoint of the first epoch (`epoch % 2 == 0`) restores into a model without the strategy: its test
    # accuracy on the CPU is the one printed for that epoch on the TPU (float32 against the MXU's bf16 products:
    # to 2 digits of 1,000), and the optimizer's state came with it (4 steps).
    assert sorted(os.listdir(checkpoint_dir)) == ["ckpt-1.optimizer.npz", "ckpt-1.weights.h5"]
    assert latest_checkpoint(checkpoint_dir) == os.path.join(checkpoint_dir, "ckpt-1")
    restored = float(re.search(r"Accuracy after restoring the saved model without strategy: " + number, out)[1])
    assert restored == pytest.approx(epochs[0][3], abs=100 * 2 / 1000), (restored, epochs)
    assert int(new_optimizer.iterations.value) == 4 and len(new_optimizer.variables) == len(optimizer.variables)
    # The loss a training step returns (the replicas' scaled losses summed) is plain Keras' loss for the same
    # weights and batch on the CPU: mean cross-entropy + the L2 terms (bf16 products on the MXU: to 2e-3).
    reference = create_model()
    reference.set_weights(model.get_weights())
    images, labels = train_images[:GLOBAL_BATCH_SIZE], train_labels[:GLOBAL_BATCH_SIZE]
    expected = float(keras.ops.mean(loss_object(labels, reference(images)))
                     + keras.ops.sum(keras.ops.stack(reference.losses)))
    (batch,) = strategy.experimental_distribute_dataset([(images, labels)])
    assert float(distributed_train_step(batch)) == pytest.approx(expected, rel=2e-3)
