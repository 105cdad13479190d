"""Rewriting JAX programs: replace chosen operations everywhere in a traced function.

A *rule* looks at one jaxpr equation and returns a replacement equation of
the same type (same operands and results), or ``None`` to keep it. A rule
may also have a ``fold``, ``fold(eqns, outvars) -> eqns``, which sees each
jaxpr's equations together before the rule sees them one by one (where a
replacement depends on what produced an operand). The
rewrite reaches every nested program: ``jit`` calls, ``scan``/``while``
bodies, ``cond`` branches, ``remat``, ``shard_map``, and the primal, JVP,
forward and backward functions of ``custom_jvp``/``custom_vjp``. Because the
rewrite is structural (equations are swapped, nothing is re-traced) shapes,
dtypes, weak types and the name stacks that tie operations to Keras layers
are kept exactly.

The MXU routing (:mod:`keras_tpu.mxu._routing`) and the vector-unit lowerings
(:mod:`keras_tpu._vector_unit`) are rules.

Before the rule sees a program, one algebraic fold is applied everywhere
(:func:`fold_summed_batch_products`): a product batched over a leading axis
whose result is only summed over that axis (through at most a transpose) is
one product contracting that axis too, and so is such a product plus a value
the same along that axis (a kernel regularizer's gradient: its sum is the
value times the axis' length). Under ``jax.vmap`` over the cores,
each core's weight gradient is such a batched product and the cores' mean
gradient (``lax.pmean``) its sum: as one contraction over all rows it is what
:class:`keras_tpu._replicated_steps.ReplicatedSteps` computes, and a model's own
``train_step`` ran its per-core products of 8 rows each 4x slower than the
one of 64 rows (a 784x256 kernel: 0.5 against 0.13 ms). The products are the
same; only the order of the float32 sums changes. Without the regularizer's
part of the fold, the "Use TPUs" guide's custom loop (its L2-regularized
model under ``TPUStrategy.run``, ``benchmarks/users_code.py``) kept eight
copies of its 18432x256 kernel's gradient: 335 MiB of temporary buffers
against 79 with it, and a step of 120-290 ms against 54-65.
"""

import collections
import dataclasses
import functools

import jax
from jax import lax
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_primitives
from jax.extend import linear_util as lu
from jax.extend import source_info_util

# Calls whose bodies are not ordinary XLA programs and must not be rewritten.
_OPAQUE_PRIMITIVES = {"pallas_call", "custom_call"}


def compose(*rules):
    """A rule that tries ``rules`` in order and uses the first replacement (their folds, too, in order)."""
    def composed(eqn):
        for rule in rules:
            replacement = rule(eqn)
            if replacement is not None:
                return replacement
        return None

    folds = [rule.fold for rule in rules if getattr(rule, "fold", None) is not None]
    if folds:
        def fold(eqns, outvars):
            for one in folds:
                eqns = one(eqns, outvars)
            return eqns
        composed.fold = fold
    return composed


def _uses(jaxpr):
    counts = collections.Counter(v for e in jaxpr.eqns for v in e.invars if isinstance(v, jex_core.Var))
    counts.update(v for v in jaxpr.outvars if isinstance(v, jex_core.Var))
    return counts


# The products the fold applies to: XLA's, and the MXU's (same operands and dimension numbers), which a program
# holds where the MXU rule ran before the cores were mapped (a TPUStrategy.run replica function).
_PRODUCTS = ("dot_general", "mxu_dot_general")


def _positional_leading_sum(eqn):
    """Whether ``eqn`` sums its one operand over axis 0 alone (``reduce_sum``, or ``psum`` over a vmapped axis)."""
    name = eqn.primitive.name
    if name not in ("reduce_sum", "psum") or len(eqn.invars) != 1 or tuple(eqn.params.get("axes", ())) != (0,):
        return False
    return name == "reduce_sum" or eqn.params.get("axis_index_groups") is None


