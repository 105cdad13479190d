"""The compiled programs of a model's steps: one per mode, compiled per batch shape and form, fed and run.

:class:`keras_tpu._replicated_steps.ReplicatedSteps` builds what one device
runs for a step (the train, test or predict device step); a :class:`Program`
turns it into the programs Keras' loops call, whichever step it runs. It
traces the device step in the form a batch needs, routes its operations to
the MXU (:mod:`keras_tpu._rewrite`), jits it over the core layout
(:mod:`keras_tpu._cores`), compiles it once per shape and form while one
core's step is checked against a core's HBM (:mod:`keras_tpu._hbm`), makes
the bfloat16 weight copies its products read
(:mod:`keras_tpu._rounded_weights`), and runs it, at most two calls in
flight. Two kinds:

* :class:`PaddedProgram`: Keras' own steps. ``steps_per_execution`` batches
  are stacked into one call (:mod:`keras_tpu._batching`), a partial batch
  padded to the global batch with a mask (its :class:`ProgramForm`); an
  inference program that may lay its cores either way times both on its
  first batches (:class:`LayoutTrial`).
* :class:`keras_tpu._custom_steps.UnpaddedProgram`: a model's own steps, and
  Keras' where padding rows would count. One step per call on a batch's real
  rows, in the form of the number of cores they split over.
"""

import concurrent.futures
import time
from typing import NamedTuple

import jax
import keras
import numpy as np
from keras import tree

from keras_tpu import _host as host, _pod as pod, _rewrite as rewrite, _rounded_weights
from keras_tpu._batching import BatchStacker, describe_input_shapes, same_shape_runs, unstack_outputs
from keras_tpu._cores import REPLICATED, ROWS, ProgramsInFlight, same_arrays
from keras_tpu._logging import logger
from keras_tpu.mxu import _kernels as kernels
from keras_tpu.mxu._numerics import Precision

#: How an inference program whose rows are independent lays a device's cores (see
#: ``ReplicatedSteps._cores_merged``): all their rows as one batch, or core by core in a loop.
MERGED, LOOPED = "merged", "looped"

#: Compiles programs in the background while the caller estimates their HBM footprint (see Program._executable).
_COMPILER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="keras-tpu-compile")


def compiling_in_background(lowered, *options):
    """A future of ``lowered.compile(*options)``, compiled on the compile thread: XLA compiles without holding the
    GIL, so the caller's Python (a per-core HBM estimate) runs meanwhile."""
    return _COMPILER.submit(lowered.compile, *options)


class ProgramForm(NamedTuple):
    """Which form of a mode's device step a program runs; each form is traced and compiled on its own.

    ``layout``: an inference program whose model may lay its cores either way
    runs them ``MERGED`` (one batch) or ``LOOPED`` (core by core), as its
    :class:`LayoutTrial` chose; every other program ignores it.

    ``padding_rows``: a training step that weighs batch statistics by the
    row mask, for batches with padding rows (``True``), or one that runs
    Keras' own, for batches whose every row is real and for every program
    whose steps compute no batch statistics (``False``).
    Batch normalization's training statistics must leave padding rows out:
    a step for batches with padding rows weighs each row by its mask
    (:func:`keras_tpu._keras_private.batch_statistics_of_rows`); one for
    full batches runs Keras' own statistics (``ops.moments``, to the last
    bit). Two programs, not one that branches on the mask (``lax.cond``):
    the weighted sums cost 8-9% of a step (the CIFAR-10 CNN's 1333
    against 1225 ms), and XLA compiles both branches of a ``cond`` and
    their gradients: ResNet-20's training program compiled in 3.2-3.5 s
    without them against 4.2-4.3 s, MobileNet's in 4.2-4.8 against
    5.0-5.8 s, the CIFAR CNN's in 3.2-3.3 against 3.3-4.1 s (plain Keras:
    2.5-2.8 s for ResNet-20). A fit whose batches all split evenly
    compiles one program; a partial last batch (or a batch size that does
    not divide over the cores) compiles the weighted one, once, where a
    traced step computed batch statistics
    (``ReplicatedSteps.computes_batch_statistics``): not for a frozen base
    model (keras.io's transfer learning), nor for a layer that calls its
    normalization with ``training=False``, which normalise with their moving
    statistics. Outside a program (a step traced on its own) the default,
    ``True``, is exact for any batch.

    ``real_rows``: a prediction whose batches have fewer rows than the cores
    (a text generator's one row at a time) runs, where its cores are merged,
    the model on those rows only (``0``: on every row) and returns their
    outputs alone, which Keras takes as they are (a device array, converted
    when Keras' own work after the call is done). The results are the same
    (the padding rows' outputs are dropped anyway), the work is the real
    rows'. The simulated TPU still runs every core's row (its step time
    counts them).

    Example:
        >>> ProgramForm(MERGED, padding_rows=False).describe()
        ''
        >>> ProgramForm(LOOPED, padding_rows=False).describe()
        ', cores in a loop'
        >>> ProgramForm(MERGED, padding_rows=False, real_rows=1).describe()
        ', computing its 1 real row(s)'
    """

    layout: str = MERGED
    padding_rows: bool = True
    real_rows: int = 0

    def describe(self):
        """What the compile log says of the form."""
        return ((", cores in a loop" if self.layout == LOOPED else "") +
                (", for batches with padding rows (BatchNormalization over the real rows)" if self.padding_rows
                 else "") + (f", computing its {self.real_rows} real row(s)" if self.real_rows else ""))


