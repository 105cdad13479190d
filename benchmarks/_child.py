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
