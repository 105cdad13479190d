"""``model.fit``/``evaluate``/``predict`` of a TPUStrategy model on the strategy's distributed datasets, as
TensorFlow's Keras takes them (``tf.keras`` ``engine/data_adapter.py``: ``DatasetAdapter`` handles a
distributed dataset, and refuses ``y`` and ``sample_weight`` with it; ``train_validation_split`` refuses to split
one). Each element's per-replica parts reach the model joined in replica order, as the global batch they came
from, so the results are those of the same calls on the undistributed batches or arrays, partial batches
included."""

import keras
import numpy as np
import pytest

import keras_tpu
from tests.tpu_helpers import classification_data, on_tpu, small_classifier

TOLERANCE = dict(rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def strategy():
    return keras_tpu.TPUStrategy(precision="highest")


def _model(strategy, **compile_kwargs):
    with strategy.scope():
        return small_classifier(**compile_kwargs)


def _batches(x, y, batch_size, *extra):
    return [(x[i:i + batch_size], y[i:i + batch_size], *(e[i:i + batch_size] for e in extra))
            for i in range(0, len(x), batch_size)]


def _assert_same_history(got, want):
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], **TOLERANCE, err_msg=key)


def _assert_same_weights(model, reference):
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, **TOLERANCE)


@pytest.mark.parametrize("rows, batch_size", [
    (100, 32),   # a partial last batch of 4 rows: all on the first replica, the others none
    (172, 64),   # TensorFlow's example: a last batch of 44 rows split 8, 8, 8, 8, 8, 4, 0, 0
    (200, 100),  # a global batch that does not divide over 8 replicas: 13 rows on four, 12 on the rest
])
def test_fit_evaluate_and_predict_on_a_distributed_dataset_equal_the_arrays(strategy, rows, batch_size):
    x, y = classification_data(rows)
    distributed = strategy.experimental_distribute_dataset(_batches(x, y, batch_size))
    parts = [features.rows or (features.values[0].shape[0],) * 8 for features, _ in distributed]
    assert sum(map(sum, parts)) == rows and len(set(parts[-1])) > 1  # the last batch is split unevenly
    model, reference = _model(strategy), _model(strategy)

    history = model.fit(distributed, epochs=2, verbose=0, validation_data=distributed)
    want = reference.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
                         validation_data=(x, y), validation_batch_size=batch_size)
    _assert_same_history(history.history, want.history)
    _assert_same_weights(model, reference)
    np.testing.assert_allclose(model.evaluate(distributed, verbose=0),
                               reference.evaluate(x, y, batch_size=batch_size, verbose=0), **TOLERANCE)
    predictions = model.predict(distributed, verbose=0)
    assert predictions.shape == (rows, 3)  # one row per row of the dataset, in the dataset's order
    np.testing.assert_allclose(predictions, reference.predict(x, batch_size=batch_size, verbose=0), **TOLERANCE)


def test_sample_weights_and_a_dict_of_features_in_the_elements(strategy):
    rows, batch_size = 90, 40
    x, y = classification_data(rows)
    weights = np.random.default_rng(3).uniform(0.1, 2.0, rows).astype("float32")
    distributed = strategy.experimental_distribute_dataset(_batches(x, y, batch_size, weights))
    model, reference = _model(strategy, weighted_metrics=["accuracy"]), \
        _model(strategy, weighted_metrics=["accuracy"])
    history = model.fit(distributed, epochs=2, verbose=0)
    want = reference.fit(x, y, sample_weight=weights, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    _assert_same_history(history.history, want.history)
    _assert_same_weights(model, reference)

    # A dict of named inputs (the element's structure is kept, each leaf joined).
    keras.utils.set_random_seed(0)
    inputs = {"a": keras.Input((4,), name="a"), "b": keras.Input((2,), name="b")}
    with strategy.scope():
        named = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Concatenate()([inputs["a"], inputs["b"]])))
    features = {"a": x[:, :4], "b": x[:, 4:]}
    dict_batches = [({"a": x[i:i + batch_size, :4], "b": x[i:i + batch_size, 4:]},)
                    for i in range(0, rows, batch_size)]
    np.testing.assert_allclose(named.predict(strategy.experimental_distribute_dataset(dict_batches), verbose=0),
                               named.predict(features, batch_size=batch_size, verbose=0), **TOLERANCE)


