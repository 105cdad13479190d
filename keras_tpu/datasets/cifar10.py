"""CIFAR-10: 50,000 training and 10,000 test 32x32 colour images in 10 classes.

Classes, in label order: airplane, automobile, bird, cat, deer, dog, frog,
horse, ship, truck.
"""

import concurrent.futures
import io
import os
import pickle
import tarfile

import numpy as np

from keras_tpu.datasets._cache import BUNDLED_DIR, cache_path, keras_datasets_dir, load_or_build

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
BUNDLED_ARCHIVE = os.path.join(BUNDLED_DIR, "cifar10-jpeg.tar.gz")
BUNDLED_SHA256 = "097287809041e0a666355dfce11470ba1b3f2631fe910d8793c716253f10b297"

# Keras 3 extracts the official archive into .../cifar-10-batches-py-target/cifar-10-batches-py;
# Keras 2 and tf.keras used .../cifar-10-batches-py.
_OFFICIAL_DIRS = (
    os.path.join("cifar-10-batches-py-target", "cifar-10-batches-py"),
    "cifar-10-batches-py",
)


def load_data():
    """Load CIFAR-10 as ``keras.datasets.cifar10.load_data()`` does, without downloading.

    Reads the official pickled batches from the Keras cache
    (``~/.keras/datasets``) when a previous Keras download left them there.
    Otherwise uses the copy bundled with keras-tpu: the same 60,000 images as
    JPEG files (decoded once, then cached as arrays). JPEG coding changes the
    pixels slightly (median PSNR 30.5 dB against the official ones), which
    costs about a point of test accuracy. The bundled archive keeps each
    class's images in their official order but not the interleaving of
    classes, so the images are interleaved in a fixed pseudo-random order.

    Returns:
        ``(x_train, y_train), (x_test, y_test)``: uint8 arrays of shapes
        ``(50000, 32, 32, 3)``, ``(50000, 1)``, ``(10000, 32, 32, 3)`` and
        ``(10000, 1)``.

    Example:
        >>> (x_train, y_train), (x_test, y_test) = load_data()
        >>> x_train.shape, y_train.shape, x_test.dtype
        ((50000, 32, 32, 3), (50000, 1), dtype('uint8'))
    """
    official = _official_dir()
    arrays = _load_official(official) if official else load_or_build(
        cache_path(f"cifar10-jpeg-{BUNDLED_SHA256[:12]}.npz"), _decode_bundled)
    return (arrays["x_train"], arrays["y_train"]), (arrays["x_test"], arrays["y_test"])


def _official_dir():
    for relative in _OFFICIAL_DIRS:
        path = os.path.join(keras_datasets_dir(), relative)
        if all(os.path.exists(os.path.join(path, name))
               for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
            return path
    return None


def _read_batch(path):
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    images = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    labels = np.asarray(batch[b"labels"], dtype=np.uint8).reshape(-1, 1)
    return images, labels


def _load_official(path):
    train = [_read_batch(os.path.join(path, f"data_batch_{i}")) for i in range(1, 6)]
    x_test, y_test = _read_batch(os.path.join(path, "test_batch"))
    return {"x_train": np.concatenate([x for x, _ in train]), "y_train": np.concatenate([y for _, y in train]),
            "x_test": x_test, "y_test": y_test}


def _decode_jpeg(data):
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


def _decode_bundled():
    if not os.path.exists(BUNDLED_ARCHIVE):
        raise FileNotFoundError(
            f"The bundled CIFAR-10 archive is missing ({BUNDLED_ARCHIVE}); reinstall keras-tpu, or put the "
            f"official 'cifar-10-batches-py' files in {keras_datasets_dir()}."
        )
    files = {"train": [], "test": []}
    with tarfile.open(BUNDLED_ARCHIVE, "r:gz") as archive:
        for member in archive:
            parts = member.name.split("/")
            if member.isfile() and len(parts) == 3 and parts[1] in CLASSES:
                files[parts[0]].append((parts[1], parts[2], archive.extractfile(member).read()))
    arrays = {}
    # Pillow releases the GIL while decoding, so threads use every core.
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for split, count, seed in (("train", 50000, 0), ("test", 10000, 1)):
            entries = sorted(files[split], key=lambda e: (CLASSES.index(e[0]), e[1]))
            if len(entries) != count:
                raise ValueError(f"The bundled CIFAR-10 {split} split has {len(entries)} images, expected {count}.")
            images = np.stack(list(pool.map(_decode_jpeg, [data for _, _, data in entries], chunksize=256)))
            labels = np.array([CLASSES.index(cls) for cls, _, _ in entries], dtype=np.uint8).reshape(-1, 1)
            order = np.random.default_rng(seed).permutation(count)
            arrays[f"x_{split}"], arrays[f"y_{split}"] = images[order], labels[order]
    return arrays
