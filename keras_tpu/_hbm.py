"""HBM, told truthfully: how much of a TPU core's memory one step of a program needs.

A v2 core has 8 GiB of high-bandwidth memory (HBM), a v3 core 16 GiB
(:mod:`keras_tpu._accelerators`). On a TPU, a program that does not fit fails at
compile time with ``ResourceExhaustedError`` listing its largest allocations.
This host runs whatever it can hold, so this module computes what one core
would need and says so before anything runs:

>>> footprint = per_core_footprint(model, batch_size=128)          # doctest: +SKIP
>>> footprint.describe()                                           # doctest: +SKIP
'5.1 of 8.0 GiB HBM per core (v2-8)'
>>> footprint.check()    # raises ResourceExhaustedError if it does not fit   # doctest: +SKIP

**What is counted.** One core's step is traced abstractly (``jax.make_jaxpr``
on ``jax.ShapeDtypeStruct`` arguments: nothing is computed or allocated) and
its buffers are laid out over the step's program order, as XLA's buffer
assignment does after scheduling:

* the arguments: parameters, optimizer slots (Adam's ``m`` and ``v``...),
  non-trainable state and one step's batch. Each core holds its own copy of
  the replicated state. State arguments are donated (the updated weights
  reuse their buffers), so an old weight dies at its last read;
* every value the step computes, from the equation that produces it to its
  last use: the activations the forward pass keeps for the backward pass
  (JAX's autodiff residuals live from the forward op that makes them to the
  backward op that reads them), the gradients (alive until the optimizer
  update), and the temporaries in between;
* loops (``scan``/``while``) and branches as their outputs plus the peak of
  one iteration's body.

The footprint is the peak of the live bytes over the program, and the
buffers listed are those live at that peak.

**XLA's fusion (``fused=True``, the TPU estimate).** XLA fuses elementwise and
layout operations into their consumers, so most of them never get a buffer of
their own. The estimate models that: the result of an elementwise, broadcast,
reshape, convert, select or slice operation is *not materialised* (its
consumers read its inputs instead, keeping those alive) unless that would
keep more bytes alive than the result itself, or it is the result of an
expensive operation (``exp``, ``tanh``, ``erf``, ...) read more than once,
which XLA computes once and stores. Matrix products, convolutions,
reductions, gathers, scatters, random bits and the like always get a
buffer. ``fused=False`` materialises every value, as an executor without a
compiler (TensorFlow 1 graphs on a GPU) does.

**The TPU's tiled layouts (``tiled=True``).** An array of rank 2 or more is
stored in tiles over its two minor dimensions: ``(8, 128)`` for 32-bit
types, ``(16, 128)`` for 16-bit types (bfloat16, as XLA's ``T(8,128)(2,1)``:
8 x 128 tiles of pairs of rows), ``(32, 128)`` for 8-bit types and
booleans; each of the two dimensions is padded up to its tile. A rank-1
array is padded to a multiple of 1024 elements (``T(1024)``, eight 128-lane
rows) from 1024 elements up, else of 256 (``T(256)``); a scalar takes a
256-element tile. Sources: XLA's tiled-layout notation (openxla.org,
"Tiled layout"), and XLA's own TPU HLO test programs, e.g. the MNIST training
loop in ``xla/service/hlo_value_semantics_analysis_test.cc``
(``f32[784,128]{1,0:T(8,128)}``, ``f32[128]{0:T(256)}``) and layouts such as
``bf16[100,256]{1,0:T(8,128)(2,1)}`` and ``s32[2048]{0:T(1024)}`` in other
XLA tests. XLA's layout assignment also picks which two dimensions are
minor (the Cloud TPU out-of-memory example stores a convolution activation
as ``f32[128,256,896,18]{0,3,2,1:T(8,128)}``, batch minor); for rank 2 and
up the estimate takes the layout with the least padding, so it counts only
the padding no layout avoids.

**Checked against published fits** (``tests/test_hbm.py``):

* ResNet-50 trains at 128 images per core on a v2 core: MLPerf Training
  v0.5 (December 2018), Google's ``cloud_v2.8`` ResNet-50 entry, global
  batch 1024 on a v2-8 (8 cores, 8 GiB each), SGD with momentum.
* BERT-Large (24 layers, hidden 1024, 16 heads, feed-forward 4096,
  vocabulary 30522) fine-tunes on SQuAD 1.1 with ``max_seq_length=384``,
  ``train_batch_size=24`` on a v2-8 (3 sequences per core), Adam with
  weight decay: google-research/bert ``README.md``, section "SQuAD 1.1".
* The same README's "Out-of-memory issues" table (the largest batch that
  fits a 12 GB Titan X for BERT-Base and BERT-Large at sequence lengths 64
  to 512, TensorFlow 1.11, Adam) checks the same arithmetic without tiling
  and without fusion (``tiled=False, fused=False``): every published batch
  fits 12 GiB; for BERT-Base twice it does not, at every sequence length;
  for BERT-Large the estimate is 2x to 4x optimistic (TensorFlow 1.11
  without XLA also keeps clipped copies of all gradients, and more per
  example than JAX's autodiff saves).

The estimate is a model of XLA, not XLA: its buffer assignment, layouts,
fusion and rematerialisation decide the real number, usually within tens of
percent of this one.
"""

