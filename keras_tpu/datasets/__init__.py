"""Datasets shaped like ``keras.datasets``, working offline.

``keras_tpu.datasets.cifar10.load_data()`` and ``keras_tpu.datasets.mnist.load_data()``
return exactly what their ``keras.datasets`` namesakes return. They read the
official files from the user's Keras cache when present; otherwise they use
the copies bundled with keras-tpu (CIFAR-10 as JPEGs, MNIST's official test
split), decoded once and cached.
"""

from keras_tpu.datasets import cifar10, mnist

__all__ = ["cifar10", "mnist"]
