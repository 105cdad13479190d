"""TPUStrategy: models built under its scope train on the TPU; run/reduce for custom loops."""

import contextlib
import logging

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_tpu
from keras_tpu import _hbm as hbm, _rewrite as rewrite
from keras_tpu._placement import installed_on
from tests.tpu_helpers import assert_weights_close, classification_data, compiled_programs, small_classifier


@pytest.fixture
def strategy():
    resolver = keras_tpu.TPUClusterResolver()
    keras_tpu.experimental_connect_to_cluster(resolver)
    keras_tpu.initialize_tpu_system(resolver)
    return keras_tpu.TPUStrategy(resolver, precision="highest")


def test_models_built_under_the_scope_run_on_the_tpu(strategy, caplog):
    caplog.set_level(logging.INFO, logger="keras_tpu")
    assert strategy.num_replicas_in_sync == 8
    x, y = classification_data(200)
    with strategy.scope():
        model = small_classifier()
    reference = small_classifier()  # built outside any scope: a plain CPU model
    got = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history  # fit outside the scope
    want = reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6)
    assert_weights_close(model.get_weights(), reference.get_weights(), atol=1e-6)
    assert installed_on(model) is not None and installed_on(reference) is None  # only one runs on the TPU
    assert compiled_programs(caplog) == [("train", 64, 1)]  # our program ran (the CPU model's did not log)
    with strategy.scope():  # evaluate and predict inside the scope work too
        scores = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
        predictions = model.predict(x[:13], verbose=0)
    assert scores == pytest.approx(reference.evaluate(x, y, batch_size=64, verbose=0, return_dict=True), rel=2e-6)
    np.testing.assert_allclose(predictions, reference.predict(x[:13], verbose=0), atol=1e-6)


def test_subclassed_models_and_compile_inside_or_outside(strategy, caplog):
    caplog.set_level(logging.INFO, logger="keras_tpu")
    class TwoLayers(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden, self.out = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)

        def call(self, x):
            return self.out(self.hidden(x))

    x, y = classification_data(64)
    with strategy.scope():
        model = TwoLayers()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # compiled outside
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert compiled_programs(caplog) == [("train", 32, 1)]