def _summed_product(eqns, producer, uses, dropped, source):
    """``(transpose, product)``: the positions of the batched product that ``source`` is, through at most a
    transpose that keeps axis 0 first (``transpose`` is then its position, else ``None``), where nothing else
    reads the intermediate results and the product has one batch dimension; else ``None``."""
    transpose = None
    j = producer.get(source)
    if j is not None and eqns[j].primitive.name == "transpose" and uses[source] == 1:
        perm = tuple(eqns[j].params["permutation"])
        if perm[0] == 0 and isinstance(eqns[j].invars[0], jex_core.Var):
            transpose, source = j, eqns[j].invars[0]
            j = producer.get(source)
    if j is None or j in dropped or eqns[j].primitive.name not in _PRODUCTS or uses[source] != 1:
        return None
    if len(eqns[j].params["dimension_numbers"][1][0]) != 1:
        return None
    return transpose, j


def _fold_product(eqns, transpose, j, out, replaced):
    """Replace the batched product at ``j`` (and the transpose of its result at ``transpose``) by the product
    that also contracts the batch dimension, into ``out``."""
    dot = eqns[j]
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    # The batch axis contracts first: the pairs are the same either way, but in this order the contracting
    # axes of [cores, rows, features] operands are leading and in order, so a product stays a plain matrix
    # product (a weight gradient of the rows: kernels.dot_layout's "lhs_transposed").
    params = dict(dot.params, dimension_numbers=((tuple(lb) + tuple(lc), tuple(rb) + tuple(rc)), ((), ())))
    if transpose is None:
        replaced[j] = dot.replace(outvars=[out], params=params)
        return
    product = jex_core.Var(dot.outvars[0].aval.update(shape=dot.outvars[0].aval.shape[1:]))
    replaced[j] = dot.replace(outvars=[product], params=params)
    perm = tuple(p - 1 for p in eqns[transpose].params["permutation"][1:])
    replaced[transpose] = eqns[transpose].replace(invars=[product], outvars=[out],
                                                  params=dict(eqns[transpose].params, permutation=perm))


def _broadcast_along_axis_0(eqn):
    """Whether ``eqn`` broadcasts its operand along a new leading axis: the same value for every core."""
    return (eqn.primitive.name == "broadcast_in_dim" and len(eqn.invars) == 1
            and 0 not in eqn.params["broadcast_dimensions"])


def _abstract(atom):
    aval = atom.aval
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _plus_copies(summed, value, *, copies, broadcast_dimensions):
    """``summed`` plus ``copies`` times ``value`` broadcast to its shape."""
    return summed + copies * lax.broadcast_in_dim(value, summed.shape, broadcast_dimensions)


def fold_summed_batch_products(jaxpr):
    """``jaxpr``'s equations with every sum over the batch axis of a ``dot_general`` folded into the product.

    Matches ``sum_0(dot_general(a, b))`` and ``sum_0(transpose(dot_general(a, b)))`` (a transpose that keeps
    axis 0 first) where the product has one batch dimension and nothing else reads the intermediate results;
    the product then contracts the batch dimension as well. A product plus a value that is the same along
    axis 0 (``sum_0(product + broadcast(r))``: a weight gradient with its regularizer's, under ``jax.vmap``
    over the cores) folds too, into ``product' + n * r``. See the module docstring.

    Example:
        >>> f = lambda a, b: jnp.sum(jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))), axis=0)
        >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((8, 4, 3)), jnp.ones((8, 3, 5))).jaxpr
        >>> [e.primitive.name for e in fold_summed_batch_products(jaxpr)]
        ['dot_general']
    """
    eqns = list(jaxpr.eqns)
    uses = _uses(jaxpr)
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    dropped, replaced = set(), {}
    for i, eqn in enumerate(eqns):
        if not _positional_leading_sum(eqn):
            continue
        source, out = eqn.invars[0], eqn.outvars[0]
        found = _summed_product(eqns, producer, uses, dropped, source)
        if found is not None and eqns[found[1]].outvars[0].aval.dtype == out.aval.dtype:
            _fold_product(eqns, *found, out, replaced)
            dropped.add(i)
            continue
        k = producer.get(source)  # the sum of a product plus a value the same along axis 0?
        if k is None or k in dropped or eqns[k].primitive.name not in ("add", "add_any") or uses[source] != 1:
            continue
        for product, other in (eqns[k].invars, eqns[k].invars[::-1]):
            b = producer.get(other) if isinstance(other, jex_core.Var) else None
            found = None if b is None or b in dropped or not _broadcast_along_axis_0(eqns[b]) else \
                _summed_product(eqns, producer, uses, dropped, product)
            if found is None or eqns[found[1]].outvars[0].aval.dtype != out.aval.dtype:
                continue
            summed = jex_core.Var(out.aval)
            _fold_product(eqns, *found, summed, replaced)
            value = eqns[b].invars[0]
            dims = tuple(d - 1 for d in eqns[b].params["broadcast_dimensions"])
            plus = jax.make_jaxpr(functools.partial(_plus_copies, copies=source.aval.shape[0],
                                                    broadcast_dimensions=dims))(_abstract(out), _abstract(value))
            replaced[i] = eqn.replace(primitive=jex_primitives.closed_call_p, invars=[summed, value],
                                      params={"call_jaxpr": plus}, effects=plus.effects)
            dropped.add(k)
            if uses[other] == 1:
                dropped.add(b)
            break
    if not dropped:
        return eqns
    return [replaced.get(k, e) for k, e in enumerate(eqns) if k not in dropped]


