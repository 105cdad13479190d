"""Mistakes get a clear answer: one test per row of the README's "Mistakes and what keras_tpu says".

Each row of that table is ``| the mistake | exception | message |``; :data:`MISTAKES` maps the
mistake (the table's first column, verbatim) to a function that makes it. The test runs it and
checks that it raises that exception with that message (``...`` in the README's message stands
for text that varies: paths, ports, long tails). So the table and the behaviour cannot drift apart.
"""

import os
import re
import subprocess
import sys

import h5py
import keras
import numpy as np
import pytest

import keras_tpu
from keras_tpu import _process, _pod as pod, _validation as validation, _weights as weights
from keras_tpu import estimator as tpu_estimator
from tests.conftest import REPO, run_python

README = os.path.join(REPO, "README.md")
SECTION = "## Mistakes and what keras_tpu says"


def readme_rows():
    """``[(mistake, exception, message)]`` from the README's table (backticks removed from the message)."""
    text = open(README, encoding="utf-8").read()
    assert SECTION in text, f"README.md lacks the section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != 3 or cells[0] in ("the mistake", "") or set(cells[0]) <= set("-: "):
            continue
        mistake, exception, message = cells
        rows.append((mistake, exception.strip("`"), message.strip("`").replace("\\|", "|")))
    return rows


def message_pattern(message):
    """The README's message as a regular expression: ``...`` matches anything."""
    return ".*".join(re.escape(part) for part in message.split("...")) + r"\Z"


# -- models and data used by the rows -------------------------------------------------------------


def classifier(classes=3, loss="sparse_categorical_crossentropy", under=None):
    with (under or keras_tpu.TPUStrategy()).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(classes, activation="softmax")])
        model.compile("sgd", loss, metrics=["accuracy"])
    return model


def tpu_classifier(classes=3, loss="sparse_categorical_crossentropy"):
    cpu = keras.Sequential([keras.Input((4,)), keras.layers.Dense(classes, activation="softmax")])
    cpu.compile("sgd", loss)
    return keras_tpu.keras_to_tpu_model(cpu)


X = np.ones((32, 4), "float32")
Y = np.arange(32) % 3


class Batches(keras.utils.PyDataset):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        return self.batches[index]


def generator(batches):
    yield from batches


def save_small(path, units=4):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units, name="hidden"),
                              keras.layers.Dense(2, name="logits")])
    (weights.save_model if path.endswith(".keras") else weights.save_weights)(model, path)
    return model


def small(units=4, layers=2):
    names = ["hidden", "logits"][:layers]
    return keras.Sequential([keras.Input((3,))] + [keras.layers.Dense(units if n == "hidden" else 2, name=n)
                                                   for n in names])


def truncated(tmp_path, name):
    path = str(tmp_path / name)
    save_small(path)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    return path


def in_process_with(env, code="import keras_tpu"):
    """The last line of stderr of ``code`` run with ``env`` (a mistake that stops the import)."""
    result = run_python(code, env=env, timeout=300)
    assert result.returncode != 0, result.stdout
    error = [line for line in result.stderr.splitlines() if line.strip()][-1]
    kind, _, message = error.partition(": ")
    raise {"ValueError": ValueError, "RuntimeError": RuntimeError}[kind.rsplit(".", 1)[-1]](message)


