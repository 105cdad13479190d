"""The README's TensorFlow compatibility table, checked against the code and against TensorFlow's own API lists.

Each row of the table (README section "TensorFlow compatibility") says, for one TensorFlow API, which of its
arguments or members are supported, have no effect, or are refused. This file checks that

* the table lists exactly TensorFlow's arguments and members (the lists below, taken from TensorFlow's sources,
  each with the file and version it comes from), no more and none missing;
* every supported or no-effect argument is accepted by our signature (so no ``TypeError: unexpected keyword``),
  and every supported or no-effect member exists;
* every refused argument or member raises ``ValueError``/``NotImplementedError``/``RuntimeError`` when used,
  with a message naming the alternative that the table's note names too;

and then runs the behaviours the table promises on small models.
"""

import inspect
import os
import pathlib
import re

import keras
import numpy as np
import pytest

import keras_tpu
from keras_tpu import estimator as tpu_estimator
from keras_tpu import _per_replica as per_replica, _strategy as tpu_strategy
from keras_tpu.estimator import ModeKeys
from tests.tpu_helpers import classification_data, on_tpu, small_classifier

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
STATUSES = ("supported", "no effect", "refused")

# -- TensorFlow's API lists ---------------------------------------------------------------------------------

KERAS_SUPPORT = "tensorflow/tensorflow v1.15.0 tensorflow/contrib/tpu/python/tpu/keras_support.py"
KERAS_MODEL = ("tensorflow/tensorflow v1.15.0 tensorflow/python/keras/engine/training.py (tf.keras.Model, which "
               "KerasTPUModel subclasses: fit_generator, train_on_batch, ...)")
RESOLVER = ("tensorflow/tensorflow v1.15.0 tensorflow/python/distribute/cluster_resolver/tpu_cluster_resolver.py; "
            "TF 2.x tensorflow/python/distribute/cluster_resolver/tpu/tpu_cluster_resolver.py adds connect, "
            "__enter__/__exit__, get_coordination_service_leader")
CONNECT = ("TF 2.x tensorflow/python/eager/remote.py (connect_to_cluster), "
           "tensorflow/python/tpu/tpu_strategy_util.py (initialize_tpu_system)")
ESTIMATOR = ("tensorflow/estimator v1.15.0 tensorflow_estimator/python/estimator/tpu/tpu_estimator.py and "
             "estimator.py (Estimator, which TPUEstimator subclasses)")
CONFIG = ("tensorflow/estimator v1.15.0 tensorflow_estimator/python/estimator/tpu/tpu_config.py and "
          "run_config.py")
OPTIMIZER = ("tensorflow/tensorflow v1.15.0 tensorflow/python/tpu/tpu_optimizer.py and "
             "tensorflow/python/training/optimizer.py (Optimizer.minimize, get_name)")
MODE_KEYS = "tensorflow/tensorflow v1.15.0 tensorflow/python/saved_model/model_utils/mode_keys.py (EstimatorModeKeys)"
STRATEGY = ("tensorflow/tensorflow v2.9 tensorflow/python/distribute/tpu_strategy.py (TPUStrategyV2, TPUExtended) "
            "and distribute_lib.py (Strategy, StrategyExtendedV2); v1.15.0 tpu_strategy.py (experimental "
            "TPUStrategy: device_assignment, steps_per_run) and distribute_lib.py (StrategyV1, StrategyExtendedV1)")

INPUT_LIB = ("tensorflow/tensorflow v2.9 tensorflow/python/distribute/input_lib.py (DistributedDatasetInterface, "
             "DistributedIteratorInterface) and distribute_lib.py (InputOptions)")

TRAINING = ("tensorflow/estimator v1.15.0 tensorflow_estimator/python/estimator/training.py (train_and_evaluate, "
            "TrainSpec, EvalSpec; TrainSpec's saving_listeners since 2.0) and exporter.py (LatestExporter, "
            "FinalExporter)")

MINIMIZE = ["loss", "global_step", "var_list", "gate_gradients", "aggregation_method", "colocate_gradients_with_ops",
            "name", "grad_loss"]
EXPORT = ["export_dir_base", "serving_input_receiver_fn", "assets_extra", "as_text", "checkpoint_path"]
QUEUE = ["max_queue_size", "workers", "use_multiprocessing"]

