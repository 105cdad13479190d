"""``keras_tpu.train``: TensorFlow 1's ``tf.train`` optimizers, learning-rate decays and global step.

The optimizers are checked against TensorFlow 1's update rules written out in NumPy (float64) from
``tensorflow/core/kernels/training_ops.cc`` and the slot initialisers of ``tensorflow/python/training``
(RMSProp's mean square starts at 1), step by step, with a decaying learning rate; then in the
workflows TF 1 code uses them: a ``TPUEstimator`` ``model_fn`` that calls ``minimize`` on the TPU and
on the CPU, and ``keras_to_tpu_model`` against the CPU model.
"""

import keras
import numpy as np
import pytest

import keras_tpu
from keras_tpu import estimator as tpu_estimator, train

GRADIENTS = [np.array([[0.5, -1.0, 2.0], [0.0, 0.25, -3.0]]), np.array([[-0.5, 0.5, 1.0], [1.0, -2.0, 0.0]]),
             np.array([[0.1, 0.2, -0.3], [2.0, 0.0, 1.5]]), np.array([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])]
INITIAL = np.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])


def tf1_reference(rule, learning_rates, **hyper):
    """TensorFlow 1's kernels (ApplyGradientDescent, ApplyMomentum, ApplyAdam, ApplyAdagrad, ApplyRMSProp,
    ApplyCenteredRMSProp) on GRADIENTS, in float64."""
    var = INITIAL.copy()
    slots = {"accum": np.zeros_like(var), "m": np.zeros_like(var), "v": np.zeros_like(var),
             "adagrad": np.full_like(var, hyper.get("initial_accumulator_value", 0.1)),
             "ms": np.ones_like(var), "mom": np.zeros_like(var), "mg": np.zeros_like(var)}
    for t, (grad, lr) in enumerate(zip(GRADIENTS, learning_rates), start=1):
        if rule == "sgd":
            var -= lr * grad
        elif rule == "momentum":
            slots["accum"] = slots["accum"] * hyper["momentum"] + grad
            if hyper.get("use_nesterov"):
                var -= grad * lr + slots["accum"] * hyper["momentum"] * lr
            else:
                var -= slots["accum"] * lr
        elif rule == "adam":
            b1, b2, eps = hyper.get("beta1", 0.9), hyper.get("beta2", 0.999), 1e-8
            # TF 1 keeps beta1**t and beta2**t in float32 variables: 1 - 0.999f is 1.3e-5 off 0.001.
            b1_power, b2_power = (np.float32(np.float64(np.float32(b)) ** t) for b in (b1, b2))
            alpha = lr * np.sqrt(1 - np.float64(b2_power)) / (1 - np.float64(b1_power))
            slots["m"] += (grad - slots["m"]) * (1 - b1)
            slots["v"] += (grad ** 2 - slots["v"]) * (1 - b2)
            var -= slots["m"] * alpha / (np.sqrt(slots["v"]) + eps)
        elif rule == "adagrad":
            slots["adagrad"] += grad ** 2
            var -= grad * lr / np.sqrt(slots["adagrad"])
        elif rule == "rmsprop":
            rho, eps, momentum = hyper.get("decay", 0.9), hyper.get("epsilon", 1e-10), hyper.get("momentum", 0.0)
            slots["ms"] += (grad ** 2 - slots["ms"]) * (1 - rho)
            denominator = slots["ms"]
            if hyper.get("centered"):
                slots["mg"] += (grad - slots["mg"]) * (1 - rho)
                denominator = slots["ms"] - slots["mg"] ** 2
            slots["mom"] = slots["mom"] * momentum + grad * lr / np.sqrt(denominator + eps)
            var -= slots["mom"]
    return var


def run_optimizer(optimizer):
    variable = keras.Variable(INITIAL.astype("float32"))
    for grad in GRADIENTS:
        optimizer.apply_gradients([(keras.ops.convert_to_tensor(grad.astype("float32")), variable)])
    return np.asarray(variable.value)


# A learning rate that changes every step: the rules that accumulate (momentum) tell TF 1 from Keras then.
DECAYING = train.exponential_decay(0.1, train.get_global_step(), decay_steps=1, decay_rate=0.5)
DECAYING_VALUES = [0.1 * 0.5 ** step for step in range(len(GRADIENTS))]


