"""Atomic saves (keras_tpu._files): a killed, interrupted or failed save leaves the previous file."""

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time

import h5py
import keras
import numpy as np
import pytest

from keras_tpu import _files, _checkpoints as checkpoints, _weights as weights
from keras_tpu.datasets import _cache
from keras_tpu._export import ExportedModel, export_model, load_exported
from tests.conftest import REPO, run_python


def _listing(directory):
    return sorted(os.listdir(directory))


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# -- the helper ---------------------------------------------------------------------------------


def test_write_file_renames_a_synced_temporary_onto_the_name(tmp_path, monkeypatch):
    path = tmp_path / "data.bin"
    synced, seen = [], []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 real_fsync(fd)))

    def write(f):
        seen.append(f.name)
        assert not path.exists()  # never written under its own name
        f.write(b"new")

    assert _files.write_file(path, write) == str(path)
    assert path.read_bytes() == b"new" and _listing(tmp_path) == ["data.bin"]
    temp = seen[0]
    assert os.path.dirname(temp) == str(tmp_path) and _files.is_temp_name(temp, of=path)
    assert os.path.basename(temp).startswith(".tmp-keras-tpu-") and temp.endswith("-data.bin")
    assert synced == [temp, str(tmp_path)]  # the file's data, then the rename in its directory
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # usual permissions, not a private temp's


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt(),
                                     ValueError("bad value")])
def test_a_failure_mid_write_keeps_the_previous_file_and_removes_the_temporary(tmp_path, failure):
    path = tmp_path / "weights.h5"
    path.write_bytes(b"previous")

    def half_write(f):
        f.write(b"half")
        f.flush()
        raise failure

    with pytest.raises(type(failure)) as raised:
        _files.write_file(path, half_write)
    assert path.read_bytes() == b"previous" and _listing(tmp_path) == ["weights.h5"]
    if isinstance(failure, OSError):
        assert str(raised.value) == (f"Could not save {path}: No space left on device; "
                                     f"the previous file is unchanged.")
        assert raised.value.errno == errno.ENOSPC and raised.value.__cause__ is failure
    elif isinstance(failure, ValueError):  # other errors keep their type and get a note naming the file
        assert raised.value is failure
        assert f"Could not save {path}; the previous file is unchanged." in failure.__notes__
    else:
        assert raised.value is failure  # Ctrl-C stays Ctrl-C


def test_a_failed_first_save_says_nothing_was_written(tmp_path):
    path = tmp_path / "new.npz"
    with pytest.raises(PermissionError, match=r"^Could not save .*new\.npz: denied; no file was written under"):
        _files.save_file(path, lambda tmp: (open(tmp, "wb").close(), _raise(PermissionError("denied"))))
    assert _listing(tmp_path) == []


def _raise(error):
    raise error


def test_save_file_gives_writers_a_fresh_name_with_the_same_ending(tmp_path):
    path = tmp_path / "model.weights.h5"
    names = []

    def save(tmp):
        names.append(tmp)
        assert not os.path.exists(tmp)
        with h5py.File(tmp, "w") as f:
            f["x"] = np.arange(3)

    _files.save_file(path, save)
    _files.save_file(path, save)
    assert names[0] != names[1] and all(n.endswith("-model.weights.h5") for n in names)
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["x"][()], np.arange(3))
    with pytest.raises(FileNotFoundError, match="the writer did not create the file"):
        _files.save_file(path, lambda tmp: None)
    assert _listing(tmp_path) == ["model.weights.h5"]