class LayoutTrial:
    """Chooses how an inference program lays its cores by timing both layouts on its first batches.

    For a model with convolutions and independent rows, evaluating the cores'
    rows as one batch or core by core computes the same; which runs faster
    depends on how XLA:CPU fuses the model's convolutions (see
    ``ReplicatedSteps._cores_merged``). The program's first call runs merged
    (compiled and warmed up); the calls after it follow :attr:`SCHEDULE`, each
    timed to its end (a run that compiled is not counted), and the layout with
    the faster best call is kept from then on: merged unless looped is at
    least :attr:`MARGIN` faster. Other processes only ever add to a call's
    time (on this project's shared 2-core hosts one call took from 0.6x to
    1.5x its layout's median), so a layout's fastest call says most about its
    speed, given enough calls: six each, the layouts alternating in pairs
    (merged, looped, looped, merged, ...) so that a load which comes and goes
    meets both. Replaying 80 alternating calls per model, the best of two or
    three calls each picked the faster layout in 74-78% of the windows
    (ResNet-20 and the CIFAR-10 CNN, 7-13% apart, under a test run's load),
    the best of six in 94-100%; medians did worse under load (56-79%). The
    trial stops at its first run, merged, if that took less than
    :attr:`MIN_STEP_SECONDS`: a few milliseconds cannot be timed reliably here
    (keras.io's MNIST convnet and Conv1D classifier timed faster looped in
    single runs and ran 0.78-0.87x plain Keras' speed so, against 0.95x
    merged). The batches of the trial are the user's own, and each computes
    its real result: the trial costs the looped program's compile and the
    slower layout's extra time on about half its calls.

    Example:
        >>> trial = LayoutTrial()
        >>> times = {MERGED: iter([0.26, 0.25, 0.31, 0.26, 0.27, 0.25]),
        ...          LOOPED: iter([None, 0.2, 0.21, 0.3, 0.19, 0.2])}   # None: the looped program compiled
        >>> chosen = None
        >>> while chosen is None:   # merged, looped (compiles), looped, merged, merged, looped, ...
        ...     layout = trial.layout()
        ...     chosen = trial.record(layout, next(times[layout]))
        >>> chosen, trial.best[LOOPED], trial.best[MERGED]
        ('looped', 0.19, 0.25)
    """

    SCHEDULE = (MERGED, LOOPED) + (LOOPED, MERGED, MERGED, LOOPED) * 2 + (LOOPED, MERGED)
    MARGIN = 0.03
    MIN_STEP_SECONDS = 0.05

    def __init__(self):
        self._runs = 0
        self.best = {MERGED: float("inf"), LOOPED: float("inf")}  # seconds per step

    def layout(self):
        """The layout the next call runs."""
        return self.SCHEDULE[self._runs]

    def record(self, layout, seconds_per_step):
        """Note a call's time per step (``None``: not comparable, it compiled); the chosen layout once the
        trial is over, else ``None``."""
        if seconds_per_step is not None:
            self.best[layout] = min(self.best[layout], seconds_per_step)
        self._runs += 1
        if self._runs == 1 and self.best[MERGED] < self.MIN_STEP_SECONDS:
            return MERGED
        if self._runs < len(self.SCHEDULE):
            return None
        return LOOPED if self.best[LOOPED] < (1 - self.MARGIN) * self.best[MERGED] else MERGED


