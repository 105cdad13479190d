"""Choices measured on the host (keras_tpu.mxu._host_speed) and the convolution kernels chosen by them
(keras_tpu.mxu._kernels.conv_kernels_here): measured once per host, kept on disk, the same numbers either way."""

import json
import os
import threading

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
import numpy as np
import pytest

from keras_tpu.mxu import _direct_conv as direct
from keras_tpu.mxu import _host_speed as host_speed
from keras_tpu.mxu import _kernels as kernels


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory, no answers in this process, measurements on (the suite takes the defaults), and
    a host that other processes leave alone (the other test process is not)."""
    monkeypatch.setenv("KERAS_TPU_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KERAS_TPU_HOST_SPEED", raising=False)
    monkeypatch.setattr(host_speed, "_answers", {})
    monkeypatch.setattr(host_speed, "others_busy", lambda seconds=0.25: 0.0)
    return tmp_path


def _counting(builds, name, fn):
    def build():
        builds.append(name)
        return jax.jit(fn), (jnp.ones((512, 512)),)
    return build


def _products(n):
    """A candidate's program: ``n`` chained 512 x 512 products (1 against 8: a difference no host noise hides)."""
    def fn(a):
        out = a
        for _ in range(n):
            out = out @ a
        return out
    return fn


def test_the_fastest_candidate_is_measured_once_and_kept_on_disk(fresh_cache):
    builds = []
    candidates = {"once": _counting(builds, "once", _products(1)),
                  "eight_times": _counting(builds, "eight_times", _products(8))}
    assert host_speed.fastest("test_question", "1", candidates, "eight_times") == "once"
    assert sorted(builds) == ["eight_times", "once"]
    # The answer is in this host's file, with what was measured.
    (path,) = (fresh_cache / "host_speed").glob("host-*.json")
    kept = json.loads(path.read_text())["test_question/1"]
    assert kept["chosen"] == "once" and kept["seconds"]["once"] < kept["seconds"]["eight_times"]
    assert kept["cpu"] == host_speed.cpu_model()
    # Another process (no answers in memory) reads it instead of measuring; a new version measures again.
    host_speed._answers.clear()
    assert host_speed.fastest("test_question", "1", candidates, "eight_times") == "once"
    assert len(builds) == 2
    assert host_speed.fastest("test_question", "2", candidates, "eight_times") == "once"
    assert len(builds) == 4
    assert set(json.loads(path.read_text())) == {"test_question/1", "test_question/2"}
    assert [p.name for p in (fresh_cache / "host_speed").iterdir() if p.suffix == ".json"] == [path.name]


def test_a_measurement_beside_other_work_is_used_but_not_kept(fresh_cache, monkeypatch):
    builds = []
    candidates = {"once": _counting(builds, "once", _products(1)),
                  "eight_times": _counting(builds, "eight_times", _products(8))}
    monkeypatch.setattr(host_speed, "others_busy", lambda seconds=0.25: 1.0)
    assert host_speed.fastest("test_busy", "1", candidates, "eight_times") == "once"
    assert not list((fresh_cache / "host_speed").glob("host-*.json"))
    host_speed._answers.clear()   # the next process measures again, and keeps a quiet measurement
    monkeypatch.setattr(host_speed, "others_busy", lambda seconds=0.25: 0.0)
    assert host_speed.fastest("test_busy", "1", candidates, "eight_times") == "once"
    assert len(builds) == 4 and list((fresh_cache / "host_speed").glob("host-*.json"))
    # The host's CPU use as /proc/stat tells it, less this process's own.
    assert 0.0 <= host_speed.others_busy(0.05) <= (os.cpu_count() or 1)


def test_the_defaults_can_be_taken_without_measuring(fresh_cache, monkeypatch):
    monkeypatch.setenv("KERAS_TPU_HOST_SPEED", "defaults")
    builds = []
    assert host_speed.fastest("test_defaults", "1", {"a": _counting(builds, "a", lambda a: a),
                                                      "b": _counting(builds, "b", lambda a: a)}, "b") == "b"
    assert builds == [] and not (fresh_cache / "host_speed").exists()


