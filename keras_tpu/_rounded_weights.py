"""Weights the MXU reads in bfloat16, rounded once for a whole evaluation instead of in every step.

At the default precision the MXU multiplies bfloat16 values, so every step of
a float32 model rounds each weight it multiplies. Training changes the weights
every step (a training program with few rows per product, or float32 copies,
reads the copies the step before returned of the weights it wrote, see
:data:`TRAINING_COPIES_BELOW_ROWS`); evaluation and
prediction do not. Their programs therefore take,
besides the float32 state, bfloat16 copies made once for a state
(:func:`round_weights`) of the trainable weights their products multiply
(:meth:`ReadingRoundedWeights.read_weights`), and a ``dot_general`` at the
default precision that reads a weight directly multiplies the copy
(:func:`reading_rounded_weights`). A weight no such product reads gets no copy
(an embedding table that is only looked up would otherwise cost half its size
again for nothing). Everything else (a bias, an embedding
lookup, a product at ``high`` or ``highest`` precision, a convolution, whose
kernel is small and which XLA:CPU runs no faster on bfloat16 operands) reads
the float32 weight, and the state a program returns is the float32 one. The
numbers do not change: such a product rounds its operands to bfloat16 anyway.

At small batches the rounding cost as much as the product: keras.io's MNIST
MLP (784-512-512-10) at batch 32 ran a 32x784x512 product in 313 us with both
operands rounded per call against 133 us on a bfloat16 copy, and plain
float32 in 163 us (``lax.dot_general`` alone, an AMD EPYC whose native bf16
products are fast). A host whose products multiply float32 operands (the
``round_f32`` form; an Intel Xeon measured so) would convert a bfloat16 copy
back to float32 in every call: there a weight's copy is a float32 array
holding the bfloat16 values (within :data:`FLOAT32_COPIES_MAX_BYTES`), which
the MXU product is told needs no rounding (keras.io's MLP at batch 32: its
training step 1.67 -> 1.39 ms, plain Keras 1.38; its evaluation 0.77 -> 0.59
ms), and a training step reads such copies at any number of rows (see
:data:`TRAINING_COPIES_BELOW_ROWS`).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding

from keras_tpu._cores import same_arrays
from keras_tpu.mxu import _kernels as kernels
from keras_tpu.mxu._numerics import Precision, canonical_precision, op_precision, round_to_bfloat16
from keras_tpu.mxu._primitives import dot_form, reading_bf16_valued

#: A training program's products read the copies of the weights that each step returns of the weights it wrote
#: when its products reading weights have fewer rows than this; with more rows it rounds each weight in every
#: product, as the rounding is then a small part of the products' work and writing a bfloat16 copy costs as
#: much. In-process A/B, copies against rounding in every product: keras.io's MLP at batch 32 (32 rows)
#: 1.13-1.15x faster, the zoo's Transformer (16384 rows) 1.02x, the zoo's MLP at batch 1024 0.95-0.99x. A float32
#: copy (a host whose products multiply float32, see :data:`FLOAT32_COPIES_MAX_BYTES`) is read at any number of
#: rows: it spares each product reading the weight a pass that writes a rounded float32 weight, for one more
#: write in the optimizer update's own pass. Intel Xeon, in-process A/B, best of 5-10 rounds in either order,
#: training step with / without: the zoo's MLP (1024 rows) 36.4 / 37.3 ms, its embedding model 9.4 / 9.8 ms, its
#: Transformer 411 / 415 ms.
TRAINING_COPIES_BELOW_ROWS = 256

#: A weight's copy holds its bfloat16 values in a float32 array where every product reading it runs in float32 on
#: this host (the ``round_f32`` form, :func:`keras_tpu.mxu._primitives.dot_form`): a bfloat16 copy would be
#: converted back to float32 in every call, a pass over the weight. Intel Xeon (Emerald Rapids), a 784-512-512
#: forward pass in float32 / bfloat16 copies converted per call / float32 copies: 32 rows 263 / 529 / 254 us,
#: 128 rows 782 / 957 / 868 us; the zoo's MLP's evaluation step (1024 rows, in-process A/B in either order) 13.2-13.3
#: ms on float32 copies, 13.7-13.8 on bfloat16 ones. So as long as the float32 copies of all the weights together
#: take at most this many bytes (twice the bfloat16 copies': a large model keeps the smaller copies, as its memory
#: counts more).
FLOAT32_COPIES_MAX_BYTES = 256 << 20

#: ... and, for the weights products of :data:`TRAINING_COPIES_BELOW_ROWS` rows or more read, as long as their
#: float32 copies together take at most this many bytes: there a large model's copies cost more memory than the
#: passes they spare cost time. The 50.4M-parameter MLP of ``benchmarks/big_models.py`` (batch 256) trained with
#: float32 copies at a peak of 1.36 GiB and 0.357 s per step, without them 1.20 GiB and 0.347 s (plain Keras 1.13
#: GiB); the zoo's MLP holds 7 MB of copies.
FLOAT32_COPIES_AT_MANY_ROWS_MAX_BYTES = 32 << 20


def roundable(leaves):
    """Positions of the float32 arrays of two or more dimensions among ``leaves`` (kernels, not biases).

    Example:
        >>> roundable([jnp.ones((3, 4)), jnp.ones(4), jnp.ones((2, 2), "int32")])
        [0]
    """
    return [i for i, a in enumerate(leaves) if a.dtype == jnp.float32 and a.ndim >= 2]


#: Up to this many elements in all, weights are rounded on the host: compiling the rounding program for a new set
#: of shapes (0.04-0.1 s) costs more than converting them there (about 2 ms per million elements with the copy to
#: the device, against 1 ms in the compiled program): the Transformer's first evaluate() 0.09 s sooner.
HOST_ROUNDING_MAX_ELEMENTS = 1 << 22


@jax.jit
def _to_bfloat16(arrays):
    return [a.astype(jnp.bfloat16) for a in arrays]


@jax.jit
def _to_float32_copies(arrays):
    return [round_to_bfloat16(a) for a in arrays]


def round_weights(trainable, positions=None, dtypes=None):
    """Copies of the arrays of ``trainable`` (a pytree) at ``positions`` (default: every :func:`roundable` array),
    in that order, rounded to bfloat16 and held in ``dtypes`` (one per copy: bfloat16, the default, or float32).

    Example:
        >>> [a.dtype for a in round_weights([jnp.ones((3, 4)), jnp.ones(4)])]
        [dtype(bfloat16)]
        >>> round_weights([jnp.ones((3, 4)), jnp.ones((5, 2))], positions=[1])[0].shape
        (5, 2)
        >>> copy, = round_weights([jnp.full((2, 2), 1 + 2**-9)], dtypes=[jnp.float32])
        >>> copy.dtype, float(copy[0, 0])
        (dtype('float32'), 1.0)
    """
    leaves = jax.tree.leaves(trainable)
    chosen = [leaves[i] for i in (roundable(leaves) if positions is None else positions)]
    dtypes = [jnp.dtype(d) for d in dtypes] if dtypes is not None else [jnp.dtype(jnp.bfloat16)] * len(chosen)
    if sum(a.size for a in chosen) <= HOST_ROUNDING_MAX_ELEMENTS and all(
            getattr(a, "is_fully_addressable", True) for a in chosen):
        # NumPy's bfloat16 conversion rounds to nearest even, as XLA's does (and keeps NaN a NaN, silently).
        with np.errstate(invalid="ignore"):
            host = [np.asarray(a).astype(jnp.bfloat16).astype(d) for a, d in zip(chosen, dtypes)]
        # Where the weights lie on a core layout, so do the copies; else JAX places them, uncommitted, as it would a
        # program's result, so that the program they go to decides its outputs' placement by its own shardings.
        return [jax.device_put(h, a.sharding if isinstance(getattr(a, "sharding", None), NamedSharding) else None)
                for h, a in zip(host, chosen)]
    in_float32 = [d == jnp.float32 for d in dtypes]
    made = iter(_to_float32_copies([a for a, f in zip(chosen, in_float32) if f]) if any(in_float32) else [])
    made_bf16 = iter(_to_bfloat16([a for a, f in zip(chosen, in_float32) if not f]) if not all(in_float32) else [])
    return [next(made) if f else next(made_bf16) for f in in_float32]


def _signature(leaves):
    """What a trace of a function depends on: each argument's shape, dtype and weak type."""
    return tuple((tuple(a.shape), jnp.dtype(a.dtype), bool(getattr(a, "weak_type", False))) for a in leaves)


