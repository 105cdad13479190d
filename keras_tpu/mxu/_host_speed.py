"""Which of several equivalent programs runs fastest on this host: measured once per host, kept on disk.

Some of keras-tpu's choices between ways of computing the same MXU numbers
depend on the CPU, not on the model. keras-tpu's own convolution kernels
(:mod:`keras_tpu.mxu._direct_conv`) multiply bf16 pairs with ``VDPBF16PS``.
An AMD EPYC (Zen 4) runs that instruction at twice its float32 rate, and
there the kernels trained the README's CIFAR-10 CNN 1.8x faster than XLA's
float32 convolutions and evaluated it 1.5x faster. On an Intel Xeon
(Emerald Rapids, model 207) with the same AVX-512 BF16 flags the same kernels
lost in evaluation (375 against 223 ms per 1024 images with XLA's
convolutions under XLA's default options, which hand them to YNNPACK) and won
by only 3-8% in training. No CPU flag tells the two apart; a measurement does.

:func:`fastest` times the candidates a question offers (compiled programs
with their arguments), interleaved round by round, each keeping its best
time, and returns the fastest; the question's default wins unless another
candidate is :data:`MARGIN` faster. The answer is written to a JSON file in
keras-tpu's cache directory (``KERAS_TPU_CACHE_DIR``, else
``~/.cache/keras_tpu``), keyed by the CPU model, the jax version and the
question's own version, so each host measures once (a few seconds, logged);
processes measuring at the same time take turns (a file lock), and a
process that finds the answer on disk measures nothing. A measurement taken
while other processes kept the host busy (:data:`BUSY_CPUS`) is used by the
process that took it but not kept: the next process measures again.
``KERAS_TPU_HOST_SPEED=defaults`` takes every question's default without
measuring (the same choices on every host: reproducible runs, the tests).

The measurement runs on a thread of its own: the programs that ask are
being traced, and a trace's context (an abstract mesh, a manual axis) must
not reach the candidates' programs.
"""

import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
import time

import jax

logger = logging.getLogger("keras_tpu")

#: How much faster than the question's default another candidate must be to be chosen.
MARGIN = 0.05
#: Rounds of timing; every candidate runs twice in each, its best call counts.
ROUNDS = 5
#: Other processes' CPU use (in CPUs) beyond which a measurement is used by this process but not kept: on a busy
#: host a candidate's time depends on what else ran beside it. (Measured beside a test run, the inference
#: question once chose Eigen's convolutions at 11.8 ms against YNNPACK's at 19.6; alone, 9.3 against 8.6.)
BUSY_CPUS = 0.3

_answers = {}   # (question, version) -> the answer, in this process