@pytest.mark.parametrize("make, rule, hyper", [
    (lambda lr: train.GradientDescentOptimizer(lr), "sgd", {}),
    (lambda lr: train.MomentumOptimizer(lr, momentum=0.9), "momentum", {"momentum": 0.9}),
    (lambda lr: train.MomentumOptimizer(lr, 0.8, use_nesterov=True), "momentum", {"momentum": 0.8,
                                                                                  "use_nesterov": True}),
    (lambda lr: train.AdamOptimizer(lr), "adam", {}),
    (lambda lr: train.AdamOptimizer(lr, beta1=0.5, beta2=0.9), "adam", {"beta1": 0.5, "beta2": 0.9}),
    (lambda lr: train.AdagradOptimizer(lr), "adagrad", {}),
    (lambda lr: train.AdagradOptimizer(lr, initial_accumulator_value=1.0), "adagrad",
     {"initial_accumulator_value": 1.0}),
    (lambda lr: train.RMSPropOptimizer(lr), "rmsprop", {}),
    (lambda lr: train.RMSPropOptimizer(lr, decay=0.8, momentum=0.5, epsilon=1e-6, centered=True), "rmsprop",
     {"decay": 0.8, "momentum": 0.5, "epsilon": 1e-6, "centered": True}),
])
@pytest.mark.parametrize("rate", ["constant", "decaying"])
def test_each_optimizer_updates_as_tensorflow_1s_kernel(make, rule, hyper, rate):
    learning_rate, values = (0.1, [0.1] * len(GRADIENTS)) if rate == "constant" else (DECAYING, DECAYING_VALUES)
    np.testing.assert_allclose(run_optimizer(make(learning_rate)), tf1_reference(rule, values, **hyper),
                               rtol=2e-6, atol=2e-7)


def test_tf1_rules_are_not_keras_rules_of_the_same_name():
    # RMSProp's mean square starts at 1 in TF 1 (Keras: 0), momentum sums gradients (Keras: steps): the checks
    # above would pass for Keras' optimizers only if these differed by nothing.
    keras_rmsprop = run_optimizer(keras.optimizers.RMSprop(0.1, rho=0.9, epsilon=1e-10))
    assert np.max(np.abs(keras_rmsprop - tf1_reference("rmsprop", [0.1] * 4))) > 0.1
    keras_momentum = run_optimizer(keras.optimizers.SGD(DECAYING, momentum=0.9))
    assert np.max(np.abs(keras_momentum - tf1_reference("momentum", DECAYING_VALUES, momentum=0.9))) > 0.05