def test_hdf5_write_errors_become_clear_os_errors(tmp_path):
    """h5py reports HDF5's failed writes (a full disk) as RuntimeError with the errno in the text."""
    path = tmp_path / "model.weights.h5"
    path.write_bytes(b"previous")
    hdf5 = RuntimeError("Can't write data (file write failed: time = ..., filename = '...', file descriptor = 3, "
                        "errno = 28, error message = 'No space left on device', buf = 0x0, total write size = 9)")
    with pytest.raises(OSError) as raised:
        _files.save_file(path, lambda tmp: (open(tmp, "wb").close(), _raise(hdf5)))
    assert str(raised.value) == f"Could not save {path}: No space left on device; the previous file is unchanged."
    assert raised.value.errno == errno.ENOSPC and path.read_bytes() == b"previous"
    assert _listing(tmp_path) == ["model.weights.h5"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_directory_is_replaced_whole(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(_files, "_exchange", lambda a, b: False)
    path = tmp_path / "export"

    def write(*files):
        def save(directory):
            assert os.listdir(directory) == [] and not os.path.samefile(directory, tmp_path)
            for name in files:
                with open(os.path.join(directory, name), "w") as f:
                    f.write(name)
        return save

    _files.save_directory(path, write("a", "b"))
    assert _listing(path) == ["a", "b"]

    def half(directory):
        write("c")(directory)
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError, match=r"export: Input/output error; the previous directory is unchanged\.$"):
        _files.save_directory(path, half)
    assert _listing(path) == ["a", "b"] and _listing(tmp_path) == ["export"]
    _files.save_directory(path, write("c"))
    assert _listing(path) == ["c"] and _listing(tmp_path) == ["export"]  # the old directory is gone


def test_temporaries_left_by_killed_processes_are_removed_by_the_next_save(tmp_path):
    path = tmp_path / "model.h5"
    dead, alive = _dead_pid(), os.getppid()
    host = _files._HOST
    other_host = f"{(int(host, 16) + 1) % 2**32:08x}"
    left = {
        f".tmp-keras-tpu-{host}-{dead}-0123abcd-model.h5": False,        # ours, its process gone: removed
        f".tmp-keras-tpu-{host}-{alive}-0123abcd-model.h5": True,        # a running save: kept
        f".tmp-keras-tpu-{other_host}-{dead}-0123abcd-model.h5": True,   # another host's: kept
        f".tmp-keras-tpu-{host}-{dead}-0123abcd-ckpt-1.npz": False,      # another file's, as dead: removed
        ".tmp-something-else": True,
    }
    for name in left:
        (tmp_path / name).write_bytes(b"partial")
    (tmp_path / f".tmp-keras-tpu-{host}-{dead}-89abcdef-model.h5").mkdir()  # a killed directory save
    _files.write_file(path, lambda f: f.write(b"done"))
    assert _listing(tmp_path) == sorted(["model.h5"] + [name for name, kept in left.items() if kept])


def test_on_chief_on_one_process_just_runs(tmp_path):
    assert _files.on_chief("nothing", lambda: 42) == 42


# -- the callers -------------------------------------------------------------------------------


def _dense(units=4, value=None):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units), keras.layers.Dense(2)])
    if value is not None:
        model.set_weights([np.full(w.shape, value, w.dtype) for w in model.get_weights()])
    return model


@pytest.mark.parametrize("name", ["model.h5", "model.weights.h5", "model.keras"])
def test_weight_and_model_saves_fail_cleanly(tmp_path, monkeypatch, name):
    path = str(tmp_path / name)
    save = weights.save_model if name.endswith(".keras") else weights.save_weights
    save(_dense(value=1.0), path)
    before = open(path, "rb").read()
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: _raise(OSError(errno.EDQUOT, "Disk quota exceeded")))
    with pytest.raises(OSError, match=f"^Could not save {path}: Disk quota exceeded; the previous file is unchanged"):
        save(_dense(value=2.0), path)
    monkeypatch.setattr(os, "replace", real_replace)
    assert open(path, "rb").read() == before and _listing(tmp_path) == [name]
    loaded = _dense()
    loaded.load_weights(path)
    assert all(np.all(w == 1.0) for w in loaded.get_weights())


def test_checkpoints_fail_cleanly_and_fall_back(tmp_path, monkeypatch):
    checkpoints.save(str(tmp_path), 1, [np.ones(3)])
    monkeypatch.setattr(np, "savez", lambda f, **arrays: (f.write(b"PK\x03\x04 half a zip"),
                                                          _raise(OSError(errno.ENOSPC, "No space left on device"))))
    with pytest.raises(OSError, match=r"ckpt-00000002\.npz: No space left on device; no file was written"):
        checkpoints.save(str(tmp_path), 2, [np.full(3, 2.0)])
    assert _listing(tmp_path) == ["checkpoint", "ckpt-00000001.npz"]
    step, arrays, _ = checkpoints.latest(str(tmp_path))
    assert step == 1 and np.all(arrays[0] == 1)