TENSORFLOW = {
    # API (as the table's first column names it): (source, arguments or members)
    "keras_to_tpu_model(...)": (KERAS_SUPPORT, ["model", "strategy"]),
    "TPUDistributionStrategy(...)": (KERAS_SUPPORT, ["tpu_cluster_resolver", "using_single_core"]),
    "KerasTPUModel": (KERAS_SUPPORT + "; " + KERAS_MODEL, [
        "compile()", "fit()", "evaluate()", "predict()", "get_config()", "optimizer", "metrics", "cpu_optimizer",
        "sync_to_cpu()", "get_weights()", "save_weights()", "save()", "set_weights()", "load_weights()",
        "fit_generator()", "evaluate_generator()", "predict_generator()", "train_on_batch()", "test_on_batch()",
        "predict_on_batch()", "reset_metrics()", "metrics_names", "summary()", "get_layer()", "layers", "to_json()",
        "to_yaml()", "reset_states()", "stateful"]),
    "KerasTPUModel.compile(...)": (KERAS_MODEL, ["optimizer", "loss", "metrics", "loss_weights", "sample_weight_mode",
                                                 "weighted_metrics", "target_tensors", "distribute", "run_eagerly"]),
    "KerasTPUModel.fit(...)": (KERAS_SUPPORT + "; " + KERAS_MODEL, [
        "x", "y", "batch_size", "epochs", "verbose", "callbacks", "validation_split", "validation_data", "shuffle",
        "class_weight", "sample_weight", "initial_epoch", "steps_per_epoch", "validation_steps", "validation_freq",
        *QUEUE, "nb_epoch", "_pipeline"]),
    "KerasTPUModel.evaluate(...)": (KERAS_MODEL, ["x", "y", "batch_size", "verbose", "sample_weight", "steps",
                                                  "callbacks", *QUEUE]),
    "KerasTPUModel.predict(...)": (KERAS_MODEL, ["x", "batch_size", "verbose", "steps", "callbacks", *QUEUE]),
    "KerasTPUModel.fit_generator(...)": (KERAS_MODEL, [
        "generator", "steps_per_epoch", "epochs", "verbose", "callbacks", "validation_data", "validation_steps",
        "validation_freq", "class_weight", *QUEUE, "shuffle", "initial_epoch"]),
    "KerasTPUModel.evaluate_generator(...)": (KERAS_MODEL, ["generator", "steps", "callbacks", *QUEUE, "verbose"]),
    "KerasTPUModel.predict_generator(...)": (KERAS_MODEL, ["generator", "steps", "callbacks", *QUEUE, "verbose"]),
    "KerasTPUModel.train_on_batch(...)": (KERAS_MODEL, ["x", "y", "sample_weight", "class_weight", "reset_metrics"]),
    "KerasTPUModel.test_on_batch(...)": (KERAS_MODEL, ["x", "y", "sample_weight", "reset_metrics"]),
    "KerasTPUModel.save_weights(...)": (KERAS_MODEL, ["filepath", "overwrite", "save_format"]),
    "KerasTPUModel.load_weights(...)": (KERAS_SUPPORT, ["filepath", "by_name"]),
    "KerasTPUModel.save(...)": (KERAS_MODEL, ["filepath", "overwrite", "include_optimizer", "save_format",
                                              "signatures", "options"]),
    "TPUClusterResolver(...)": (RESOLVER, ["tpu", "zone", "project", "job_name", "coordinator_name",
                                           "coordinator_address", "credentials", "service", "discovery_url"]),
    "TPUClusterResolver": (RESOLVER, [
        "master()", "get_master()", "get_job_name()", "cluster_spec()", "num_accelerators()",
        "get_tpu_system_metadata()", "get_coordination_service_leader()", "connect()", "__enter__()", "__exit__()",
        "environment", "task_type", "task_id", "rpc_layer"]),
    "TPUClusterResolver.master(...)": (RESOLVER, ["task_type", "task_id", "rpc_layer"]),
    "TPUClusterResolver.num_accelerators(...)": (RESOLVER, ["task_type", "task_id", "config_proto"]),
    "TPUClusterResolver.connect(...)": (RESOLVER, ["tpu", "zone", "project"]),
    "initialize_tpu_system(...)": (CONNECT, ["cluster_resolver"]),
    "experimental_connect_to_cluster(...)": (CONNECT, [
        "cluster_spec_or_resolver", "job_name", "task_index", "protocol", "make_master_device_default",
        "cluster_device_filters"]),
    "TPUEstimator(...)": (ESTIMATOR, [
        "model_fn", "model_dir", "config", "params", "use_tpu", "train_batch_size", "eval_batch_size",
        "predict_batch_size", "batch_axis", "eval_on_tpu", "export_to_tpu", "export_to_cpu", "warm_start_from",
        "embedding_config_spec", "export_saved_model_api_version"]),
    "TPUEstimator": (ESTIMATOR, [
        "train()", "evaluate()", "predict()", "export_saved_model()", "export_savedmodel()",
        "experimental_export_all_saved_models()", "eval_dir()", "latest_checkpoint()", "get_variable_names()",
        "get_variable_value()", "model_fn", "model_dir", "config", "params"]),
    "TPUEstimator.train(...)": (ESTIMATOR, ["input_fn", "hooks", "steps", "max_steps", "saving_listeners"]),
    "TPUEstimator.evaluate(...)": (ESTIMATOR, ["input_fn", "steps", "hooks", "checkpoint_path", "name"]),
    "TPUEstimator.predict(...)": (ESTIMATOR, ["input_fn", "predict_keys", "hooks", "checkpoint_path",
                                              "yield_single_examples"]),
    "TPUEstimator.export_saved_model(...)": (ESTIMATOR, EXPORT + ["experimental_mode"]),
    "TPUEstimator.export_savedmodel(...)": (ESTIMATOR, EXPORT + ["strip_default_attrs"]),
    "TPUEstimator.experimental_export_all_saved_models(...)": (ESTIMATOR, [
        "export_dir_base", "input_receiver_fn_map", "assets_extra", "as_text", "checkpoint_path"]),
    "TPUEstimatorSpec(...)": (ESTIMATOR, [
        "mode", "predictions", "loss", "train_op", "eval_metrics", "export_outputs", "scaffold_fn", "host_call",
        "training_hooks", "evaluation_hooks", "prediction_hooks"]),
    "TPUEstimatorSpec": (ESTIMATOR, ["as_estimator_spec()"]),
    "EstimatorSpec(...)": ("tensorflow/estimator v1.15.0 tensorflow_estimator/python/estimator/model_fn.py", [
        "mode", "predictions", "loss", "train_op", "eval_metric_ops", "export_outputs", "training_chief_hooks",
        "training_hooks", "scaffold", "evaluation_hooks", "prediction_hooks"]),
    "train_and_evaluate(...)": (TRAINING, ["estimator", "train_spec", "eval_spec"]),
    "TrainSpec(...)": (TRAINING, ["input_fn", "max_steps", "hooks", "saving_listeners"]),
    "EvalSpec(...)": (TRAINING, ["input_fn", "steps", "name", "hooks", "exporters", "start_delay_secs",
                                 "throttle_secs"]),
    "LatestExporter(...)": (TRAINING, ["name", "serving_input_receiver_fn", "assets_extra", "as_text",
                                       "exports_to_keep"]),
    "FinalExporter(...)": (TRAINING, ["name", "serving_input_receiver_fn", "assets_extra", "as_text"]),
    "RunConfig(...)": (CONFIG, [
        "tpu_config", "evaluation_master", "master", "cluster", "model_dir", "tf_random_seed", "save_summary_steps",
        "save_checkpoints_steps", "save_checkpoints_secs", "session_config", "keep_checkpoint_max",
        "keep_checkpoint_every_n_hours", "log_step_count_steps", "train_distribute", "device_fn", "protocol",
        "eval_distribute", "experimental_distribute", "experimental_max_worker_delay_secs",
        "session_creation_timeout_secs"]),
    "RunConfig": (CONFIG, [
        "replace()", "cluster_spec", "is_chief", "task_type", "task_id", "global_id_in_cluster", "num_worker_replicas",
        "num_ps_replicas", "service", "master", "evaluation_master", "tpu_config", "cluster", "model_dir",
        "tf_random_seed", "save_summary_steps", "save_checkpoints_steps", "save_checkpoints_secs", "session_config",
        "keep_checkpoint_max", "keep_checkpoint_every_n_hours", "log_step_count_steps", "train_distribute",
        "eval_distribute", "device_fn", "protocol", "experimental_max_worker_delay_secs",
        "session_creation_timeout_secs"]),
    "TPUConfig(...)": (CONFIG, [
        "iterations_per_loop", "num_shards", "num_cores_per_replica", "per_host_input_for_training", "tpu_job_name",
        "initial_infeed_sleep_secs", "input_partition_dims", "eval_training_input_configuration",
        "experimental_host_call_every_n_steps"]),
    "CrossShardOptimizer(...)": (OPTIMIZER, ["opt", "reduction", "name", "group_assignment"]),
    "CrossShardOptimizer": (OPTIMIZER, ["compute_gradients()", "apply_gradients()", "get_slot()", "get_slot_names()",
                                        "variables()", "minimize()", "get_name()"]),
    "CrossShardOptimizer.minimize(...)": (OPTIMIZER, MINIMIZE),
    "ModeKeys": (MODE_KEYS, ["TRAIN", "EVAL", "PREDICT"]),
    "TPUStrategy(...)": (STRATEGY, ["tpu_cluster_resolver", "experimental_device_assignment",
                                    "experimental_spmd_xla_partitioning", "device_assignment", "steps_per_run"]),
    "TPUStrategy": (STRATEGY, [
        "scope()", "run()", "reduce()", "gather()", "experimental_local_results()", "experimental_distribute_dataset()",
        "distribute_datasets_from_function()", "experimental_distribute_datasets_from_function()",
        "experimental_distribute_values_from_function()", "experimental_assign_to_logical_device()",
        "experimental_split_to_logical_devices()", "experimental_replicate_to_logical_devices()",
        "num_replicas_in_sync", "extended", "cluster_resolver",
        # TF 1.15's StrategyV1
        "experimental_run_v2()", "experimental_run()", "make_dataset_iterator()", "make_input_fn_iterator()",
        "experimental_make_numpy_dataset()", "unwrap()", "update_config_proto()", "steps_per_run"]),
    "TPUStrategy.run(...)": (STRATEGY, ["fn", "args", "kwargs", "options"]),
    "TPUStrategy.reduce(...)": (STRATEGY, ["reduce_op", "value", "axis"]),
    "TPUStrategy.gather(...)": (STRATEGY, ["value", "axis"]),
    "TPUStrategy.experimental_local_results(...)": (STRATEGY, ["value"]),
    "TPUStrategy.experimental_distribute_dataset(...)": (STRATEGY, ["dataset", "options"]),
    "TPUStrategy.distribute_datasets_from_function(...)": (STRATEGY, ["dataset_fn", "options"]),
    "TPUStrategy.experimental_distribute_datasets_from_function(...)": (STRATEGY, ["dataset_fn", "options"]),
    "TPUStrategy.experimental_distribute_values_from_function(...)": (STRATEGY, ["value_fn"]),
    "DistributedDataset": (INPUT_LIB, ["element_spec", "reduce()"]),
    "DistributedIterator": (INPUT_LIB, ["get_next()", "get_next_as_optional()", "element_spec"]),
    "InputOptions(...)": (INPUT_LIB, ["experimental_fetch_to_device", "experimental_replication_mode",
                                      "experimental_place_dataset_on_device", "experimental_per_replica_buffer_size"]),
    "TPUStrategy.extended": (STRATEGY, [
        "steps_per_run", "num_hosts", "num_replicas_per_host", "worker_devices", "parameter_devices",
        "experimental_require_static_shapes", "experimental_between_graph", "experimental_should_init",
        "should_checkpoint", "should_save_summary", "experimental_enable_get_next_as_optional",
        "experimental_enable_dynamic_batch_size", "reduce_to()", "batch_reduce_to()", "update()", "update_non_slot()",
        "value_container()", "variable_created_in_scope()", "read_var()", "non_slot_devices()",
        "call_for_each_replica()", "experimental_logical_device()", "colocate_vars_with()", "broadcast_to()",
        "experimental_run_steps_on_iterator()", "experimental_make_numpy_dataset()"]),
}