class Program:
    """The compiled programs of one mode (``"train"``, ``"test"`` or ``"predict"``) of a model's steps.

    What every TPU program shares, whichever step it runs: the device step is
    traced in each form a batch needs (:meth:`_device_step`), its operations
    routed to the MXU (:mod:`keras_tpu._rewrite`) and its default-precision
    products set to read bfloat16 weight copies (:mod:`keras_tpu._rounded_weights`);
    it is jitted and compiled once per shape and form, with XLA:CPU's options
    for its kind, while one core's step is checked against a core's HBM
    (:meth:`_footprint`); the copies are made once per set of weights, or
    taken from the training step that returned them; at most two calls are in
    flight. Two kinds: :class:`PaddedProgram` (Keras' own steps, stacked,
    their partial batches padded and masked) and
    :class:`keras_tpu._custom_steps.UnpaddedProgram` (a model's own steps, or
    Keras' where padding rows would count: one step per call on real rows).
    """

    #: How the device program's arguments after the weight copies lie over the devices; the copies follow the
    #: state, replicated.
    ARGUMENT_SPECS = (REPLICATED, ROWS)

    def __init__(self, mode, builder, steps_per_execution, purpose=None):
        """``builder``: the :class:`keras_tpu._replicated_steps.ReplicatedSteps` of the model and core layout;
        ``steps_per_execution``: the batches each call of Keras' step function takes; ``purpose``: what the log
        calls the program (``mode``)."""
        self.steps = int(steps_per_execution)
        if self.steps < 1:
            raise ValueError(f"steps_per_execution must be a positive integer; got {steps_per_execution}.")
        self.mode = mode
        self.purpose = purpose or mode
        self.builder = builder
        self.layout = builder.layout
        # Default-precision products read bfloat16 copies of the weights they multiply (see
        # keras_tpu._rounded_weights), passed after the state. Evaluation and prediction do not change the weights:
        # their copies are made once per state. A training step changes them: where its products have few rows, or
        # its copies are float32 (keras_tpu._rounded_weights.TRAINING_COPIES_BELOW_ROWS), it returns the copies of
        # the weights it wrote, rounded in the optimizer update's own pass, for the next step to read (forward
        # products and input gradients alike), instead of rounding every weight again in each of its products.
        self.rounds_weights = builder.on_mxu and builder.precision is Precision.DEFAULT
        self._readings = {}  # form -> the device step reading weight copies (see _reading)
        self._jitted = {}  # (reads copies, form) -> the jitted program (see _program)
        self._executables = {}  # (the arguments' structure, shapes and dtypes; form) -> executable
        self._copies = _rounded_weights.WeightCopies()  # the bfloat16 weight copies the next call reads
        self._reads_copies = self.rounds_weights  # whether the program of the last call reads copies
        self._last_state = []  # the leaves of the state the last call returned
        self._last_call = None  # (the batch's key, executable) of the last call (see _prepared)
        self._in_flight = ProgramsInFlight(self.layout.max_programs_in_flight)

    # -- what a kind of program says ------------------------------------------------------

    def _device_step(self, form):
        """What one device runs for a step of this mode in ``form``: ``(state, *arguments) -> (logs or outputs,
        state, ...)``."""
        raise NotImplementedError

    def _over_devices(self, step_fn, returns_copies):
        """``step_fn`` (one device's program, MXU-routed) as a function of the arrays of all the layout's devices
        (``returns_copies``: it also returns weight copies, last). Itself, for a program on one device."""
        return step_fn

    def _footprint(self, args, form):
        """The per-core HBM one step of ``form`` needs for the program's ``args`` (an
        :class:`keras_tpu._hbm.HBMFootprint`), or ``None`` when not checked."""
        raise NotImplementedError

    def _log_compiled(self, args, form, seconds, footprint):
        """Say that the program for ``args`` in ``form`` compiled, in ``seconds``."""
        raise NotImplementedError

    def _hoists_loop_invariants(self, program, args):
        """Whether XLA lifts loop invariants out of the loops of ``program`` (traced for ``args``): see
        :func:`keras_tpu.mxu._kernels.hoists_loop_invariants`. Yes, unless a kind of program knows its own loops."""
        return True

    # -- the programs ----------------------------------------------------------------------

    def _reading(self, form):
        """The device step in ``form`` as it reads bfloat16 weight copies (``None`` when it reads none)."""
        if not self.rounds_weights:
            return None
        if form not in self._readings:
            self._readings[form] = _rounded_weights.reading_rounded_weights(
                self._device_step(form), self.builder.precision, training=self.mode == "train")
        return self._readings[form]

    def _program(self, copies, form):
        """The jitted program of this mode in ``form``, its products reading bfloat16 weight copies (``copies``)
        or not.

        Either way it takes ``(state, copies, *arguments)``; a training program reading copies also returns
        those of the weights it wrote, last. Both forms run the device step as traced once by
        :class:`keras_tpu._rounded_weights.ReadingRoundedWeights`.
        """
        key = copies, form
        if key in self._jitted:
            return self._jitted[key]
        reading, train, rule = self._reading(form), self.mode == "train", self.builder.rule
        if reading is None:
            device_fn = self._device_step(form)

            def step_fn(state, _no_copies, *rest):
                return device_fn(state, *rest)

            routed = rewrite.transform(step_fn, rule)
        else:
            # (the step traced once by the reading is routed as it stands, not traced again: see
            # ReadingRoundedWeights.step)
            routed = reading.step(copies, returns_copies=train,
                                  transform=lambda closed: rewrite.rewrite_closed_jaxpr(closed, rule))
        returns_copies = bool(copies) and train
        self._jitted[key] = jax.jit(self._over_devices(routed, returns_copies),
                                    donate_argnums=(0, 1) if returns_copies else 0)
        return self._jitted[key]

    def _executable(self, args, form):
        """``(executable, whether it was compiled now)`` of this mode's program in ``form`` for ``args``."""
        leaves, structure = jax.tree.flatten(args)
        signature = structure, tuple((a.shape, a.dtype) for a in leaves)
        key = signature, form
        executable = self._executables.get(key)
        if executable is not None:
            return executable, False
        started = time.perf_counter()
        # XLA compiles without holding the GIL, so the per-core HBM estimate (a Python trace of one
        # core's step) runs meanwhile: ResNet-20's first step is ready 0.7 s sooner.
        traced = self._program(self._reads_copies, form).trace(*args)
        # XLA:CPU's options on this host, for this kind of program (see keras_tpu.mxu._kernels.compiler_options).
        with kernels.lowering_mode(self.mode):   # (some kernel forms are chosen per kind of program)
            lowered = traced.lower()
        compiling = compiling_in_background(lowered, kernels.compiler_options(
            self.mode, traced.jaxpr, hoist_loop_invariants=self._hoists_loop_invariants(traced.jaxpr, args)))
        # A TPU keeps no bf16 copies. One core's step needs about the same HBM in every form: checked once per shape.
        checked = any(compiled == signature for compiled, _ in self._executables)
        footprint = None if checked else self._footprint(args, form)
        if footprint is not None:
            footprint.check()  # a program that would not fit a core's HBM fails here, as on a TPU
        executable = compiling.result()
        host.release_freed_memory()  # the compiler's scratch: the process's peak memory stays below plain Keras'
        self._executables[key] = executable
        self._log_compiled(args, form, time.perf_counter() - started, footprint)
        return executable, True

    def _prepared(self, args, form, batch_key, returned):
        """``(arguments with the weight copies, executable, whether it was compiled now)`` for a call of the
        program in ``form`` on ``args`` (``(state, *arguments)``, placed), whose batch has ``batch_key`` (its
        structure, shapes and dtypes: a cheaper key than every weight's, ~15 us per step, as a step's state has
        the shapes of the state it was given); ``returned``: the state is what the last call returned."""
        same_program = returned and self._last_call is not None and self._last_call[0] == batch_key
        if same_program:
            return (args[0], self._copies.copies) + args[1:], self._last_call[1], False
        with host.collection_paused():  # (a program may be traced and compiled: see host.collection_paused)
            if self.rounds_weights:
                self._round_weights(args, form)
            args = (args[0], self._copies.copies) + args[1:]
            # (a failure keeps the weights: see ReplicatedSteps._state_kept_on_error)
            executable, compiled = self._executable(args, form)
        self._last_call = batch_key, executable
        return args, executable, compiled

    def _round_weights(self, args, form):
        """Make the bfloat16 copies the program reads of the weights in ``args`` (see keras_tpu._rounded_weights),
        unless the copies at hand are of these weights already.

        Only weights the program's products multiply get a copy (traced abstractly once per shape, a trace the
        compile reuses), not a table that is only looked up. A new evaluate() resets the metrics but passes back
        the weights: they are rounded once per set of weights.
        """
        self._reads_copies, read, dtypes = self._reading(form).copies_to_make(
            *self.layout.device_shapes(args, (REPLICATED,) + self.ARGUMENT_SPECS[1:]), axis_env=self.layout.axis_env())
        self._copies.for_weights(jax.tree.leaves(args[0][0]), read, dtypes)

    def _run(self, executable, args):
        """Call ``executable`` on ``args``: ``(logs or outputs, state)``, the next call's weight copies kept."""
        result = self._kept_copies(executable(*args))
        self._last_state = jax.tree.leaves(result[1])
        self._in_flight.add(result[0])  # logs or outputs: the state is donated to the next call
        return result

    def _kept_copies(self, result):
        """``(outputs or logs, state)`` of a program's result; the bfloat16 copies it read, or those a training
        step returned of the weights it wrote (its last output), are kept for the next call."""
        if self.rounds_weights:
            returned = result[-1] if self.mode == "train" and self._reads_copies else None
            self._copies.returned(jax.tree.leaves(result[1][0]), returned)
        return result[:2]


