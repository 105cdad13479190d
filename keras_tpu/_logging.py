"""The ``keras_tpu`` logger.

TensorFlow's TPU code reported its progress as ``INFO`` lines ("Found TPU
system", "Copying TPU weights to the CPU") that notebook users are used to
seeing. Python hides INFO records unless logging is configured, so the logger
gets its own handler when the application has not configured one.
"""

import logging
import sys

logger = logging.getLogger("keras_tpu")

# Whether Keras' progress bar has written a line to stdout without ending it (see
# keras_tpu._keras_private.track_progress_line, which keeps this up to date).
_progress_line = {"open": False}


def note_progress_output(message):
    """Record what Keras' progress bar just wrote to stdout (whether its line is left open)."""
    if message:
        _progress_line["open"] = not message.endswith("\n")


class _OwnLine(logging.Filter):
    """Start every keras_tpu record on a line of its own.

    Keras' progress bar leaves its line open between updates (it rewrites it
    with ``\r``); a compile or weight-copy message logged in between would be
    printed onto the end of that line. Ending the line first keeps both
    readable; the bar continues on the next line.
    """

    def filter(self, record):
        if _progress_line["open"]:
            _progress_line["open"] = False
            try:
                sys.stdout.write("\n")
                sys.stdout.flush()
            except (OSError, ValueError):  # a closed or broken stdout: nothing to tidy
                pass
        return True


logger.addFilter(_OwnLine())


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
