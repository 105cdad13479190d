"""MNIST: 28x28 greyscale handwritten digits."""

import gzip
import os

import numpy as np

from keras_tpu.datasets._cache import BUNDLED_DIR, keras_datasets_dir

BUNDLED_IMAGES = os.path.join(BUNDLED_DIR, "mnist", "t10k-images-idx3-ubyte.gz")
BUNDLED_LABELS = os.path.join(BUNDLED_DIR, "mnist", "t10k-labels-idx1-ubyte.gz")
BUNDLED_TRAIN_SIZE = 8000


def load_data(path="mnist.npz"):
    """Load MNIST as ``keras.datasets.mnist.load_data()`` does, without downloading.

    Reads Keras' own ``mnist.npz`` from the Keras cache (``~/.keras/datasets``)
    when present: 60,000 training and 10,000 test images. Otherwise uses the
    copy bundled with keras-tpu, which is only MNIST's official 10,000-image
    **test** split (byte-identical to the published IDX files): its first
    8,000 images are returned as the training set and the last 2,000 as the
    test set.

    Returns:
        ``(x_train, y_train), (x_test, y_test)``: uint8 images ``(n, 28, 28)``
        and uint8 labels ``(n,)``.

    Example:
        >>> (x_train, y_train), (x_test, y_test) = load_data()
        >>> x_train.dtype, x_train.shape[1:], y_train.ndim
        (dtype('uint8'), (28, 28), 1)
    """
    official = os.path.join(keras_datasets_dir(), path)
    if os.path.exists(official):
        with np.load(official, allow_pickle=False) as f:
            return (f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])
    images, labels = _read_idx(BUNDLED_IMAGES), _read_idx(BUNDLED_LABELS)
    n = BUNDLED_TRAIN_SIZE
    return (images[:n], labels[:n]), (images[n:], labels[n:])


def _read_idx(path):
    """Read an IDX file (the format MNIST is published in)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"The bundled MNIST file {path} is missing; reinstall keras-tpu.")
    with gzip.open(path, "rb") as f:
        data = f.read()
    if data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file.")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)
