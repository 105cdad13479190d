"""keras-tpu: train, evaluate and predict Keras 3 models on a simulated Cloud TPU.

Eight TPU cores, each with a 128x128 systolic matrix unit (MXU) that
multiplies in bfloat16 and accumulates in float32, simulated on JAX.

Example:
    >>> import keras_tpu
    >>> resolver = keras_tpu.TPUClusterResolver(tpu="grpc://10.0.0.2:8470")
    >>> topology = keras_tpu.initialize_tpu_system(resolver)
    >>> topology.num_cores
    8
"""

from keras_tpu import _host

_host.prepare_host()  # before anything imports jax's backend or keras

from keras_tpu import mxu  # noqa: E402
from keras_tpu._logging import set_verbosity  # noqa: E402
from keras_tpu._accelerators import ACCELERATOR_TYPES, AcceleratorSpec  # noqa: E402
from keras_tpu._cluster import (ClusterSpec, Topology,  # noqa: E402
                               TPUClusterResolver, experimental_connect_to_cluster,
                               initialize_tpu_system, shutdown_tpu_system)
from keras_tpu._cores import CoreLayout  # noqa: E402
from keras_tpu import datasets  # noqa: E402
from keras_tpu._tpu_model import KerasTPUModel, TPUDistributionStrategy, keras_to_tpu_model  # noqa: E402
from keras_tpu._strategy import (DeviceAssignment, InputContext, PerReplica, ReduceOp, TPUStrategy,  # noqa: E402
                                ValueContext)
from keras_tpu._per_replica import (InputOptions, InputReplicationMode, OptionalValue,  # noqa: E402
                                    OutOfRangeError)
from keras_tpu import train  # noqa: E402
from keras_tpu import estimator  # noqa: E402
from keras_tpu import callbacks  # noqa: E402
from keras_tpu._profiling import TPUProfile, profile  # noqa: E402
from keras_tpu._export import load_exported  # noqa: E402
from keras_tpu._pod import WorkerLostError  # noqa: E402
from keras_tpu._hbm import ResourceExhaustedError  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ACCELERATOR_TYPES", "AcceleratorSpec", "ClusterSpec", "CoreLayout", "DeviceAssignment", "InputContext",
    "KerasTPUModel", "PerReplica", "ReduceOp", "ValueContext", "InputOptions", "InputReplicationMode", "OptionalValue",
    "OutOfRangeError",
    "TPUClusterResolver", "TPUDistributionStrategy", "TPUStrategy", "Topology", "datasets", "estimator", "train",
    "experimental_connect_to_cluster", "initialize_tpu_system", "shutdown_tpu_system", "keras_to_tpu_model", "mxu", "set_verbosity",
    "TPUProfile", "callbacks", "profile", "load_exported", "WorkerLostError", "ResourceExhaustedError",
]