def test_a_models_own_compute_loss_runs_on_the_tpu(strategy):
    class MeanSquared(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            per_row = keras.ops.mean((y_pred - y) ** 2, axis=-1)
            if sample_weight is None:  # no padding row reaches a model's own compute_loss
                return keras.ops.mean(per_row)
            return keras.ops.sum(per_row * sample_weight) / keras.ops.sum(sample_weight)

    x, _ = classification_data(64)
    y = x[:, :1] * 2
    with strategy.scope():
        model = MeanSquared()
        model.compile(keras.optimizers.SGD(0.1))
    losses = model.fit(x, y, batch_size=16, epochs=5, verbose=0).history["loss"]
    assert losses[-1] < 0.5 * losses[0]


def test_nested_and_mixed_scopes_are_refused(strategy):
    other = keras_tpu.TPUStrategy()
    with strategy.scope():
        with pytest.raises(RuntimeError, match="do not nest"):
            with other.scope():
                pass
        with pytest.raises(RuntimeError, match="do not nest"):
            with strategy.scope():
                pass
    outside = small_classifier()
    with strategy.scope():
        with pytest.raises(ValueError, match="created outside"):
            outside.compile("adam", "mse")
    with other.scope():
        inside_other = small_classifier()
    with strategy.scope():
        with pytest.raises(ValueError, match="another TPUStrategy"):
            inside_other.compile("adam", "mse")


def test_steps_per_execution_from_the_strategy(caplog):
    caplog.set_level(logging.INFO, logger="keras_tpu")
    strategy = keras_tpu.TPUStrategy(steps_per_execution=3)
    with strategy.scope():
        model = small_classifier()
    x, y = classification_data(7 * 16)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    # 7 batches an epoch: 3 + 3 + 1 steps per call.
    assert model.steps_per_execution == 3 and compiled_programs(caplog) == [("train", 16, 3), ("train", 16, 1)]
    assert int(model.optimizer.iterations.value) == 14 and len(history.history["loss"]) == 2


def test_run_reduce_and_distribute_dataset(strategy):
    batches = [np.arange(32 * 3, dtype=np.float32).reshape(32, 3)]
    (per_replica,) = list(strategy.experimental_distribute_dataset(batches))
    assert per_replica.num_replicas == 8 and per_replica.values[1].shape == (4, 3)
    sums = strategy.run(lambda x: jnp.sum(x), args=(per_replica,))
    assert float(strategy.reduce("SUM", sums)) == batches[0].sum()
    assert float(strategy.reduce(keras_tpu.ReduceOp.MEAN, sums)) == pytest.approx(batches[0].sum() / 8)
    rows = strategy.run(lambda x, scale: x * scale, args=(per_replica, 2.0))
    np.testing.assert_allclose(strategy.reduce("MEAN", rows, axis=0), 2 * batches[0].mean(axis=0))
    np.testing.assert_allclose(np.concatenate(strategy.experimental_local_results(rows)), 2 * batches[0])
    # A plain value is the same on every replica: its mean is itself, and (as in TensorFlow) it has no sum.
    assert float(strategy.reduce("MEAN", 2.0)) == 2.0 and float(strategy.reduce("SUM", 0)) == 0
    with pytest.raises(ValueError, match="non-DistributedValues value 2.0 cannot be reduced with ReduceOp.SUM"):
        strategy.reduce("SUM", 2.0)
    # 12 rows do not divide over 8 replicas: TensorFlow's split, the first four get one row more.
    (uneven,) = strategy.experimental_distribute_dataset([batches[0][:12]])
    assert uneven.rows == (2, 2, 2, 2, 1, 1, 1, 1)
    np.testing.assert_array_equal(np.concatenate(uneven.values), batches[0][:12])
    with pytest.raises(ValueError, match="one number of rows"):
        list(strategy.experimental_distribute_dataset([(np.ones((12, 3)), np.ones((10,)))]))


def test_a_custom_training_loop_with_run_reduce_and_grad():
    strategy = keras_tpu.TPUStrategy()  # default bf16 MXU numerics
    x, y = classification_data(256)
    with strategy.scope():
        model = small_classifier()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    non_trainable = [v.value for v in model.non_trainable_variables]

    def replica_step(trainable, batch):
        features, labels = batch

        def loss_of(trainable):
            predictions, _ = model.stateless_call(trainable, non_trainable, features)
            return loss_fn(labels, predictions)

        return jax.value_and_grad(loss_of)(trainable)

    trainable = [v.value for v in model.trainable_variables]
    global_batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 256, 64)]
    losses = []
    for _ in range(15):
        for batch in strategy.experimental_distribute_dataset(global_batches):
            loss, grads = strategy.run(replica_step, args=(trainable, batch))
            grads = strategy.reduce("MEAN", grads)
            trainable = [w - 0.5 * g for w, g in zip(trainable, grads)]
            losses.append(float(strategy.reduce("MEAN", loss)))
    assert np.mean(losses[-4:]) < 0.6 * np.mean(losses[:4])
    (program,) = strategy._run_programs.values()  # one compiled program for all 60 steps
    jaxpr = str(jax.make_jaxpr(program)([*trainable], [part.stacked[:, :8] for part in batch]))  # (features, labels)
    assert "mxu_dot_general" in jaxpr and " dot_general[" not in jaxpr


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_custom_loop_updates_metrics_and_applies_gradients_inside_strategy_run(optimizer):
    """TensorFlow 2's custom training loop: strategy.run(train_step) where train_step calls the model, updates
    Keras metrics and applies the gradients with an optimizer (Adam: its slots are created on the first step,
    inside the replica function). Each replica scales its loss by 1 / global batch (tf.nn.compute_average_loss),
    the optimizer sums the replicas' gradients, as TensorFlow's does in a replica context; metrics combined;
    equal to the same loop on the CPU over whole batches (SGD shows the gradients' scale)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")

    def setup():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
        chosen = keras.optimizers.Adam(0.05) if optimizer == "adam" else keras.optimizers.SGD(0.5)
        return model, chosen, keras.metrics.Mean("loss"), keras.metrics.SparseCategoricalAccuracy("accuracy")

    def make_step(model, optimizer, loss_metric, accuracy):
        def train_step(inputs):
            features, labels = inputs

            def loss_of(trainable):
                logits, _ = model.stateless_call(trainable, [v.value for v in model.non_trainable_variables],
                                                 features)
                per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
                return keras.ops.sum(per_example) / GLOBAL_BATCH, (logits, per_example)

            (loss, (logits, per_example)), grads = jax.value_and_grad(loss_of, has_aux=True)(
                [v.value for v in model.trainable_variables])
            loss_metric.update_state(per_example)
            accuracy.update_state(labels, logits)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return train_step

    GLOBAL_BATCH = 32

    strategy = keras_tpu.TPUStrategy(precision="highest")
    with strategy.scope():
        tpu_parts = setup()
    tpu_step = make_step(*tpu_parts)
    batches = [(x[:32], y[:32]), (x[32:], y[32:])]
    losses = [strategy.run(tpu_step, args=(batch,)) for batch in strategy.experimental_distribute_dataset(batches)]
    cpu_parts = setup()
    cpu_step = make_step(*cpu_parts)
    cpu_losses = [float(cpu_step(batch)) for batch in batches]

    tpu_model, tpu_optimizer, tpu_loss, tpu_accuracy = tpu_parts
    cpu_model, cpu_optimizer, cpu_loss, cpu_accuracy = cpu_parts
    assert all(len(strategy.experimental_local_results(l)) == 8 for l in losses)
    np.testing.assert_allclose([float(strategy.reduce("SUM", l)) for l in losses], cpu_losses, rtol=1e-5)
    assert int(tpu_optimizer.iterations.value) == int(cpu_optimizer.iterations.value) == 2
    for a, b in zip(tpu_model.get_weights(), cpu_model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(float(tpu_loss.result()), float(cpu_loss.result()), rtol=1e-5)
    assert float(tpu_accuracy.result()) == pytest.approx(float(cpu_accuracy.result()))
    assert float(tpu_accuracy.count.value) == 64  # every row of both steps, over all replicas


@contextlib.contextmanager
def _compile_events():
    """The XLA compiles while the block runs (jax.monitoring's events), as a list."""
    compiles = []

    def note_compile(event, seconds, **kwargs):
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(note_compile)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(note_compile)


def test_variables_built_in_a_replica_function_start_at_their_constant_values_without_compiling_a_program():
    # An optimizer's slots are built in a replica function's first step (the test above); their zeros are made on
    # the host, not by an XLA program per shape (jnp.zeros), which cost the TF guide's loop 0.1-0.2 s on its first
    # step. Other initializers run as Keras runs them.
    from keras_tpu import _keras_private

    shape = (13, 29, 3)   # a shape no other test's zeros compiled for
    constant = {"zeros": (keras.initializers.Zeros(), "float32", 0.0), "ones": ("ones", "bfloat16", 1.0),
                "constant": (keras.initializers.Constant(2.5), "float16", 2.5),
                "integer": (keras.initializers.Zeros(), "int32", 0)}
    with keras.StatelessScope(initialize_variables=False):
        variables = {name: keras.Variable(initializer=init, shape=shape, dtype=dtype, name=name)
                     for name, (init, dtype, _) in constant.items()}
    with _compile_events() as compiles:
        _keras_private.initialize_deferred_variables()
    assert compiles == []
    for name, (_, dtype, fill) in constant.items():
        value = variables[name].value
        assert isinstance(value, jax.Array) and value.dtype == jnp.dtype(dtype) and value.shape == shape
        assert np.all(np.asarray(value, "float32") == fill)
    with keras.StatelessScope(initialize_variables=False):
        drawn = keras.Variable(initializer=keras.initializers.GlorotUniform(seed=3), shape=(13, 29), name="drawn")
    _keras_private.initialize_deferred_variables()
    np.testing.assert_array_equal(drawn.numpy(), keras.initializers.GlorotUniform(seed=3)((13, 29)))
    # Nothing is left for the next scope to initialise again.
    with keras.StatelessScope():
        pass
    assert np.all(np.asarray(variables["ones"].value, "float32") == 1.0)


def test_moving_statistics_set_in_strategy_run_are_the_cores_mean():
    """BatchNormalization's moving statistics, updated by every replica on its own rows in strategy.run, read
    as their mean over the replicas (TensorFlow's variables synchronised on read, MEAN), not one core's."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 2)) * 2 + np.arange(64)[:, None] / 8).astype("float32")  # rows differ by core
    strategy = keras_tpu.TPUStrategy(precision="highest")
    with strategy.scope():
        layer = keras.layers.BatchNormalization(momentum=0.5)
        model = keras.Sequential([keras.Input((2,)), layer])
    (batch,) = strategy.experimental_distribute_dataset([x])
    strategy.run(lambda rows: model(rows, training=True), args=(batch,))
    cores = x.reshape(8, 8, 2)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * 0 + 0.5 * cores.mean(axis=1).mean(axis=0),
                               rtol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 0.5 * 1 + 0.5 * cores.var(axis=1).mean(axis=0),
                               rtol=1e-5)


def test_a_consumed_generator_says_what_to_do(caplog):
    strategy = keras_tpu.TPUStrategy()
    generator = strategy.experimental_distribute_dataset(np.ones((16, 2)) for _ in range(3))
    assert len(list(generator)) == 3
    with caplog.at_level(logging.WARNING, logger="keras_tpu"):
        assert list(generator) == []  # as a Python generator: consumed by the first epoch
    assert "one-shot iterator" in caplog.text


def test_strategy_run_inside_jax_jit_refuses_to_update_variables():
    """@tf.function around strategy.run ports as jax.jit: a replica function that only computes runs inside it,
    but one that updates Keras variables (an optimizer's step) would leave traced values in them."""
    strategy = keras_tpu.TPUStrategy(precision="highest")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.1)
    x = np.ones((16, 4), "float32")
    before = [w.copy() for w in model.get_weights()]

    def train_step(features):
        grads = jax.grad(lambda trainable: keras.ops.sum(model.stateless_call(trainable, [], features)[0]))(
            [v.value for v in model.trainable_variables])
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return features

    @jax.jit
    def step(stacked):
        return strategy.run(train_step, args=(keras_tpu.PerReplica(stacked),))

    (batch,) = strategy.experimental_distribute_dataset([x])
    with pytest.raises(RuntimeError, match="Call strategy.run outside jax.jit"):
        step(batch.stacked)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    total = jax.jit(lambda stacked: strategy.reduce(
        "SUM", strategy.run(lambda rows: keras.ops.sum(rows * 2), args=(keras_tpu.PerReplica(stacked),)), axis=None))
    assert float(total(batch.stacked)) == 2 * x.sum()
    # A PerReplica is a JAX pytree: it passes into jax.jit and comes out of it whole.
    doubled = jax.jit(lambda value: strategy.run(lambda rows: rows * 2, args=(value,)))(batch)
    assert isinstance(doubled, keras_tpu.PerReplica)
    np.testing.assert_array_equal(np.concatenate(doubled.values), 2 * x)


@pytest.mark.parametrize("regularized", [False, True])
def test_the_tpu_guides_replica_step_compiles_once_and_trains_as_the_cpu(regularized):
    """TensorFlow's "Use TPUs" guide writes its replica function inside the step function (``@tf.function``
    traced it once); ported, a new ``step_fn`` is defined on every step. It runs one compiled program, computes
    the cores' weight gradients without a per-core copy of a Dense kernel's gradient or a grouped convolution
    (each core's convolution gradient in turn, the Dense gradients one product over all rows), and trains as
    plain Keras does on the global batch. The guide's model regularizes its kernels (``L2``, each replica's
    share of the model's losses added to its loss): a kernel's gradient is then its rows' product plus the
    regularizer's, and still no per-core copy."""
    strategy = keras_tpu.TPUStrategy(precision="highest")
    rng = np.random.default_rng(0)
    x, y = rng.random((4 * 64, 12, 12, 1), dtype=np.float32), rng.integers(0, 10, 4 * 64)
    regularizer = (lambda: keras.regularizers.L2(1e-2)) if regularized else (lambda: None)

    def create_model():
        keras.utils.set_random_seed(3)
        return keras.Sequential([
            keras.Input((12, 12, 1)), keras.layers.Conv2D(4, 3, activation="relu", kernel_regularizer=regularizer()),
            keras.layers.Flatten(), keras.layers.Dense(32, activation="relu", kernel_regularizer=regularizer()),
            keras.layers.Dense(10, kernel_regularizer=regularizer())])

    with strategy.scope():
        model = create_model()
        optimizer = keras.optimizers.SGD(0.5)

    def train_step(inputs):
        def step_fn(inputs):
            images, labels = inputs

            def loss_of(trainable):
                logits, _, losses = model.stateless_call(trainable, [], images, training=True, return_losses=True)
                per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
                # tf.nn.compute_average_loss(global_batch_size=64), tf.nn.scale_regularization_loss
                return keras.ops.sum(per_example) / 64 + sum(losses) / strategy.num_replicas_in_sync

            loss, grads = jax.value_and_grad(loss_of)([v.value for v in model.trainable_variables])
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.reduce("SUM", strategy.run(step_fn, args=(inputs,)))

    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, len(x), 64)]
    losses = [float(train_step(batch)) for batch in strategy.experimental_distribute_dataset(batches)]
    (program,) = strategy._run_programs.values()  # one program for the four steps

    cpu = create_model()
    cpu_optimizer = keras.optimizers.SGD(0.5)
    cpu_losses = []
    for images, labels in batches:
        def loss_of(trainable):
            logits, _, losses = cpu.stateless_call(trainable, [], images, training=True, return_losses=True)
            return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)) \
                + sum(losses)
        loss, grads = jax.value_and_grad(loss_of)([v.value for v in cpu.trainable_variables])
        cpu_optimizer.apply_gradients(zip(grads, cpu.trainable_variables))
        cpu_losses.append(float(loss))
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-5)
    assert_weights_close(model.get_weights(), cpu.get_weights(), atol=1e-5)

    sharded = [strategy._rows_by_replica(part.stacked)
               for part in next(iter(strategy.experimental_distribute_dataset(batches[:1])))]
    jaxpr = jax.make_jaxpr(program.nested_program)([v.value for v in program.variables], [], sharded)
    products = [o.eqn for o in rewrite.walk(jaxpr, lambda e: e.primitive.name.startswith("mxu_"))]
    dots = [tuple(e.outvars[0].aval.shape) for e in products if e.primitive.name == "mxu_dot_general"]
    for kernel in (model.layers[2].kernel, model.layers[3].kernel):  # the gradient, in either orientation
        either = (tuple(kernel.shape), tuple(kernel.shape)[::-1])
        assert any(shape in dots for shape in either) and not any((8,) + shape in dots for shape in either), dots
    convs = [e for e in products if e.primitive.name == "mxu_conv"]
    assert convs and all(e.params["feature_group_count"] == 1 and e.params["batch_group_count"] == 1 for e in convs)