TF1_TRAIN = ("tensorflow/tensorflow v1.15.0 tensorflow/python/training/gradient_descent.py, momentum.py, adam.py, "
             "adagrad.py, rmsprop.py, optimizer.py (Optimizer), training_util.py (global step) and "
             "learning_rate_decay.py")
DECAY = ["learning_rate", "global_step", "decay_steps", "decay_rate", "staircase", "name"]
TENSORFLOW.update({
    "GradientDescentOptimizer(...)": (TF1_TRAIN, ["learning_rate", "use_locking", "name"]),
    "MomentumOptimizer(...)": (TF1_TRAIN, ["learning_rate", "momentum", "use_locking", "name", "use_nesterov"]),
    "AdamOptimizer(...)": (TF1_TRAIN, ["learning_rate", "beta1", "beta2", "epsilon", "use_locking", "name"]),
    "AdagradOptimizer(...)": (TF1_TRAIN, ["learning_rate", "initial_accumulator_value", "use_locking", "name"]),
    "RMSPropOptimizer(...)": (TF1_TRAIN, ["learning_rate", "decay", "momentum", "epsilon", "use_locking", "centered",
                                          "name"]),
    "Optimizer": (TF1_TRAIN, ["minimize()", "compute_gradients()", "apply_gradients()", "get_name()", "get_slot()",
                              "get_slot_names()", "variables()"]),
    "Optimizer.minimize(...)": (TF1_TRAIN, MINIMIZE),
    "Optimizer.apply_gradients(...)": (TF1_TRAIN, ["grads_and_vars", "global_step", "name"]),
    "get_global_step(...)": (TF1_TRAIN, ["graph"]),
    "get_or_create_global_step(...)": (TF1_TRAIN, ["graph"]),
    "exponential_decay(...)": (TF1_TRAIN, DECAY),
    "inverse_time_decay(...)": (TF1_TRAIN, DECAY),
    "natural_exp_decay(...)": (TF1_TRAIN, DECAY),
    "polynomial_decay(...)": (TF1_TRAIN, ["learning_rate", "global_step", "decay_steps", "end_learning_rate", "power",
                                          "cycle", "name"]),
    "cosine_decay(...)": (TF1_TRAIN, ["learning_rate", "global_step", "decay_steps", "alpha", "name"]),
    "piecewise_constant(...)": (TF1_TRAIN, ["x", "boundaries", "values", "name"]),
})