class ReadingRoundedWeights:
    """``fn(state, *rest)`` as ``fn(state, rounded, *rest)``, its default-precision products reading ``rounded``.

    ``state[0]`` holds the trainable weights. Every ``dot_general`` at the top
    level of ``fn``'s program that runs at the default precision (the op asks
    for none higher and ``precision`` is ``"default"``) and takes one of those
    weights as an operand takes its bfloat16 copy instead; the result keeps its
    float32 type. Products inside nested programs (a ``scan`` body, say) keep
    reading the float32 weight, and so does everything that is not such a
    product (an embedding lookup, a convolution): :meth:`read_weights` says
    which weights get a copy, and ``rounded`` is
    ``round_weights(state[0], read_weights(...))``. A weight no product reads
    (a 100,000-row embedding table, say) costs no copy.

    ``fn`` is traced once per signature of its arguments, by :meth:`read_weights`
    (abstractly, before the program is compiled) or by the first call; a call
    with the same shapes reuses that trace, and so does :meth:`without_copies`,
    the same program multiplying the float32 weights.

    Example:
        >>> f = reading_rounded_weights(lambda state, x: x @ state[0][0] + state[0][1].sum())
        >>> w, table = jnp.full((3, 2), 1 / 3), jnp.ones((10, 4))
        >>> f.read_weights(([w, table],), jnp.ones((1, 3)))
        [0]
        >>> f(([w, table],), round_weights([w, table], [0]), jnp.ones((1, 3))).dtype
        dtype('float32')
    """

    def __init__(self, fn, precision="default", training=False):
        self.fn = fn
        self.default = canonical_precision(precision)
        self.training = training
        # argument signature -> (closed jaxpr, output structure, positions of the weights read as copies, the copies'
        # dtypes)
        self._traces = {}

    def _trace(self, state, rest, axis_env=None):
        leaves = jax.tree.leaves((state, *rest))
        key = jax.tree.structure((state, *rest)), _signature(leaves)
        if key not in self._traces:
            closed, out_shape = jax.make_jaxpr(self.fn, axis_env=axis_env, return_shape=True)(state, *rest)
            weights = closed.jaxpr.invars[:len(jax.tree.leaves(state[0]))]  # the program's first inputs
            candidates = set(weights[i] for i in roundable([v.aval for v in weights]))
            rows = {}  # weight -> the fewest rows of a product reading it
            in_float32 = {}  # weight -> whether every product reading it multiplies float32 operands on this host
            for eqn in closed.jaxpr.eqns:
                if _multiplies_a_copy(eqn, self.default):
                    for side, v in enumerate(eqn.invars[:2]):
                        if isinstance(v, jex_core.Var) and v in candidates:
                            rows[v] = min(rows.get(v, math.inf), _product_rows(eqn, 1 - side))
                            form = dot_form(*(u.aval for u in eqn.invars[:2]), eqn.params["dimension_numbers"],
                                            bf16_valued=tuple(i == side for i in range(2)))
                            in_float32[v] = in_float32.get(v, True) and kernels.operand_dtype(form) == jnp.float32
            positions = [i for i, v in enumerate(weights) if v in rows]
            read = [weights[i] for i in positions]
            chosen, dtypes = _copies_read(read, [rows[v] for v in read], [in_float32[v] for v in read], self.training)
            positions = [positions[i] for i in chosen]
            self._traces[key] = closed, jax.tree.structure(out_shape), positions, dtypes
        return self._traces[key]

    def read_weights(self, state, *rest, axis_env=None):
        """Positions in ``jax.tree.leaves(state[0])`` of the weights whose copies the program reads.

        The arguments may be ``jax.ShapeDtypeStruct`` pytrees (nothing is
        computed); ``axis_env`` names the collective axes ``fn`` uses, as in
        :func:`jax.make_jaxpr`.
        """
        return self._trace(state, rest, axis_env)[2]

    def copies_to_make(self, state, *rest, axis_env=None):
        """``(reads copies, positions, dtypes)``: whether the program should read copies, of which weights, and
        what each copy holds its bfloat16 values in.

        Inference reads copies of every weight its products multiply. A
        training step (``training``) reads them where its products that read a
        weight have fewer than :data:`TRAINING_COPIES_BELOW_ROWS` rows; with
        more, only the float32 copies (else ``(False, [], [])``): rounding a
        weight costs a pass over it, its products that pass times their rows.
        A copy is a float32 array where each product reading it multiplies
        float32 operands on this host (within :data:`FLOAT32_COPIES_MAX_BYTES`
        and :data:`FLOAT32_COPIES_AT_MANY_ROWS_MAX_BYTES`), else a bfloat16 one.
        """
        _, _, positions, dtypes = self._trace(state, rest, axis_env)
        return bool(positions), positions, dtypes

    def without_copies(self, state, *rest, transform=None):
        """``fn(state, *rest)`` itself, from the same trace: its products read the float32 weights. ``transform``
        (``ClosedJaxpr -> ClosedJaxpr``, as :meth:`step` takes) rewrites the traced program first."""
        closed, out_structure = self._trace(state, rest)[:2]
        return _evaluated(closed, out_structure, jax.tree.leaves((state, *rest)), transform)

    def step(self, copies, returns_copies=False, transform=None):
        """``(state, rounded, *rest) -> fn's outputs``, its products reading ``rounded`` (``copies``) or the
        float32 weights (``rounded`` is then ``[]``). With ``returns_copies`` (a training step, whose second output
        holds the weights it wrote, as ``state`` does) it also returns the copies of those for the next step.

        ``transform`` (``ClosedJaxpr -> ClosedJaxpr``; the MXU's routing,
        say) rewrites the program traced once before it runs: the step is
        then not traced again to be rewritten (ResNet-20's training step is a
        0.1 s trace).
        """
        if not copies:
            return lambda state, _no_copies, *rest: self.without_copies(state, *rest, transform=transform)

        def reading_copies(state, rounded, *rest):
            return self(state, rounded, *rest, transform=transform)

        if not returns_copies:
            return reading_copies

        def training_step(state, rounded, *rest):
            outputs = reading_copies(state, rounded, *rest)
            weights = jax.tree.leaves(outputs[1][0])
            return (*outputs, [weights[i].astype(jnp.bfloat16).astype(copy.dtype)
                               for i, copy in zip(self.read_weights(state, *rest), rounded)])

        return training_step

    def __call__(self, state, rounded, *rest, transform=None):
        closed, out_structure, positions = self._trace(state, rest)[:3]
        if len(rounded) != len(positions):
            raise ValueError(f"The program reads bfloat16 copies of {len(positions)} weights (positions {positions} "
                             f"of state[0]); got {len(rounded)}: pass round_weights(state[0], read_weights(...)).")
        jaxpr = closed.jaxpr
        weights = jaxpr.invars[:len(jax.tree.leaves(state[0]))]
        copies = [jex_core.Var(jax.core.ShapedArray(weights[i].aval.shape, copy.dtype))
                  for i, copy in zip(positions, rounded)]
        copy_of = {weights[i]: copy for i, copy in zip(positions, copies)}
        eqns = [_reading_copies(eqn, copy_of, self.default) for eqn in jaxpr.eqns]
        reading = closed.replace(jaxpr=jaxpr.replace(invars=jaxpr.invars + copies, eqns=eqns))
        return _evaluated(reading, out_structure, jax.tree.leaves((state, *rest)) + list(rounded), transform)


