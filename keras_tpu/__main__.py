"""Command line: ``python -m keras_tpu <command>``.

Commands:
    cifar10   train the CIFAR-10 notebook model on the simulated TPU (see --help)
    profile   print the TPU profile of a saved Keras model (.keras or .h5; see --help)
"""

import sys

COMMANDS = ("cifar10", "profile")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "cifar10":
        from keras_tpu.examples import cifar10

        cifar10.main(rest)
    elif command == "profile":
        return profile_command(rest)
    return 0


def profile_command(argv):
    import argparse
    import os

    import keras

    from keras_tpu import _step_time as step_time
    from keras_tpu._profiling import profile

    parser = argparse.ArgumentParser(prog="python -m keras_tpu profile",
                                     description="Print the TPU profile (MXU ops, cycles, utilisation, the whole step's time by part) of a "
                                                 "saved Keras model.")
    parser.add_argument("model", help="a model saved with model.save (.keras, or a whole-model .h5)")
    parser.add_argument("--batch-size", type=int, default=None, help="global batch (default: 128 per core)")
    parser.add_argument("--accelerator-type", default="v2-8")
    parser.add_argument("--dataset-size", type=int, default=None, help="examples per epoch, for epoch totals")
    parser.add_argument("--deployment", default=None, choices=sorted(step_time.DEPLOYMENTS),
                        help="where the input pipeline and the Python loop run (default: tpu_vm)")
    parser.add_argument("--steps-per-execution", type=int, default=None,
                        help="steps per host call (iterations_per_loop), amortising the host's cost")
    parser.add_argument("--plot", default=None, help="also save the utilisation/time plot to this PNG")
    parser.add_argument("--scalesim", default=None, help="also write the train step as a SCALE-Sim GEMM topology")
    args = parser.parse_args(argv)
    if not os.path.exists(args.model):
        parser.error(f"no such file: {args.model}")
    try:
        model = keras.models.load_model(args.model)
    except (ValueError, OSError) as error:
        parser.error(f"{args.model} is not a saved Keras model ({error}). Weights-only files hold no "
                     f"architecture: save the model with model.save('model.keras').")
    report = profile(model, batch_size=args.batch_size, accelerator_type=args.accelerator_type,
                     dataset_size=args.dataset_size, deployment=args.deployment,
                     steps_per_execution=args.steps_per_execution)
    print(report)
    if args.plot:
        print(f"Plot saved to {report.plot(args.plot)}")
    if args.scalesim:
        print(f"SCALE-Sim topology saved to {report.to_scalesim_topology(args.scalesim)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
