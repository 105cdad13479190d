"""keras_tpu.accelerators and (during the move) keras_tpu.cluster hold the same accelerator table.

cluster.py still defines its own copy of the names that moved to
accelerators.py. Until it imports them from there, these tests check that
both copies agree value for value; afterwards they are trivially true.
"""

import dataclasses

import pytest

from keras_tpu import accelerators, cluster
from keras_tpu.mxu import cost

NAMES = ("ACCELERATOR_TYPES", "DEFAULT_ACCELERATOR_TYPE", "GENERATIONS", "GIB", "SLICE_SIZES")


def _public_attributes(cls):
    return sorted(name for name in dir(cls) if not name.startswith("_"))


def _values(spec):
    """Every field and property of a spec, by name."""
    return {name: getattr(spec, name) for name in _public_attributes(type(spec))}


def test_the_spec_classes_have_the_same_fields_defaults_and_properties():
    old, new = cluster.AcceleratorSpec, accelerators.AcceleratorSpec
    as_pairs = lambda cls: [(f.name, f.type, f.default) for f in dataclasses.fields(cls)]
    assert as_pairs(old) == as_pairs(new)
    assert _public_attributes(old) == _public_attributes(new)
    assert old.__dataclass_params__.frozen and new.__dataclass_params__.frozen


@pytest.mark.parametrize("name", NAMES)
def test_the_tables_are_equal(name):
    old, new = getattr(cluster, name), getattr(accelerators, name)
    if name == "GENERATIONS":
        assert list(old) == list(new)
        for generation in old:
            assert _values(old[generation]) == _values(new[generation]), generation
    else:
        assert old == new


@pytest.mark.parametrize("accelerator_type", accelerators.ACCELERATOR_TYPES + ("v5e-8", " V3-8 "))
def test_accelerator_spec_parses_the_same(accelerator_type):
    (old, old_cores), (new, new_cores) = (cluster.accelerator_spec(accelerator_type),
                                          accelerators.accelerator_spec(accelerator_type))
    assert old_cores == new_cores
    assert _values(old) == _values(new)


def test_accelerator_spec_rejects_the_same():
    for bad in ("v3-7", "v9-8", "tpu"):
        with pytest.raises(ValueError) as old:
            cluster.accelerator_spec(bad)
        with pytest.raises(ValueError) as new:
            accelerators.accelerator_spec(bad)
        assert str(old.value) == str(new.value)


def test_the_cost_model_takes_either_copy_of_a_spec():
    gemm = cost.gemm_cost(1024, 288, 64)
    by_name = gemm.timing("v3-8")
    assert gemm.timing(cluster.accelerator_spec("v3-8")[0]) == by_name
    assert gemm.timing(accelerators.accelerator_spec("v3-8")[0]) == by_name
    assert gemm.timing("v3") == by_name