def test_a_replica_function_given_the_same_inputs_on_every_core(strategy):
    """The guide's ``strategy.run(tf.matmul, args=(a, b))``: no per-replica argument, every core computes the same."""
    a = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], "float32")
    b = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "float32")
    z = strategy.run(keras.ops.matmul, args=(a, b))
    assert z.num_replicas == 8
    for value in z.values:
        np.testing.assert_allclose(value, a @ b, rtol=1e-6)


def test_a_replica_function_defined_anew_reuses_its_program_only_while_it_reads_the_same_objects(strategy):
    (batch,) = strategy.experimental_distribute_dataset([np.ones((16, 2), "float32")])

    def scaled_by(scale):
        return lambda rows: rows * scale

    first, second = (strategy.run(scaled_by(np.float32(s)), args=(batch,)) for s in (2.0, 3.0))
    assert float(strategy.reduce("SUM", first, axis=0).sum()) == 64.0
    assert float(strategy.reduce("SUM", second, axis=0).sum()) == 96.0  # not the first program's constant
    scale = np.float32(5.0)
    for _ in range(3):
        strategy.run(scaled_by(scale), args=(batch,))
    assert len(strategy._run_programs) == 3


def test_a_replica_function_that_would_not_fit_a_core_fails_before_it_runs(monkeypatch, caplog):
    """strategy.run checks one core's replica function against a core's HBM before its program first runs, as a
    TPU's compiler does: a training step through a 32,768-wide layer at 65,536 rows per replica (~10 GiB) fails
    with the TPU's error and leaves the variables as they were (one replica, so that a regression could not
    allocate eight times that here); at 64 rows the same function trains, its footprint logged."""
    monkeypatch.delenv(hbm.IGNORE_HBM_ENV, raising=False)
    caplog.set_level(logging.INFO, logger="keras_tpu")
    resolver = keras_tpu.TPUClusterResolver()
    topology = keras_tpu.initialize_tpu_system(resolver)
    strategy = keras_tpu.TPUStrategy(resolver, experimental_device_assignment=keras_tpu.DeviceAssignment.build(
        topology, num_replicas=1))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(32768, activation="relu"),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
    before = model.get_weights()

    def train_step(inputs):
        features, targets = inputs

        def loss_of(trainable):
            predicted, _ = model.stateless_call(trainable, [v.value for v in model.non_trainable_variables], features)
            return keras.ops.mean((predicted - targets) ** 2)

        loss, grads = jax.value_and_grad(loss_of)([v.value for v in model.trainable_variables])
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x = np.ones((65536, 4), "float32")
    too_large = next(iter(strategy.experimental_distribute_dataset([(x, x[:, :1])])))
    with pytest.raises(keras_tpu.ResourceExhaustedError,
                       match=r"The replica function 'train_step' needs .* a v2-8 core has 8\.00 GiB") as raised:
        strategy.run(train_step, args=(too_large,))
    assert "dense" in str(raised.value) and raised.value.footprint.total_bytes > 8 * 2**30
    assert int(optimizer.iterations.value) == 0
    for kept, was in zip(model.get_weights(), before):
        np.testing.assert_array_equal(kept, was)
    fits = next(iter(strategy.experimental_distribute_dataset([(x[:64], x[:64, :1])])))
    strategy.run(train_step, args=(fits,))
    assert int(optimizer.iterations.value) == 1
    assert "replica function 'train_step' needs 0.0 of 8.0 GiB HBM per core" in caplog.text