def test_a_failed_export_keeps_the_previous_export(tmp_path, monkeypatch):
    path = str(tmp_path / "exported")
    export_model(_dense(value=1.0), path)
    monkeypatch.setattr(np, "savez", lambda *a, **k: _raise(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError, match="No space left on device; the previous directory is unchanged"):
        export_model(_dense(value=2.0), path)
    monkeypatch.undo()
    assert _listing(tmp_path) == ["exported"]
    ones = np.ones((1, 3), np.float32)  # all weights v: 4 units of 3v + v, then 4 * 4v * v + v
    np.testing.assert_allclose(load_exported(path)(ones), np.full((1, 2), 17.0), rtol=1e-2)
    export_model(_dense(value=0.5), path)
    assert _listing(tmp_path) == ["exported"]
    np.testing.assert_allclose(load_exported(path)(ones), np.full((1, 2), 4.5), rtol=1e-2)


def test_the_dataset_cache_is_written_atomically(tmp_path):
    path = str(tmp_path / "cache.npz")
    assert _cache.load_or_build(path, lambda: {"x": np.arange(4)})["x"].tolist() == [0, 1, 2, 3]
    assert _listing(tmp_path) == ["cache.npz"]
    assert _cache.load_or_build(path, lambda: _raise(AssertionError("rebuilt")))["x"].tolist() == [0, 1, 2, 3]


# -- real processes: SIGKILL at random moments, and a full disk ------------------------------------

SAVER = """
import os, sys
import keras_tpu, keras, numpy as np
from keras_tpu import _checkpoints as checkpoints, _weights as weights
from keras_tpu._export import export_model
directory = sys.argv[1]
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512), keras.layers.Dense(256), keras.layers.Dense(10)])
step = 0
while True:
    step += 1  # every weight of save number `step` is `step`: a torn file would mix values
    model.set_weights([np.full(w.shape, step, w.dtype) for w in model.get_weights()])
    weights.save_weights(model, os.path.join(directory, "model.h5"))
    weights.save_weights(model, os.path.join(directory, "model.weights.h5"))
    checkpoints.save(directory, step, model.get_weights(), keep=2)  # what TPUEstimator writes
    weights.save_model(model, os.path.join(directory, "model.keras"))
    export_model(model, os.path.join(directory, "exported"))
    if step == 1:
        print("SAVED", flush=True)
"""

FINAL_NAMES = ("model.h5", "model.weights.h5", "checkpoint", "model.keras", "exported")


def _saver_model():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(512), keras.layers.Dense(256),
                             keras.layers.Dense(10)])


def _step_of(arrays):
    values = {float(v) for a in arrays for v in np.unique(a)}
    assert len(values) == 1, f"a torn save: values {sorted(values)[:5]}"
    return int(values.pop())


def _check_after_kill(directory):
    """Every file under a final name is complete and loads; what else is there is a temporary."""
    names = _listing(directory)
    leftovers = [n for n in names if n not in FINAL_NAMES and not checkpoints._NAME.match(n)]
    assert all(_files.is_temp_name(n) for n in leftovers), names
    steps = {}
    for name in ("model.h5", "model.weights.h5"):
        with h5py.File(os.path.join(directory, name), "r"):
            pass
        model = _saver_model()
        weights.load_weights(model, os.path.join(directory, name))
        steps[name] = _step_of(model.get_weights())
    with open(os.path.join(directory, "checkpoint")) as f:
        json.load(f)
    for name in names:
        if checkpoints._NAME.match(name):
            with np.load(os.path.join(directory, name)) as data:
                assert _step_of([data[k] for k in data.files if k != "header"]) == int(name[5:13])
    step, arrays, _ = checkpoints.latest(directory)
    assert _step_of(arrays) == step
    model = _saver_model()
    weights.load_weights(model, os.path.join(directory, "model.keras"))
    exported = ExportedModel(os.path.join(directory, "exported"))  # complete: its artifact deserializes
    assert exported(np.zeros((2, 64), np.float32)).shape == (2, 10)
    # Saved in this order, so each is the same save as the one before it, or one behind.
    in_order = [steps["model.h5"], steps["model.weights.h5"], step, _step_of(model.get_weights()),
                _step_of(exported.trainable)]
    assert in_order == sorted(in_order, reverse=True) and in_order[0] - in_order[-1] <= 1, in_order
    return len(leftovers)