# Where each API lives in keras_tpu (the class or function the table's first column names).
KERAS_TPU = {
    "keras_to_tpu_model": keras_tpu.keras_to_tpu_model,
    "TPUDistributionStrategy": keras_tpu.TPUDistributionStrategy,
    "KerasTPUModel": keras_tpu.KerasTPUModel,
    "TPUClusterResolver": keras_tpu.TPUClusterResolver,
    "initialize_tpu_system": keras_tpu.initialize_tpu_system,
    "experimental_connect_to_cluster": keras_tpu.experimental_connect_to_cluster,
    "TPUEstimator": tpu_estimator.TPUEstimator,
    "TPUEstimatorSpec": tpu_estimator.TPUEstimatorSpec,
    "RunConfig": tpu_estimator.RunConfig,
    "TPUConfig": tpu_estimator.TPUConfig,
    "CrossShardOptimizer": tpu_estimator.CrossShardOptimizer,
    "ModeKeys": tpu_estimator.ModeKeys,
    "EstimatorSpec": tpu_estimator.EstimatorSpec,
    "train_and_evaluate": tpu_estimator.train_and_evaluate,
    "TrainSpec": tpu_estimator.TrainSpec,
    "EvalSpec": tpu_estimator.EvalSpec,
    "LatestExporter": tpu_estimator.LatestExporter,
    "FinalExporter": tpu_estimator.FinalExporter,
    "TPUStrategy": keras_tpu.TPUStrategy,
    "TPUStrategy.extended": tpu_strategy.TPUExtended,
    "DistributedDataset": per_replica.DistributedDataset,
    "DistributedIterator": per_replica.DistributedIterator,
    "InputOptions": keras_tpu.InputOptions,
    # keras_tpu.train: each optimizer's constructor; "Optimizer" is what the five share (TF 1's base class).
    **{name: getattr(keras_tpu.train, name) for name in (
        "GradientDescentOptimizer", "MomentumOptimizer", "AdamOptimizer", "AdagradOptimizer", "RMSPropOptimizer",
        "get_global_step", "get_or_create_global_step", "exponential_decay", "inverse_time_decay",
        "natural_exp_decay", "polynomial_decay", "cosine_decay", "piecewise_constant")},
    "Optimizer": keras_tpu.train.GradientDescentOptimizer,
}

