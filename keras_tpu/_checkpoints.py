"""Training checkpoints in a model directory, safe against crashes.

A checkpoint is one ``.npz`` file holding a list of arrays (model variables,
then optimizer variables) and a small JSON header with the global step. It is
written atomically (see :mod:`keras_tpu._files`: under a temporary name,
fsynced, then renamed to ``ckpt-<step>.npz``); the ``checkpoint`` index naming
the latest file is replaced the same way afterwards. A process killed at any
moment therefore leaves either the previous checkpoint or the new one, never a
half-written file under a checkpoint's name. Restoring falls back to the newest
readable checkpoint if the index points at a missing or damaged file. In a pod
the chief writes and every worker waits until it is done.
"""

import glob
import json
import os
import re
import zipfile

import numpy as np

from keras_tpu import _files

INDEX = "checkpoint"
_NAME = re.compile(r"ckpt-(\d+)\.npz$")


def save(model_dir, step, arrays, metadata=None, keep=5):
    """Write checkpoint ``step`` of ``arrays`` (a list) into ``model_dir``; keep the newest ``keep``.

    Example:
        >>> path = save("/tmp/ckpt_example", 10, [np.ones(3)])
        >>> latest("/tmp/ckpt_example")[0]
        10
    """
    name = f"ckpt-{int(step):08d}.npz"
    _files.on_chief(f"saved {model_dir}/{name}", lambda: _write(model_dir, name, step, arrays, metadata, keep))
    return os.path.join(model_dir, name)


def _write(model_dir, name, step, arrays, metadata, keep):
    os.makedirs(model_dir, exist_ok=True)
    header = dict(metadata or {}, step=int(step), count=len(arrays),
                  shapes=[list(np.shape(a)) for a in arrays], dtypes=[str(np.asarray(a).dtype) for a in arrays])
    payload = {f"a{i}": np.asarray(a) for i, a in enumerate(arrays)}
    payload["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    # One writer (the chief in a pod, which on_chief above arranges), so no barrier per file.
    _files.write_file(os.path.join(model_dir, name), lambda f: np.savez(f, **payload), pod_sync=False)
    steps = sorted(_steps_on_disk(model_dir))
    index = json.dumps({"latest": name, "all": [f"ckpt-{s:08d}.npz" for s in steps]})
    _files.write_file(os.path.join(model_dir, INDEX), lambda f: f.write(index), "w", pod_sync=False)
    for old in steps[:-keep] if keep else []:
        os.remove(os.path.join(model_dir, f"ckpt-{old:08d}.npz"))


def _steps_on_disk(model_dir):
    return [int(m.group(1)) for m in (_NAME.search(p) for p in glob.glob(os.path.join(model_dir, "ckpt-*.npz"))) if m]


def read_checkpoint(path):
    """``(header, arrays)`` of one checkpoint file written by :func:`save` (the estimator reads one directly)."""
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
            header, arrays = read_checkpoint(os.path.join(model_dir, f"ckpt-{step:08d}.npz"))
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            continue  # unreadable: fall back to an older checkpoint
        return header["step"], arrays, header
    return None