def _kill_savers(tmp_path, kills, parallel):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND", "KERAS_TPU_WORKERS")}
    rng = random.Random(0)
    leftovers = 0
    for round_ in range(0, kills, parallel):
        savers = []
        for i in range(round_, min(kills, round_ + parallel)):
            directory = tmp_path / f"saver-{i}"
            directory.mkdir()
            with open(tmp_path / f"saver-{i}.log", "w") as log:
                savers.append((directory, subprocess.Popen([sys.executable, "-c", SAVER, str(directory)], cwd=REPO,
                                                           env=env, stdout=subprocess.PIPE, stderr=log, text=True)))
        for directory, saver in savers:
            line = saver.stdout.readline()  # blocks until the first complete round of saves
            assert line.strip() == "SAVED", open(f"{directory}.log").read()[-3000:]
            time.sleep(rng.uniform(0.0, 1.5))  # kill somewhere in a later round, at a random moment
            saver.kill()
            saver.wait()  # reaped: its pid no longer runs
            saver.stdout.close()
        for directory, _ in savers:
            leftovers += _check_after_kill(str(directory))
    # A later save in the same place (by another process) removes the killed processes' temporaries.
    directory = str(tmp_path / "saver-0")
    model = _saver_model()
    weights.save_weights(model, os.path.join(directory, "model.h5"))
    weights.save_weights(model, os.path.join(directory, "model.weights.h5"))
    checkpoints.save(directory, 10**6, model.get_weights(), keep=2)
    weights.save_model(model, os.path.join(directory, "model.keras"))
    export_model(model, os.path.join(directory, "exported"))
    assert not [n for n in _listing(directory) if _files.is_temp_name(n)]
    return leftovers


@pytest.mark.slow
def test_saves_killed_at_fifteen_random_moments_leave_loadable_files(tmp_path):
    _kill_savers(tmp_path, kills=15, parallel=3)


FULL_DISK = """
import json, os, resource, signal, sys
import keras_tpu, keras, numpy as np
from keras_tpu import _checkpoints as checkpoints, _weights as weights
from keras_tpu.datasets import _cache
from keras_tpu._export import export_model
directory = sys.argv[1]
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(10)])
model.set_weights([np.full(w.shape, 1.0, w.dtype) for w in model.get_weights()])
names = ["model.h5", "model.keras", "model.weights.h5"]
for name in names:
    (weights.save_model if name.endswith(".keras") else weights.save_weights)(model, os.path.join(directory, name))
checkpoints.save(directory, 1, model.get_weights())
export_model(model, os.path.join(directory, "exported"))
model.set_weights([np.full(w.shape, 2.0, w.dtype) for w in model.get_weights()])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so that write() fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # files of at most 4 kB
errors = {}
def attempt(key, save):
    try:
        save()
        errors[key] = None
    except Exception as error:
        errors[key] = [type(error).__name__, str(error), getattr(error, "errno", None)]
attempt("checkpoint", lambda: checkpoints.save(directory, 1, model.get_weights()))
attempt("exported", lambda: export_model(model, os.path.join(directory, "exported")))
attempt("cache.npz", lambda: _cache.load_or_build(os.path.join(directory, "cache.npz"),
                                                   lambda: {"x": np.zeros(10000)}))
for name in names:  # Keras' own .weights.h5 writer last (see below)
    attempt(name, lambda: (weights.save_model if name.endswith(".keras") else weights.save_weights)(
        model, os.path.join(directory, name)))
print("ERRORS", json.dumps(errors), flush=True)
# Keras writes .weights.h5 through HDF5, which keeps the failed file's objects and crashes when
# it closes them at exit: skip HDF5's exit handler (the save itself failed cleanly).
os._exit(0)
"""


def test_a_full_disk_fails_with_a_clear_error_and_keeps_the_previous_files(tmp_path):
    code = f"import sys; sys.argv = ['-c', {str(tmp_path)!r}]\n" + FULL_DISK
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.split("ERRORS", 1)[1])
    for name in ["checkpoint", "exported", "model.h5", "model.keras", "model.weights.h5"]:
        kind, message, code = errors[name]
        kind_of_file = "directory" if name == "exported" else "file"
        target = os.path.join(str(tmp_path), "ckpt-00000001.npz" if name == "checkpoint" else name)
        assert kind == "OSError" and code == errno.EFBIG, (name, errors[name])
        assert message == f"Could not save {target}: File too large; the previous {kind_of_file} is unchanged."
    kind, message, code = errors["cache.npz"]
    assert message.endswith("cache.npz: File too large; no file was written under that name.")
    assert _listing(tmp_path) == ["checkpoint", "ckpt-00000001.npz", "exported", "model.h5", "model.keras",
                                  "model.weights.h5"]  # no temporaries
    for name in ["model.h5", "model.keras", "model.weights.h5"]:
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(10)])
        model.load_weights(str(tmp_path / name))
        assert all(np.all(w == 1.0) for w in model.get_weights()), name  # the previous save's weights
    step, arrays, _ = checkpoints.latest(str(tmp_path))
    assert step == 1 and all(np.all(a == 1.0) for a in arrays)
    assert load_exported(str(tmp_path / "exported"))(np.zeros((2, 64), np.float32)).shape == (2, 10)