def cache_directories(kind):
    """Where keras-tpu keeps ``kind`` (``"kernels"``, ``"host_speed"``): ``KERAS_TPU_CACHE_DIR`` or the user's cache
    directory, else (not writable) a temporary directory, in that order.

    Example:
        >>> [os.path.basename(d) for d in cache_directories("kernels")]
        ['kernels', 'kernels']
    """
    root = os.environ.get("KERAS_TPU_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "keras_tpu")
    return os.path.join(root, kind), os.path.join(tempfile.gettempdir(), f"keras_tpu-{os.getuid()}", kind)


def cpu_model():
    """This host's CPU model as ``/proc/cpuinfo`` names it (with its family and model numbers), else the platform's.

    Example:
        >>> isinstance(cpu_model(), str) and cpu_model() != ""
        True
    """
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if not key:
                    break   # the first processor's block
                fields.setdefault(key, value.strip())
    except OSError:
        pass
    named = " ".join(fields[k] for k in ("vendor_id", "model name", "cpu family", "model") if k in fields)
    return named or platform.processor() or platform.machine() or "unknown"


def _file(directory):
    key = hashlib.sha256("\0".join([cpu_model(), jax.__version__]).encode()).hexdigest()[:16]
    return os.path.join(directory, f"host-{key}.json")


def _read(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write(path, answers):
    """Write ``answers`` to ``path`` under a name of its own, renamed into place (a reader never sees half a file)."""
    fd, staging = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(answers, f, indent=1, sort_keys=True)
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


@contextlib.contextmanager
def _cache_file():
    """The path of this host's answers file, held under an exclusive lock (``None``: no writable directory)."""
    for directory in cache_directories("host_speed"):
        try:
            os.makedirs(directory, exist_ok=True)
            lock = open(os.path.join(directory, "lock"), "a")   # noqa: SIM115 (closed below)
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield _file(directory)
        finally:
            lock.close()   # (releases the lock)
        return
    yield None


def _cpu_jiffies():
    """(busy, total) CPU time of the whole host so far, in clock ticks, from ``/proc/stat`` (``None`` elsewhere)."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle and iowait
    return sum(fields) - idle, sum(fields)


def others_busy(seconds=0.25):
    """How many CPUs other processes kept busy over the next ``seconds`` (this process's own use left out); 0.0
    where the host does not say.

    Example:
        >>> others_busy(0.05) >= 0.0
        True
    """
    before, own, started = _cpu_jiffies(), os.times(), time.perf_counter()
    time.sleep(seconds)
    after, own_after, elapsed = _cpu_jiffies(), os.times(), time.perf_counter() - started
    if before is None or after is None or after[1] == before[1]:
        return 0.0
    cpus = os.cpu_count() or 1
    host = cpus * (after[0] - before[0]) / (after[1] - before[1])   # CPUs busy, over the interval
    mine = (own_after.user + own_after.system - own.user - own.system) / elapsed
    return max(0.0, host - mine)


def _time(candidates, rounds):
    """``{name: best seconds per call}`` of ``{name: build}`` (``build() -> (fn, args)``), interleaved."""
    built = {}
    for name, build in candidates.items():
        fn, args = build()
        jax.block_until_ready(fn(*args))   # compiled and warmed up before any timing
        built[name] = fn, args
    best = dict.fromkeys(built, float("inf"))
    names = list(built)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn, args = built[name]
            for _ in range(2):
                started = time.perf_counter()
                jax.block_until_ready(fn(*args))
                best[name] = min(best[name], time.perf_counter() - started)
    return best


def choose(seconds, default, margin=MARGIN):
    """The fastest of ``seconds`` (``{name: seconds}``); ``default`` unless another is ``margin`` faster.

    Example:
        >>> choose({"xla": 1.0, "direct": 0.97}, "xla"), choose({"xla": 1.0, "direct": 0.9}, "xla")
        ('xla', 'direct')
    """
    fastest_name = min(seconds, key=seconds.get)
    return fastest_name if seconds[fastest_name] < (1 - margin) * seconds[default] else default


def fastest(question, version, candidates, default, describe=""):
    """The name of the fastest of ``candidates`` on this host, measured once per host and kept.

    ``candidates``: ``{name: build}``, ``build()`` returning ``(fn, args)``, a
    program and the arguments to time it on; ``default``: the candidate that wins
    ties (within :data:`MARGIN`); ``version``: changes whenever the candidates
    or what they compute change (a new version measures again); ``describe``:
    what the log says is measured.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.ones((256, 256))
        >>> fastest("doctest_matmul", "1", {"once": lambda: (jax.jit(lambda a: a @ a), (x,)),
        ...                                 "twice": lambda: (jax.jit(lambda a: (a @ a) @ a), (x,))}, "once")
        'once'
    """
    key = f"{question}/{version}"
    if key in _answers:
        return _answers[key]
    if os.environ.get("KERAS_TPU_HOST_SPEED", "").strip().lower() == "defaults":
        return default   # no measurement: the same choices on every host (reproducible runs, the tests)
    with _cache_file() as path:
        answers = _read(path) if path else {}
        if key in answers and answers[key].get("chosen") in candidates:
            _answers[key] = answers[key]["chosen"]
            return _answers[key]
        logger.info("keras-tpu: timing %s on this host (once per host; a few seconds).", describe or question)
        busy = others_busy()
        # A thread of its own: none of the asking trace's context reaches the candidates' programs.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            seconds = pool.submit(_time, candidates, ROUNDS).result()
        busy = max(busy, others_busy())
        chosen = choose(seconds, default)
        kept = path is not None and busy <= BUSY_CPUS
        logger.info("keras-tpu: %s: %s; %s%s.", describe or question,
                    ", ".join(f"{n} {1e3 * s:.2f} ms" for n, s in seconds.items()), chosen,
                    f" is kept for this host (in {path})" if kept else
                    f" for this process (other processes kept {busy:.1f} CPUs busy: measured again next time)"
                    if busy > BUSY_CPUS else " for this process")
        if kept:
            answers[key] = {"chosen": chosen, "seconds": seconds, "cpu": cpu_model(),
                            "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
            try:
                _write(path, answers)
            except OSError as error:
                logger.warning("keras-tpu: could not keep the measurement in %s (%s).", path, error)
    _answers[key] = chosen
    return chosen
