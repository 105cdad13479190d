"""Atomic saves: a file or directory appears under its name complete, or not at all.

Every file keras-tpu writes (weights, whole models, checkpoints, exports, the
dataset cache) goes through this module:

* the content is written under a unique temporary name in the destination's
  own directory (``.tmp-keras-tpu-<host>-<pid>-<random>-<name>``; it keeps the
  destination's ending, which Keras, h5py and NumPy look at), never under the
  final name;
* the file (every file, for a directory) is flushed to disk with ``fsync``;
* it is moved onto the final name with one ``rename`` (an existing directory is
  swapped with ``renameat2(RENAME_EXCHANGE)`` where the system has it), and the
  parent directory is fsynced so that the rename itself survives a power cut;
* on any failure, Ctrl-C included, the temporary is removed and the previous
  file is left as it was; an ``OSError`` is raised again with a message naming
  the file ("Could not save model.h5: No space left on device; the previous
  file is unchanged.").

A process killed with SIGKILL (or a power cut) cannot remove its temporary:
it stays behind, hidden by its leading dot, until a later successful save in
the same directory on the same host removes it (its process being gone).

In a TPU pod (several worker processes, see :mod:`keras_tpu._pod`) only the
chief writes; every worker then waits at :func:`keras_tpu._pod.barrier`, so no
worker reads a file the chief is still writing, and a failed write raises on
every worker. Callers that already run on the chief alone pass
``pod_sync=False`` (so do callers writing per-host files such as caches).
"""

import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import zlib

TEMP_PREFIX = ".tmp-keras-tpu-"
_HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"
_HDF5_ERRNO = re.compile(r"errno = (\d+), error message = '([^']*)'")  # how HDF5 reports a failed write
_TEMP = re.compile(re.escape(TEMP_PREFIX) + r"(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}-(?P<name>.+)\Z", re.S)


def temp_name(path):
    """A fresh temporary name next to ``path`` that ends like ``path``."""
    directory, name = os.path.split(os.path.abspath(path))
    if len(os.fsencode(name)) > 180:  # stay within the usual 255-byte limit on file names
        name = name[-120:]
    return os.path.join(directory, f"{TEMP_PREFIX}{_HOST}-{os.getpid()}-{secrets.token_hex(4)}-{name}")


def is_temp_name(name, of=None):
    """Whether ``name`` (a file name) is one of this module's temporaries (of the file ``of``, if given)."""
    match = _TEMP.match(os.path.basename(name))
    return bool(match) and (of is None or match.group("name") == os.path.basename(os.path.abspath(of)))