POD = """
import os, sys, time
import keras_tpu, h5py, jax, keras, numpy as np
from keras_tpu import _keras_private, _checkpoints as checkpoints, _weights as weights
directory = sys.argv[1]
chief = jax.process_index() == 0
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
path = os.path.join(directory, "model.h5")
write = _keras_private.legacy_h5.save_weights_to_hdf5_group

def slow_write(f, model):
    time.sleep(2)  # the other worker must wait for this at the barrier
    write(f, model)

_keras_private.legacy_h5.save_weights_to_hdf5_group = slow_write
weights.save_weights(model, path)
with h5py.File(path) as f:  # readable on every worker as soon as save_weights returns
    print("READ", sorted(f.keys()) != [], flush=True)

def broken_write(f, model):
    raise OSError(28, "No space left on device")

if chief:
    _keras_private.legacy_h5.save_weights_to_hdf5_group = broken_write
try:
    weights.save_weights(model, path)
    print("SAVED")
except OSError as error:  # on every worker, not only on the chief (the others do not hang)
    print("ERROR", error, flush=True)
checkpoints.save(directory, 7, model.get_weights())
print("CHECKPOINT", checkpoints.latest(directory)[0], flush=True)
"""


@pytest.mark.slow
def test_in_a_pod_the_chief_writes_and_every_worker_waits_and_hears_of_failures(tmp_path):
    from tests.test_pod_and_export import finish, launch

    results = finish(launch(POD, 2, 4, tmp_path), timeout=300)
    for returncode, out, err in results:
        assert returncode == 0, err[-3000:]
        assert "READ True" in out and "CHECKPOINT 7" in out and "SAVED" not in out
    path = tmp_path / "model.h5"
    assert (f"ERROR Could not save {path}: No space left on device; the previous file is unchanged."
            in results[0][1])
    assert f"ERROR Could not save {path}: the chief worker failed to write it; see its error." in results[1][1]
    assert _listing(tmp_path) == ["checkpoint", "ckpt-00000007.npz", "model.h5"]


# -- training killed mid-epoch, then resumed ---------------------------------------------------------

TRAINER = """
import json, os, signal, sys
import keras_tpu, keras, numpy as np
backup, out, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.standard_normal((96, 6)).astype("float32")
y = x[:, :3].argmax(axis=1)
with keras_tpu.TPUStrategy().scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")

class KillMidEpoch(keras.callbacks.Callback):
    batches = 0

    def on_train_batch_end(self, batch, logs=None):
        KillMidEpoch.batches += 1
        if KillMidEpoch.batches == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of any kind, as a lost machine

callbacks = [keras.callbacks.BackupAndRestore(backup),
             keras.callbacks.ModelCheckpoint(backup + "-last.weights.h5", save_weights_only=True),
             KillMidEpoch()]
history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
np.save(out, np.concatenate([w.ravel() for w in model.get_weights()]))
print("EPOCHS", json.dumps(history.epoch), flush=True)
"""


def _train(backup, out, kill_after):
    result = run_python(f"import sys; sys.argv = ['-c', {str(backup)!r}, {str(out)!r}, '{kill_after}']\n"
                        + TRAINER, timeout=300)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", [9, 22], ids=["epoch-2", "epoch-4"])
def test_training_killed_mid_epoch_resumes_to_the_same_weights(tmp_path, kill_after):
    """6 batches per epoch: batch 9 is in the middle of epoch 2, batch 22 in the middle of epoch 4."""
    whole = _train(tmp_path / "whole", tmp_path / "whole.npy", -1)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = _train(tmp_path / "backup", tmp_path / "never.npy", kill_after)
    assert killed.returncode == -signal.SIGKILL and not (tmp_path / "never.npy").exists(), killed.stderr[-3000:]
    resumed = _train(tmp_path / "backup", tmp_path / "resumed.npy", -1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = (kill_after - 1) // 6  # epochs completed (and backed up) before the kill
    assert f"EPOCHS {list(range(done, 4))}" in resumed.stdout  # resumed at the interrupted epoch
    np.testing.assert_array_equal(np.load(tmp_path / "resumed.npy"), np.load(tmp_path / "whole.npy"))
    last = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16), keras.layers.Dense(3)])
    last.load_weights(str(tmp_path / "backup-last.weights.h5"))  # ModelCheckpoint's file: the final weights
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in last.get_weights()]),
                                  np.load(tmp_path / "whole.npy"))
