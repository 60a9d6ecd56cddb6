"""Published specs of the accelerators jaxserve targets: one small table, each row with its source.

`jaxserve plan` checks a launch config's memory against `hbm_bytes` and turns the compiler's
cost analysis into a roofline estimate with `hbm_bytes_per_s` and `peak_bf16_flops` (dense).
`topology_name` is what `jax.experimental.topologies.get_topology_desc` takes for a TPU; GPUs
have none (jax cannot compile for CUDA without a CUDA device, see docs/scaling.md).
Plain data; imports nothing of jaxserve.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB, GB, TB = 2**30, 10**9, 10**12


@dataclass(frozen=True)
class ChipSpec:
    name: str
    platform: str  # "tpu" | "gpu"
    device_kind: str  # what jax reports as Device.device_kind
    hbm_bytes: int
    hbm_bytes_per_s: float
    peak_bf16_flops: float  # dense
    source: str
    topology_name: str | None = None  # TPU generation for get_topology_desc("<name>:<topology>")


CHIPS: dict[str, ChipSpec] = {
    c.name: c
    for c in (
        ChipSpec(
            "tpu-v5e",
            "tpu",
            "TPU v5 lite",
            16 * GiB,
            819 * GB,
            197 * TB,
            "https://cloud.google.com/tpu/docs/v5e (16 GiB HBM2, 819 GBps, 197 TFLOPs bf16)",
            "v5e",
        ),
        ChipSpec(
            "tpu-v5p",
            "tpu",
            "TPU v5",
            95 * GiB,
            2765 * GB,
            459 * TB,
            "https://cloud.google.com/tpu/docs/v5p (95 GiB HBM2e, 2765 GBps, 459 TFLOPs bf16)",
            "v5p",
        ),
        ChipSpec(
            "tpu-v6e",
            "tpu",
            "TPU v6 lite",
            32 * GiB,
            1640 * GB,
            918 * TB,
            "https://cloud.google.com/tpu/docs/v6e (32 GiB HBM, 1640 GBps, 918 TFLOPs bf16)",
            "v6e",
        ),
        ChipSpec(
            "gpu-h200",
            "gpu",
            "NVIDIA H200",
            141 * GB,
            4.8 * TB,
            989 * TB,
            "https://www.nvidia.com/en-us/data-center/h200/ (141 GB HBM3e, 4.8 TB/s, 989 TFLOPS bf16 dense)",
        ),
        ChipSpec(
            "gpu-h100",
            "gpu",
            "NVIDIA H100 80GB HBM3",
            80 * GB,
            3.35 * TB,
            989 * TB,
            "https://www.nvidia.com/en-us/data-center/h100/ (SXM: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS bf16 dense)",
        ),
    )
}
