"""The MXU's convolutions on the host's bfloat16 dot instructions, as XLA custom calls.

XLA:CPU has no bfloat16 convolution: it converts the operands to float32 and
runs Eigen's or YNNPACK's float32 kernels. A host with AVX-512 BF16 multiplies
bf16 pairs exactly and sums them in float32 (``VDPBF16PS``), which is the
MXU's arithmetic, at twice the float32 rate on AMD's Zen 4 (where the
instruction yields fewer products than float32 FMAs, as on Intel's Emerald
Rapids, the kernels sum on FMAs of the widened operands instead:
:func:`sums_on_fma`). ``_direct_conv.cc`` computes convolutions directly (no
im2col patches), on operands as XLA holds them (it pads and packs them itself):
the forward convolution, which also serves the input gradient of a stride-1
convolution, and the weight gradient. This module compiles it once per host into a cache directory (the
C++ compiler and jaxlib's FFI headers are all it needs), registers its two
handlers with XLA, and states a ``conv_general_dilated`` in their terms:
:func:`direct_conv` returns ``None`` for anything they do not cover
(feature or batch groups, more than two spatial dimensions, a dilated
input together with a stride or a dilated window), which then runs as before.

The kernels are used only where :func:`available` (an x86 host with
AVX-512 BF16, a compiler, ``KERAS_TPU_DIRECT_CONV`` not ``0``); the form
choice is in :mod:`keras_tpu.mxu._kernels` (``bf16_direct``).
"""

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from keras_tpu.mxu._host_speed import cache_directories

logger = logging.getLogger("keras_tpu")

_SOURCE = os.path.join(os.path.dirname(__file__), "_direct_conv.cc")
_FLAGS = ("-O3", "-std=c++17", "-march=x86-64-v4", "-mavx512bf16", "-fPIC", "-w")
#: The source's two parts (``KERAS_TPU_PART``: the forward kernel, the weight gradient's), compiled side by side
#: and linked into one library: 8.7 s on 2 cores against 12.6 as one (-O2 would take 7.4 s as one, and its kernels
#: ran the timed training convolutions in 104 ms against 70).
_PARTS = (1, 2)
_FORWARD = "keras_tpu_mxu_conv_forward"
_WEIGHT_GRAD = "keras_tpu_mxu_conv_weight_grad"


def _cpu_flags():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


def _compile(compiler):
    """The path of the compiled library, built into the cache directory unless it is there already."""
    with open(_SOURCE, "rb") as f:
        source = f.read()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), version.encode(),
                                     jax.ffi.include_dir().encode(), jax.__version__.encode()])).hexdigest()[:16]
    name = f"direct_conv-{key}.so"
    for directory in cache_directories("kernels"):
        if os.path.exists(os.path.join(directory, name)):
            return os.path.join(directory, name)
    for directory in cache_directories("kernels"):
        try:
            os.makedirs(directory, exist_ok=True)
            fd, staging = tempfile.mkstemp(suffix=".so", dir=directory)
            break
        except OSError:   # not writable: the next place
            continue
    else:
        raise OSError(f"No writable directory for the compiled kernels among {cache_directories('kernels')}.")
    os.close(fd)
    logger.info("keras-tpu: compiling its MXU convolution kernels for this host (once; about 9 s on 2 cores) into %s",
                directory)
    # Built under a name of its own and renamed into place: a process that loads it never sees half a file.
    objects = [f"{staging}.part{part}.o" for part in _PARTS]
    try:
        _run_at_once([[compiler, *_FLAGS, "-c", f"-DKERAS_TPU_PART={part}", "-I", jax.ffi.include_dir(), _SOURCE,
                       "-o", path] for part, path in zip(_PARTS, objects)])
        subprocess.run([compiler, "-shared", "-fPIC", *objects, "-o", staging], capture_output=True, text=True,
                       check=True)
        os.replace(staging, os.path.join(directory, name))
    finally:
        for path in [staging, *objects]:
            if os.path.exists(path):
                os.remove(path)
    return os.path.join(directory, name)


def _run_at_once(commands):
    """Run ``commands`` side by side; raise ``CalledProcessError`` (with its output) for the first that failed."""
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for command in commands]
    outputs = [process.communicate() for process in running]
    for command, process, (stdout, stderr) in zip(commands, running, outputs):
        if process.returncode != 0:
            raise subprocess.CalledProcessError(process.returncode, command, stdout, stderr)