class PaddedProgram(Program):
    """The programs of one mode of Keras' own step: ``steps_per_execution`` batches stacked into one call (one
    program per number of stacked steps), padded to the global batch with a mask that weighs the padding rows
    out (:mod:`keras_tpu._batching`), run on any layout, a pod's too."""

    #: How the device program's arguments (state, data, mask, real rows) lie over the devices.
    ARGUMENT_SPECS = (REPLICATED, ROWS, ROWS, REPLICATED)

    def __init__(self, mode, builder, steps_per_execution, device_fn, purpose=None):
        """``device_fn``: the builder's device step of ``mode``, ``(state, data, mask, real rows) -> (logs or
        outputs, state)`` (a training step's also returns its large gradients)."""
        super().__init__(mode, builder, steps_per_execution, purpose)
        self.stacker = BatchStacker(self.layout.num_cores, self.steps)
        self._device_fn = device_fn
        # Whether batches with padding rows run a program of their own (ProgramForm.padding_rows): until a
        # traced step shows that none of its layers computes batch statistics.
        self._padding_rows_matter = builder.padding_rows_may_matter(mode)
        # How the cores lie in an inference program that may merge them (ReplicatedSteps.layout_choices): None
        # (merged) until the LayoutTrial started after the first call has timed both, once per program.
        self._cores_layout = None
        self._trial = None
        builder.last_programs[mode] = self

    def _device_step(self, form):
        builder, device_fn = self.builder, self._device_fn

        def step_in_form(*args):
            with builder.tracing_form(form):
                return device_fn(*args)

        return step_in_form

    def _over_devices(self, step_fn, returns_copies):
        train = self.mode == "train"
        # (logs or outputs, state), a training step's gradients (see _device_train_returning_gradients) and the
        # weight copies it returns
        outputs = ((ROWS if self.mode == "predict" else REPLICATED, REPLICATED) + ((REPLICATED,) if train else ())
                   + ((REPLICATED,) if returns_copies else ()))
        return self.layout.per_device(step_fn, in_specs=(REPLICATED,) + self.ARGUMENT_SPECS, out_specs=outputs)

    def _footprint(self, args, form):
        return self.builder.hbm_footprint(self.mode, (args[0],) + args[2:], form)

    def _hoists_loop_invariants(self, program, args):
        # Its own loops: the stacked steps' (more than one) and a training step's cores' (see
        # ReplicatedSteps.trains_cores_in_a_loop); any other is the model's, its loss's or its metrics'.
        own_loops = int(args[3].shape[1] > 1) + int(self.mode == "train" and self.builder.trains_cores_in_a_loop)
        weights = sum(int(np.size(w)) for w in jax.tree.leaves(args[0][0]))
        return kernels.hoists_loop_invariants(self.mode, program, own_loops, weights)

    def _log_compiled(self, args, form, seconds, footprint):
        data, mask, real_rows = args[2:]
        steps, real = mask.shape[1], int(np.max(real_rows))
        padding = "" if real == self.stacker.global_batch else f", {real} real rows"
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        shapes = tree.map_structure(lambda a: a[:, 0], x, none_is_leaf=False)  # one step's rows
        logger.info("Compiled the TPU %s program (global batch %d%s, %d step(s) per call%s) in %.1f s; inputs "
                    "%s%s.", self.purpose, self.stacker.global_batch, padding, steps, form.describe(), seconds,
                    describe_input_shapes(shapes), "" if footprint is None else f"; {footprint.describe()}")
        self.builder.note_compiled_shape(self.mode, describe_input_shapes(shapes, rows="None"))

    def _place(self, state, stacked, returned):
        args = (state, stacked.data, stacked.mask, stacked.real_rows)
        # Per-step Python overhead counts on small models: the state the last step returned stays where it is
        # (device_put costs ~8 us per array even then) and the batch goes to the compiled program as host
        # arrays, which its C++ call places by its own input shardings.
        if returned and not pod.is_multi_worker():
            return args
        leaves = jax.tree.leaves(state)
        replicated, by_rows = self.layout.replicated_sharding(), self.layout.batch_sharding()
        # A Keras variable's value on a one-device layout's device is placed already.
        on_cores = lambda a: isinstance(a, jax.Array) and (a.sharding == replicated or
                                                           a.sharding.is_equivalent_to(replicated, a.ndim))
        state_placed = all(on_cores(a) for a in leaves)
        if not state_placed:
            logger.debug("Copying weights to the TPU cores.")
        if pod.is_multi_worker():  # each worker places only its own cores' share
            shardings = (replicated, by_rows, by_rows, replicated)
            put = lambda tree, sharding: jax.tree.map(lambda a: a if on_cores(a) and sharding == replicated
                                                      else pod.global_array(a, sharding), tree)
            return tuple(put(arg, sharding) for arg, sharding in zip(args, shardings))
        if state_placed:
            return args
        return (jax.device_put(state, replicated),) + args[1:]

    def _call(self, state, iterator):
        """Run the next ``steps_per_execution`` batches: ``[((logs or outputs, state), stacked batches)]``, one
        entry per program call, in order (batches of other shapes than the previous one's call another)."""
        batches = []
        for _ in range(self.stacker.steps):
            try:
                batches.append(next(iterator))
            except StopIteration:
                break
        if not batches:
            raise StopIteration
        if self.mode == "predict":
            batches = [(keras.utils.unpack_x_y_sample_weight(b)[0], None, None) for b in batches]
        results = []
        for run in same_shape_runs(batches):
            results.append(self._call_program(state, run))
            state = results[-1][0][1]
        return results

    def _call_program(self, state, batches):
        stacked = self.stacker.stack(batches)
        returned = same_arrays(jax.tree.leaves(state), self._last_state)  # Keras hands the state back as it is
        args = self._place(state, stacked, returned)
        layout = self._trial.layout() if self._trial is not None else self._cores_layout or MERGED
        form = ProgramForm(layout, padding_rows=self._padding_rows_matter and stacked.has_padding_rows,
                           real_rows=self._rows_to_compute(state, stacked, layout))
        batch_leaves, batch_structure = jax.tree.flatten(stacked.data)
        batch_key = batch_structure, tuple((a.shape, a.dtype) for a in batch_leaves), form
        args, executable, compiled = self._prepared(args, form, batch_key, returned)
        if compiled and not self.builder.computes_batch_statistics:
            # No layer of the traced step computes batch statistics: one program serves every batch.
            self._padding_rows_matter = False
        if not pod.is_multi_worker():
            started = time.perf_counter()
            result = self._run(executable, args)
            self._time_layout(form.layout, result, started, stacked.steps, compiled)
            return result, stacked
        try:
            return self._kept_copies(jax.block_until_ready(executable(*args))), stacked
        except Exception as error:  # a collective with a worker that is gone
            raise pod.WorkerLostError(
                f"The TPU {self.purpose} step failed because a worker of the pod stopped ({error}). Restart all "
                f"workers; training resumes from the last checkpoint.") from error

    def _rows_to_compute(self, state, stacked, layout):
        """The :attr:`ProgramForm.real_rows` of a call on ``stacked``: its real rows, for one batch of a
        prediction whose loop has fewer rows than cores, on one device, with its cores merged; else 0 (every row).

        Only such loops: a prediction at a larger batch runs its partial last batch on the program of its full
        ones, rather than compile one more for a single call.
        """
        if (self.mode != "predict" or layout != MERGED or stacked.steps != 1 or pod.is_multi_worker()
                or self.layout.cores_per_device != self.layout.num_cores
                or self.stacker.global_batch != self.layout.num_cores):
            return 0
        real = int(stacked.real_rows[0])
        if real >= self.stacker.global_batch:
            return 0
        x = keras.utils.unpack_x_y_sample_weight(stacked.data)[0]
        one_step = jax.tree.map(lambda a: a[:, 0], x)
        return real if self.builder.merges_cores_at_inference(*state, one_step) else 0

    def _time_layout(self, layout, result, started, steps, compiled):
        """Start or continue the :class:`LayoutTrial` of an inference program that may choose its cores' layout.

        Not on a pod: every worker must run the same program, and each would time its own.
        """
        if self._trial is None:
            if self._cores_layout is None and compiled and self.mode in self.builder.layout_choices:
                self._trial = LayoutTrial()  # the first call compiled and warmed the merged program
            return
        jax.block_until_ready(result)
        chosen = self._trial.record(layout, None if compiled else (time.perf_counter() - started) / steps)
        if chosen is None:
            return
        best = self._trial.best
        if best[LOOPED] != float("inf"):  # else too short to time (see LayoutTrial): merged, nothing to report
            logger.info("The TPU %s program runs its cores %s: %.0f ms per step looped, %.0f ms merged.",
                        self.purpose, "in a loop" if chosen == LOOPED else "as one batch", 1e3 * best[LOOPED],
                        1e3 * best[MERGED])
        self._cores_layout, self._trial = chosen, None

    def _kept_copies(self, result):
        """(See :meth:`Program._kept_copies`; a training step's gradients are dropped.)"""
        if self.mode == "train" and result[2]:
            # A step with large gradients of its own runs alone: a second in flight holds a second set (the
            # embedding model peaked at 538 MiB with two, 496 with one, plain Keras 512-522; as fast).
            self._in_flight.limit = 1
        return super()._kept_copies(result)

    def run_for_logs(self, state, iterator):
        (logs, state), _ = self._call(state, iterator)[-1]
        return (pod.to_host(logs) if pod.is_multi_worker() else logs), state

    def run_for_outputs(self, state, iterator):
        results = self._call(state, iterator)
        parts = [unstack_outputs(pod.to_host(outputs) if pod.is_multi_worker() else outputs, stacked)
                 for (outputs, _), stacked in results]
        outputs = parts[0] if len(parts) == 1 else tree.map_structure(lambda *a: np.concatenate(a), *parts)
        return outputs, results[-1][0][1]
