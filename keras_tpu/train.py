"""TensorFlow 1's ``tf.train`` optimizers, learning-rate decays and global step, as Keras 3 objects.

TF 1.x TPU code builds its optimizer from ``tf.train``: Cloud TPU's Shakespeare notebook compiles
``tf.train.RMSPropOptimizer(0.01)``, the TPUEstimator models call
``tf.train.AdamOptimizer(tf.train.exponential_decay(0.01, tf.train.get_global_step(), ...))
.minimize(loss, global_step)``. With ``tf.train`` -> ``keras_tpu.train`` that code runs unchanged:

.. code-block:: python

    from keras_tpu import train

    learning_rate = 0.0001 + train.exponential_decay(0.01, train.get_global_step(), 250, 0.5)
    optimizer = train.AdamOptimizer(learning_rate)
    if params["use_tpu"]:
        optimizer = tpu_estimator.CrossShardOptimizer(optimizer)
    train_op = optimizer.minimize(loss, train.get_global_step())

Each optimizer is a ``keras.optimizers.Optimizer`` (so ``model.compile``, ``keras_to_tpu_model``,
``TPUStrategy`` and ``CrossShardOptimizer`` take it) that updates the weights by TensorFlow 1's
own rule, as its kernel in ``tensorflow/core/kernels/training_ops.cc`` computes it, with TF 1's
arguments and defaults: where a Keras optimizer of the same name differs (Adam's epsilon 1e-8
against 1e-7, Adagrad without an epsilon, RMSProp's mean square starting at 1 with epsilon 1e-10,
momentum accumulating gradients rather than steps) the TF 1 rule is the one here. Gradients are
dense, as on a TPU, where ``CrossShardOptimizer``'s cross-core sum made an embedding's sparse
gradient dense: momentum and RMSProp also move rows that a step did not look up.

A learning rate from ``get_global_step()`` (``exponential_decay``, ``piecewise_constant``,
``polynomial_decay``, ``cosine_decay``, ``inverse_time_decay``, ``natural_exp_decay``, and ``+ - * /``
with numbers or each other) is a :class:`StepSchedule`, a Keras ``LearningRateSchedule`` of the
optimizer's step (which is the estimator's global step) that saves with the model. Other
``tf`` operations on the global step (``tf.cast``, ``tf.minimum``) have no counterpart here.
"""

import math
import numbers

import keras
from keras import ops

from keras_tpu import _validation as validation

__all__ = [
    "AdagradOptimizer", "AdamOptimizer", "GradientDescentOptimizer", "MomentumOptimizer", "RMSPropOptimizer",
    "StepSchedule", "cosine_decay", "exponential_decay", "get_global_step", "get_or_create_global_step",
    "inverse_time_decay", "natural_exp_decay", "piecewise_constant", "polynomial_decay",
]


# -- the global step and learning rates computed from it -------------------------------------------


def _float(value):
    return ops.cast(value, "float32")


def _decay_progress(step, decay_steps, staircase):
    progress = _float(step) / decay_steps
    return ops.floor(progress) if staircase else progress


def _piecewise_constant(x, boundaries, values):
    # TensorFlow's rule: values[0] while x <= boundaries[0], values[i] while boundaries[i-1] < x <= boundaries[i],
    # values[-1] after the last boundary.
    result = _float(values[-1])
    for boundary, value in reversed(list(zip(boundaries, values[:-1]))):
        result = ops.where(_float(x) <= boundary, _float(value), result)
    return result


def _polynomial_decay(learning_rate, step, decay_steps, end_learning_rate, power, cycle):
    step = _float(step)
    if cycle:
        # TensorFlow: the decay restarts every decay_steps, the first period counting from step 0.
        decay_steps = decay_steps * ops.maximum(ops.ceil(step / decay_steps), 1.0)
    else:
        step = ops.minimum(step, decay_steps)
    return (learning_rate - end_learning_rate) * (1.0 - step / decay_steps) ** power + end_learning_rate