def _evaluated(closed, out_structure, flat_args, transform=None):
    """The outputs of the program ``closed`` (rewritten by ``transform`` first, if given) on ``flat_args``."""
    if transform is not None:
        closed = transform(closed)
    return jax.tree.unflatten(out_structure, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat_args))


class WeightCopies:
    """The bfloat16 copies a program's products read, kept between its calls.

    They are made from a state's weights when those are new
    (:meth:`for_weights`) and taken from a training step's results when it
    returns those of the weights it wrote (:meth:`returned`).

    Example:
        >>> copies, w = WeightCopies(), [jnp.ones((3, 4))]
        >>> first = copies.for_weights(w, [0])
        >>> copies.returned(w)   # the program handed the same weights back
        >>> copies.for_weights(w, [0]) is first
        True
    """

    def __init__(self):
        self.copies = []  # bfloat16 copies of the weights at positions _read of _of
        self._of = []
        self._read = None

    def for_weights(self, weights, read, dtypes=None):
        """The copies at positions ``read`` of ``weights`` (a list of arrays), in ``dtypes`` (default bfloat16, see
        :func:`round_weights`): those at hand if they are of these very arrays, else new ones."""
        dtypes = [jnp.dtype(d) for d in dtypes] if dtypes is not None else [jnp.dtype(jnp.bfloat16)] * len(read)
        if (read, dtypes) != self._read or not same_arrays(weights, self._of):
            self.copies, self._read = round_weights(weights, read, dtypes), (list(read), dtypes)
            self._of = list(weights)
        return self.copies

    def returned(self, weights, copies=None):
        """A call returned ``weights`` (a list of arrays), with ``copies`` of them from a training step; an
        inference program returns its weights unchanged (new arrays), whose copies are those at hand."""
        if copies is not None:
            self.copies = list(copies)
        self._of = list(weights)