class _Rewriter:
    def __init__(self, rule):
        self.rule = rule
        self._memo = {}

    def jaxpr(self, jaxpr):
        key = id(jaxpr)
        if key not in self._memo:
            eqns = fold_summed_batch_products(jaxpr)
            fold = getattr(self.rule, "fold", None)
            if fold is not None:
                eqns = fold(eqns, jaxpr.outvars)
            self._memo[key] = (jaxpr, jaxpr.replace(eqns=[self.eqn(e) for e in eqns]))
        return self._memo[key][1]

    def closed(self, closed):
        return closed.replace(jaxpr=self.jaxpr(closed.jaxpr))

    def value(self, value):
        if isinstance(value, jex_core.ClosedJaxpr):
            return self.closed(value)
        if isinstance(value, jex_core.Jaxpr):
            return self.jaxpr(value)
        if isinstance(value, tuple) and value and all(
                isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr)) for v in value):
            return tuple(self.value(v) for v in value)
        return value

    def eqn(self, eqn):
        replacement = self.rule(eqn)
        if replacement is not None:
            return replacement
        name = eqn.primitive.name
        if name in _OPAQUE_PRIMITIVES:
            return eqn
        params = {k: self.value(v) for k, v in eqn.params.items()}
        if name == "custom_jvp_call":
            params["jvp_jaxpr_fun"] = self._jaxpr_thunk(eqn.params["jvp_jaxpr_fun"])
        elif name == "custom_vjp_call":
            params["fwd_jaxpr_thunk"] = self._jaxpr_thunk(eqn.params["fwd_jaxpr_thunk"])
            params["bwd"] = self._function(eqn.params["bwd"])
        if all(params[k] is eqn.params[k] for k in params):
            return eqn
        return eqn.replace(params=params)

    def _jaxpr_thunk(self, thunk):
        """Wrap a custom_jvp/custom_vjp rule thunk so the jaxpr it returns is rewritten too."""
        rewrite = self.jaxpr

        def rewritten(*args):
            jaxpr, consts, *rest = thunk.call_wrapped(*args)
            return (rewrite(jaxpr), consts, *rest)

        return lu.wrap_init(rewritten, debug_info=thunk.debug_info)

    def _function(self, fun):
        """Wrap a Python-level function (custom_vjp's bwd) so what it computes is rewritten."""
        rule = self.rule

        def rewritten(*args):
            return _trace_rewrite_eval(fun.call_wrapped, args, rule)

        return lu.wrap_init(rewritten, debug_info=fun.debug_info)


def rewrite_closed_jaxpr(closed, rule):
    """Apply ``rule`` to every equation of a closed jaxpr, recursively."""
    return _Rewriter(rule).closed(closed)


def _is_array_like(x):
    return isinstance(x, (jax.Array, jax.core.Tracer)) or hasattr(x, "shape") and hasattr(x, "dtype")


