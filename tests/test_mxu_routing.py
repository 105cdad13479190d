"""Part 5: routing every dot_general and conv_general_dilated of a program to the MXU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from keras_tpu import mxu, _rewrite as rewrite
from keras_tpu.mxu import mxu_conv_p, mxu_dot_general_p


def op_counts(closed):
    """(plain float dots/convs, MXU ops) anywhere in a jaxpr."""
    plain = rewrite.walk(closed, lambda e: e.primitive in (lax.dot_general_p, lax.conv_general_dilated_p))
    on_mxu = rewrite.walk(closed, lambda e: e.primitive in (mxu_dot_general_p, mxu_conv_p))
    return len(plain), len(on_mxu)


@jax.custom_jvp
def tanh_dense(x, w):
    return jnp.tanh(x @ w)


@tanh_dense.defjvp
def _tanh_dense_jvp(primals, tangents):
    x, w = primals
    tx, tw = tangents
    y = tanh_dense(x, w)
    return y, (1 - y**2) * (tx @ w + x @ tw)


@jax.custom_vjp
def linear(x, w):
    return x @ w


linear.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))


@jax.jit
def jitted(x, w):
    return jnp.sin(x @ w)


def everything(w, x):
    """Dots in custom_jvp, custom_vjp, jit, remat, scan and cond, and a convolution."""
    a = tanh_dense(x, w) + linear(x, w) + jitted(x, w)
    b = jax.checkpoint(lambda x: x @ w)(x)
    c = lax.scan(lambda carry, _: (jnp.tanh(carry @ w), None), x, None, length=3)[0]
    e = lax.cond(x.sum() > 0, lambda: x @ w, lambda: -(x @ w))
    y = lax.conv_general_dilated(x[None, :, :, None], w[:3, :3, None, None], (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(a + b + c + e) + jnp.sum(y)


@pytest.fixture
def operands(rng):
    w = (0.5 * rng.standard_normal((4, 4))).astype(np.float32)
    x = rng.standard_normal((4, 4)).astype(np.float32)
    return jnp.asarray(w), jnp.asarray(x)


@pytest.mark.parametrize("compose", ["route(grad)", "grad(route)", "vmap(route(grad))", "jit(route(grad))"])
def test_no_plain_matmul_is_left_anywhere(operands, compose):
    w, x = operands
    fn = {
        "route(grad)": lambda: (mxu.route(jax.grad(everything)), (w, x)),
        "grad(route)": lambda: (jax.grad(mxu.route(everything)), (w, x)),
        "vmap(route(grad))": lambda: (jax.vmap(mxu.route(jax.grad(everything)), in_axes=(None, 0)),
                                      (w, jnp.stack([x, -x]))),
        "jit(route(grad))": lambda: (jax.jit(mxu.route(jax.grad(everything))), (w, x)),
    }[compose]
    f, args = fn()
    plain, on_mxu = op_counts(jax.make_jaxpr(f)(*args))
    assert plain == 0
    assert on_mxu >= 15  # forward and backward ops of every construct


def test_routed_gradients_match_within_bf16_and_exactly_at_highest(operands):
    w, x = operands
    reference = jax.grad(everything)(w, x)
    scale = float(jnp.abs(reference).max())
    routed = jax.jit(mxu.route(jax.grad(everything)))(w, x)
    differentiated = jax.jit(jax.grad(mxu.route(everything)))(w, x)
    highest = jax.jit(mxu.route(jax.grad(everything), precision="highest"))(w, x)
    assert 1e-4 * scale < float(jnp.abs(routed - reference).max()) < 3e-2 * scale
    np.testing.assert_allclose(differentiated, routed, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(highest, reference, rtol=1e-5, atol=1e-5 * scale)


def test_while_loop_and_nested_jit_forward(operands):
    w, x = operands

    def f(w, x):
        inner = jax.jit(lambda v: jax.jit(lambda u: u @ w)(v) @ w)
        return lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.tanh(inner(s[1]))), (0, x))[1]

    closed = jax.make_jaxpr(mxu.route(f))(w, x)
    assert op_counts(closed) == (0, 2)
    np.testing.assert_allclose(mxu.route(f, "highest")(w, x), f(w, x), rtol=1e-5, atol=1e-6)


def test_an_op_that_asks_for_more_precision_gets_it(operands):
    w, x = operands
    f = lambda w, x: jnp.dot(x, w, precision=lax.Precision.HIGHEST) + x @ w
    closed = jax.make_jaxpr(mxu.route(f))(w, x)
    precisions = sorted(op.eqn.params["mxu_precision"].name
                        for op in rewrite.walk(closed, lambda e: e.primitive is mxu_dot_general_p))
    assert precisions == ["DEFAULT", "HIGHEST"]


def test_name_stacks_are_kept_for_costing(operands):
    w, x = operands

    def f(w, x):
        with jax.named_scope("dense_1"):
            return jnp.sum(jnp.tanh(x @ w))

    ops = mxu.trace_mxu_ops(jax.grad(f), w, x)
    assert [op.pass_name for op in ops] == ["forward", "backward"]
    assert all(op.scopes[-1] == "dense_1" for op in ops)


def test_scan_repeats_are_counted(operands):
    w, x = operands
    f = lambda w, x: lax.scan(lambda c, _: (c @ w, None), x, None, length=7)[0]
    (op,) = mxu.trace_mxu_ops(f, w, x)
    assert op.repeats == 7 and op.cycles == 7 * op.cost.cycles


def test_keyword_arguments_and_pytrees(operands):
    w, x = operands
    f = lambda params, x, scale=1.0: {"y": (x @ params["w"]) * scale}
    out = mxu.route(f, "highest")({"w": w}, x=x, scale=2.0)
    np.testing.assert_allclose(out["y"], 2 * (x @ w), rtol=1e-5, atol=1e-6)


def test_a_reversed_window_is_read_by_the_mxu_op_itself_under_grad_and_vmap(rng):
    # Autodiff's input gradient of a convolution reverses the window: the routed op reads it unreversed (no rev
    # left in the program), and differentiating or vmapping that op computes what the plain program does. Small
    # integers: every product and sum is exact, so the MXU's rounding changes nothing.
    dn = ("NHWC", "HWIO", "NHWC")
    conv = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)
    x = rng.integers(-3, 4, (2, 6, 5, 3)).astype(np.float32)
    w = rng.integers(-3, 4, (3, 2, 3, 4)).astype(np.float32)
    c = rng.integers(-3, 4, (2, 6, 5, 4)).astype(np.float32)
    input_grad = lambda x, w: jax.grad(lambda x: jnp.sum(conv(x, w) * c))(x)

    closed = jax.make_jaxpr(mxu.route(input_grad))(x, w)
    reversed_windows = rewrite.walk(closed, lambda e: e.primitive is mxu_conv_p and e.params.get("window_reversed"))
    assert len(reversed_windows) == 1
    assert not rewrite.walk(closed, lambda e: e.primitive is lax.rev_p)
    np.testing.assert_array_equal(jax.jit(mxu.route(input_grad))(x, w), input_grad(x, w))

    # The op's own transpose (a second derivative, through the kernel) and batching rules.
    second = lambda x, w: jax.grad(lambda w: jnp.sum(mxu.route(input_grad)(x, w) ** 2))(w)
    plain_second = lambda x, w: jax.grad(lambda w: jnp.sum(input_grad(x, w) ** 2))(w)
    np.testing.assert_array_equal(jax.jit(second)(x, w), plain_second(x, w))
    batched = jax.vmap(mxu.route(input_grad), in_axes=(0, None))
    np.testing.assert_array_equal(jax.jit(batched)(np.stack([x, -x]), w), jax.vmap(input_grad, (0, None))(
        np.stack([x, -x]), w))
