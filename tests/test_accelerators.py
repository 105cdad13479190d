"""The accelerator table (keras_tpu._accelerators): published figures, parsing, and its readers."""

import pytest

import keras_tpu
from keras_tpu import _accelerators as accelerators
from keras_tpu.mxu import _cost as cost


@pytest.mark.parametrize("generation, peak_tflops, hbm_gib", [
    ("v2", 22.9, 8),      # 128 x 128 MXU at 700 MHz; 16 GiB per chip of 2 cores
    ("v3", 61.6, 16),     # 2 MXUs at 940 MHz (123 TFLOP/s per chip); 32 GiB per chip
    ("v4", 137.6, 16),    # 4 MXUs at 1050 MHz (275 TFLOP/s per chip)
])
def test_per_core_figures_match_the_published_chip_figures(generation, peak_tflops, hbm_gib):
    spec = accelerators.GENERATIONS[generation]
    assert spec.peak_flops_per_core / 1e12 == pytest.approx(peak_tflops, rel=0.01)
    assert spec.hbm_bytes_per_core == hbm_gib * accelerators.GIB


@pytest.mark.parametrize("name, generation, cores", [
    ("v2-8", "v2", 8), (" V3-8 ", "v3", 8), ("v3-2048", "v3", 2048), ("v5e-8", "v5litepod", 8),
    ("v5litepod-16", "v5litepod", 16),
])
def test_accelerator_spec_parses_names_as_cloud_tpu_spells_them(name, generation, cores):
    spec, parsed_cores = accelerators.accelerator_spec(name)
    assert (spec.generation, parsed_cores) == (generation, cores)


@pytest.mark.parametrize("bad", ["v3-7", "v9-8", "tpu", "v2-16", ""])
def test_unknown_types_are_refused_with_the_known_ones_listed(bad):
    with pytest.raises(ValueError, match="Known types: v2-8, v2-32"):
        accelerators.accelerator_spec(bad)


def test_every_listed_type_parses_and_the_package_exports_the_one_table():
    for name in accelerators.ACCELERATOR_TYPES:
        accelerators.accelerator_spec(name)
    assert keras_tpu.ACCELERATOR_TYPES is accelerators.ACCELERATOR_TYPES
    assert keras_tpu.AcceleratorSpec is accelerators.AcceleratorSpec
    resolver = keras_tpu.TPUClusterResolver(tpu="", accelerator_type="v3-8")
    assert resolver.spec is accelerators.GENERATIONS["v3"]


def test_the_cost_model_takes_a_spec_a_type_or_a_generation():
    gemm = cost.gemm_cost(1024, 288, 64)
    by_name = gemm.timing("v3-8")
    assert gemm.timing(accelerators.accelerator_spec("v3-8")[0]) == by_name
    assert gemm.timing("v3") == by_name
    assert gemm.timing("v2-8") != by_name