# Arguments taken through **kwargs (as in TensorFlow's signature); test_kwargs_arguments_work calls them for real.
THROUGH_KWARGS = {("KerasTPUModel.fit(...)", "nb_epoch"), ("KerasTPUModel.fit(...)", "_pipeline")}


# -- the table ------------------------------------------------------------------------------------------------

def table_rows():
    """``[(api, [names], status, note)]`` from the README's TensorFlow compatibility section."""
    text = README.read_text()
    start = text.index("\n## TensorFlow compatibility\n")
    end = text.find("\n## ", start + 1)
    rows = []
    for line in text[start:end].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 4 or cells[0] in ("API", "---") or set(cells[0]) <= set("-"):
            continue
        api = cells[0].strip("`")
        names = re.findall(r"`([^`]+)`", cells[1])
        rows.append((api, names, cells[2], cells[3]))
    return rows


ROWS = table_rows()


def target(api):
    """The keras_tpu object an API of the table names (``"TPUStrategy.run(...)"`` -> ``TPUStrategy.run``)."""
    name = api.removesuffix("(...)")
    if name in KERAS_TPU:
        return KERAS_TPU[name]
    owner, _, member = name.rpartition(".")
    return getattr(KERAS_TPU[owner], member)


def plain(text):
    return text.replace("`", "").lower()


def test_the_table_lists_exactly_tensorflows_arguments_and_members():
    assert len(ROWS) > 60, "the README's TensorFlow compatibility table was not found"
    seen = {}
    for api, names, status, _ in ROWS:
        assert api in TENSORFLOW, f"{api}: not a TensorFlow API this test knows (add its TensorFlow list)"
        assert status in STATUSES, f"{api} {names}: status {status!r} is not one of {STATUSES}"
        assert names, f"{api}: a row without names"
        for name in names:
            if api.endswith("(...)"):
                assert not name.endswith("()"), f"{api}: {name}: arguments are written without ()"
            assert (api, name) not in seen, f"{api} {name} is listed twice"
            seen[api, name] = status
    for api, (source, names) in TENSORFLOW.items():
        listed = {name for (row_api, name) in seen if row_api == api}
        assert listed == set(names), (f"{api} ({source}): missing from the table {sorted(set(names) - listed)}, "
                                      f"not TensorFlow's {sorted(listed - set(names))}")


