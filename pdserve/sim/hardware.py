"""Device and link specifications for the simulator's latency models (torch-free).

Numbers are public spec-sheet values (sources in each entry's docstring block below). Two
conventions matter when reading them:

* ``DeviceSpec.peak_tflops`` is **dense** FP16/BF16 tensor-core throughput (NVIDIA sheets quote
  sparse numbers with an asterisk at twice the dense value; those are not used here).
* ``LinkSpec.bandwidth_gbs`` is the **per-direction** data rate one GPU (or one NIC) can push,
  in GB/s (1e9 bytes/s). NVLink and PCIe spec sheets quote the *bidirectional* aggregate
  (A100: "600 GB/s"); a single transfer or one ring step of an all-reduce sees half of it.
  Network links are quoted in Gb/s: 25 Gb/s Ethernet (DistServe's §6.1 testbed) = 3.125 GB/s.
  ``latency_s`` is a per-message start-up cost (software + wire), order-of-magnitude values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

_T = TypeVar("_T", "DeviceSpec", "LinkSpec")
GIB = 1024**3


@dataclass(frozen=True)
class LinkSpec:
    """An interconnect: per-direction ``bandwidth_gbs`` (GB/s) and per-message ``latency_s``."""

    name: str
    bandwidth_gbs: float
    latency_s: float = 0.0
    description: str = ""

    def __post_init__(self) -> None:
        if self.bandwidth_gbs <= 0:
            raise ValueError(f"link {self.name!r}: bandwidth_gbs must be > 0")
        if self.latency_s < 0:
            raise ValueError(f"link {self.name!r}: latency_s must be >= 0")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbs * 1e9

    def min_time(self, nbytes: float) -> float:
        """``nbytes / bandwidth + latency`` (same contract as ``cluster.transport.Link``)."""
        return nbytes / self.bytes_per_s + self.latency_s


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator as the analytic roofline model sees it.

    ``peak_tflops``: dense FP16/BF16 tensor TFLOP/s; ``memory_gib``: device memory (GiB);
    ``memory_bw_gbs``: HBM/GDDR bandwidth (GB/s); ``intra_node_link``: name of the link joining
    GPUs of one node (tensor-parallel all-reduce, intra-node KV hand-off); ``fp32_tflops``:
    non-tensor FP32 (used for ``float32`` runs).
    """

    name: str
    peak_tflops: float
    memory_gib: float
    memory_bw_gbs: float
    intra_node_link: str
    fp32_tflops: float = 0.0
    description: str = ""

    def __post_init__(self) -> None:
        for f in ("peak_tflops", "memory_gib", "memory_bw_gbs"):
            if getattr(self, f) <= 0:
                raise ValueError(f"device {self.name!r}: {f} must be > 0")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    def flops_per_s(self, dtype: str = "float16") -> float:
        if dtype == "float32":
            return (self.fp32_tflops or self.peak_tflops / 16) * 1e12
        return self.peak_tflops * 1e12

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound (DistServe App. A.2: 156 on
        A100)."""
        return self.peak_tflops * 1e12 / (self.memory_bw_gbs * 1e9)


# ---------------------------------------------------------------------------------- links
# NVLink: NVIDIA A100 datasheet (NVLink 3, 600 GB/s bidirectional per GPU), H100/H200 datasheets
# (NVLink 4, 900 GB/s), A800 datasheet (NVLink 400 GB/s, export-limited A100), V100 (NVLink 2,
# 300 GB/s). PCIe: PCI-SIG, x16 Gen4 = 16 GT/s ≈ 31.5 GB/s per direction, Gen5 ≈ 63 GB/s.
# InfiniBand HDR 200 Gb/s and NDR 400 Gb/s (NVIDIA ConnectX-6/-7). Ethernet 25/100 Gb/s.
_LINKS: tuple[LinkSpec, ...] = (
    LinkSpec("nvlink2", 150.0, 5e-6, "NVLink 2 (V100): 300 GB/s bidirectional"),
    LinkSpec("nvlink3", 300.0, 5e-6, "NVLink 3 (A100 SXM): 600 GB/s bidirectional"),
    LinkSpec("nvlink3-a800", 200.0, 5e-6, "NVLink (A800 SXM): 400 GB/s bidirectional"),
    LinkSpec("nvlink4", 450.0, 5e-6, "NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional"),
    LinkSpec("pcie4", 32.0, 10e-6, "PCIe 4.0 x16: 64 GB/s bidirectional"),
    LinkSpec("pcie5", 64.0, 10e-6, "PCIe 5.0 x16: 128 GB/s bidirectional"),
    LinkSpec("ib-hdr", 25.0, 5e-6, "InfiniBand HDR 200 Gb/s, one NIC"),
    LinkSpec("ib-ndr", 50.0, 5e-6, "InfiniBand NDR 400 Gb/s, one NIC"),
    LinkSpec("eth-25g", 3.125, 50e-6, "25 Gb/s Ethernet (DistServe §6.1 cross-node)"),
    LinkSpec("eth-100g", 12.5, 20e-6, "100 Gb/s Ethernet"),
    LinkSpec("loopback", 1e4, 0.0, "same device / shared memory (CPU placeholder)"),
)

_LINK_ALIASES = {
    "nvlink": "nvlink3", "nvlink-a100": "nvlink3", "nvlink-h100": "nvlink4",
    "nvlink-a800": "nvlink3-a800", "pcie": "pcie4", "pcie-gen4": "pcie4", "pcie-gen5": "pcie5",
    "ib": "ib-hdr", "infiniband": "ib-hdr", "hdr": "ib-hdr", "ndr": "ib-ndr",
    "ethernet": "eth-25g", "eth": "eth-25g", "25g": "eth-25g", "100g": "eth-100g",
}

# -------------------------------------------------------------------------------- devices
# A100-80GB SXM / A100-40GB SXM: NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 tensor
#   312 TFLOPS dense, FP32 19.5; HBM2e 2,039 GB/s (80GB), HBM2 1,555 GB/s (40GB); NVLink 600 GB/s.
# A800-80GB SXM: NVIDIA A800 datasheet: A100 compute and memory, NVLink 400 GB/s.
# H100 SXM: NVIDIA H100 datasheet: BF16/FP16 989 TFLOPS dense (1,979 sparse), FP32 67,
#   HBM3 80 GB at 3.35 TB/s, NVLink 900 GB/s.
# H200 SXM: NVIDIA H200 datasheet: same compute as H100 SXM, HBM3e 141 GB at 4.8 TB/s.
# L20: NVIDIA L20 product brief (Ada AD102): FP16/BF16 tensor 119.5 TFLOPS dense, FP32 59.8,
#   48 GB GDDR6 at 864 GB/s, PCIe 4.0 x16, no NVLink.
# cpu: a placeholder for tests and CPU runs (one modern server socket, order of magnitude).
_DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec("A100-80GB", 312.0, 80.0, 2039.0, "nvlink3", 19.5, "A100 SXM4 80GB"),
    DeviceSpec("A100-40GB", 312.0, 40.0, 1555.0, "nvlink3", 19.5, "A100 SXM4 40GB"),
    DeviceSpec("A800-80GB", 312.0, 80.0, 2039.0, "nvlink3-a800", 19.5, "A800 SXM4 80GB"),
    DeviceSpec("H100", 989.0, 80.0, 3350.0, "nvlink4", 67.0, "H100 SXM5 80GB"),
    DeviceSpec("H200", 989.0, 141.0, 4800.0, "nvlink4", 67.0, "H200 SXM 141GB"),
    DeviceSpec("L20", 119.5, 48.0, 864.0, "pcie4", 59.8, "L20 48GB PCIe"),
    DeviceSpec("cpu", 2.0, 64.0, 100.0, "loopback", 2.0, "CPU placeholder (not a measurement)"),
)

_DEVICE_ALIASES = {
    "a100": "A100-80GB", "a100-80g": "A100-80GB", "a100-sxm": "A100-80GB",
    "a100-sxm4-80gb": "A100-80GB", "a100-40g": "A100-40GB", "a800": "A800-80GB",
    "a800-80g": "A800-80GB", "h100-sxm": "H100", "h100-80gb": "H100", "h100-sxm5": "H100",
    "h200-sxm": "H200", "h200-141gb": "H200", "l20-48gb": "L20",
}

DEVICES: dict[str, DeviceSpec] = {d.name.lower(): d for d in _DEVICES}
LINKS: dict[str, LinkSpec] = {lk.name.lower(): lk for lk in _LINKS}


def _lookup(kind: str, name: str, table: dict[str, _T], aliases: dict[str, str]) -> _T:
    key = name.strip().lower().replace("_", "-")
    key = aliases.get(key, key).lower()
    if key in table:
        return table[key]
    choices = sorted(v.name for v in table.values())
    raise ValueError(f"unknown {kind} {name!r}; choices: {', '.join(choices)} "
                     f"(aliases: {', '.join(sorted(aliases))})")


def get_device(name: str | DeviceSpec) -> DeviceSpec:
    """Device by case-insensitive name or alias (``a100`` = A100-80GB SXM)."""
    if isinstance(name, DeviceSpec):
        return name
    return _lookup("device", name, DEVICES, _DEVICE_ALIASES)


def get_link(name: str | LinkSpec) -> LinkSpec:
    """Link by case-insensitive name or alias (``nvlink`` = NVLink 3, ``ethernet`` = 25 Gb/s)."""
    if isinstance(name, LinkSpec):
        return name
    return _lookup("link", name, LINKS, _LINK_ALIASES)


def list_devices() -> list[str]:
    return [d.name for d in _DEVICES]


def list_links() -> list[str]:
    return [lk.name for lk in _LINKS]
