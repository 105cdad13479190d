"""Runnable examples: the CIFAR-10 TPU notebook as a script (``python -m keras_tpu cifar10``)."""