def always_on():
    """Whether ``KERAS_TPU_DIRECT_CONV=1`` asks for the kernels wherever they run, without timing them against XLA's
    (see :func:`keras_tpu.mxu._kernels.conv_kernels_here`).

    Example:
        >>> always_on() in (True, False)
        True
    """
    return os.environ.get("KERAS_TPU_DIRECT_CONV", "auto").strip() == "1"


@functools.lru_cache(maxsize=None)
def available():
    """Whether the direct convolution kernels run on this host (compiled and registered on first call).

    Example:
        >>> available() in (True, False)
        True
    """
    if os.environ.get("KERAS_TPU_DIRECT_CONV", "auto").strip() == "0":
        return False
    if "avx512_bf16" not in _cpu_flags():
        return False
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        logger.info("keras-tpu: no C++ compiler found; convolutions run on XLA's float32 kernels "
                    "(install g++ for the faster bf16 ones).")
        return False
    global _library
    try:
        library = ctypes.CDLL(_compile(compiler))
        jax.ffi.register_ffi_target(_FORWARD, jax.ffi.pycapsule(library.MxuConvForward), platform="cpu")
        jax.ffi.register_ffi_target(_WEIGHT_GRAD, jax.ffi.pycapsule(library.MxuConvWeightGrad), platform="cpu")
        library.MxuBf16DotSpeedup.restype = ctypes.c_double
    except (OSError, subprocess.CalledProcessError, AttributeError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("keras-tpu: could not build its MXU convolution kernels (%s); convolutions run on XLA's "
                       "float32 kernels.", str(detail).strip()[:2000])
        return False
    _library = library
    return True


_library = None   # the loaded kernels (available())


@functools.lru_cache(maxsize=None)
def sums_on_fma():
    """Whether the kernels sum the MXU's products with float32 FMAs on bfloat16 values widened to float32 (exact
    products too) rather than with the bf16 dot instruction, VDPBF16PS: where that instruction yields fewer
    products per second. Measured once per process (~4 ms): an Intel Xeon of the Emerald Rapids generation runs
    one VDPBF16PS per two cycles and two FMAs per cycle, half the products (0.50x); AMD's Zen 4 the reverse.

    Example:
        >>> sums_on_fma() in (True, False)
        True
    """
    if not available():
        return False
    speedup = _library.MxuBf16DotSpeedup()
    logger.debug("keras-tpu: the bf16 dot instruction sums %.2fx the products of float32 FMAs on this host.", speedup)
    return speedup < 1.0


def _attributes(strides, dilation, padding):
    """The kernels' attributes: strides, window dilation and the zeros before the input (``padding``'s low
    sides; fewer than zero crop it), per spatial dimension, and how they sum (:func:`sums_on_fma`). The high
    sides need no attribute: the output's shape says how far the kernels read, and they read zeros past the
    input."""
    (sh, sw), (dh, dw), ((pt, _), (pl, _)) = strides, dilation, padding
    return dict(sh=np.int64(sh), sw=np.int64(sw), dh=np.int64(dh), dw=np.int64(dw), pt=np.int64(pt),
                pl=np.int64(pl), fma=np.int64(sums_on_fma()))


def _output_size(size, window, strides, padding, dilation):
    return tuple((n + lo + hi - (k - 1) * d - 1) // s + 1
                 for n, k, s, (lo, hi), d in zip(size, window, strides, padding, dilation))


def _forward(x, w, strides, padding, dilation=(1, 1), io_swapped=False, flipped=False):
    """``out[n, y, x, o] = sum x[n, y*sh + i*dh - pad, x*sw + j*dw - pad, c] w[i, j, c, o]``; x NHWC, w HWIO
    (HWOI with ``io_swapped``; ``flipped``: ``w`` holds the window reversed in both spatial dimensions, read back
    to front). The kernel pads the input and packs the weights itself: no padded copy of the activations, no
    rearranged or reversed weights for XLA to write (or to generate code for)."""
    co = w.shape[2] if io_swapped else w.shape[3]
    oh, ow = _output_size(x.shape[1:3], w.shape[:2], strides, padding, dilation)
    return jax.ffi.ffi_call(_FORWARD, jax.ShapeDtypeStruct((x.shape[0], oh, ow, co), jnp.float32))(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), io_swapped=np.int64(io_swapped), flipped=np.int64(flipped),
        **_attributes(strides, dilation, padding))


