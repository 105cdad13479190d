"""The ``keras_tpu`` logger.

TensorFlow's TPU code reported its progress as ``INFO`` lines ("Found TPU
system", "Copying TPU weights to the CPU") that notebook users are used to
seeing. Python hides INFO records unless logging is configured, so the logger
gets its own handler when the application has not configured one.
"""

import logging

logger = logging.getLogger("keras_tpu")


def _install_default_handler():
    if logger.handlers or logging.getLogger().handlers:
        return  # the application configured logging; respect it
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:keras_tpu:%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def set_verbosity(level):
    """Set how much keras_tpu logs (a `logging` level or its name).

    Example:
        >>> import keras_tpu
        >>> keras_tpu.set_verbosity("WARNING")   # silence the INFO lines
    """
    logger.setLevel(level)


_install_default_handler()