def _trace_rewrite_eval(fun, args, rule):
    """Run ``fun(*args)`` with ``rule`` applied; non-array arguments/results pass through as-is."""
    array_positions = [i for i, a in enumerate(args) if _is_array_like(a)]
    passthrough = {}
    output_count = []

    def traced(*arrays):
        full = list(args)
        for i, a in zip(array_positions, arrays):
            full[i] = a
        outs = list(fun(*full))
        output_count.append(len(outs))
        kept = []
        for i, o in enumerate(outs):
            if _is_array_like(o):
                kept.append(o)
            else:
                passthrough[i] = o
        return kept

    arrays = [args[i] for i in array_positions]
    rewritten = rewrite_closed_jaxpr(jax.make_jaxpr(traced)(*arrays), rule)
    values = iter(jax.core.eval_jaxpr(rewritten.jaxpr, rewritten.consts, *arrays))
    return [passthrough[i] if i in passthrough else next(values) for i in range(output_count[0])]


def transform(fun, rule):
    """Return a function that computes ``fun`` with ``rule`` applied to its whole program.

    ``fun`` is traced when the result is called (so call the result inside
    ``jax.jit`` to trace once). Its arguments must be arrays or pytrees of
    arrays; bind other arguments with ``functools.partial``.

    Example:
        >>> from keras_tpu.mxu import mxu_rule
        >>> fast = jax.jit(transform(lambda a, b: a @ b, mxu_rule("default")))
    """
    @functools.wraps(fun)
    def transformed(*args, **kwargs):
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args, **kwargs)
        rewritten = rewrite_closed_jaxpr(closed, rule)
        flat = jax.tree.leaves((args, kwargs))
        out = jax.core.eval_jaxpr(rewritten.jaxpr, rewritten.consts, *flat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return transformed


@dataclasses.dataclass(frozen=True)
class Occurrence:
    """An equation found by :func:`walk`, with where and how often it runs."""

    eqn: object
    repeats: int            # times it runs per call of the program (scan lengths multiplied)
    name_stack: str         # e.g. "transpose(jvp(functional))/conv2d"
    in_loop: bool           # inside a while loop (trip count unknown; counted once)
    in_branch: bool         # inside a cond branch (may not run)


def sub_jaxprs(eqn):
    """The programs an equation holds in its parameters (a loop's body, a cond's branches, a jit's program), as
    jaxprs.

    Example:
        >>> closed = jax.make_jaxpr(lambda x: jax.lax.map(jnp.sin, x))(jnp.ones((2, 3)))
        >>> [len(sub.eqns) for sub in sub_jaxprs(closed.eqns[0])]
        [1]
    """
    found = []
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(sub, jex_core.ClosedJaxpr):
                found.append(sub.jaxpr)
            elif isinstance(sub, jex_core.Jaxpr):
                found.append(sub)
    return found


def walk(closed_or_jaxpr, predicate):
    """Every equation (recursively) for which ``predicate(eqn)`` is true, as :class:`Occurrence`.

    Example:
        >>> closed = jax.make_jaxpr(lambda a: jax.lax.scan(lambda c, _: (c @ a, None), a, None, length=4)[0])
        >>> [o.repeats for o in walk(closed(jnp.ones((2, 2))), lambda e: e.primitive.name == "dot_general")]
        [4]
    """
    jaxpr = closed_or_jaxpr.jaxpr if isinstance(closed_or_jaxpr, jex_core.ClosedJaxpr) else closed_or_jaxpr
    found = []

    def visit(jaxpr, repeats, prefix, in_loop, in_branch):
        for eqn in jaxpr.eqns:
            stack = prefix + eqn.source_info.name_stack
            if predicate(eqn):
                found.append(Occurrence(eqn, repeats, str(stack), in_loop, in_branch))
                continue
            name = eqn.primitive.name
            if name in _OPAQUE_PRIMITIVES:
                continue
            for sub in sub_jaxprs(eqn):
                times = repeats * (eqn.params["length"] if name == "scan" else 1)
                visit(sub, times, stack, in_loop or name == "while", in_branch or name == "cond")

    visit(jaxpr, 1, source_info_util.new_name_stack(), False, False)
    return found