def _cosine_decay(learning_rate, step, decay_steps, alpha):
    progress = ops.minimum(_float(step), decay_steps) / decay_steps
    return learning_rate * ((1.0 - alpha) * 0.5 * (1.0 + ops.cos(math.pi * progress)) + alpha)


# Each StepSchedule is one of these functions of its arguments (numbers, lists, or StepSchedules evaluated at the
# step first), so a schedule is a small expression that get_config can write out and from_config rebuild.
_STEP_FUNCTIONS = {
    "global_step": None,  # the step itself (StepSchedule.__call__)
    "add": lambda a, b: a + b,
    "subtract": lambda a, b: a - b,
    "multiply": lambda a, b: a * b,
    "divide": lambda a, b: a / b,
    "negative": lambda a: -a,
    "exponential_decay": lambda lr, step, decay_steps, rate, staircase:
        lr * ops.power(_float(rate), _decay_progress(step, decay_steps, staircase)),
    "inverse_time_decay": lambda lr, step, decay_steps, rate, staircase:
        lr / (1.0 + rate * _decay_progress(step, decay_steps, staircase)),
    "natural_exp_decay": lambda lr, step, decay_steps, rate, staircase:
        lr * ops.exp(-rate * _decay_progress(step, decay_steps, staircase)),
    "piecewise_constant": _piecewise_constant,
    "polynomial_decay": _polynomial_decay,
    "cosine_decay": _cosine_decay,
}