def pod_of_two(tmp_path, second_worker_env):
    """Start two workers whose second one differs by ``second_worker_env``; both must stop within
    seconds with the same message; raise it."""
    from tests.test_pod_and_export import free_ports

    addresses = [f"localhost:{port}" for port in free_ports(3)]
    processes = []
    for task in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
        env.update(KERAS_TPU_WORKERS=",".join(addresses[:2]), KERAS_TPU_TASK_INDEX=str(task),
                   KERAS_TPU_CORES_PER_WORKER="4", KERAS_TPU_HEARTBEAT_TIMEOUT="5")
        if task == 1:
            env.update({k: v.replace("{third}", addresses[2]).replace("{first}", addresses[0])
                        for k, v in second_worker_env.items()})
        processes.append(subprocess.Popen([sys.executable, "-c", "import keras_tpu; print('JOINED')"], cwd=REPO,
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    messages = []
    for process in processes:
        out, err = process.communicate(timeout=120)  # fails fast: no worker waits for the initialization timeout
        assert process.returncode != 0 and "JOINED" not in out, err[-2000:]
        messages.append([line for line in err.splitlines() if line.startswith("RuntimeError: ")][-1])
    assert all("disagree" in m or "different numbers of cores" in m for m in messages), messages
    raise RuntimeError(messages[0].split(": ", 1)[1])


def nan_fit(raise_error):
    x = np.ones((64, 4), "float32")
    y = np.full((64, 1), 1e30, "float32")
    with keras_tpu.TPUStrategy().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(1e10), "mse")
    return model.fit(x, y, batch_size=16, epochs=3, verbose=0,
                     callbacks=[keras.callbacks.TerminateOnNaN(raise_error=raise_error)])


def nan_reported_in_the_log(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="keras_tpu"):
        history = nan_fit(raise_error=False)
    assert len(history.history["loss"]) == 1  # TerminateOnNaN stopped the training, as on the CPU
    return " ".join(r.getMessage() for r in caplog.records if "loss first became" in r.getMessage())


def nan_raised():
    try:
        nan_fit(raise_error=True)
    except RuntimeError as error:
        raise RuntimeError(str(error) + " " + " ".join(getattr(error, "__notes__", []))) from None


# -- the rows -----------------------------------------------------------------------------------------

MISTAKES = {
    "`fit` on empty arrays": lambda: classifier().fit(X[:0], Y[:0]),
    "`evaluate` on empty arrays": lambda: classifier().evaluate(X[:0], Y[:0]),
    "`predict` on empty arrays": lambda: tpu_classifier().predict(X[:0]),
    "`fit` on a generator that yields nothing": lambda: classifier().fit(generator([]), steps_per_epoch=2),
    "`fit` on a `PyDataset` of no batches": lambda: classifier().fit(Batches([])),
    "`validation_data` with no rows": lambda: classifier().fit(X, Y, validation_data=(X[:0], Y[:0])),
    "`x` and `y` with different numbers of rows": lambda: tpu_classifier().fit(X, Y[:10]),
    "`x` of a shape the model does not take": lambda: classifier().fit(np.ones((32, 5)), Y),
    "`fit(..., batch_size=0)`": lambda: classifier().fit(X, Y, batch_size=0),
    "`TPUEstimator(train_batch_size=0)` (or a negative, non-integer eval/predict batch size)":
        lambda: tpu_estimator.TPUEstimator(model_fn=lambda features, labels, mode, params: None, train_batch_size=0),
    "`TPUEstimator(train_batch_size=100)` on 8 cores":
        lambda: tpu_estimator.TPUEstimator(model_fn=lambda features, labels, mode, params: None,
                                           train_batch_size=100),
    "`fit(..., batch_size=-8)`": lambda: tpu_classifier().fit(X, Y, batch_size=-8),
    "`batch_size` not an integer (`2.5`, `\"64\"`)": lambda: classifier().evaluate(X, Y, batch_size="64"),
    "`fit(..., steps_per_epoch=0)`": lambda: classifier().fit(X, Y, steps_per_epoch=0),
    "`predict(..., steps=-1)`": lambda: classifier().predict(X, steps=-1),
    "`fit(..., epochs=0)`": lambda: classifier().fit(X, Y, epochs=0),
    "`initial_epoch` beyond `epochs`": lambda: classifier().fit(X, Y, epochs=2, initial_epoch=5),
    "`validation_split` outside [0, 1)": lambda: classifier().fit(X, Y, validation_split=1.5),
    "`validation_freq=0`": lambda: classifier().fit(X, Y, validation_data=(X, Y), validation_freq=0),
    "`compile(steps_per_execution=0)`": lambda: classifier().compile("sgd", "mse", steps_per_execution=0),
    "`model.steps_per_execution = 0` set after `compile`":
        lambda: (lambda m: (setattr(m, "steps_per_execution", 0), m.fit(X, Y, verbose=0)))(classifier()),
    "sparse labels outside `[0, classes)`": lambda: classifier().fit(X, np.full(32, 7)),
    "negative sparse labels": lambda: tpu_classifier().evaluate(X, -np.ones(32, "int32")),
    "sparse labels counted from 1": lambda: classifier().fit(X, Y + 1),
    "fractional labels for a sparse loss": lambda: classifier().fit(X, Y + 0.5),
    "one-hot labels for a sparse loss": lambda: classifier().fit(X, keras.utils.to_categorical(Y, 3)),
    "class indices for a categorical loss": lambda: classifier(loss="categorical_crossentropy").fit(X, Y),
    "binary labels outside `[0, 1]`": lambda: classifier(1, "binary_crossentropy").fit(X, Y),
    "out-of-range labels in a generator's first batch":
        lambda: classifier().fit(generator([(X, np.full(32, 3))] * 2), steps_per_epoch=2),
    "out-of-range labels in a `PyDataset`'s first batch": lambda: tpu_classifier().fit(Batches([(X, Y + 5)])),
    "out-of-range labels in `train_on_batch`": lambda: classifier().train_on_batch(X, Y + 3),
    "`TPUClusterResolver(\"grpc://\")`": lambda: keras_tpu.TPUClusterResolver("grpc://"),
    "an address without a port, or a bad port": lambda: keras_tpu.TPUClusterResolver("grpc://10.0.0.2:84x0"),
    "an address with another scheme": lambda: keras_tpu.TPUClusterResolver("http://10.0.0.2:8470"),
    "a TPU name with spaces": lambda: keras_tpu.TPUClusterResolver("my tpu"),
    "a worker listed twice": lambda: keras_tpu.TPUClusterResolver(["10.0.0.2:8470", "grpc://10.0.0.2:8470"]),
    "a worker list entry without a port": lambda: keras_tpu.TPUClusterResolver("10.0.0.2:8470,10.0.0.3"),
    "an empty worker list": lambda: keras_tpu.TPUClusterResolver([]),
    "`task_index` outside the worker list": lambda: keras_tpu.TPUClusterResolver(["a:1", "b:1"], task_index=2),
    "a malformed `KERAS_TPU_WORKERS`":
        lambda: in_process_with({"KERAS_TPU_WORKERS": "10.0.0.2:8470,10.0.0.3", "KERAS_TPU_TASK_INDEX": "0"}),
    "a non-integer `KERAS_TPU_HEARTBEAT_TIMEOUT`": lambda: in_process_with({"KERAS_TPU_HEARTBEAT_TIMEOUT": "10s"}),
    "a non-integer `KERAS_TPU_STARTUP_TIMEOUT`": lambda: in_process_with({"KERAS_TPU_STARTUP_TIMEOUT": "2m"}),
    "a resolver naming another pod than the one this process joined": None,  # needs monkeypatch, see below
    "an `accelerator_type` of another size than the pod": None,  # needs monkeypatch, see below
    "pod workers given different worker lists": None,  # needs tmp_path, see below
    "pod workers simulating different numbers of cores": None,
    "`load_weights` of a truncated `.h5`": None,
    "`load_weights` of a file that is not HDF5": None,
    "`load_weights` of a damaged `.keras`": None,
    "`load_weights` of another model's `.h5` (other shapes)": None,
    "`load_weights` of a `.h5` with more layers than the model": None,
    "`load_weights` of another model's `.weights.h5` (Keras would load it silently)": None,
    "a damaged file given to a `TPUStrategy` model's `load_weights`": None,
    "NaN loss under `TerminateOnNaN`": None,
    "NaN loss under `TerminateOnNaN(raise_error=True)`": lambda: nan_raised(),
}


def with_fixtures(mistake, tmp_path, monkeypatch, caplog):
    """The rows that need pytest's fixtures."""
    if mistake == "a resolver naming another pod than the one this process joined":
        monkeypatch.setattr(_process.STATE, "pod", (("10.0.0.2:8476", "10.0.0.3:8476"), 0))
        return lambda: keras_tpu.initialize_tpu_system(keras_tpu.TPUClusterResolver(["10.0.0.2:8476", "10.0.0.4:8476"]))
    if mistake == "an `accelerator_type` of another size than the pod":
        workers = ("10.0.0.2:8476", "10.0.0.3:8476")
        monkeypatch.setattr(_process.STATE, "pod", (workers, 0))
        monkeypatch.setattr(pod, "is_multi_worker", lambda: True)
        monkeypatch.setattr(pod, "num_workers", lambda: 2)
        monkeypatch.setenv("KERAS_TPU_CORES_PER_WORKER", "4")
        return lambda: keras_tpu.initialize_tpu_system(
            keras_tpu.TPUClusterResolver(list(workers), accelerator_type="v2-32", task_index=0))
    if mistake == "pod workers given different worker lists":
        return lambda: pod_of_two(tmp_path, {"KERAS_TPU_WORKERS": "{first},{third}"})
    if mistake == "pod workers simulating different numbers of cores":
        return lambda: pod_of_two(tmp_path, {"KERAS_TPU_CORES_PER_WORKER": "8"})
    if mistake == "`load_weights` of a truncated `.h5`":
        return lambda: keras_tpu.keras_to_tpu_model(compiled(small())).load_weights(truncated(tmp_path, "w.h5"))
    if mistake == "`load_weights` of a file that is not HDF5":
        (tmp_path / "w.weights.h5").write_text("these are not weights")
        return lambda: weights.load_weights(small(), str(tmp_path / "w.weights.h5"))
    if mistake == "`load_weights` of a damaged `.keras`":
        return lambda: weights.load_weights(small(), truncated(tmp_path, "m.keras"))
    if mistake == "`load_weights` of another model's `.h5` (other shapes)":
        save_small(str(tmp_path / "w.h5"))
        return lambda: keras_tpu.keras_to_tpu_model(compiled(small(units=5))).load_weights(str(tmp_path / "w.h5"))
    if mistake == "`load_weights` of a `.h5` with more layers than the model":
        save_small(str(tmp_path / "w.h5"))
        return lambda: weights.load_weights(small(layers=1), str(tmp_path / "w.h5"))
    if mistake == "`load_weights` of another model's `.weights.h5` (Keras would load it silently)":
        save_small(str(tmp_path / "w.weights.h5"))
        return lambda: weights.load_weights(small(layers=1), str(tmp_path / "w.weights.h5"))
    if mistake == "a damaged file given to a `TPUStrategy` model's `load_weights`":
        def load():
            with keras_tpu.TPUStrategy().scope():
                model = small()
            model.load_weights(truncated(tmp_path, "w.weights.h5"))
        return load
    if mistake == "NaN loss under `TerminateOnNaN`":
        return lambda: nan_reported_in_the_log(caplog)
    return MISTAKES[mistake]


def compiled(model):
    model.compile("sgd", "mse")
    return model


ROWS = readme_rows()


def test_the_readme_lists_every_mistake_tested_here_and_at_least_25():
    assert [mistake for mistake, _, _ in ROWS] == list(MISTAKES)
    assert len(ROWS) >= 25


@pytest.mark.parametrize("mistake, exception, message", ROWS, ids=[row[0].strip("`")[:60] for row in ROWS])
def test_each_mistake_gets_its_message(mistake, exception, message, tmp_path, monkeypatch, caplog):
    make_the_mistake = with_fixtures(mistake, tmp_path, monkeypatch, caplog)
    if exception == "logged warning":  # not an error: training stops, and the log says where
        said = make_the_mistake()
    else:
        with pytest.raises(Exception) as raised:
            make_the_mistake()
        said = str(raised.value)
        print("RAISED:", type(raised.value).__name__)
        assert type(raised.value).__name__ == exception, raised.value
    print("SAID:", said)
    assert re.match(message_pattern(message), said, re.S), said


# -- the checks themselves ------------------------------------------------------------------------------


def test_checks_run_once_per_call_not_again_inside_keras(monkeypatch):
    """Keras' fit calls evaluate for the validation data; the TPU model's fit calls Keras'. Each user
    call is checked once."""
    calls = []
    real = validation.check_call
    monkeypatch.setattr(validation, "check_call", lambda *a: (calls.append(a[1]), real(*a))[1])
    model = classifier()
    model.fit(X, Y, batch_size=16, epochs=2, validation_data=(X, Y), verbose=0)
    model.evaluate(X, Y, batch_size=16, verbose=0)
    tpu_classifier().fit(X, Y, batch_size=16, verbose=0)
    assert calls == ["fit", "evaluate", "fit"]


def test_a_peeked_generator_still_gives_every_batch():
    seen = []

    def batches():
        for i in range(4):
            seen.append(i)
            yield X[:8], np.full(8, i % 3)

    model = classifier()
    history = model.fit(batches(), steps_per_epoch=4, epochs=1, verbose=0)
    assert seen == [0, 1, 2, 3] and len(history.history["loss"]) == 1


def test_labels_that_are_right_pass():
    model = classifier()
    ignore = keras.losses.SparseCategoricalCrossentropy(ignore_class=-1)
    with keras_tpu.TPUStrategy().scope():
        padded = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        padded.compile("sgd", ignore)
    validation.check_labels(padded, np.array([0, -1, 2]), "fit")     # the ignored class is allowed
    validation.check_labels(model, Y.reshape(-1, 1).astype("float32"), "fit")  # (rows, 1), whole floats
    validation.check_labels(classifier(loss="categorical_crossentropy"), keras.utils.to_categorical(Y, 3), "fit")
    validation.check_labels(classifier(1, "binary_crossentropy"), np.array([0.0, 0.3, 1.0]), "fit")
    validation.check_labels(classifier(loss="mse"), np.full((3, 3), 9.0), "fit")  # not a classification loss


def test_a_multi_output_model_checks_each_output_with_its_loss():
    inputs = keras.Input((4,))
    with keras_tpu.TPUStrategy().scope():
        model = keras.Model(inputs, {"kind": keras.layers.Dense(3, name="kind")(inputs),
                                     "size": keras.layers.Dense(1, name="size")(inputs)})
        model.compile("sgd", {"kind": "sparse_categorical_crossentropy", "size": "mse"})
    validation.check_labels(model, {"kind": Y, "size": np.full(32, 40.0)}, "fit")
    with pytest.raises(ValueError, match=r"y\['kind'\] holds the label 4 at index 0"):
        validation.check_labels(model, {"kind": np.full(32, 4), "size": np.zeros(32)}, "fit")


def test_addresses_that_are_right_pass():
    assert validation.check_address("grpc://[::1]:8470") == "[::1]:8470"
    assert keras_tpu.TPUClusterResolver("projects/p/locations/z/nodes/my-tpu").is_local
    assert keras_tpu.TPUClusterResolver("10.0.0.2:8470,10.0.0.3:8470,").workers == ["10.0.0.2:8470",
                                                                                    "10.0.0.3:8470"]


def test_right_weights_still_load_and_skip_mismatch_still_skips(tmp_path):
    for name in ("w.h5", "w.weights.h5", "m.keras"):
        saved = save_small(str(tmp_path / name))
        loaded = small()
        weights.load_weights(loaded, str(tmp_path / name))
        for a, b in zip(loaded.get_weights(), saved.get_weights()):
            np.testing.assert_array_equal(a, b)
    other = small(units=5)
    weights.load_weights(other, str(tmp_path / "w.h5"), by_name=True, skip_mismatch=True)
    with h5py.File(tmp_path / "w.h5") as f:  # the file was only read
        assert sorted(f.attrs["layer_names"]) == ["hidden", "logits"]


@pytest.mark.parametrize("argument, value", [("eval_batch_size", -8), ("predict_batch_size", 2.5),
                                             ("train_batch_size", "1024")])
def test_tpu_estimator_refuses_batch_sizes_that_are_not_positive_integers(argument, value, tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"TPUEstimator({argument}={value!r}): the batch size must be a "
                                                   "positive integer")):
        tpu_estimator.TPUEstimator(model_fn=lambda features, labels, mode, params: None, model_dir=str(tmp_path),
                                   **{argument: value})
