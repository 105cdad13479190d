"""Training checkpoints in a model directory, safe against crashes.

A checkpoint is one ``.npz`` file holding a list of arrays (model variables,
then optimizer variables) and a small JSON header with the global step. It is
written under a temporary name, flushed to disk and only then renamed to
``ckpt-<step>.npz``; the ``checkpoint`` index naming the latest file is
replaced the same way afterwards. A process killed at any moment therefore
leaves either the previous checkpoint or the new one, never a half-written
file under a checkpoint's name. Restoring falls back to the newest readable
checkpoint if the index points at a missing or damaged file.
"""

import glob
import json
import os
import re
import tempfile
import zipfile

import numpy as np

INDEX = "checkpoint"
_NAME = re.compile(r"ckpt-(\d+)\.npz$")


def _atomic_write(path, write):
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save(model_dir, step, arrays, metadata=None, keep=5):
    """Write checkpoint ``step`` of ``arrays`` (a list) into ``model_dir``; keep the newest ``keep``.

    Example:
        >>> path = save("/tmp/ckpt_example", 10, [np.ones(3)])
        >>> latest("/tmp/ckpt_example")[0]
        10
    """
    from keras_tpu import pod

    if not pod.is_chief():  # one writer in a pod; the others wait at the next collective
        return os.path.join(model_dir, f"ckpt-{int(step):08d}.npz")
    os.makedirs(model_dir, exist_ok=True)
    header = dict(metadata or {}, step=int(step), count=len(arrays),
                  shapes=[list(np.shape(a)) for a in arrays], dtypes=[str(np.asarray(a).dtype) for a in arrays])
    name = f"ckpt-{int(step):08d}.npz"
    payload = {f"a{i}": np.asarray(a) for i, a in enumerate(arrays)}
    payload["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    _atomic_write(os.path.join(model_dir, name), lambda f: np.savez(f, **payload))
    steps = sorted(_steps_on_disk(model_dir))
    _atomic_write(os.path.join(model_dir, INDEX),
                  lambda f: f.write(json.dumps({"latest": name, "all": [f"ckpt-{s:08d}.npz" for s in steps]}).encode()))
    for old in steps[:-keep] if keep else []:
        os.remove(os.path.join(model_dir, f"ckpt-{old:08d}.npz"))
    return os.path.join(model_dir, name)


def _steps_on_disk(model_dir):
    return [int(m.group(1)) for m in (_NAME.search(p) for p in glob.glob(os.path.join(model_dir, "ckpt-*.npz"))) if m]


def _read(path):
    with np.load(path, allow_pickle=False) as data:
        header = json.loads(bytes(data["header"]).decode())
        arrays = [data[f"a{i}"] for i in range(header["count"])]
    return header, arrays


def latest(model_dir):
    """``(step, arrays, header)`` of the newest readable checkpoint in ``model_dir``, or ``None``."""
    if not model_dir or not os.path.isdir(model_dir):
        return None
    candidates = sorted(_steps_on_disk(model_dir), reverse=True)
    try:
        with open(os.path.join(model_dir, INDEX)) as f:
            named = _NAME.search(json.load(f)["latest"])
        if named:
            candidates.insert(0, int(named.group(1)))
    except (OSError, ValueError, KeyError):
        pass  # no index, or a damaged one: look at the files themselves
    for step in candidates:
        try:
            header, arrays = _read(os.path.join(model_dir, f"ckpt-{step:08d}.npz"))
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            continue  # unreadable: fall back to an older checkpoint
        return header["step"], arrays, header
    return None