@keras.saving.register_keras_serializable(package="keras_tpu")
class StepSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A value computed from the global step: what TensorFlow 1's learning-rate tensors are here.

    Made by :func:`get_global_step` and the decay functions, and by ``+``, ``-``, ``*``, ``/`` on them
    and numbers; an optimizer given one evaluates it at its step (``optimizer.iterations``, the
    estimator's global step) before each update.

    Example:
        >>> rate = 0.0001 + exponential_decay(0.01, get_global_step(), decay_steps=100, decay_rate=0.5)
        >>> round(float(rate(200)), 6)
        0.0026
    """

    def __init__(self, function, arguments=()):
        if function not in _STEP_FUNCTIONS:
            raise ValueError(f"Unknown step function {function!r}; known: {sorted(_STEP_FUNCTIONS)}.")
        self.function = function
        self.arguments = tuple(arguments)

    def __call__(self, step):
        if self.function == "global_step":
            return _float(step)
        values = [argument(step) if isinstance(argument, StepSchedule) else argument for argument in self.arguments]
        return _STEP_FUNCTIONS[self.function](*values)

    def get_config(self):
        return {"function": self.function,
                "arguments": [keras.saving.serialize_keras_object(a) if isinstance(a, StepSchedule) else a
                              for a in self.arguments]}

    @classmethod
    def from_config(cls, config):
        arguments = [keras.saving.deserialize_keras_object(a) if isinstance(a, dict) else a
                     for a in config["arguments"]]
        return cls(config["function"], arguments)

    def __repr__(self):
        return f"StepSchedule({self.function}, {list(self.arguments)})"

    def _combine(self, function, *arguments):
        for argument in arguments:
            if not isinstance(argument, (StepSchedule, numbers.Real)):
                return NotImplemented
        return StepSchedule(function, arguments)

    def __add__(self, other): return self._combine("add", self, other)
    def __radd__(self, other): return self._combine("add", other, self)
    def __sub__(self, other): return self._combine("subtract", self, other)
    def __rsub__(self, other): return self._combine("subtract", other, self)
    def __mul__(self, other): return self._combine("multiply", self, other)
    def __rmul__(self, other): return self._combine("multiply", other, self)
    def __truediv__(self, other): return self._combine("divide", self, other)
    def __rtruediv__(self, other): return self._combine("divide", other, self)
    def __neg__(self): return StepSchedule("negative", (self,))


def get_global_step(graph=None):
    """The global step, the optimizer's step count (TensorFlow 1's ``tf.train.get_global_step``).

    In a ``TPUEstimator`` it is the estimator's global step (restored from ``model_dir``); with
    ``keras_to_tpu_model`` or ``TPUStrategy``, the optimizer's ``iterations``. Use it in the decay
    functions, in arithmetic, and as ``minimize``'s ``global_step``. ``graph`` is accepted (there is
    one step per optimizer, no graph).

    Example:
        >>> float(get_global_step()(41))
        41.0
    """
    return StepSchedule("global_step")


def get_or_create_global_step(graph=None):
    """The global step (TensorFlow 1's ``tf.train.get_or_create_global_step``); see :func:`get_global_step`.

    Example:
        >>> float((get_or_create_global_step() * 2)(3))
        6.0
    """
    return get_global_step(graph)


def _schedule(function, *arguments):
    for argument in arguments:
        if isinstance(argument, (list, tuple)) and any(isinstance(a, StepSchedule) for a in argument):
            raise TypeError(f"{function}: only the learning rate and the step may depend on the global step.")
    return StepSchedule(function, arguments)


def _positive(name, value):
    if not isinstance(value, numbers.Real) or value <= 0:
        raise ValueError(f"{name} must be a positive number; got {value!r}.")
    return value


def exponential_decay(learning_rate, global_step, decay_steps, decay_rate, staircase=False, name=None):
    """``learning_rate * decay_rate ** (global_step / decay_steps)`` (``tf.train.exponential_decay``;
    with ``staircase=True`` the exponent is rounded down).

    Example:
        >>> rate = exponential_decay(0.1, get_global_step(), decay_steps=10, decay_rate=0.5, staircase=True)
        >>> [round(float(rate(step)), 4) for step in (0, 9, 10, 25)]
        [0.1, 0.1, 0.05, 0.025]
    """
    return _schedule("exponential_decay", learning_rate, global_step, _positive("decay_steps", decay_steps),
                     decay_rate, bool(staircase))


def inverse_time_decay(learning_rate, global_step, decay_steps, decay_rate, staircase=False, name=None):
    """``learning_rate / (1 + decay_rate * global_step / decay_steps)`` (``tf.train.inverse_time_decay``).

    Example:
        >>> round(float(inverse_time_decay(0.1, get_global_step(), 10, 1.0)(10)), 4)
        0.05
    """
    return _schedule("inverse_time_decay", learning_rate, global_step, _positive("decay_steps", decay_steps),
                     decay_rate, bool(staircase))


def natural_exp_decay(learning_rate, global_step, decay_steps, decay_rate, staircase=False, name=None):
    """``learning_rate * exp(-decay_rate * global_step / decay_steps)`` (``tf.train.natural_exp_decay``).

    Example:
        >>> round(float(natural_exp_decay(0.1, get_global_step(), 10, 1.0)(10)), 4)
        0.0368
    """
    return _schedule("natural_exp_decay", learning_rate, global_step, _positive("decay_steps", decay_steps),
                     decay_rate, bool(staircase))


def piecewise_constant(x, boundaries, values, name=None):
    """``values[0]`` while ``x <= boundaries[0]``, then ``values[i]`` up to ``boundaries[i]``, then
    ``values[-1]`` (``tf.train.piecewise_constant``; ``x`` is usually the global step).

    Example:
        >>> rate = piecewise_constant(get_global_step(), [100, 200], [0.1, 0.01, 0.001])
        >>> [round(float(rate(step)), 4) for step in (100, 101, 201)]
        [0.1, 0.01, 0.001]
    """
    boundaries, values = list(boundaries), list(values)
    if len(values) != len(boundaries) + 1:
        raise ValueError(f"piecewise_constant needs one more value than boundaries; got {len(boundaries)} "
                         f"boundaries and {len(values)} values.")
    if boundaries != sorted(boundaries):
        raise ValueError(f"piecewise_constant's boundaries must increase; got {boundaries}.")
    return _schedule("piecewise_constant", x, boundaries, values)


def polynomial_decay(learning_rate, global_step, decay_steps, end_learning_rate=0.0001, power=1.0, cycle=False,
                     name=None):
    """From ``learning_rate`` to ``end_learning_rate`` over ``decay_steps`` steps along
    ``(1 - step / decay_steps) ** power`` (``tf.train.polynomial_decay``; ``cycle=True`` restarts it).

    Example:
        >>> rate = polynomial_decay(0.1, get_global_step(), 100, end_learning_rate=0.0)
        >>> [round(float(rate(step)), 4) for step in (0, 50, 150)]
        [0.1, 0.05, 0.0]
    """
    return _schedule("polynomial_decay", learning_rate, global_step, _positive("decay_steps", decay_steps),
                     end_learning_rate, power, bool(cycle))


def cosine_decay(learning_rate, global_step, decay_steps, alpha=0.0, name=None):
    """Half a cosine from ``learning_rate`` down to ``alpha * learning_rate`` over ``decay_steps``
    (``tf.train.cosine_decay``).

    Example:
        >>> rate = cosine_decay(0.1, get_global_step(), 100)
        >>> [round(float(rate(step)), 4) for step in (0, 50, 100)]
        [0.1, 0.05, 0.0]
    """
    return _schedule("cosine_decay", learning_rate, global_step, _positive("decay_steps", decay_steps), alpha)


# -- the optimizers --------------------------------------------------------------------------------


class _CallableList(list):
    def __call__(self):
        return list(self)


class _TF1Optimizer(keras.optimizers.Optimizer):
    """What every ``tf.train.Optimizer`` offers beyond Keras': ``minimize`` as the estimator's ``train_op``,
    ``get_name``, and TF 1's ``use_locking`` (accepted: updates here are never concurrent)."""

    def __init__(self, learning_rate, use_locking=False, name=None):
        if isinstance(learning_rate, numbers.Real) and learning_rate < 0:
            raise ValueError(f"{type(self).__name__}: learning_rate must not be negative; got {learning_rate}.")
        super().__init__(learning_rate=learning_rate, name=name)
        self.use_locking = use_locking

    def get_name(self):
        return self.name

    def minimize(self, loss, global_step=None, var_list=None, gate_gradients=1, aggregation_method=None,
                 colocate_gradients_with_ops=False, name=None, grad_loss=None):
        """The ``train_op`` of a ``TPUEstimatorSpec``/``EstimatorSpec``: this optimizer, which the estimator
        uses to minimise the spec's ``loss`` and whose step is the global step. ``global_step``,
        ``gate_gradients``, ``aggregation_method``, ``colocate_gradients_with_ops`` and ``name`` have no
        effect; ``var_list`` and ``grad_loss`` are refused (freeze layers with ``trainable = False``)."""
        validation.check_minimize_arguments(var_list, grad_loss)
        return self

    def compute_gradients(self, loss, var_list=None, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__}.compute_gradients: gradients are not symbolic tensors in keras_tpu. In a "
            f"model_fn return optimizer.minimize(loss) as train_op; in Keras code, model.compile(optimizer=...); "
            f"in a custom loop, take jax.grad of the loss and call apply_gradients(zip(grads, variables)).")

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Keras' ``apply_gradients`` with TF 1's arguments: ``global_step`` need not be passed (the
        optimizer counts its own steps, which are the global step), ``name`` has no effect."""
        return super().apply_gradients(grads_and_vars)

    @property
    def variables(self):
        # TF 1's Optimizer.variables() is a method, Keras' optimizer.variables a list property that Keras itself
        # reads: a list that can also be called serves both.
        return _CallableList(super().variables)

    def _slots(self):
        """``{TF 1 slot name: one optimizer variable per trainable variable}``."""
        return {}

    def get_slot_names(self):
        """TF 1's names of this optimizer's per-variable slots (``["m", "v"]`` for Adam)."""
        return sorted(self._slots())

    def get_slot(self, var, name):
        """The slot ``name`` of the trainable variable ``var`` (a ``keras.Variable``), or ``None`` if the
        optimizer has no such slot or has not been built for ``var`` yet, as in TF 1."""
        slots = self._slots().get(name)
        if not slots or not self.built:
            return None
        try:
            return slots[self._get_variable_index(var)]
        except (KeyError, AttributeError):
            return None

    def get_config(self):
        # The Keras base keys TF 1's constructors do not take (weight decay, clipping, EMA, ...) are left out.
        return {"learning_rate": super().get_config()["learning_rate"], "name": self.name,
                "use_locking": self.use_locking}

    def _slot(self, slots, variable):
        return slots[self._get_variable_index(variable)]


@keras.saving.register_keras_serializable(package="keras_tpu")
class GradientDescentOptimizer(_TF1Optimizer):
    """``tf.train.GradientDescentOptimizer``: ``var -= learning_rate * grad``.

    Example:
        >>> GradientDescentOptimizer(0.5).get_name()
        'GradientDescent'
    """

    def __init__(self, learning_rate, use_locking=False, name="GradientDescent"):
        super().__init__(learning_rate, use_locking, name)

    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, ops.cast(gradient, variable.dtype) * ops.cast(learning_rate, variable.dtype))


@keras.saving.register_keras_serializable(package="keras_tpu")
class MomentumOptimizer(_TF1Optimizer):
    """``tf.train.MomentumOptimizer``: ``accum = momentum * accum + grad; var -= learning_rate * accum``
    (with ``use_nesterov``: ``var -= learning_rate * (grad + momentum * accum)``). The accumulator
    sums gradients, not steps, so a changing learning rate scales all of it (Keras' SGD momentum
    keeps steps taken at earlier rates).

    Example:
        >>> MomentumOptimizer(0.1, momentum=0.9, use_nesterov=True).use_nesterov
        True
    """

    def __init__(self, learning_rate, momentum, use_locking=False, name="Momentum", use_nesterov=False):
        super().__init__(learning_rate, use_locking, name)
        self.momentum = momentum
        self.use_nesterov = use_nesterov

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._accumulators = self.add_optimizer_variables(var_list, "momentum")

    def _slots(self):
        return {"momentum": getattr(self, "_accumulators", None)}

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        accum = self._slot(self._accumulators, variable)
        self.assign(accum, accum * self.momentum + gradient)
        if self.use_nesterov:
            self.assign_sub(variable, gradient * lr + accum * self.momentum * lr)
        else:
            self.assign_sub(variable, accum * lr)

    def get_config(self):
        return {**super().get_config(), "momentum": self.momentum, "use_nesterov": self.use_nesterov}


@keras.saving.register_keras_serializable(package="keras_tpu")
class AdamOptimizer(_TF1Optimizer):
    """``tf.train.AdamOptimizer`` (epsilon 1e-8, in the "epsilon hat" form TF 1 computes):
    ``m += (grad - m) * (1 - beta1); v += (grad**2 - v) * (1 - beta2);
    var -= lr * sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + epsilon)``.

    Example:
        >>> AdamOptimizer().epsilon
        1e-08
    """

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-08, use_locking=False, name="Adam"):
        super().__init__(learning_rate, use_locking, name)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._m, self._v = self.add_optimizer_variables(var_list, ["m", "v"])

    def _slots(self):
        return {"m": getattr(self, "_m", None), "v": getattr(self, "_v", None)}

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        step = ops.cast(self.iterations + 1, variable.dtype)
        alpha = lr * ops.sqrt(1.0 - ops.power(self.beta2, step)) / (1.0 - ops.power(self.beta1, step))
        m, v = self._slot(self._m, variable), self._slot(self._v, variable)
        self.assign_add(m, (gradient - m) * (1.0 - self.beta1))
        self.assign_add(v, (ops.square(gradient) - v) * (1.0 - self.beta2))
        self.assign_sub(variable, (m * alpha) / (ops.sqrt(v) + self.epsilon))

    def get_config(self):
        return {**super().get_config(), "beta1": self.beta1, "beta2": self.beta2, "epsilon": self.epsilon}


@keras.saving.register_keras_serializable(package="keras_tpu")
class AdagradOptimizer(_TF1Optimizer):
    """``tf.train.AdagradOptimizer``: ``accum += grad**2; var -= learning_rate * grad / sqrt(accum)``
    (no epsilon; the accumulator starts at ``initial_accumulator_value``, which must be positive).

    Example:
        >>> AdagradOptimizer(0.05).initial_accumulator_value
        0.1
    """

    def __init__(self, learning_rate, initial_accumulator_value=0.1, use_locking=False, name="Adagrad"):
        if not initial_accumulator_value > 0:
            raise ValueError(f"initial_accumulator_value must be positive; got {initial_accumulator_value}.")
        super().__init__(learning_rate, use_locking, name)
        self.initial_accumulator_value = initial_accumulator_value

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._accumulators = self.add_optimizer_variables(
            var_list, "accumulator", initializer=keras.initializers.Constant(self.initial_accumulator_value))

    def _slots(self):
        return {"accumulator": getattr(self, "_accumulators", None)}

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        accum = self._slot(self._accumulators, variable)
        self.assign_add(accum, ops.square(gradient))
        self.assign_sub(variable, gradient * lr * ops.rsqrt(accum))

    def get_config(self):
        return {**super().get_config(), "initial_accumulator_value": self.initial_accumulator_value}


@keras.saving.register_keras_serializable(package="keras_tpu")
class RMSPropOptimizer(_TF1Optimizer):
    """``tf.train.RMSPropOptimizer``: the mean square starts at 1 (Keras' RMSprop: at 0, so its first
    steps are far larger), ``ms += (grad**2 - ms) * (1 - decay);
    mom = momentum * mom + learning_rate * grad / sqrt(ms + epsilon); var -= mom``; with ``centered``
    the mean gradient ``mg`` is tracked too and ``ms - mg**2`` takes ``ms``'s place.

    Example:
        >>> RMSPropOptimizer(0.01).decay
        0.9
    """

    def __init__(self, learning_rate, decay=0.9, momentum=0.0, epsilon=1e-10, use_locking=False, centered=False,
                 name="RMSProp"):
        super().__init__(learning_rate, use_locking, name)
        self.decay, self.momentum, self.epsilon, self.centered = decay, momentum, epsilon, centered

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._mean_squares = self.add_optimizer_variables(var_list, "rms", initializer="ones")
        self._moments = self.add_optimizer_variables(var_list, "momentum")
        self._mean_gradients = self.add_optimizer_variables(var_list, "mg") if self.centered else []

    def _slots(self):
        slots = {"rms": getattr(self, "_mean_squares", None), "momentum": getattr(self, "_moments", None)}
        return {**slots, "mg": getattr(self, "_mean_gradients", None)} if self.centered else slots

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        ms, mom = self._slot(self._mean_squares, variable), self._slot(self._moments, variable)
        self.assign_add(ms, (ops.square(gradient) - ms) * (1.0 - self.decay))
        denominator = ms
        if self.centered:
            mg = self._slot(self._mean_gradients, variable)
            self.assign_add(mg, (gradient - mg) * (1.0 - self.decay))
            denominator = ms - ops.square(mg)
        self.assign(mom, mom * self.momentum + (gradient * lr) / ops.sqrt(denominator + self.epsilon))
        self.assign_sub(variable, mom)

    def get_config(self):
        return {**super().get_config(), "decay": self.decay, "momentum": self.momentum, "epsilon": self.epsilon,
                "centered": self.centered}