def test_the_default_wins_unless_another_is_clearly_faster():
    assert host_speed.choose({"xla": 1.0, "direct": 0.96}, "xla") == "xla"
    assert host_speed.choose({"xla": 1.0, "direct": 0.94}, "xla") == "direct"
    assert host_speed.choose({"xla": 1.0, "direct": 1.5, "other": 0.5}, "xla") == "other"


def test_the_measurement_runs_outside_the_asking_trace(fresh_cache):
    # Asked from inside a jitted function's trace (as a convolution's rule is), the candidates still compile and
    # run on concrete arrays: on a thread of their own.
    seen = []

    def traced(x):
        seen.append(host_speed.fastest("test_in_trace", "1", {"a": _counting([], "a", lambda a: a + 1)}, "a"))
        return x * 2

    np.testing.assert_array_equal(jax.jit(traced)(jnp.ones(3)), 2.0)
    assert seen == ["a"]


def test_an_unreadable_answer_file_is_measured_again(fresh_cache):
    directory = fresh_cache / "host_speed"
    directory.mkdir()
    path = directory / os.path.basename(host_speed._file(str(directory)))
    path.write_text("{ not json")
    builds = []
    assert host_speed.fastest("test_question", "1", {"a": _counting(builds, "a", lambda a: a)}, "a") == "a"
    assert builds == ["a"] and json.loads(path.read_text())["test_question/1"]["chosen"] == "a"


def test_processes_measuring_at_once_take_turns(fresh_cache, monkeypatch):
    # Two askers at once (two test processes, two notebooks): one measures, the other waits and reads its answer.
    builds, barrier, timing = [], threading.Barrier(2), []
    real_time = host_speed._time

    def recorded_time(candidates, rounds):
        timing.append(("start", threading.get_ident()))
        try:
            return real_time(candidates, rounds)
        finally:
            timing.append(("end", threading.get_ident()))

    monkeypatch.setattr(host_speed, "_time", recorded_time)

    def ask():
        barrier.wait()
        host_speed._answers.clear()   # (each as a process of its own: nothing in memory)
        return host_speed.fastest("test_turns", "1", {"a": _counting(builds, "a", lambda a: a * 3)}, "a")

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Measured once, by one of them: the other found the answer on disk once the lock was free.
    assert builds == ["a"] and [event for event, _ in timing] == ["start", "end"]
    (path,) = (fresh_cache / "host_speed").glob("host-*.json")
    assert json.loads(path.read_text())["test_turns/1"]["chosen"] == "a"


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_the_timed_convolution_programs_compute_the_same_numbers(training):
    # The candidates differ only in how XLA or the kernels sum the same exact bf16 products (the second
    # convolution's operand is rounded from the first's output in each): the same results to float32 order.
    candidates = {"round_f32": kernels._timed_conv_program(training, kernels.ROUND_F32, kernels._YNN_DOTS_AND_SUMS),
                  "round_f32_ynnpack": kernels._timed_conv_program(training, kernels.ROUND_F32, None)}
    if direct.available():
        candidates["bf16_direct"] = kernels._timed_conv_program(training, kernels.BF16_DIRECT,
                                                                kernels._YNN_DOTS_AND_SUMS)
    results = {}
    for name, build in candidates.items():
        program, args = build()
        results[name] = program(*args)
    assert len(results["round_f32"]) == (9 if training else 2)   # the loss and eight gradients, or the two outputs
    # (A float32 sum in another order can round the next convolution's operand to the neighbouring bf16 value: a
    # few elements differ by up to about one bf16 step, on average the differences are float32's.)
    for name, got in results.items():
        for g, want in zip(got, results["round_f32"]):
            scale = float(jnp.abs(want).max())
            np.testing.assert_allclose(g, want, rtol=0, atol=1e-2 * scale, err_msg=name)
            assert float(jnp.abs(g - want).mean()) < 1e-5 * scale, name
    # ... and not XLA's float32 numbers: the MXU's roundings are in every candidate.
    closed, args = kernels._timed_conv_block(training)
    unrounded = jax.jit(jax_core.jaxpr_as_fun(closed))(*jax.tree.leaves(args))
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(unrounded, results["round_f32"])) > 1e-3


