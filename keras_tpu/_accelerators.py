"""Cloud TPU accelerator types and the per-generation figures of their cores.

The table the cluster resolver (:mod:`keras_tpu._cluster`) and the MXU cost
model (:mod:`keras_tpu.mxu._cost`) share. It depends on nothing else in
keras_tpu, so the MXU package can use it without importing the cluster.
"""

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class AcceleratorSpec:
    """Public per-generation figures of a Cloud TPU TensorCore ("core").

    Sources: Cloud TPU system-architecture pages (v3, v4, v5e) and Jouppi et
    al., "A Domain-Specific Supercomputer for Training Deep Neural Networks",
    CACM 2020 (v2). Per-core HBM figures are the chip figures divided by the
    cores per chip.

    Example:
        >>> spec = GENERATIONS["v3"]
        >>> spec.cores_per_chip, spec.mxus_per_core, spec.hbm_bytes_per_core // GIB
        (2, 2, 16)
        >>> round(spec.peak_flops_per_core / 1e12, 1)   # bf16 TFLOP/s of one core
        61.6
    """

    generation: str
    cores_per_chip: int
    mxus_per_core: int
    clock_hz: float
    hbm_bytes_per_core: int
    hbm_bytes_per_second_per_core: float
    mxu_rows: int = 128
    mxu_cols: int = 128

    @property
    def peak_flops_per_core(self):
        """bf16 peak: two flops per multiply-accumulate, every MXU cell every cycle."""
        return 2.0 * self.mxus_per_core * self.mxu_rows * self.mxu_cols * self.clock_hz


GIB = 1 << 30

GENERATIONS = {
    # 2 cores x 1 MXU at 700 MHz (~45 TFLOP/s per chip), 16 GiB and 700 GB/s per chip.
    "v2": AcceleratorSpec("v2", 2, 1, 700e6, 8 * GIB, 350e9),
    # 2 cores x 2 MXUs at 940 MHz (123 TFLOP/s per chip), 32 GiB and 900 GB/s per chip.
    "v3": AcceleratorSpec("v3", 2, 2, 940e6, 16 * GIB, 450e9),
    # 2 cores x 4 MXUs at 1050 MHz (275 TFLOP/s per chip), 32 GiB and 1200 GB/s per chip.
    "v4": AcceleratorSpec("v4", 2, 4, 1050e6, 16 * GIB, 600e9),
    # 1 core x 4 MXUs at 1.5 GHz (197 TFLOP/s per chip), 16 GB and 819 GB/s per chip.
    "v5litepod": AcceleratorSpec("v5litepod", 1, 4, 1500e6, 16 * 10**9, 819e9),
}