def reading_rounded_weights(fn, precision="default", training=False):
    """``fn(state, *rest)`` as ``fn(state, rounded, *rest)``: a :class:`ReadingRoundedWeights` (``training``: of a
    training step, which returns its state).

    Example:
        >>> f = reading_rounded_weights(lambda state, x: x @ state[0][0])
        >>> w = jnp.full((3, 2), 1 / 3)
        >>> f(([w],), round_weights([w]), jnp.ones((1, 3))).dtype
        dtype('float32')
    """
    return ReadingRoundedWeights(fn, precision, training)


def _copies_read(weights, rows, in_float32, training):
    """``(indices, dtypes)``: which of ``weights`` (avals; each read by products of at least ``rows`` rows, all of
    them multiplying float32 operands on this host where ``in_float32``) a program reads as copies, and in what
    dtype (see :data:`TRAINING_COPIES_BELOW_ROWS`, :data:`FLOAT32_COPIES_MAX_BYTES` and
    :data:`FLOAT32_COPIES_AT_MANY_ROWS_MAX_BYTES`)."""
    many_rows = [r >= TRAINING_COPIES_BELOW_ROWS for r in rows]
    float32_bytes = lambda chosen: sum(4 * w.aval.size for w, c in zip(weights, chosen) if c)
    if float32_bytes(in_float32) > FLOAT32_COPIES_MAX_BYTES:
        in_float32 = [False] * len(weights)
    if float32_bytes([f and m for f, m in zip(in_float32, many_rows)]) > FLOAT32_COPIES_AT_MANY_ROWS_MAX_BYTES:
        in_float32 = [f and not m for f, m in zip(in_float32, many_rows)]
    dtypes = [jnp.dtype(jnp.float32 if f else jnp.bfloat16) for f in in_float32]
    indices = list(range(len(weights)))
    if training and all(many_rows):
        # Many rows: only float32 copies pay (see TRAINING_COPIES_BELOW_ROWS).
        indices = [i for i in indices if dtypes[i] == jnp.float32]
    return indices, [dtypes[i] for i in indices]