@pytest.mark.parametrize("api", sorted({api for api, *_ in ROWS if api.endswith("(...)")}))
def test_supported_and_no_effect_arguments_are_accepted(api):
    parameters = inspect.signature(target(api)).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for row_api, names, status, _ in ROWS:
        if row_api != api or status == "refused":
            continue
        for name in names:
            in_signature = name in parameters and parameters[name].kind not in (
                inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
            assert in_signature or (takes_kwargs and (api, name) in THROUGH_KWARGS), \
                f"{api}: {name} ({status}) is not accepted"


# -- instances to look members up on, and the refusals --------------------------------------------------------


def tiny_model_fn(features, labels, mode, params):
    logits = keras.layers.Dense(3)(features)
    if mode == ModeKeys.PREDICT:
        on_tpu_flag = keras.ops.ones_like(logits[:, 0]) * (1.0 if params["use_tpu"] else 0.0)
        return tpu_estimator.TPUEstimatorSpec(mode, predictions={"logits": logits, "use_tpu": on_tpu_flag})
    loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    return tpu_estimator.TPUEstimatorSpec(
        mode, loss=loss, train_op=tpu_estimator.CrossShardOptimizer(keras.optimizers.SGD(0.1)))


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    strategy = keras_tpu.TPUStrategy()
    return {
        "KerasTPUModel": on_tpu(small_classifier()),
        "TPUClusterResolver": keras_tpu.TPUClusterResolver("local"),
        "TPUEstimator": tpu_estimator.TPUEstimator(
            tiny_model_fn, model_dir=str(tmp_path_factory.mktemp("estimator")), train_batch_size=16),
        "TPUEstimatorSpec": tpu_estimator.TPUEstimatorSpec(ModeKeys.TRAIN),
        "RunConfig": tpu_estimator.RunConfig(),
        "CrossShardOptimizer": tpu_estimator.CrossShardOptimizer(keras.optimizers.SGD(0.1)),
        "ModeKeys": ModeKeys,
        "TPUStrategy": strategy,
        "TPUStrategy.extended": strategy.extended,
        "DistributedDataset": strategy.experimental_distribute_dataset([np.ones((8, 2))]),
        "DistributedIterator": iter(strategy.experimental_distribute_dataset([np.ones((8, 2))])),
        "Optimizer": keras_tpu.train.AdamOptimizer(),
    }


def refusals(objects, tmp_path):
    """``{(api, name): (what the message must name, the call)}`` for every refused row of the table."""
    tpu_model, optimizer = objects["KerasTPUModel"], objects["CrossShardOptimizer"]
    strategy, extended = objects["TPUStrategy"], objects["TPUStrategy.extended"]
    compile_ = "KerasTPUModel.compile(...)"
    to_cores = "TPUConfig(num_shards=...)"
    return {
        ("KerasTPUModel", "to_yaml()"): ("to_json()", lambda: tpu_model.to_yaml()),
        (compile_, "target_tensors"): ("pass the targets as y",
                                       lambda: tpu_model.compile("adam", "mse", target_tensors=[np.ones(3)])),
        (compile_, "distribute"): ("TPUStrategy().scope()",
                                   lambda: tpu_model.compile("adam", "mse", distribute=keras_tpu.TPUStrategy())),
        (compile_, "run_eagerly"): ("tpu_model.cpu_model", lambda: tpu_model.compile("adam", "mse", run_eagerly=True)),
        ("KerasTPUModel.save(...)", "signatures"): (
            "tpu_model.export(path)", lambda: tpu_model.save(str(tmp_path / "m.keras"), signatures={})),
        ("KerasTPUModel.save(...)", "options"): (
            "tpu_model.export(path)", lambda: tpu_model.save(str(tmp_path / "m.keras"), options=object())),
        ("TPUEstimator(...)", "embedding_config_spec"): (
            "keras.layers.Embedding",
            lambda: tpu_estimator.TPUEstimator(tiny_model_fn, model_dir=str(tmp_path), embedding_config_spec={})),
        ("RunConfig(...)", "train_distribute"): (to_cores, lambda: tpu_estimator.RunConfig(train_distribute=strategy)),
        ("RunConfig(...)", "eval_distribute"): (to_cores, lambda: tpu_estimator.RunConfig(eval_distribute=strategy)),
        ("RunConfig(...)", "experimental_distribute"): (
            to_cores, lambda: tpu_estimator.RunConfig(experimental_distribute=object())),
        ("RunConfig(...)", "device_fn"): ("device_fn=None", lambda: tpu_estimator.RunConfig(device_fn=lambda op: "")),
        ("TPUConfig(...)", "num_cores_per_replica"): (
            "num_shards", lambda: tpu_estimator.TPUConfig(num_cores_per_replica=2)),
        ("TPUConfig(...)", "input_partition_dims"): (
            "use None", lambda: tpu_estimator.TPUConfig(input_partition_dims=[[1, 2, 1, 1], None])),
        ("CrossShardOptimizer(...)", "group_assignment"): (
            "group_assignment=None",
            lambda: tpu_estimator.CrossShardOptimizer(keras.optimizers.SGD(), group_assignment=[[0, 1, 2, 3]])),
        ("EstimatorSpec(...)", "eval_metric_ops"): (
            "TPUEstimatorSpec(eval_metrics=(metric_fn, tensors))",
            lambda: tpu_estimator.EstimatorSpec("eval", eval_metric_ops={"accuracy": None}).as_tpu_estimator_spec()),
        ("CrossShardOptimizer", "compute_gradients()"): (
            "TPUEstimatorSpec(train_op=...)", lambda: optimizer.compute_gradients(0.0)),
        ("CrossShardOptimizer", "apply_gradients()"): (
            "TPUEstimatorSpec(train_op=...)", lambda: optimizer.apply_gradients([])),
        ("CrossShardOptimizer", "get_slot()"): (".variables()", lambda: optimizer.get_slot(None, "momentum")),
        ("CrossShardOptimizer", "get_slot_names()"): (".variables()", lambda: optimizer.get_slot_names()),
        ("CrossShardOptimizer.minimize(...)", "var_list"): (
            "layer.trainable = False", lambda: optimizer.minimize(0.0, var_list=[])),
        ("CrossShardOptimizer.minimize(...)", "grad_loss"): (
            "scale the loss in model_fn", lambda: optimizer.minimize(0.0, grad_loss=1.0)),
        ("Optimizer", "compute_gradients()"): (
            "optimizer.minimize(loss)", lambda: objects["Optimizer"].compute_gradients(0.0)),
        ("Optimizer.minimize(...)", "var_list"): (
            "layer.trainable = False", lambda: objects["Optimizer"].minimize(0.0, var_list=[])),
        ("Optimizer.minimize(...)", "grad_loss"): (
            "scale the loss in model_fn", lambda: objects["Optimizer"].minimize(0.0, grad_loss=1.0)),
        ("TPUStrategy", "make_input_fn_iterator()"): (
            "distribute_datasets_from_function", lambda: strategy.make_input_fn_iterator(lambda context: [])),
        ("TPUStrategy", "experimental_make_numpy_dataset()"): (
            "experimental_distribute_dataset", lambda: strategy.experimental_make_numpy_dataset(np.ones((8, 2)))),
        ("TPUStrategy.extended", "experimental_run_steps_on_iterator()"): (
            "strategy.run", lambda: extended.experimental_run_steps_on_iterator(lambda ctx, x: x, iter([]))),
        ("TPUStrategy.extended", "experimental_make_numpy_dataset()"): (
            "experimental_distribute_dataset", lambda: extended.experimental_make_numpy_dataset(np.ones((8, 2)))),
    }


def test_supported_and_no_effect_members_exist(instances):
    for api, names, status, _ in ROWS:
        if api.endswith("(...)") or status == "refused":
            continue
        found = instances.get(api, KERAS_TPU.get(api))
        for name in names:
            member = name.removesuffix("()")
            assert hasattr(found, member), f"{api}: {name} ({status}) is missing"
            if name.endswith("()"):
                assert callable(getattr(found, member)), f"{api}: {name} is not callable"


def test_every_refusal_raises_and_names_the_alternative_the_table_names(instances, tmp_path):
    calls = refusals(instances, tmp_path)
    refused = [(api, name, note) for api, names, status, note in ROWS if status == "refused" for name in names]
    assert {(api, name) for api, name, _ in refused} == set(calls), "every refused row needs a refusal call here"
    for api, name, note in refused:
        alternative, call = calls[api, name]
        with pytest.raises((ValueError, NotImplementedError, RuntimeError)) as info:
            call()
        assert alternative.lower() in str(info.value).lower(), f"{api} {name}: {info.value} does not name {alternative}"
        assert alternative.lower() in plain(note), f"{api} {name}: the table's note does not name {alternative}"


def test_value_refusals_of_supported_arguments(instances, tmp_path):
    tpu_model, estimator = instances["KerasTPUModel"], instances["TPUEstimator"]
    with pytest.raises(ValueError, match="export"):
        tpu_model.save(str(tmp_path / "m.keras"), save_format="tf")
    with pytest.raises(ValueError, match=r"\.h5"):
        tpu_model.save_weights(str(tmp_path / "w.h5"), save_format="tf")
    with pytest.raises(ValueError, match="PREDICT"):
        estimator.export_saved_model(str(tmp_path), lambda: np.ones((1, 4), np.float32), experimental_mode="train")
    with pytest.raises(ValueError, match="number of steps"):
        tpu_estimator.TPUConfig(iterations_per_loop="60s")
    with pytest.raises(ValueError, match="model parallelism"):
        keras_tpu.TPUStrategy(experimental_device_assignment=keras_tpu.DeviceAssignment.build(
            None, computation_shape=[1, 1, 2], num_replicas=4))


# -- the behaviours the table promises ------------------------------------------------------------------------


def test_no_effect_arguments_change_nothing():
    plain_resolver = keras_tpu.TPUClusterResolver("grpc://10.0.0.2:8470")
    resolver = keras_tpu.TPUClusterResolver("grpc://10.0.0.2:8470", zone="us-central1-b", project="p",
                                            credentials=object(), service=object(), discovery_url="http://x/{api}")
    assert resolver.master() == plain_resolver.master()
    assert resolver.cluster_spec() == plain_resolver.cluster_spec()
    assert resolver.num_accelerators("worker", 0, object()) == {"TPU": 8}
    keras_tpu.experimental_connect_to_cluster(resolver, job_name="tpu", task_index=1, protocol="grpc",
                                              make_master_device_default=False, cluster_device_filters=object())
    config = tpu_estimator.TPUConfig(
        iterations_per_loop=3, per_host_input_for_training=tpu_estimator.InputPipelineConfig.PER_SHARD_V1,
        tpu_job_name="tpu", initial_infeed_sleep_secs=5,
        eval_training_input_configuration=tpu_estimator.InputPipelineConfig.SLICED,
        experimental_host_call_every_n_steps=10)
    run_config = tpu_estimator.RunConfig(
        tpu_config=config, evaluation_master="grpc://x:1", save_summary_steps=1, session_config=object(),
        keep_checkpoint_every_n_hours=1, log_step_count_steps=1, protocol="grpc+verbs",
        experimental_max_worker_delay_secs=3, session_creation_timeout_secs=5)
    assert run_config.tpu_config.iterations_per_loop == 3 and run_config.is_chief
    strategy = keras_tpu.TPUStrategy(experimental_spmd_xla_partitioning=True)
    data = next(iter(strategy.experimental_distribute_dataset([np.ones((16, 2))], options=object())))
    total = strategy.run(lambda x: x.sum(), args=(data,), options=object())
    assert float(strategy.reduce("SUM", total, axis=None)) == 32.0
    settings = object()
    assert strategy.update_config_proto(settings) is settings
    assert strategy.extended.broadcast_to(data, "/job:worker/task:0") is data
    with strategy.extended.colocate_vars_with(None):
        pass


def test_tpu_cluster_resolver_with_no_tpu_named_is_the_local_simulated_tpu(monkeypatch):
    for variable in ("COLAB_TPU_ADDR", "TPU_NAME", "KERAS_TPU_WORKERS"):
        monkeypatch.delenv(variable, raising=False)
    try:  # the detection cell of Google's TPU notebooks
        tpu = keras_tpu.TPUClusterResolver()
        print("Running on TPU ", tpu.cluster_spec().as_dict()["worker"])
    except ValueError:
        tpu = None
    assert tpu is not None and tpu.cluster_spec().as_dict()["worker"] == ["localhost:8470"]
    assert tpu.master() == "" and tpu.get_coordination_service_leader() == "/job:worker/task:0"
    with keras_tpu.TPUClusterResolver() as resolver:
        assert keras_tpu.TPUStrategy(resolver).num_replicas_in_sync == 8


def batches(x, y, size):
    while True:
        for start in range(0, len(x), size):
            yield x[start:start + size], y[start:start + size]


def test_generator_methods_train_evaluate_and_predict_on_the_tpu():
    x, y = classification_data(128)
    tpu_model = on_tpu(small_classifier())
    history = tpu_model.fit_generator(batches(x, y, 32), steps_per_epoch=4, epochs=6, verbose=0, max_queue_size=3,
                                      workers=2, use_multiprocessing=False)
    losses = history.history["loss"]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0]
    scores = tpu_model.evaluate_generator(batches(x, y, 32), steps=4, max_queue_size=1, workers=4)
    np.testing.assert_allclose(scores, tpu_model.evaluate(x, y, batch_size=32, verbose=0), rtol=1e-6)
    predictions = tpu_model.predict_generator((x[i:i + 40] for i in range(0, 128, 40)), steps=4)
    assert predictions.shape == (128, 3)
    np.testing.assert_allclose(predictions, tpu_model.predict(x, batch_size=32, verbose=0), atol=1e-6)