def write_file(path, write, mode="wb", *, pod_sync=True):
    """Atomically write ``path`` with ``write(f)``, ``f`` an open file (``mode`` ``"wb"`` or ``"w"``).

    Example:
        >>> write_file("/tmp/atomic_example.txt", lambda f: f.write("hello"), "w")
        '/tmp/atomic_example.txt'
        >>> open("/tmp/atomic_example.txt").read()
        'hello'
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"write_file writes a new file: mode must be 'wb' or 'w', not {mode!r}.")

    def save(tmp):
        with open(tmp, mode.replace("w", "x"), **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)

    return save_file(path, save, pod_sync=pod_sync)


def save_file(path, save, *, pod_sync=True):
    """Atomically write ``path`` with ``save(tmp_path)``, for writers that take a file name
    (h5py, Keras' ``save``/``save_weights``, ``np.savez``). Returns ``path``.

    ``tmp_path`` does not exist yet and ends like ``path`` (``.weights.h5``, ``.keras``, ``.npz``...).
    """
    return _on_chief_if(pod_sync, os.fspath(path), lambda: _replace(os.fspath(path), save, directory=False))


def save_directory(path, save, *, pod_sync=True):
    """Atomically write the directory ``path`` with ``save(tmp_dir)``, ``tmp_dir`` an empty directory.

    An existing ``path`` is replaced by the new directory only once it is complete;
    it is swapped in one step where the system can (Linux' ``renameat2``).
    """
    return _on_chief_if(pod_sync, os.fspath(path), lambda: _replace(os.fspath(path), save, directory=True))


def on_chief(name, fn, failure_message=None):
    """Run ``fn()`` on the chief only, then make every worker of a pod wait at ``pod.barrier(name)``.

    Returns ``fn()``'s result on the chief (``None`` on the other workers). If
    ``fn`` fails on the chief, it raises there and an ``OSError`` (with
    ``failure_message``) on the other workers, after the barrier. On one
    process this is just ``fn()``.
    """
    from keras_tpu import _pod as pod

    if not pod.is_multi_worker():
        return fn()
    result, failure = None, None
    if pod.is_chief():
        try:
            result = fn()
        except Exception as error:  # reach the barrier anyway: the other workers would wait forever
            failure = error
    pod.barrier(name)  # nobody goes on to read a file that is still being written
    import numpy as np
    from jax.experimental import multihost_utils

    chief_ok = bool(multihost_utils.broadcast_one_to_all(np.int32(failure is None)))
    if failure is not None:
        raise failure
    if not chief_ok:
        raise OSError(failure_message or f"The chief worker failed at {name!r}; see its error.")
    return result


def _on_chief_if(pod_sync, path, fn):
    if pod_sync:
        on_chief(f"saved {path}", fn, f"Could not save {path}: the chief worker failed to write it; see its error.")
    else:
        fn()
    return path


def _replace(path, save, directory):
    target = os.path.abspath(path)
    parent = os.path.dirname(target)
    existed = os.path.lexists(target)
    tmp = temp_name(target)
    try:
        if directory:
            os.mkdir(tmp)
        save(tmp)
        if not os.path.lexists(tmp):
            raise FileNotFoundError(errno.ENOENT, "the writer did not create the file")
        _fsync_tree(tmp)
        old = _swap(tmp, target) if directory and existed else os.replace(tmp, target)
        _fsync_directory(parent)
    except BaseException as error:  # Ctrl-C included: never leave the temporary behind
        try:
            _remove(tmp)
        except OSError:
            pass
        if isinstance(error, OSError):
            raise _clear_error(error, path, existed, directory) from error
        hdf5 = _HDF5_ERRNO.search(str(error)) if isinstance(error, Exception) else None
        if hdf5:  # h5py raises HDF5's I/O failures (a full disk) as RuntimeError
            clear = OSError(_message(path, hdf5.group(2), existed, directory))
            clear.errno = int(hdf5.group(1))
            raise clear from error
        if isinstance(error, Exception):
            error.add_note(_message(path, None, existed, directory))
        raise
    if old:
        _remove(old)
    _remove_stale_temps(target)
    return path


def _message(path, reason, existed, directory):
    kind = "directory" if directory else "file"
    after = f"the previous {kind} is unchanged" if existed else f"no {kind} was written under that name"
    return f"Could not save {path}: {reason}; {after}." if reason else f"Could not save {path}; {after}."


def _clear_error(error, path, existed, directory):
    """``error`` (an OSError) again, of the same type and errno, with a message naming ``path``."""
    reason = error.strerror or str(error) or type(error).__name__
    message = _message(path, reason, existed, directory)
    try:
        clear = type(error)(message)  # one argument: str(clear) is the message alone
    except Exception:
        clear = OSError(message)
    clear.errno = error.errno  # (setting strerror too would make str() drop the message)
    return clear


def _swap(new, target):
    """Put the directory ``new`` at ``target``; return where the previous ``target`` now is."""
    if _exchange(new, target):
        return new
    aside = temp_name(target)  # no atomic exchange on this system: two renames
    os.replace(target, aside)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(aside, target)
        raise
    return aside


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a, b):
    """Swap two paths in one step with Linux' ``renameat2``; False where that is not available."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # old kernel or a file system without exchange
    raise OSError(code, os.strerror(code), b)


def _fsync_tree(path):
    if os.path.isdir(path) and not os.path.islink(path):
        for root, dirs, files in os.walk(path):
            for name in files:
                _fsync_file(os.path.join(root, name))
            for name in dirs:
                _fsync_directory(os.path.join(root, name))
        _fsync_directory(path)
    else:
        _fsync_file(path)


def _fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(path):
    if os.name == "nt":
        return  # directories cannot be opened (nor need to be synced) on Windows
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # file systems that cannot
            raise
    finally:
        os.close(fd)


def _remove(path):
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def _remove_stale_temps(target):
    """Remove the temporaries in ``target``'s directory left by processes of this host that no
    longer run (killed mid-save)."""
    directory = os.path.dirname(target)
    try:
        entries = [e for e in os.listdir(directory) if e.startswith(TEMP_PREFIX)]
    except OSError:
        return
    for entry in entries:
        match = _TEMP.match(entry)
        if not match or match.group("host") != _HOST:
            continue
        pid = int(match.group("pid"))
        if pid == os.getpid() or _running(pid):
            continue
        try:
            _remove(os.path.join(directory, entry))
        except OSError:
            pass  # someone else's, or already gone: not our business


def _running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True
