"""Running one benchmark configuration in a fresh Python process."""

import json
import os
import subprocess
import sys


def run_child(script, arguments):
    """Run ``script --child ...`` with a clean JAX/Keras environment; return the JSON it prints last."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    done = subprocess.run([sys.executable, script, "--child", *map(str, arguments)], capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(map(str, arguments))} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def results_path(script, chosen, every):
    """Where a run's results go unless ``--json`` says: ``benchmarks/results/<script>.json`` for a run of
    ``every`` model and configuration, else a file named after the ``chosen`` ones, so that a run of a few
    models does not overwrite the full run's results (the README cites them).

    Example:
        >>> os.path.basename(results_path("zoo.py", ["mlp", "keras"], ["mlp", "cifar_cnn", "keras"]))
        'zoo_mlp_keras.json'
    """
    stem = os.path.splitext(os.path.basename(script))[0]
    name = stem if list(chosen) == list(every) else "_".join([stem, *chosen])
    return os.path.join(os.path.dirname(os.path.abspath(script)), "results", f"{name}.json")