@pytest.mark.parametrize("per_replica_pipelines", [False, True])
def test_a_dataset_from_distribute_datasets_from_function(strategy, per_replica_pipelines):
    """``dataset_fn`` gives per-replica batches of 4 rows (a global batch of 32); 102 rows end in a step whose
    replicas hold 4, 2 and then no rows: joined, the global batches of arrays batched by 32."""
    rows, global_batch = 102, 32
    x, y = classification_data(rows)
    options = keras_tpu.InputOptions(experimental_replication_mode=keras_tpu.InputReplicationMode.PER_REPLICA) \
        if per_replica_pipelines else None

    def dataset_fn(context):
        per_replica = context.get_per_replica_batch_size(global_batch)
        starts = range(0, rows, per_replica)
        if per_replica_pipelines:  # pipeline i reads replica i's rows of each global batch
            starts = range(context.input_pipeline_id * per_replica, rows, global_batch)
        return [(x[s:s + per_replica], y[s:s + per_replica]) for s in starts]

    distributed = strategy.distribute_datasets_from_function(dataset_fn, options)
    assert [features.rows for features, _ in distributed][-1] == (4, 2, 0, 0, 0, 0, 0, 0)
    model, reference = _model(strategy), _model(strategy)
    history = model.fit(distributed, epochs=2, verbose=0)
    want = reference.fit(x, y, batch_size=global_batch, epochs=2, shuffle=False, verbose=0)
    _assert_same_history(history.history, want.history)
    _assert_same_weights(model, reference)
    np.testing.assert_allclose(model.evaluate(distributed, verbose=0),
                               reference.evaluate(x, y, batch_size=global_batch, verbose=0), **TOLERANCE)
    np.testing.assert_allclose(model.predict(distributed, verbose=0),
                               reference.predict(x, batch_size=global_batch, verbose=0), **TOLERANCE)


def test_a_distributed_generator_and_steps_per_epoch(strategy):
    """A generator is read once: Keras' look at the first batch before the loop does not lose it. With
    ``steps_per_epoch`` an epoch ends after that many batches and the next goes on from there (TensorFlow keeps
    one iterator over a distributed dataset), as for arrays."""
    x, y = classification_data(100)
    batches = _batches(x, y, 32)
    model, reference = _model(strategy), _model(strategy)
    history = model.fit(strategy.experimental_distribute_dataset(b for b in batches), verbose=0)
    want = reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    _assert_same_history(history.history, want.history)
    _assert_same_weights(model, reference)

    model, reference = _model(strategy), _model(strategy)
    history = model.fit(strategy.experimental_distribute_dataset(batches), epochs=4, steps_per_epoch=2, verbose=0)
    want = reference.fit(x, y, batch_size=32, epochs=4, steps_per_epoch=2, shuffle=False, verbose=0)
    _assert_same_history(history.history, want.history)
    _assert_same_weights(model, reference)
    assert int(model.optimizer.iterations.value) == 8


def test_what_tensorflow_refuses_with_a_distributed_dataset_says_what_to_do(strategy):
    x, y = classification_data(64)
    model = _model(strategy)
    distributed = strategy.experimental_distribute_dataset(_batches(x, y, 32))
    refusals = [
        (lambda: model.fit(distributed, y), r"y is not supported when x is a distributed dataset.*Distribute "
                                            r"\(features, labels\) batches"),
        (lambda: model.evaluate(distributed, sample_weight=np.ones(64)),
         r"sample_weight is not supported.*Distribute \(features, labels, sample_weights\) batches"),
        (lambda: model.fit(distributed, validation_split=0.25),
         r"cannot be split.*Pass validation_data instead"),
        (lambda: model.fit(distributed, class_weight={0: 1.0, 1: 2.0, 2: 1.0}),
         r"class weights are not supported.*each row's sample weight its class's weight"),
        (lambda: model.fit(distributed, batch_size=64),
         r"batch_size=64.*first global batch has 32 rows.*Leave batch_size out, or batch the data by 64 rows"),
        (lambda: model.predict(distributed, batch_size=16), r"Leave batch_size out"),
        (lambda: model.fit(x, y, validation_data=distributed, validation_batch_size=8),
         r"Leave validation_batch_size out"),
        (lambda: model.fit(iter(distributed)),
         r"an iterator over a distributed dataset.*takes a distributed dataset itself"),
        (lambda: model.predict(next(iter(distributed))[0]), r"a per-replica value.*Pass the dataset"),
        (lambda: model.train_on_batch(*next(iter(distributed))),
         r"takes one global batch of arrays.*or give the distributed dataset to fit\(\)"),
        (lambda: model.fit(strategy.experimental_distribute_dataset([])), r"has no elements.*Distribute at least"),
        (lambda: model.fit(strategy.distribute_datasets_from_function(
            lambda context: [(x[:4], y[:4], np.float32(1.0))] * 8)), r"a scalar on each replica.*one value per row"),
    ]
    weights = [w.copy() for w in model.get_weights()]
    for call, message in refusals:
        with pytest.raises(ValueError, match=message):
            call()
    for a, b in zip(model.get_weights(), weights):  # nothing trained
        np.testing.assert_array_equal(a, b)
    # batch_size equal to the dataset's global batch changes nothing (TensorFlow's Keras ignores it).
    assert model.fit(distributed, batch_size=32, verbose=0).history["loss"]


def test_only_the_models_of_the_strategy_that_distributed_it_take_it(strategy):
    x, y = classification_data(64)
    distributed = strategy.experimental_distribute_dataset(_batches(x, y, 32))
    other = _model(keras_tpu.TPUStrategy(precision="highest"))
    for model in (other, on_tpu(small_classifier())):
        with pytest.raises(ValueError, match=r"not a model of the TPUStrategy that distributed this dataset.*"
                                             r"Distribute the batches with the strategy whose scope created"):
            model.fit(distributed, verbose=0)
