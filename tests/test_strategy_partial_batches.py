"""Custom loops on batches that do not fill the replicas evenly: TensorFlow splits such a global batch over the
replicas unevenly, gives some replicas no rows (its dummy batches), and a TPU runs each replica at its own rows
(``tf.distribute.RunOptions(experimental_enable_dynamic_batch_size=True)``, the default). ``strategy.run`` does
the same, equal to the loop on the CPU over whole batches."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_tpu
from keras_tpu import _pod as pod


def _data(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 6)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")


def _classifier():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def _parts():
    return _classifier(), keras.optimizers.Adam(0.01), keras.metrics.SparseCategoricalAccuracy()


def _train_step(model, optimizer, accuracy, global_batch):
    """TensorFlow's custom-loop step: the loss scaled by 1 / global batch (tf.nn.compute_average_loss)."""
    def step(inputs):
        features, labels = inputs

        def loss_of(trainable):
            logits, _ = model.stateless_call(trainable, [], features, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            return keras.ops.sum(per_example) / global_batch, logits

        (loss, logits), grads = jax.value_and_grad(loss_of, has_aux=True)(
            [v.value for v in model.trainable_variables])
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(labels, logits)
        return loss, logits
    return step


@pytest.mark.parametrize("global_batch, rows", [
    (64, [None, None, (8, 8, 8, 8, 8, 4, 0, 0)]),                     # a partial last batch of 44 rows
    (100, [(13, 13, 13, 13, 12, 12, 12, 12), (13, 13, 13, 13, 12, 8, 0, 0)]),  # 100 does not divide by 8
])
def test_uneven_and_partial_batches_train_each_replica_on_its_own_rows_as_the_cpu(global_batch, rows):
    x, y = _data(172)
    batches = [(x[i:i + global_batch], y[i:i + global_batch]) for i in range(0, len(x), global_batch)]
    strategy = keras_tpu.TPUStrategy(precision="highest")
    with strategy.scope():
        model, optimizer, accuracy = _parts()
    step = _train_step(model, optimizer, accuracy, global_batch)
    distributed = list(strategy.experimental_distribute_dataset(batches))
    assert [(features.rows, labels.rows) for features, labels in distributed] == [(r, r) for r in rows]
    results = [strategy.run(step, args=(batch,)) for batch in distributed]

    cpu, cpu_optimizer, cpu_accuracy = _parts()
    cpu_step = _train_step(cpu, cpu_optimizer, cpu_accuracy, global_batch)
    cpu_results = [cpu_step(batch) for batch in batches]

    np.testing.assert_allclose([float(strategy.reduce("SUM", loss)) for loss, _ in results],
                               [float(loss) for loss, _ in cpu_results], rtol=1e-5)
    for a, b in zip(model.get_weights(), cpu.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)
    assert int(optimizer.iterations.value) == len(batches)
    assert float(accuracy.count.value) == 172
    assert float(accuracy.result()) == pytest.approx(float(cpu_accuracy.result()))
    # Each replica's logits are its own rows: gathered, they are the batch's, in order; a mean over the rows
    # counts the real rows only.
    logits = results[-1][1]
    assert logits.rows == rows[-1] and [part.shape[0] for part in logits.values] == list(rows[-1])
    np.testing.assert_allclose(strategy.gather(logits, axis=0), cpu_results[-1][1], atol=2e-5)
    np.testing.assert_allclose(strategy.reduce("MEAN", logits, axis=0), np.mean(cpu_results[-1][1], axis=0),
                               atol=2e-5)
    with pytest.raises(ValueError, match="different numbers of rows.*axis=0"):
        strategy.reduce("SUM", logits)
    assert len(strategy._run_programs) == (2 if rows[0] is None else len(rows))  # a program per pattern of rows


def test_a_step_with_two_optimizers_sums_each_ones_gradients_over_all_replicas():
    """A GAN's step applies two optimizers, the second's loss read through the first's new weights: on uneven
    replicas each optimizer still applies the sum of every replica's gradients."""
    x, _ = _data(44, seed=2)

    def build():
        keras.utils.set_random_seed(4)
        first = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
        second = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        return first, second, keras.optimizers.SGD(0.3), keras.optimizers.Adam(0.05)

    def make_step(first, second, first_optimizer, second_optimizer):
        def step(features):
            def first_loss(trainable):
                hidden, _ = first.stateless_call(trainable, [], features)
                return keras.ops.sum(hidden ** 2) / 64

            grads = jax.grad(first_loss)([v.value for v in first.trainable_variables])
            first_optimizer.apply_gradients(zip(grads, first.trainable_variables))
            hidden = first(features)  # the new weights

            def second_loss(trainable):
                out, _ = second.stateless_call(trainable, [], hidden)
                return keras.ops.sum((out - 1.0) ** 2) / 64

            loss, grads = jax.value_and_grad(second_loss)([v.value for v in second.trainable_variables])
            second_optimizer.apply_gradients(zip(grads, second.trainable_variables))
            return loss
        return step

    strategy = keras_tpu.TPUStrategy(precision="highest")
    with strategy.scope():
        parts = build()
    (batch,) = strategy.experimental_distribute_dataset([x[:64]])  # 44 rows: one batch, as its own global batch
    assert batch.rows == (6, 6, 6, 6, 5, 5, 5, 5)
    loss = strategy.run(make_step(*parts), args=(batch,))
    cpu = build()
    cpu_loss = make_step(*cpu)(x)
    np.testing.assert_allclose(float(strategy.reduce("SUM", loss)), float(cpu_loss), rtol=1e-5)
    for model, cpu_model in zip(parts[:2], cpu[:2]):
        for a, b in zip(model.get_weights(), cpu_model.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_moving_statistics_of_a_partial_batch_are_the_mean_of_the_replicas_with_rows():
    """BatchNormalization on replicas with rows and without: a replica without rows has no statistic (its mean
    of no rows is NaN), so the moving statistics average the replicas that have rows."""
    x = (np.random.default_rng(0).standard_normal((20, 2)) + np.arange(20)[:, None] / 4).astype("float32")
    strategy = keras_tpu.TPUStrategy(precision="highest")
    with strategy.scope():
        layer = keras.layers.BatchNormalization(momentum=0.5)
        model = keras.Sequential([keras.Input((2,)), layer])
    batch = list(strategy.experimental_distribute_dataset([np.zeros((32, 2), "float32"), x]))[1]
    assert batch.rows == (4, 4, 4, 4, 4, 0, 0, 0)
    out = strategy.run(lambda rows: model(rows, training=True), args=(batch,))
    assert out.rows == batch.rows
    replicas = x.reshape(5, 4, 2)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * replicas.mean(axis=1).mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 0.5 + 0.5 * replicas.var(axis=1).mean(axis=0),
                               rtol=1e-5)


def test_per_replica_datasets_that_run_out_mid_step_give_the_rest_no_rows():
    """distribute_datasets_from_function: a dataset whose per-replica batches end in the middle of a step, the
    last of them partial, leaves the step's other replicas batches of no rows (TensorFlow's dummy batches)."""
    data = np.arange(10 * 4 * 3, dtype=np.float32).reshape(-1, 3)[:38]

    def dataset_fn(context):
        rows = context.get_per_replica_batch_size(32)
        return [data[i:i + rows] for i in range(0, len(data), rows)]  # 9 batches of 4 rows, then one of 2

    strategy = keras_tpu.TPUStrategy()
    steps = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert [step.rows for step in steps] == [None, (4, 2, 0, 0, 0, 0, 0, 0)]
    sums = [strategy.run(lambda x: jnp.sum(x, axis=0), args=(step,)) for step in steps]
    np.testing.assert_allclose(sum(np.asarray(strategy.reduce("SUM", s)) for s in sums), data.sum(axis=0))
    np.testing.assert_allclose(strategy.gather(steps[1], axis=0), data[32:])


def _convnet():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8, 8, 2)), keras.layers.Conv2D(4, 3, activation="relu"),
                             keras.layers.MaxPooling2D(), keras.layers.DepthwiseConv2D(3, padding="same"),
                             keras.layers.Flatten(), keras.layers.Dense(3)])