import contextlib
import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.extend import core as jex_core
from jax.extend import source_info_util

from keras_tpu import _keras_private
from keras_tpu._accelerators import GIB, accelerator_spec
from keras_tpu._rewrite import sub_jaxprs
from keras_tpu.mxu._program import split_name_stack

#: Set to 1 to run programs that exceed the accelerator's HBM anyway (see :meth:`HBMFootprint.check`).
IGNORE_HBM_ENV = "KERAS_TPU_IGNORE_HBM"

LANES = 128                # the minor tile dimension: 128 lanes of a vector register
RANK1_TILE = 1024          # rank-1 arrays of 1024 elements or more: T(1024)
SMALL_RANK1_TILE = 256     # smaller rank-1 arrays and scalars: T(256)
# A fused operation is read through its inputs when they total at most this much more than its result
# (so small operands such as BatchNormalization's statistics do not force the result into a buffer).
FUSION_SLACK = 1.25


class ResourceExhaustedError(RuntimeError):
    """A TPU program needs more HBM per core than the accelerator type has.

    Raised before the program runs, as a TPU raises it at compile time; the
    message says what is needed, what there is, the largest buffers and what
    to do. ``footprint`` is the :class:`HBMFootprint`.

    Example:
        >>> try:                                                            # doctest: +SKIP
        ...     tpu_model.fit(x, y, batch_size=8 * 4096)
        ... except keras_tpu.ResourceExhaustedError as error:
        ...     print(error.footprint.describe())   # what the step needs, against 8.0 GiB per core
    """

    def __init__(self, message, footprint=None):
        super().__init__(message)
        self.footprint = footprint


# -- the TPU's tiled layout ------------------------------------------------------------------


def _itemsize(dtype):
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes, e.g. a PRNG key (two uint32 words)
        return 8