def test_learning_rate_arithmetic_and_decays_follow_tensorflow():
    step = train.get_or_create_global_step()
    rate = 0.0001 + train.exponential_decay(0.01, step, 2000 // 8, 1 / np.e)  # Cloud TPU's MNIST estimator
    assert float(rate(500)) == pytest.approx(0.0001 + 0.01 * np.exp(-2), rel=1e-6)
    assert float((2 * step - 1)(10)) == 19 and float((-step / 4)(10)) == -2.5 and float((1 / (step + 1))(3)) == 0.25
    staircase = train.exponential_decay(1.0, step, 10, 0.5, staircase=True)
    assert [float(staircase(s)) for s in (9, 10, 19, 20)] == [1.0, 0.5, 0.5, 0.25]
    pieces = train.piecewise_constant(step, [10, 20], [1.0, 0.5, 0.25])
    assert [float(pieces(s)) for s in (0, 10, 11, 20, 21)] == [1.0, 1.0, 0.5, 0.5, 0.25]
    polynomial = train.polynomial_decay(1.0, step, 10, end_learning_rate=0.0, power=2.0)
    assert [float(polynomial(s)) for s in (0, 5, 10, 50)] == pytest.approx([1.0, 0.25, 0.0, 0.0])
    cycling = train.polynomial_decay(1.0, step, 10, end_learning_rate=0.0, cycle=True)
    assert [float(cycling(s)) for s in (0, 10, 15)] == pytest.approx([1.0, 0.0, 0.25])  # step 15: 1 - 15/20
    assert float(train.cosine_decay(1.0, step, 10, alpha=0.2)(5)) == pytest.approx(0.6)
    assert float(train.inverse_time_decay(1.0, step, 10, 1.0, staircase=True)(19)) == pytest.approx(0.5)
    assert float(train.natural_exp_decay(1.0, step, 10, 2.0)(5)) == pytest.approx(np.exp(-1.0))
    with pytest.raises(ValueError, match="one more value than boundaries"):
        train.piecewise_constant(step, [10, 20], [1.0, 0.5])
    with pytest.raises(ValueError, match="decay_steps must be a positive number"):
        train.exponential_decay(0.1, step, 0, 0.5)
    with pytest.raises(TypeError):
        step + "1"


def test_optimizers_and_schedules_save_with_the_model(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    rate = train.piecewise_constant(train.get_global_step(), [2], [0.1, 0.01]) * 0.5
    model.compile(optimizer=train.RMSPropOptimizer(rate, momentum=0.9, centered=True), loss="mse")
    model.fit(np.ones((8, 3), "float32"), np.zeros((8, 2), "float32"), batch_size=4, epochs=2, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    optimizer = loaded.optimizer
    assert isinstance(optimizer, train.RMSPropOptimizer) and optimizer.centered and optimizer.momentum == 0.9
    assert float(optimizer.learning_rate) == pytest.approx(0.005)  # step 4: past the boundary
    for saved, restored in zip(model.optimizer.variables, optimizer.variables):
        np.testing.assert_array_equal(np.asarray(saved.value), np.asarray(restored.value))


def tf1_model_fn(features, labels, mode, params):
    """A TF 1 TPU model_fn as Cloud TPU's MNIST estimator writes it: tf.train's optimizer and decay,
    CrossShardOptimizer on the TPU only, ``train_op = optimizer.minimize(loss, global_step)``."""
    logits = keras.layers.Dense(10)(keras.layers.Rescaling(1 / 255)(keras.layers.Flatten()(features)))
    loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    if mode == tpu_estimator.ModeKeys.EVAL:
        return tpu_estimator.TPUEstimatorSpec(mode, loss=loss)
    step = train.get_global_step()
    optimizer = params["optimizer"](0.0001 + train.exponential_decay(0.05, step, 8, 0.5))
    if params["use_tpu"]:
        optimizer = tpu_estimator.CrossShardOptimizer(optimizer)
    return tpu_estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(loss, step))


@pytest.mark.parametrize("optimizer", [train.AdamOptimizer, train.RMSPropOptimizer,
                                       lambda lr: train.MomentumOptimizer(lr, 0.9)])
def test_a_tf1_model_fn_trains_on_the_tpu_as_on_the_cpu(tmp_path, optimizer):
    (x, y), _ = keras_tpu.datasets.mnist.load_data()
    x, y = x[:512].astype("float32"), y[:512].astype("int32")
    losses = {}
    for use_tpu in (True, False):
        config = tpu_estimator.RunConfig(model_dir=str(tmp_path / str(use_tpu)),
                                         tpu_config=tpu_estimator.TPUConfig(iterations_per_loop=4, num_shards=8),
                                         tf_random_seed=0)
        estimator = tpu_estimator.TPUEstimator(model_fn=tf1_model_fn, config=config, use_tpu=use_tpu,
                                               params={"optimizer": optimizer}, precision="highest",
                                               train_batch_size=64, eval_batch_size=64)
        estimator.train(lambda params: (x, y), max_steps=12)
        losses[use_tpu] = estimator.evaluate(lambda params: (x, y))["loss"]
        assert estimator.get_variable_value("global_step") == 12
        kernel = estimator.get_variable_value("dense/kernel")
        if use_tpu:
            tpu_kernel = kernel
    np.testing.assert_allclose(tpu_kernel, kernel, rtol=0, atol=2e-5)
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert losses[True] < 2.0  # it learned: log(10) = 2.30 at the start


def test_a_bare_tf1_optimizer_on_the_tpu_is_refused_as_tensorflow_requires(tmp_path):
    def model_fn(features, labels, mode, params):
        loss = keras.ops.mean(keras.ops.square(keras.layers.Dense(1)(features) - labels))
        return tpu_estimator.TPUEstimatorSpec(mode, loss=loss, train_op=train.AdamOptimizer().minimize(loss))
    estimator = tpu_estimator.TPUEstimator(model_fn=model_fn, model_dir=str(tmp_path), train_batch_size=16)
    with pytest.raises(ValueError, match="CrossShardOptimizer"):
        estimator.train(lambda params: (np.ones((32, 2), "float32"), np.ones((32, 1), "float32")), max_steps=1)
    with pytest.raises(ValueError, match="var_list"):
        train.AdamOptimizer().minimize(None, var_list=[])
    with pytest.raises(NotImplementedError, match="minimize"):
        train.GradientDescentOptimizer(0.1).compute_gradients(None)


def test_keras_to_tpu_model_trains_with_a_tf1_optimizer_as_the_cpu_does():
    def create():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=train.RMSPropOptimizer(learning_rate=0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(100, 20)).astype("float32"), rng.integers(0, 3, 100).astype("int32")
    cpu = create()
    cpu_history = cpu.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    tpu = keras_tpu.keras_to_tpu_model(create(), strategy=keras_tpu.TPUDistributionStrategy(precision="highest"))
    tpu_history = tpu.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(tpu_history.history["loss"], cpu_history.history["loss"], rtol=1e-5)
    for tpu_weight, cpu_weight in zip(tpu.get_weights(), cpu.get_weights()):
        np.testing.assert_allclose(tpu_weight, cpu_weight, rtol=0, atol=1e-5)


def test_tf1_optimizer_members_slots_variables_and_apply_gradients():
    optimizer = train.RMSPropOptimizer(0.1, momentum=0.5, centered=True)
    variable = keras.Variable(np.ones((2, 3), "float32"))
    assert optimizer.get_slot(variable, "rms") is None and optimizer.get_name() == "RMSProp"
    # A custom loop's call with TF 1's arguments (global_step is the optimizer's own count).
    optimizer.apply_gradients(zip([np.full((2, 3), 2.0, "float32")], [variable]), global_step=None, name="step")
    assert optimizer.get_slot_names() == ["mg", "momentum", "rms"]
    # The mean square started at 1: 0.9 * 1 + 0.1 * 2**2.
    np.testing.assert_allclose(np.asarray(optimizer.get_slot(variable, "rms").value), 1.3, rtol=1e-6)
    assert optimizer.get_slot(variable, "m") is None
    assert optimizer.get_slot(keras.Variable(np.ones(2, "float32")), "rms") is None  # not one of its variables
    assert optimizer.variables() == optimizer.variables and len(optimizer.variables) == 5  # TF 1 calls, Keras reads
    assert int(optimizer.iterations.value) == 1
    assert train.AdamOptimizer().get_slot_names() == ["m", "v"]
    assert train.GradientDescentOptimizer(0.1).get_slot_names() == []
