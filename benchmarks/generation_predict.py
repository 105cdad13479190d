"""One row at a time: keras.io's character-level text generator's ``predict`` loop, keras-tpu against plain Keras.

keras.io's "Character-level text generation with LSTM" samples each next character with
``model.predict(x_pred)`` on one row: an LSTM(128) over 40 steps of 60 one-hot characters and a
softmax. This times that call (``predict`` and ``predict_on_batch``) for plain Keras 3 on JAX and
for the same model under ``keras_tpu.TPUStrategy`` (default and ``"highest"`` MXU precision), in
one process, interleaved, best of ``--repeats`` runs of ``--calls`` calls each after a warm-up, and
writes ``benchmarks/results/generation_predict.json``. A batch of fewer rows than cores computes
only its real rows (``keras_tpu._programs.ProgramForm.real_rows``); the 8-row column is the cost of
computing every core's row.

Usage:
    python benchmarks/generation_predict.py [--calls 300] [--repeats 3] [--json PATH]
"""

import argparse
import json
import os
import time

import keras_tpu
import keras
import numpy as np

MAXLEN, CHARS = 40, 60


def generator_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((MAXLEN, CHARS)), keras.layers.LSTM(128),
                              keras.layers.Dense(CHARS, activation="softmax")])
    model.compile(keras.optimizers.RMSprop(0.01), "categorical_crossentropy")
    return model


def seconds_per_call(call, x, calls, repeats):
    for _ in range(5):
        call(x)  # compiles and warms up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            call(x)
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                       "generation_predict.json"))
    args = parser.parse_args()
    models = {"keras": generator_model()}
    for precision in ("default", "highest"):
        with keras_tpu.TPUStrategy(precision=precision).scope():
            models[f"keras_tpu ({precision})"] = generator_model()
    rng = np.random.default_rng(0)
    inputs = {rows: rng.random((rows, MAXLEN, CHARS)).astype("float32") for rows in (1, 8)}
    calls = {"predict, 1 row": (lambda m: lambda x: m.predict(x, verbose=0), 1),
             "predict_on_batch, 1 row": (lambda m: m.predict_on_batch, 1),
             "predict_on_batch, 8 rows": (lambda m: m.predict_on_batch, 8)}
    results = {}
    for call_name, (make_call, rows) in calls.items():
        for name, model in models.items():  # interleaved: the machine's load moves all configurations alike
            results.setdefault(call_name, {})[name] = 1e3 * seconds_per_call(make_call(model), inputs[rows],
                                                                              args.calls, args.repeats)
    names = list(models)
    print("| call | " + " | ".join(f"{n} (ms)" for n in names) + " | keras-tpu's time / plain Keras' (default) |")
    print("|---|" + "---:|" * (len(names) + 1))
    for call_name, row in results.items():
        ratio = row["keras_tpu (default)"] / row["keras"]
        print(f"| {call_name} | " + " | ".join(f"{row[n]:.3f}" for n in names) + f" | {ratio:.2f}x |")
    with open(args.json, "w") as f:
        json.dump({"ms_per_call": results, "calls": args.calls, "repeats": args.repeats}, f, indent=1)


if __name__ == "__main__":
    main()
