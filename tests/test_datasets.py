"""keras_tpu.datasets: what keras.datasets returns, from the bundled copies or the Keras cache."""

import gzip
import os
import pickle

import numpy as np
import pytest

from keras_tpu.datasets import cifar10, mnist
from keras_tpu.datasets._cache import cache_path


def test_cifar10_from_the_bundled_jpegs():
    (x_train, y_train), (x_test, y_test) = cifar10.load_data()
    assert x_train.shape == (50000, 32, 32, 3) and x_test.shape == (10000, 32, 32, 3)
    assert y_train.shape == (50000, 1) and y_test.shape == (10000, 1)
    assert x_train.dtype == y_train.dtype == np.uint8
    assert np.bincount(y_train[:, 0]).tolist() == [5000] * 10
    assert np.bincount(y_test[:, 0]).tolist() == [1000] * 10
    # Classes are interleaved, not sorted (validation_split takes the last rows).
    assert len(np.unique(y_train[-5000:, 0])) == 10
    # Real photographs: full range of pixel values, colour, and per-class structure
    # (the sky-heavy airplane and ship classes are bluer than the rest).
    assert x_train.min() == 0 and x_train.max() == 255
    blue_minus_red = x_train[..., 2].mean(axis=(1, 2)) - x_train[..., 0].mean(axis=(1, 2))
    by_class = [blue_minus_red[y_train[:, 0] == c].mean() for c in range(10)]
    assert by_class[0] > 5 and by_class[8] > 5 and by_class[6] < 0  # airplane, ship > 0 > frog
    assert os.path.exists(cache_path(f"cifar10-jpeg-{cifar10.BUNDLED_SHA256[:12]}.npz"))


def _write_official_batch(path, images, labels):
    data = images.transpose(0, 3, 1, 2).reshape(len(images), -1)  # the official CHW rows
    with open(path, "wb") as f:
        pickle.dump({b"data": data, b"labels": list(map(int, labels))}, f)


def test_cifar10_reads_the_official_files_from_the_keras_cache(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    official = tmp_path / "datasets" / "cifar-10-batches-py-target" / "cifar-10-batches-py"
    official.mkdir(parents=True)
    images = rng.integers(0, 256, (6, 4, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, (6, 4))
    for i in range(5):
        _write_official_batch(official / f"data_batch_{i + 1}", images[i], labels[i])
    _write_official_batch(official / "test_batch", images[5], labels[5])
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    (x_train, y_train), (x_test, y_test) = cifar10.load_data()
    np.testing.assert_array_equal(x_train, images[:5].reshape(20, 32, 32, 3))
    np.testing.assert_array_equal(y_train[:, 0], labels[:5].reshape(-1))
    np.testing.assert_array_equal(x_test, images[5])
    assert y_test.shape == (4, 1) and y_test.dtype == np.uint8


def test_mnist_bundled_test_split_is_divided_8000_2000():
    (x_train, y_train), (x_test, y_test) = mnist.load_data()
    assert x_train.shape == (8000, 28, 28) and x_test.shape == (2000, 28, 28)
    assert y_train.shape == (8000,) and y_test.shape == (2000,)
    assert x_train.dtype == y_train.dtype == np.uint8
    assert set(np.unique(y_train)) == set(range(10))
    with gzip.open(mnist.BUNDLED_LABELS, "rb") as f:
        raw_labels = np.frombuffer(f.read(), np.uint8, offset=8)
    np.testing.assert_array_equal(np.concatenate([y_train, y_test]), raw_labels)
    # Digits are dark strokes on a zero background.
    assert (x_train == 0).mean() > 0.7 and x_train.max() == 255


def test_mnist_prefers_keras_own_file(tmp_path, monkeypatch):
    (tmp_path / "datasets").mkdir()
    arrays = {k: np.full(s, i, np.uint8) for i, (k, s) in enumerate(
        [("x_train", (3, 28, 28)), ("y_train", (3,)), ("x_test", (2, 28, 28)), ("y_test", (2,))])}
    np.savez(tmp_path / "datasets" / "mnist.npz", **arrays)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    (x_train, y_train), (x_test, y_test) = mnist.load_data()
    assert x_train.shape == (3, 28, 28) and int(y_test[0]) == 3


def test_missing_bundled_files_are_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(mnist, "BUNDLED_IMAGES", str(tmp_path / "gone.gz"))
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="reinstall keras-tpu"):
        mnist.load_data()