def _product_rows(eqn, operand):
    """The free size of operand ``operand`` (0: lhs, 1: rhs) of a ``dot_general``: its rows in the product."""
    (contracting, batch) = (axes[operand] for axes in eqn.params["dimension_numbers"])
    shape = eqn.invars[operand].aval.shape
    return math.prod(d for i, d in enumerate(shape) if i not in contracting and i not in batch)


def _multiplies_a_copy(eqn, default):
    """Whether ``eqn`` is a default-precision float32 product, which may multiply a weight's bfloat16 copy."""
    if eqn.primitive is not lax.dot_general_p:
        return False
    if op_precision(eqn.params.get("precision"), default) is not Precision.DEFAULT:
        return False
    return eqn.outvars[0].aval.dtype == jnp.float32 and all(v.aval.dtype == jnp.float32 for v in eqn.invars[:2])


def _reading_copies(eqn, copy_of, default):
    """``eqn`` with its weight operands replaced by their copies, where it is a default-precision product (an MXU
    product told which float32 operands hold bfloat16 values, where a copy is float32)."""
    if not any(v in copy_of for v in eqn.invars[:2] if isinstance(v, jex_core.Var)):
        return eqn
    if not _multiplies_a_copy(eqn, default):
        return eqn
    invars = [copy_of.get(v, v) if isinstance(v, jex_core.Var) else v for v in eqn.invars]
    float32_copies = [i for i, v in enumerate(eqn.invars[:2]) if isinstance(v, jex_core.Var) and v in copy_of
                      and copy_of[v].aval.dtype == jnp.float32]
    # Mixed operand types need the result type spelled out (float32, as before).
    replaced = eqn.replace(invars=invars, params=dict(eqn.params, preferred_element_type=eqn.outvars[0].aval.dtype))
    return reading_bf16_valued(replaced, float32_copies) if float32_copies else replaced