def sublane_tile(dtype):
    """Rows per tile of an array's second-minor dimension: 8 for 32-bit types, 16 for bf16, 32 for 8-bit.

    Example:
        >>> sublane_tile("float32"), sublane_tile("bfloat16"), sublane_tile("int8"), sublane_tile("bool")
        (8, 16, 32, 32)
    """
    return 8 * max(1, 4 // _itemsize(dtype))


def tiled_shape(shape, dtype):
    """The shape an array occupies in a TPU core's HBM in XLA's default (row-major) layout.

    Its two minor dimensions are padded to whole tiles: ``(8, 128)`` for
    32-bit types, ``(16, 128)`` for bf16, ``(32, 128)`` for 8-bit types.

    Example:
        >>> tiled_shape((128, 1000), "float32"), tiled_shape((3, 3, 3, 64), "float32")
        ((128, 1024), (3, 3, 8, 128))
        >>> tiled_shape((10,), "float32"), tiled_shape((2048,), "float32"), tiled_shape((100, 10), "bfloat16")
        ((256,), (2048,), (112, 128))
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) == 0:
        return (SMALL_RANK1_TILE,)
    if len(shape) == 1:
        tile = RANK1_TILE if shape[0] >= RANK1_TILE else SMALL_RANK1_TILE
        return (max(1, math.ceil(shape[0] / tile)) * tile,)
    rows = sublane_tile(dtype)
    return shape[:-2] + (max(1, math.ceil(shape[-2] / rows)) * rows, max(1, math.ceil(shape[-1] / LANES)) * LANES)


def _layout_bytes(shape, dtype, minor):
    """Bytes of ``shape`` tiled with dimensions ``minor = (second-minor, minor)`` innermost."""
    rows, cols = shape[minor[0]], shape[minor[1]]
    rest = math.prod(d for i, d in enumerate(shape) if i not in minor)
    tile_rows = sublane_tile(dtype)
    return rest * max(1, math.ceil(rows / tile_rows)) * tile_rows * max(1, math.ceil(cols / LANES)) * LANES


def array_bytes(shape, dtype, tiled=True):
    """Bytes of an array in a TPU core's HBM, tiled (or packed, ``tiled=False``).

    Rank 0 and 1 as :func:`tiled_shape`. For rank 2 and more, XLA's layout
    assignment picks which two dimensions are minor (a convolution's batch is
    often the minor one, a matrix may be stored transposed); the estimate takes
    the layout that wastes least, so only padding no layout can avoid counts.

    Example:
        >>> array_bytes((100, 1000), "float32"), array_bytes((100, 1000), "float32", tiled=False)
        (425984, 400000)
        >>> array_bytes((1, 128), "bfloat16")                  # one 16 x 128 tile
        4096
        >>> array_bytes((128, 224, 224, 3), "float32") == 128 * 224 * 224 * 3 * 4   # width and batch minor
        True
    """
    shape = tuple(int(d) for d in shape)
    if not tiled:
        return math.prod(shape) * _itemsize(dtype)
    if len(shape) < 2:
        return math.prod(tiled_shape(shape, dtype)) * _itemsize(dtype)
    pairs = [(i, j) for i in range(len(shape)) for j in range(len(shape)) if i != j]
    return min(_layout_bytes(shape, dtype, pair) for pair in pairs) * _itemsize(dtype)


def format_bytes(n):
    """``n`` bytes in GiB, MiB or KiB.

    Example:
        >>> format_bytes(5 * 2**30 + 2**29), format_bytes(3 * 2**20), format_bytes(512)
        ('5.50 GiB', '3.0 MiB', '0.5 KiB')
    """
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


# -- the result --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer live at the step's peak."""

    name: str       # a Keras variable path, or the layer and operation that made it
    kind: str       # "parameter", "optimizer slot", "state", "input", "activation", "backward", "update", ...
    shape: tuple
    dtype: str
    bytes: int      # as laid out (tiled, unless the estimate was not)

    def __str__(self):
        dims = ",".join(str(d) for d in self.shape)
        return f"{format_bytes(self.bytes):>11s}  {self.dtype}[{dims}]  {self.kind}: {self.name}"


class HBMFootprint:
    """The per-core HBM one step needs, against what the accelerator type has.

    Attributes:
        total_bytes: the peak of the live bytes over the step.
        capacity_bytes: the accelerator type's HBM per core.
        accelerator_type: e.g. ``"v2-8"``.
        buffers: the buffers live at the peak, largest first.
        label: what was estimated (e.g. ``"train step of 'resnet50', 128 rows per core"``).

    Example:
        >>> footprint = per_core_footprint(model, batch_size=1024)     # doctest: +SKIP
        >>> print(footprint)                                           # doctest: +SKIP
    """

    def __init__(self, total_bytes, capacity_bytes, accelerator_type, buffers, label="", tiled=True, fused=True):
        self.total_bytes = int(total_bytes)
        self.capacity_bytes = int(capacity_bytes)
        self.accelerator_type = accelerator_type
        self.buffers = sorted(buffers, key=lambda b: -b.bytes)
        self.label = label
        self.tiled = tiled
        self.fused = fused

    @property
    def fits(self):
        return self.total_bytes <= self.capacity_bytes

    @property
    def fraction(self):
        """The share of the core's HBM the step needs (above 1: it does not fit)."""
        return self.total_bytes / self.capacity_bytes

    def largest(self, n=5):
        """The ``n`` largest buffers live at the peak."""
        return self.buffers[:n]

    def by_kind(self):
        """Bytes live at the peak per kind of buffer, largest first: ``{"parameter": ..., "activation": ...}``."""
        totals = {}
        for b in self.buffers:
            totals[b.kind] = totals.get(b.kind, 0) + b.bytes
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def describe(self):
        """One line for the compile log, e.g. ``"5.1 of 8.0 GiB HBM per core (v2-8)"``."""
        return (f"{self.total_bytes / GIB:.1f} of {self.capacity_bytes / GIB:.1f} GiB HBM per core"
                + (f" ({self.accelerator_type})" if self.accelerator_type else ""))

    def __str__(self):
        lines = [f"HBM per core{' of the ' + self.label if self.label else ''}: {self.describe()}"]
        lines.append("  live at the peak: " + ", ".join(f"{kind} {format_bytes(n)}"
                                                         for kind, n in self.by_kind().items()))
        lines += ["  " + str(b) for b in self.largest(10)]
        return "\n".join(lines)

    def __repr__(self):
        return f"HBMFootprint({self.describe()})"

    def error_message(self):
        """What :meth:`check` raises with: needed, available, the five largest buffers, what to do."""
        over = self.total_bytes - self.capacity_bytes
        lines = [
            f"The {self.label or 'program'} needs {format_bytes(self.total_bytes)} of HBM per TPU core; a "
            f"{self.accelerator_type or 'TPU'} core has {format_bytes(self.capacity_bytes)} "
            f"({format_bytes(over)} over). On a TPU this program fails to compile with ResourceExhaustedError.",
            "Largest buffers live at the peak:",
        ] + [f"  {b}" for b in self.largest(5)] + [
            "To fit: use a smaller batch per core (the activations grow with it); compute in bfloat16 "
            "(keras.mixed_precision.set_global_policy('mixed_bfloat16') halves the activations); use a larger "
            "accelerator type (a v3 core has 16 GiB); or an optimizer with fewer slots (SGD instead of Adam). "
            f"To run it anyway on the simulator, set {IGNORE_HBM_ENV}=1 (or pass ignore_hbm=True).",
        ]
        return "\n".join(lines)

    def check(self, ignore_hbm=None):
        """Raise :class:`ResourceExhaustedError` if the step does not fit the core's HBM.

        Args:
            ignore_hbm: True runs it anyway; None (the default) reads the
                environment variable ``KERAS_TPU_IGNORE_HBM`` (``1`` ignores).

        Returns:
            self, when it fits or is ignored.

        Example:
            >>> per_core_footprint(model, batch_size=1024).check()          # doctest: +SKIP
        """
        if ignore_hbm is None:
            ignore_hbm = ignore_hbm_setting()
        if not self.fits and not ignore_hbm:
            raise ResourceExhaustedError(self.error_message(), self)
        return self


def ignore_hbm_setting():
    """Whether ``KERAS_TPU_IGNORE_HBM`` asks to run programs that exceed the HBM.

    Example:
        >>> os.environ.get(IGNORE_HBM_ENV) is None and ignore_hbm_setting()
        False
    """
    return os.environ.get(IGNORE_HBM_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# -- buffer liveness over a jaxpr ---------------------------------------------------------------

# Operations XLA fuses into their consumers (elementwise, layout and cheap shape operations).
FUSIBLE = frozenset("""
    abs add and atan2 broadcast_in_dim cbrt ceil clamp convert_element_type copy copy_p cos cosh div eq erf erf_inv
    erfc exp exp2 expand_dims expm1 floor ge gt imag integer_pow iota is_finite le log log1p logistic lt max min mul
    ne neg nextafter not or pow real reduce_precision rem reshape round rsqrt select_n shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh slice sqrt square squeeze stop_gradient sub tan tanh
    transpose xor
""".split())
# Elementwise operations XLA does not duplicate into several consumers (it computes them once and stores them).
EXPENSIVE = frozenset("atan2 cbrt cos cosh erf erf_inv erfc exp exp2 expm1 log log1p logistic pow rsqrt sin sinh "
                       "sqrt tan tanh".split())
# Calls whose body runs once, in place: inlined into the caller's program order.
INLINE = frozenset("pjit jit closed_call core_call custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr remat "
                    "checkpoint remat2 custom_lin shard_map".split())


class _Value:
    __slots__ = ("aval", "bytes", "name", "kind", "roots", "birth", "death", "pinned", "inputs")

    def __init__(self, aval, nbytes, name, kind, birth):
        self.aval, self.bytes, self.name, self.kind = aval, nbytes, name, kind
        self.roots = None     # None: materialised; else the materialised values it is read through (fused)
        self.birth, self.death, self.pinned = birth, birth, False
        self.inputs = None    # a fusible result kept in a buffer: the buffers it could be read through


def _read(env, atom):
    return None if isinstance(atom, jex_core.Literal) else env.get(atom)


class _Liveness:
    """Program-order buffer liveness of a jaxpr (see the module docstring)."""

    def __init__(self, tiled, fused):
        self.tiled, self.fused = tiled, fused
        self.values = []
        self.extra = []       # (step, transient bytes inside a loop or branch body at that step)
        self.steps = 0

    def new_value(self, aval, name, kind, pinned=False):
        shape, dtype = tuple(getattr(aval, "shape", ())), getattr(aval, "dtype", np.float32)
        value = _Value(aval, array_bytes(shape, dtype, self.tiled), name, kind, self.steps)
        value.pinned = pinned
        self.values.append(value)
        return value

    def roots(self, value):
        return (value,) if value.roots is None else value.roots

    def pin(self, value):
        for root in self.roots(value):
            root.pinned = True

    def run(self, jaxpr, env, prefix):
        """Emit ``jaxpr``'s equations in program order; ``env`` maps its variables to values."""
        uses = {}
        for eqn in jaxpr.eqns:
            for atom in eqn.invars:
                if not isinstance(atom, jex_core.Literal):
                    uses[atom] = uses.get(atom, 0) + 1
        for atom in jaxpr.outvars:
            if not isinstance(atom, jex_core.Literal):
                uses[atom] = uses.get(atom, 0) + 2  # a result is always stored
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            stack = prefix + eqn.source_info.name_stack
            subs = sub_jaxprs(eqn)
            if name in INLINE and len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
                sub = subs[0]
                sub_env = {var: _read(env, atom) for var, atom in zip(sub.invars, eqn.invars)
                           if _read(env, atom) is not None}
                sub_env.update((var, self._fresh(var, "constant", stack, pinned=True)) for var in sub.constvars)
                self.run(sub, sub_env, stack)
                for outer, inner in zip(eqn.outvars, sub.outvars):
                    value = _read(sub_env, inner)
                    env[outer] = value if value is not None else self._fresh(outer, name, stack)
                continue
            self.steps += 1
            inputs = [v for v in (_read(env, a) for a in eqn.invars) if v is not None]
            for value in inputs:
                for root in self.roots(value):
                    root.death = max(root.death, self.steps)
            if subs:  # a loop or branch: the peak of its body on top of its inputs and outputs
                self.extra.append((self.steps, max(self._body_extra(sub) for sub in subs)))
            for var in eqn.outvars:
                out = env[var] = self._fresh(var, name, stack)
                if self.fused and name in FUSIBLE and (name not in EXPENSIVE or uses.get(var, 0) <= 1):
                    self._maybe_fuse(out, inputs)

    def _fresh(self, var, primitive, stack, pinned=False):
        scopes, transforms = split_name_stack(stack)
        layer = "/".join(scopes) or "(step)"
        kind = "constant" if primitive == "constant" else "backward" if "transpose" in transforms else "activation"
        return self.new_value(var.aval, f"{layer} ({primitive})", kind, pinned)

    def _maybe_fuse(self, out, inputs):
        """Leave ``out`` unmaterialised (read through its inputs) when that keeps no more bytes alive."""
        roots = {}
        for value in inputs:
            for root in self.roots(value):
                roots[id(root)] = root
        if sum(r.bytes for r in roots.values()) <= FUSION_SLACK * out.bytes:
            out.roots = tuple(roots.values())
        else:
            out.inputs = tuple(roots.values())

    def _end(self, value):
        return self.steps if value.pinned else value.death

    def _fused_after_all(self, value):
        """A fusible result whose inputs outlive it anyway needs no buffer (XLA fuses it into its readers)."""
        return value.inputs is not None and not value.pinned and \
            all(self._end(r) >= value.death for r in value.inputs)

    def _body_extra(self, jaxpr):
        """Bytes a loop or branch body needs beyond its inputs, at its own peak."""
        inner = _Liveness(self.tiled, self.fused)
        env = {var: inner.new_value(var.aval, "body input", "input", pinned=True) for var in jaxpr.invars}
        env.update((var, inner.new_value(var.aval, "constant", "constant", pinned=True)) for var in jaxpr.constvars)
        inputs = sum(v.bytes for v in env.values())
        inner.run(jaxpr, env, source_info_util.new_name_stack())
        for atom in jaxpr.outvars:
            value = _read(env, atom)
            if value is not None:
                inner.pin(value)
        peak, _ = inner.peak()
        return max(0, peak - inputs)

    def peak(self):
        """``(peak bytes, the values live at the peak)``."""
        last = self.steps
        materialised = [v for v in self.values if v.roots is None and not self._fused_after_all(v)]
        end = self._end
        delta = np.zeros(last + 2, dtype=np.int64)
        for v in materialised:
            delta[v.birth] += v.bytes
            delta[end(v) + 1] -= v.bytes
        live = np.cumsum(delta)[:last + 1]
        for step, extra in self.extra:
            live[step] += extra
        at = int(np.argmax(live))
        return int(live[at]), [v for v in materialised if v.birth <= at <= end(v)]


def step_footprint(step_fn, args, *, accelerator_type="v2-8", argument_names=None, argument_kinds=None,
                   donate_argnums=(0,), tiled=True, fused=True, label="", capacity_bytes=None, axis_env=None):
    """The per-core HBM footprint of one core's step ``step_fn(*args)``, traced abstractly.

    Args:
        step_fn: what one TPU core runs (e.g. a training step on one core's
            rows); any JAX-traceable function.
        args: its arguments, as arrays or ``jax.ShapeDtypeStruct`` pytrees
            (nothing is computed or allocated).
        accelerator_type: whose HBM per core is the capacity.
        argument_names, argument_kinds: optional flat lists matching
            ``jax.tree.leaves(args)``: each leaf's name (a Keras variable
            path) and kind (``"parameter"``, ``"optimizer slot"``, ...).
        donate_argnums: arguments whose buffers the outputs reuse (the
            step's state): they are freed after their last read.
        tiled, fused: the TPU's tiled layouts and XLA's fusion (module docstring).
        capacity_bytes: the HBM to compare with (default: the accelerator type's).
        axis_env: the collective axes ``step_fn`` uses, as in :func:`jax.make_jaxpr`.

    Example:
        >>> w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
        >>> x = jax.ShapeDtypeStruct((128, 1024), jnp.float32)
        >>> step = lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        >>> footprint = step_footprint(step, (w, x))
        >>> footprint.total_bytes >= array_bytes((1024, 1024), "float32") * 2
        True
    """
    spec, _ = accelerator_spec(accelerator_type)
    closed = jax.make_jaxpr(step_fn, axis_env=axis_env)(*args)
    jaxpr = closed.jaxpr
    leaves, _ = jax.tree.flatten(args)
    donated = set()
    offset = 0
    for i, arg in enumerate(args):
        count = len(jax.tree.leaves(arg))
        if i in donate_argnums:
            donated.update(range(offset, offset + count))
        offset += count
    names = (list(argument_names or []) + [None] * len(leaves))[:len(leaves)]
    kinds = (list(argument_kinds or []) + [None] * len(leaves))[:len(leaves)]
    liveness = _Liveness(tiled, fused)
    env = {}
    for i, var in enumerate(jaxpr.invars):
        env[var] = liveness.new_value(var.aval, names[i] or f"argument {i}", kinds[i] or "input",
                                      pinned=i not in donated)
    env.update((var, liveness.new_value(var.aval, "constant", "constant", pinned=True)) for var in jaxpr.constvars)
    liveness.run(jaxpr, env, source_info_util.new_name_stack())
    for atom in jaxpr.outvars:
        value = _read(env, atom)
        if value is not None:
            liveness.pin(value)  # results are live until the step ends
    peak, alive = liveness.peak()
    buffers = [Buffer(v.name, v.kind, tuple(getattr(v.aval, "shape", ())), str(getattr(v.aval, "dtype", "")),
                      v.bytes) for v in alive]
    capacity = spec.hbm_bytes_per_core if capacity_bytes is None else capacity_bytes
    return HBMFootprint(peak, capacity, accelerator_type, buffers, label, tiled, fused)


# -- Keras models ---------------------------------------------------------------------------------


@contextlib.contextmanager
def abstract_weights():
    """Build Keras models (and optimizers) inside this block without allocating their weights.

    Keras defers a variable's initialisation when it is created inside a
    ``keras.StatelessScope``; the variables keep their shapes, dtypes and
    paths but hold no values, which is all :func:`per_core_footprint` needs.
    Such a model can be estimated, not run. (Keras internals: the list of
    deferred variables is restored on exit, so a later ``StatelessScope``
    does not initialise them behind the caller's back.)

    Example:
        >>> with abstract_weights():
        ...     big = keras.Sequential([keras.Input((32768,)), keras.layers.Dense(32768)])
        >>> big.weights[0].shape
        (32768, 32768)
    """
    with _keras_private.deferred_variables_kept():
        with keras.StatelessScope(initialize_variables=False):
            yield


def _abstract(variable):
    return jax.ShapeDtypeStruct(tuple(variable.shape), variable.dtype)


def optimizer_variables(model):
    """The optimizer's variables for ``model``'s trainable weights, without allocating them.

    A built optimizer's own variables; otherwise those of an abstract copy
    (same class and configuration) built for the weights.

    Example:
        >>> model.compile(keras.optimizers.Adam(), "mse")                       # doctest: +SKIP
        >>> [v.path for v in optimizer_variables(model)][:3]                   # doctest: +SKIP
        ['adam/iteration', 'adam/learning_rate', 'adam/dense_kernel_momentum']
    """
    optimizer = model.optimizer
    if optimizer.built:
        return optimizer, list(optimizer.variables)
    copy = optimizer.__class__.from_config(optimizer.get_config())
    with abstract_weights():
        copy.build(model.trainable_variables)
    return copy, list(copy.variables)


def _input_specs(model, rows):
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError("An HBM estimate from a model needs known inputs (a functional or Sequential model "
                         "with an Input); pass x_spec.")
    specs = [jax.ShapeDtypeStruct((rows,) + tuple(t.shape[1:]), t.dtype) for t in inputs]
    return specs[0] if len(specs) == 1 else specs


def _target_specs(model, rows):
    """Targets for the compiled loss: class indices for sparse losses, else the outputs' shapes."""
    names = [str(getattr(loss, "name", loss)) for loss in keras.tree.flatten(model.loss)] if model.loss else []
    sparse = any("sparse" in name.lower() for name in names)
    specs = [jax.ShapeDtypeStruct((rows,) + tuple(t.shape[1:-1]) + (1,), jnp.int32) if sparse else
             jax.ShapeDtypeStruct((rows,) + tuple(t.shape[1:]), jnp.float32) for t in model.outputs]
    return specs[0] if len(specs) == 1 else specs


def _inference_kwargs(model):
    return {"training": False} if getattr(model, "_call_has_training_arg", False) else {}


def per_core_footprint(model, batch_size=None, *, accelerator_type="v2-8", num_cores=None, mode="train",
                       x_spec=None, y_spec=None, tiled=True, fused=True, capacity_bytes=None):
    """The HBM one TPU core needs for one training (or inference) step of a Keras model.

    Nothing is run or allocated: the step is traced on abstract arrays, so a
    model built under :func:`abstract_weights` (no weight values at all) can
    be estimated as well as an ordinary one.

    Args:
        model: a Keras model; compiled with an optimizer and a loss for ``mode="train"``.
        batch_size: the global batch, split over ``num_cores`` (default: 128 per core).
        accelerator_type: e.g. ``"v2-8"`` (8 GiB per core) or ``"v3-8"`` (16 GiB).
        num_cores: the cores sharing the batch (default: the type's, at most 8).
        mode: ``"train"`` (forward, backward and optimizer update) or ``"predict"``.
        x_spec, y_spec: one core's inputs and targets as ``jax.ShapeDtypeStruct``
            (default: from the model's inputs and outputs).
        tiled, fused: the TPU's tiled layouts and XLA's fusion (module docstring);
            ``tiled=False, fused=False`` estimates a framework without a compiler.
        capacity_bytes: the memory to compare with (default: the type's HBM per core).

    Returns:
        an :class:`HBMFootprint`; ``.check()`` raises :class:`ResourceExhaustedError`
        if the step does not fit.

    Example:
        >>> model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])
        >>> model.compile("adam", "sparse_categorical_crossentropy")
        >>> footprint = per_core_footprint(model, batch_size=1024)
        >>> footprint.fits, footprint.capacity_bytes == 8 * GIB
        (True, True)
    """
    spec, type_cores = accelerator_spec(accelerator_type)
    num_cores = num_cores or min(type_cores, 8)
    batch_size = batch_size or 128 * num_cores
    if batch_size % num_cores:
        raise ValueError(f"The global batch {batch_size} must be a multiple of the {num_cores} cores.")
    rows = batch_size // num_cores
    x_spec = x_spec if x_spec is not None else _input_specs(model, rows)
    trainable = [_abstract(v) for v in model.trainable_variables]
    non_trainable = [_abstract(v) for v in model.non_trainable_variables]
    names = [v.path for v in model.trainable_variables] + [v.path for v in model.non_trainable_variables]
    kinds = ["parameter"] * len(trainable) + ["state"] * len(non_trainable)
    what = f"{mode} step of {model.name!r}, {rows} rows per core"
    if mode == "predict":
        kwargs = _inference_kwargs(model)
        step = lambda state, x: model.stateless_call(state[0], state[1], x, **kwargs)[0]
        args = ((trainable, non_trainable), x_spec)
    elif mode == "train":
        if model.optimizer is None or not getattr(model, "compiled", False):
            raise ValueError(f"Estimating a training step needs a compiled model; compile {model.name!r} with an "
                             f"optimizer and a loss, or pass mode='predict'.")
        optimizer, slots = optimizer_variables(model)
        y_spec = y_spec if y_spec is not None else _target_specs(model, rows)
        metrics = [_abstract(v) for v in model.metrics_variables]
        names += [v.path for v in slots] + [v.path for v in model.metrics_variables]
        kinds += ["optimizer slot"] * len(slots) + ["metric"] * len(metrics)

        def step(state, x, y):
            trainable, non_trainable, slot_values, metric_values = state

            def loss_of(trainable):
                loss, (_, _, new_non_trainable, _) = model.compute_loss_and_updates(
                    trainable, non_trainable, metric_values, x, y, None, training=True,
                    optimizer_variables=slot_values)
                return loss, new_non_trainable

            (loss, new_non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
            # On a TPU the gradients are all-reduced here (in place), then applied once per core.
            new_trainable, new_slots = optimizer.stateless_apply(slot_values, grads, trainable)
            return (new_trainable, new_non_trainable, new_slots, metric_values), loss

        args = ((trainable, non_trainable, [_abstract(v) for v in slots], metrics), x_spec, y_spec)
    else:
        raise ValueError(f"mode must be 'train' or 'predict'; got {mode!r}.")
    names += [None] * (len(jax.tree.leaves(args)) - len(names))
    kinds += ["input"] * (len(jax.tree.leaves(args)) - len(kinds))
    return step_footprint(step, args, accelerator_type=f"{spec.generation}-{type_cores}", argument_names=names,
                          argument_kinds=kinds, donate_argnums=(0,), tiled=tiled, fused=fused, label=what,
                          capacity_bytes=capacity_bytes)


def _state_variables(model, mode):
    parts = [("parameter", model.trainable_variables), ("state", model.non_trainable_variables)]
    if mode == "train":
        optimizer = getattr(model, "optimizer", None)
        slots = list(optimizer.variables) if optimizer is not None and optimizer.built else []
        parts += [("optimizer slot", slots), ("metric", model.metrics_variables)]
    elif mode == "test":
        parts += [("metric", model.metrics_variables)]
    return [(kind, v) for kind, part in parts for v in part]


def state_names(model, mode="train"):
    """The Keras variable paths of a TPU program's state, in its order, for ``argument_names``.

    The state of the programs of :mod:`keras_tpu._replicated_steps`:
    ``(trainable, non_trainable, optimizer, metrics)`` in training,
    ``(trainable, non_trainable, metrics)`` in evaluation, ``(trainable,
    non_trainable)`` in prediction.

    Example:
        >>> state_names(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="m"), "predict")
        ['m/d/kernel', 'm/d/bias']
    """
    return [v.path for _, v in _state_variables(model, mode)]


def state_kinds(model, mode="train"):
    """The kinds (``"parameter"``, ``"optimizer slot"``, ...) matching :func:`state_names`."""
    return [kind for kind, _ in _state_variables(model, mode)]


def one_core_arguments(args, cores_per_device, row_argnums=(1, 2), steps_argnums=(1, 2, 3)):
    """One core's share of a device program's arguments, for :func:`step_footprint` at compile time.

    A device program on this host holds ``cores_per_device`` cores: its
    row-split arguments (the stacked batch and its mask, ``(rows, steps, ...)``)
    hold all of them and every stacked step. One core's one step has
    ``rows // cores_per_device`` rows and one step (the replicated state is
    kept whole: every TPU core holds its own copy).

    Example:
        >>> state, data = [jax.ShapeDtypeStruct((4, 4), jnp.float32)], jax.ShapeDtypeStruct((1024, 3, 32), jnp.float32)
        >>> mask, real = jax.ShapeDtypeStruct((1024, 3), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32)
        >>> one_core_arguments((state, data, mask, real), 8)[1].shape
        (128, 1, 32)
    """
    out = []
    for i, arg in enumerate(args):
        def shrink(a, i=i):
            shape = tuple(a.shape)
            if i in row_argnums and shape:
                shape = (shape[0] // cores_per_device,) + shape[1:]
                if i in steps_argnums and len(shape) > 1:
                    shape = shape[:1] + (1,) + shape[2:]
            elif i in steps_argnums and shape:
                shape = (1,) + shape[1:]
            return jax.ShapeDtypeStruct(shape, a.dtype)
        out.append(jax.tree.map(shrink, arg))
    return tuple(out)