# Slice sizes (TensorCores, i.e. the number after the dash) Cloud TPU offers.
SLICE_SIZES = {
    "v2": (8, 32, 128, 256, 512),
    "v3": (8, 32, 64, 128, 256, 512, 1024, 2048),
    "v4": (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    "v5litepod": (1, 4, 8, 16, 32, 64, 128, 256),
}

#: Every accelerator type a :class:`keras_tpu.TPUClusterResolver` accepts (``"v2-8"``, ``"v3-32"``, ...).
ACCELERATOR_TYPES = tuple(f"{gen}-{n}" for gen, sizes in SLICE_SIZES.items() for n in sizes)

DEFAULT_ACCELERATOR_TYPE = "v2-8"


@dataclasses.dataclass(frozen=True)
class SystemFigures:
    """Per-generation figures beyond the core's MXUs and HBM, for the whole-step time model
    (:mod:`keras_tpu._step_time`).

    Attributes:
        vpu_ops_per_cycle: 32-bit element operations the core's vector unit does per cycle.
        ici_allreduce_bytes_per_second_per_chip: bytes per second a chip sends (and receives) over its
            inter-chip links in an all-reduce.
        ici_hop_latency_s: latency of one inter-chip hop.
        host_link_bytes_per_second_per_chip: host-to-chip (PCIe) bandwidth.
        cores_per_host: TensorCores one host (VM) drives.
    """

    vpu_ops_per_cycle: int
    ici_allreduce_bytes_per_second_per_chip: float
    ici_hop_latency_s: float
    host_link_bytes_per_second_per_chip: float
    cores_per_host: int = 8


# Vector unit: 8 sublanes x 128 lanes of 32-bit ALUs per core, one register-wide operation per cycle (the Cloud TPU
# performance guide: "Each TPU core uses two-dimensional 8 X 128 vector registers"; Norrie et al., "The Design
# Process for Google's Training Chips: TPUv2 and TPUv3", IEEE Micro 41(2), 2021). ICI: TPUv2 has 4 links of
# 496 Gbit/s and TPUv3 4 links of 656 Gbit/s per chip (Jouppi et al., CACM 63(7), 2020, Table 3); v4 and v5e
# from the Cloud TPU pages' "all-reduce bandwidth per Pod" divided by the Pod's chips (v4: 1.1 PB/s / 4096;
# v5e: 51.2 TB/s / 256, = half of v5e's 400 GB/s bidirectional ICI per chip). Hop latency: 1 us, an
# estimate (no published per-hop figure). Host link: PCIe Gen3 x16 per chip (15.75 GB/s; TPUv1's host
# interface, Jouppi et al., ISCA 2017, kept as the figure for later hosts, whose links are not published per
# chip). Eight cores per host: a v2-8/v3-8 host drives 4 chips of 2 cores, a v4 host 4 chips of 2, a v5e
# host 8 chips of 1 (Cloud TPU v5e page: "Chips per host 8").
SYSTEM_FIGURES = {
    "v2": SystemFigures(8 * 128, 4 * 496e9 / 8, 1e-6, 15.75e9),
    "v3": SystemFigures(8 * 128, 4 * 656e9 / 8, 1e-6, 15.75e9),
    "v4": SystemFigures(8 * 128, 1.1e15 / 4096, 1e-6, 15.75e9),
    "v5litepod": SystemFigures(8 * 128, 51.2e12 / 256, 1e-6, 15.75e9),
}


def system_figures(generation):
    """The :class:`SystemFigures` of a generation (``"v2"``, ``"v3"``, ``"v4"``, ``"v5litepod"``/``"v5e"``) or
    of an accelerator type such as ``"v3-8"``.

    Example:
        >>> system_figures("v3-8").ici_allreduce_bytes_per_second_per_chip / 1e9
        328.0
    """
    name = str(generation).strip().lower()
    name = "v5litepod" if name == "v5e" else name
    if name not in SYSTEM_FIGURES:
        name = accelerator_spec(name)[0].generation
    return SYSTEM_FIGURES[name]


def accelerator_spec(accelerator_type):
    """Parse an accelerator type such as ``"v3-8"`` into ``(AcceleratorSpec, num_cores)``.

    Example:
        >>> spec, cores = accelerator_spec("v2-8")
        >>> cores, spec.mxus_per_core
        (8, 1)
    """
    match = re.fullmatch(r"(v2|v3|v4|v5litepod|v5e)-(\d+)", str(accelerator_type).strip().lower())
    generation = None
    if match:
        generation = "v5litepod" if match.group(1) == "v5e" else match.group(1)
        cores = int(match.group(2))
        if cores in SLICE_SIZES[generation]:
            return GENERATIONS[generation], cores
    raise ValueError(
        f"Unknown TPU accelerator type {accelerator_type!r}. Known types: "
        + ", ".join(ACCELERATOR_TYPES)
        + "."
    )


__all__ = ["ACCELERATOR_TYPES", "AcceleratorSpec", "DEFAULT_ACCELERATOR_TYPE", "GENERATIONS", "GIB", "SLICE_SIZES",
           "SYSTEM_FIGURES", "SystemFigures", "accelerator_spec", "system_figures"]