def _weight_grad(x, g, window, strides, padding, dilation=(1, 1)):
    """``dw[i, j, c, o] = sum x[n, y*sh + i*dh - pad, x*sw + j*dw - pad, c] g[n, y, x, o]``; x, g NHWC."""
    return jax.ffi.ffi_call(_WEIGHT_GRAD, jax.ShapeDtypeStruct(tuple(window) + (x.shape[3], g.shape[3]), jnp.float32))(
        x.astype(jnp.bfloat16), g.astype(jnp.bfloat16), **_attributes(strides, dilation, padding))


def _forward_of_residue(x, taps, pad, outputs):
    return _forward(x, taps, (1, 1), pad)


def _weight_grad_of_residue(x, taps, pad, outputs):
    out = _weight_grad(lax.transpose(x, (3, 1, 2, 0)), jnp.moveaxis(taps, 2, 0), outputs, (1, 1), pad)
    return jnp.moveaxis(out, 2, 0)


def _dilated(x, w, dilation, padding, out_size, convolve):
    """A stride-1 convolution of ``x`` dilated (``dilation - 1`` zeros between its positions), without
    multiplying the zeros: the output's positions of each residue ``r`` modulo the dilation read only the
    window's taps ``k0, k0 + d, ...`` (``k0 = (lo - r) mod d``), so each residue is a stride-1 convolution of
    ``x`` with that part of the window (``convolve(x, taps, padding, outputs)``: the forward kernel for a
    transposed convolution or a strided one's input gradient, the weight-gradient kernel for a transposed
    convolution's kernel gradient), and the residues' outputs interleave into the result."""
    residues = []   # per spatial dim: (first tap, input offset, outputs) of each residue
    for d, (lo, _), n_out in zip(dilation, padding, out_size):
        residues.append([((lo - r) % d, (r + (lo - r) % d - lo) // d, len(range(r, n_out, d))) for r in range(d)])
    rows = max(a for _, _, a in residues[0])
    cols = max(a for _, _, a in residues[1])
    parts = []
    for k0h, ch, ah in residues[0]:
        row = []
        for k0w, cw, aw in residues[1]:
            taps = w[k0h::dilation[0], k0w::dilation[1]]
            if ah == 0 or aw == 0 or taps.shape[0] == 0 or taps.shape[1] == 0:
                part = jnp.zeros((x.shape[0], ah, aw, w.shape[3]), jnp.float32)
            else:
                # Output a reads inputs a + c .. a + c + taps - 1: pad (or crop) x to exactly those.
                pad = [(-c, a + t - 1 - n + c) for c, a, t, n in zip((ch, cw), (ah, aw), taps.shape[:2],
                                                                    x.shape[1:3])]
                part = convolve(x, taps, pad, (ah, aw))
            row.append(jnp.pad(part, ((0, 0), (0, rows - ah), (0, cols - aw), (0, 0))))
        parts.append(jnp.stack(row))
    stacked = jnp.stack(parts)                                  # dh, dw, b, rows, cols, o
    b, o = x.shape[0], w.shape[3]
    out = stacked.transpose(2, 3, 0, 4, 1, 5).reshape(b, rows * dilation[0], cols * dilation[1], o)
    return out[:, :out_size[0], :out_size[1]]


def direct_conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                feature_group_count, batch_group_count, window_reversed=False):
    """``conv_general_dilated`` of bf16-valued operands on the direct kernels (float32 result), or ``None``.

    Any ``conv_general_dilated`` is ``out[b, y, o] = sum over f, k of lhs[b,
    y*stride + k*rhs_dilation - pad, f] rhs[k, f, o]`` (axes named by its
    dimension numbers). Where the rhs's window is smaller than the output
    (a forward convolution, autodiff's input gradient) the forward kernel
    computes it. Where it is larger (autodiff's weight gradient: the rhs is
    the output gradient, the result the kernel's shape) the weight-gradient
    kernel does, reading ``lhs[b, ..., f]`` as example ``f``'s feature ``b``,
    the rhs dilation as the stride and the window stride as the taps'
    dilation.
    One and two spatial dimensions, no groups. An lhs dilation (a transposed
    convolution, its kernel gradient, the input gradient of a strided one)
    only at stride 1 without rhs dilation, one residue of the dilation at a
    time, never multiplying the dilation's zeros; ``None`` for anything else.
    ``window_reversed``: the convolution's window is ``rhs`` reversed in its
    spatial dimensions (autodiff's input gradient reverses the forward
    window), which the forward kernel reads back to front.

    Example:
        >>> x, w = jnp.ones((2, 5, 5, 3)), jnp.ones((3, 3, 3, 16))
        >>> dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
        >>> out = direct_conv(x, w, (1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1), dn, 1, 1)
        >>> out is None or (out.shape, float(out[0, 2, 2, 0])) == ((2, 5, 5, 16), 27.0)
        True
    """
    spatial = lhs.ndim - 2
    if feature_group_count != 1 or batch_group_count != 1 or spatial not in (1, 2) or lhs.size == 0 \
            or rhs.size == 0 or not available():
        return None
    lspec, rspec, ospec = dimension_numbers
    lhs = lax.transpose(lhs, (lspec[0],) + tuple(lspec[2:]) + (lspec[1],))      # b, spatial..., f
    # Autodiff's input gradient states the window as spatial..., o, f: the forward kernel reads it so, untransposed.
    io_swapped = tuple(rspec[2:]) + (rspec[0], rspec[1]) == tuple(range(rhs.ndim))
    as_given = rhs
    rhs = lax.transpose(rhs, tuple(rspec[2:]) + (rspec[1], rspec[0]))           # spatial..., f, o
    pad, size = tuple(tuple(p) for p in padding), lhs.shape[1:-1]
    if spatial == 1:
        lhs, rhs, as_given, pad, size = lhs[:, None], rhs[None], as_given[None], ((0, 0),) + pad, (1,) + size
        window_strides, rhs_dilation = (1,) + tuple(window_strides), (1,) + tuple(rhs_dilation)
        lhs_dilation = (1,) + tuple(lhs_dilation)
    window = rhs.shape[:2]
    padded = [(n - 1) * d + 1 + lo + hi for n, d, (lo, hi) in zip(size, lhs_dilation, pad)]
    out_size = [(p - (k - 1) * d - 1) // s + 1 for p, k, d, s in zip(padded, window, rhs_dilation, window_strides)]
    if min(out_size) < 1:
        return None
    if window_reversed and (any(d != 1 for d in lhs_dilation) or math.prod(window) > math.prod(out_size)):
        rhs = lax.rev(rhs, (0, 1))       # only the forward kernel reads a window reversed
    if any(d != 1 for d in lhs_dilation):
        if any(d != 1 for d in (*window_strides, *rhs_dilation)):
            return None
        # A transposed convolution or a strided one's input gradient (forward kernel), or a transposed
        # convolution's kernel gradient (weight-gradient kernel).
        convolve = _weight_grad_of_residue if math.prod(window) > math.prod(out_size) else _forward_of_residue
        out = _dilated(lhs, rhs, lhs_dilation, pad, out_size, convolve)
    elif math.prod(window) > math.prod(out_size):
        # The rhs dilation steps over the examples' positions, the window stride over the taps.
        examples_first = lax.transpose(lhs, (3, 1, 2, 0))                      # f, spatial..., b
        out = _weight_grad(examples_first, jnp.moveaxis(rhs, 2, 0), out_size, rhs_dilation, pad, window_strides)
        out = jnp.moveaxis(out, 2, 0)                                            # b, spatial..., o
    elif io_swapped:
        out = _forward(lhs, as_given, window_strides, pad, rhs_dilation, io_swapped=True, flipped=window_reversed)
    else:
        out = _forward(lhs, rhs, window_strides, pad, rhs_dilation, flipped=window_reversed)   # b, spatial..., o
    if spatial == 1:
        out = out[:, 0]
    order = (ospec[0],) + tuple(ospec[2:]) + (ospec[1],)      # the axes of ``out``, as dimension_numbers numbers them
    inverse = [0] * len(order)
    for position, axis in enumerate(order):
        inverse[axis] = position
    return out if inverse == list(range(len(order))) else lax.transpose(out, tuple(inverse))