def _depends_on(closed):
    """Per output of ``closed`` (a ClosedJaxpr), the indices of the inputs it is computed from."""
    deps = {v: {i} for i, v in enumerate(closed.jaxpr.invars)}
    for eqn in closed.jaxpr.eqns:
        used = set().union(*(deps.get(v, set()) for v in eqn.invars if not isinstance(v, jax_core.Literal)))
        deps.update((v, used) for v in eqn.outvars)
    return [deps.get(v, set()) for v in closed.jaxpr.outvars]


def test_the_timed_inference_program_runs_as_a_model_would():
    # Its two parts run one after the other, as a model's layers do: the MNIST convnet's result is computed from
    # the block's input too (XLA:CPU would otherwise run the two side by side, which the kernels lose).
    closed, args = kernels._timed_conv_block(training=False)
    block_input = len(jax.tree.leaves(args[0]))   # the leaves: the block's parameters, its images, ...
    assert args[1].shape == kernels.TIMED_CONV_BLOCK[0]
    block_output, mnist_output = _depends_on(closed)
    assert block_input in block_output and block_input in mnist_output
    # The kernels' candidate leaves the one-channel first convolution (9 products per output) on XLA, as the
    # inference rule does, and computes the other three on the kernels.
    forms = []
    run = kernels._with_forms(closed, conv_form=lambda layout, gemm: forms.append(gemm[2]) or kernels.ROUND_F32)
    jax.make_jaxpr(run)(*jax.tree.leaves(args))
    assert sorted(forms) == [9, 288, 288, 288] and 9 < kernels.INFERENCE_DIRECT_MIN_K <= 288
    if not direct.available():
        pytest.skip("this host has no direct convolution kernels")
    program, flat = kernels._timed_conv_program(False, kernels.BF16_DIRECT, kernels._YNN_DOTS_AND_SUMS)()
    hlo = program.as_text()
    assert hlo.count("keras_tpu_mxu_conv_forward") >= 3 and " convolution(" in hlo


def test_measured_choices_decide_the_convolutions_and_the_inference_options(monkeypatch):
    monkeypatch.setattr(kernels, "host_class", lambda: "bf16")
    monkeypatch.delenv("KERAS_TPU_DIRECT_CONV", raising=False)
    monkeypatch.delenv("KERAS_TPU_HOST_SPEED", raising=False)
    monkeypatch.setattr(direct, "available", lambda: True)
    answers = {}
    monkeypatch.setattr(host_speed, "fastest", lambda question, version, candidates, default, describe="":
                        answers[question.split("_")[1]])
    gemm = (1, 131072, 288, 32)
    answers.update(training=kernels.BF16_DIRECT, inference=kernels.ROUND_F32_YNNPACK)
    assert kernels.builtin_choice("bf16", "conv", "weight_grad", gemm) == kernels.BF16_DIRECT
    with kernels.lowering_mode("test"):
        assert kernels.builtin_choice("bf16", "conv", "forward", gemm) == kernels.ROUND_F32
    # XLA's default options (YNNPACK's convolutions) for inference programs with windows; training keeps its own.
    assert "xla_cpu_experimental_ynn_fusion_type" not in kernels.compiler_options("test")
    assert kernels.compiler_options("train")["xla_cpu_experimental_ynn_fusion_type"]
    answers.update(training=kernels.ROUND_F32, inference=kernels.BF16_DIRECT)
    assert kernels.builtin_choice("bf16", "conv", "weight_grad", gemm) == kernels.ROUND_F32
    with kernels.lowering_mode("predict"):
        assert kernels.builtin_choice("bf16", "conv", "forward", gemm) == kernels.BF16_DIRECT
    assert kernels.compiler_options("predict")["xla_cpu_experimental_ynn_fusion_type"]
    # KERAS_TPU_DIRECT_CONV=1 takes the kernels without asking; =0 never.
    monkeypatch.setenv("KERAS_TPU_DIRECT_CONV", "1")
    assert kernels.conv_kernels_here() == kernels.conv_kernels_here(inference=True) == kernels.BF16_DIRECT
    monkeypatch.setattr(direct, "available", lambda: False)
    answers.update(training=kernels.ROUND_F32)
    assert kernels.builtin_choice("bf16", "conv", "weight_grad", gemm) == kernels.ROUND_F32
    # A host without bf16 instructions measures nothing.
    monkeypatch.setattr(kernels, "host_class", lambda: "no_bf16")
    answers.clear()
    assert kernels.conv_kernels_here() == kernels.ROUND_F32