def test_distributed_batches_unpack_iterate_and_print_as_tensorflows(strategy):
    """The TF "Distributed input" tutorial's ways with a distributed dataset: an element is the batch's structure
    with a PerReplica at each leaf; iterators have get_next, get_next_as_optional and element_spec; a dataset's
    element_spec leaves a generator's first batch for the loop; PerReplica prints each replica's part."""
    x, y = np.arange(20, dtype=np.float32).reshape(10, 2), np.arange(10)
    dataset = strategy.experimental_distribute_dataset([(x[:8], y[:8]), (x[8:], y[8:])])
    features, labels = next(iter(dataset))
    assert labels.values[3].tolist() == [3] and features.values[3].tolist() == [[6.0, 7.0]]
    assert dataset.element_spec[0].shape == (1, 2) and dataset.element_spec[1].dtype == y.dtype
    iterator, seen = iter(dataset), []
    assert iterator.element_spec[1].shape == (1,)   # (peeks: the element is still the next one)
    while True:
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        seen.append(strategy.gather(strategy.run(lambda f, l: f[:, 0] + l, args=optional.get_value()), axis=0))
    np.testing.assert_array_equal(np.concatenate(seen), x[:, 0] + y)
    assert seen[1].shape == (2,)  # the partial batch: two replicas of one row, the rest none
    with pytest.raises(keras_tpu.OutOfRangeError, match="End of sequence"):
        iterator.get_next()
    with pytest.raises(keras_tpu.OutOfRangeError):
        optional.get_value()
    by_name = next(iter(strategy.experimental_distribute_dataset([{"image": x[:8], "label": y[:8]}])))
    assert sorted(by_name) == ["image", "label"] and by_name["label"].values[7].tolist() == [7]
    assert repr(labels).startswith("PerReplica:{\n  0: array([0])") and "  7: array([7])\n}" in repr(labels)

    generator = strategy.experimental_distribute_dataset(x[i:i + 8] for i in (0, 8))
    assert generator.element_spec.shape == (1, 2)
    assert [batch.rows for batch in generator] == [None, (1, 1, 0, 0, 0, 0, 0, 0)]  # nothing lost to the spec
    assert dataset.reduce(0.0, lambda total, batch: total + float(strategy.reduce("SUM", batch[1], axis=0))) == 45


def test_input_options_per_replica_call_dataset_fn_once_per_replica(strategy):
    calls = []

    def dataset_fn(context):
        calls.append((context.num_input_pipelines, context.input_pipeline_id))
        return [np.full((2, 1), 10 * step + context.input_pipeline_id, np.float32) for step in range(3)]

    options = keras_tpu.InputOptions(experimental_replication_mode=keras_tpu.InputReplicationMode.PER_REPLICA)
    steps = list(strategy.distribute_datasets_from_function(dataset_fn, options))
    assert calls == [(8, replica) for replica in range(8)] and len(steps) == 3
    assert [float(part[0, 0]) for part in steps[2].values] == [20.0 + replica for replica in range(8)]
    with pytest.raises(ValueError, match="only supported in distribute_datasets_from_function"):
        strategy.experimental_distribute_dataset([np.ones((8, 1))], options)