def test_predict_generator_of_a_model_with_two_inputs_takes_lists_of_inputs():
    """TF 1.x's predict_generator took any batch that is not a tuple as the inputs: a list is a model's inputs."""
    first, second = keras.Input((3,)), keras.Input((2,))
    model = keras.Model([first, second], keras.layers.Dense(2)(keras.layers.Concatenate()([first, second])))
    model.compile("sgd", "mse")
    tpu_model = on_tpu(model)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((20, 3)).astype("float32"), rng.standard_normal((20, 2)).astype("float32")
    predictions = tpu_model.predict_generator(([a[i:i + 8], b[i:i + 8]] for i in range(0, 20, 8)), steps=3)
    np.testing.assert_allclose(predictions, tpu_model.predict([a, b], verbose=0), atol=1e-6)


def test_kwargs_arguments_work():
    x, y = classification_data(64)
    tpu_model = on_tpu(small_classifier())
    history = tpu_model.fit(x, y, batch_size=32, nb_epoch=3, verbose=0, _pipeline=False)
    assert len(history.history["loss"]) == 3  # nb_epoch is Keras 1's epochs
    with pytest.raises(ValueError, match="nb_epoch"):
        tpu_model.fit(x, y, epochs=2, nb_epoch=3, verbose=0)


def test_tensorflow_1_strategy_methods():
    strategy = keras_tpu.TPUStrategy(steps_per_run=4)
    assert strategy.steps_per_run == 4 == strategy.extended.steps_per_run
    global_batches = [np.arange(16, dtype=np.float32).reshape(8, 2) + 100 * i for i in range(2)]
    iterator = strategy.make_dataset_iterator(global_batches)
    sums = strategy.experimental_run(lambda batch: batch.sum(), iterator)
    assert [float(s) for s in strategy.unwrap(sums)] == [float(r.sum()) for r in global_batches[0]]
    second = strategy.experimental_run(lambda batch: batch.sum(), iterator)
    assert float(strategy.reduce("SUM", second)) == float(global_batches[1].sum())
    extended = strategy.extended
    per_core = extended.call_for_each_replica(lambda batch: batch * 2, args=(next(iter(
        strategy.experimental_distribute_dataset(global_batches))),))
    np.testing.assert_array_equal(np.concatenate(strategy.experimental_local_results(per_core)), 2 * global_batches[0])
    assert float(extended.read_var(keras.Variable(3.0))) == 3.0
    assert extended.update_non_slot(None, lambda a: a + 1, args=(1,)) == 2
    assert extended.update_non_slot(None, lambda: 5, group=False) == (5,)
    assert extended.non_slot_devices([]) == "/job:worker/replica:0/task:0/device:CPU:0"
    assert extended.experimental_enable_dynamic_batch_size is extended.experimental_enable_get_next_as_optional is True


def test_estimator_params_batches_and_export(tmp_path):
    rng = np.random.default_rng(0)
    features, labels = rng.standard_normal((64, 4)).astype("float32"), rng.integers(0, 3, 64)
    estimator = tpu_estimator.TPUEstimator(
        tiny_model_fn, config=tpu_estimator.RunConfig(
            model_dir=str(tmp_path / "model"), tpu_config=tpu_estimator.TPUConfig(iterations_per_loop=2)),
        train_batch_size=16, predict_batch_size=16)
    estimator.train(lambda params: (features, labels), max_steps=2)
    batches_ = list(estimator.predict(lambda params: features[:40], yield_single_examples=False))
    assert [len(batch["logits"]) for batch in batches_] == [16, 16, 8]
    assert all(batch["use_tpu"].min() == 1.0 for batch in batches_)  # params["use_tpu"] in model_fn
    path = estimator.export_savedmodel(str(tmp_path / "export"), lambda: features[:1], as_text=True,
                                       strip_default_attrs=True)
    assert os.path.isdir(path)
    exported = keras_tpu.load_exported(path)(features[:5])
    np.testing.assert_allclose(exported["logits"], np.concatenate([b["logits"] for b in batches_])[:5], atol=1e-5)