def test_a_convolutional_step_with_replicas_without_rows_trains_as_the_cpu():
    """Convolutions, max pooling's gradient and depthwise convolutions of replicas with no rows (a partial batch
    of 5 rows where batches have 16) have nothing to compute; the step equals the CPU's on the 5 rows."""
    rng = np.random.default_rng(1)
    images = rng.standard_normal((21, 8, 8, 2)).astype("float32")
    labels = rng.integers(0, 3, 21)
    batches = [(images[:16], labels[:16]), (images[16:], labels[16:])]
    strategy = keras_tpu.TPUStrategy(precision="highest")
    with strategy.scope():
        model, optimizer = _convnet(), keras.optimizers.SGD(0.1)
    distributed = list(strategy.experimental_distribute_dataset(batches))
    assert distributed[1][0].rows == distributed[1][1].rows == (2, 2, 1, 0, 0, 0, 0, 0)
    step = _train_step(model, optimizer, keras.metrics.SparseCategoricalAccuracy(), 16)
    losses = [float(strategy.reduce("SUM", strategy.run(step, args=(batch,))[0])) for batch in distributed]
    cpu, cpu_optimizer = _convnet(), keras.optimizers.SGD(0.1)
    cpu_step = _train_step(cpu, cpu_optimizer, keras.metrics.SparseCategoricalAccuracy(), 16)
    np.testing.assert_allclose(losses, [float(cpu_step(batch)[0]) for batch in batches], rtol=1e-5)
    for a, b in zip(model.get_weights(), cpu.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_convolutional_step_on_replicas_without_rows_and_under_jit():
    """Convolutions and matrix products of a replica with no rows (nothing to multiply on the MXU), in a replica
    function that only computes, called inside the user's jax.jit (the port of @tf.function)."""
    images = np.random.default_rng(1).standard_normal((11, 8, 8, 2)).astype("float32")
    strategy = keras_tpu.TPUStrategy(precision="highest")
    with strategy.scope():
        model = _convnet()
    batch = list(strategy.experimental_distribute_dataset([np.zeros((16, 8, 8, 2), "float32"), images]))[1]
    assert batch.rows == (2, 2, 2, 2, 2, 1, 0, 0)

    @jax.jit
    def predict(batch):
        return strategy.run(lambda rows: model(rows), args=(batch,))

    out = predict(batch)
    assert out.rows == batch.rows
    np.testing.assert_allclose(strategy.gather(out, axis=0), model(images), atol=1e-5)
    with pytest.raises(ValueError, match="only a part's first axis may follow them"):
        strategy.run(lambda rows: jnp.transpose(rows), args=(batch,))


def test_a_pods_processes_refuse_replicas_with_different_rows_and_say_what_to_do(monkeypatch):
    strategy = keras_tpu.TPUStrategy()
    (batch,) = strategy.experimental_distribute_dataset([np.ones((12, 3), "float32")])
    monkeypatch.setattr(pod, "is_multi_worker", lambda: True)
    with pytest.raises(ValueError, match=r"different numbers of rows \(\[\[2, 2, 2, 2, 1, 1, 1, 1\]\]\).*"
                                         r"drop_remainder=True"):
        strategy.run(lambda x: jnp.sum(x), args=(batch,))
