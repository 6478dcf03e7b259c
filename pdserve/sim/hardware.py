"""Hardware as data: devices, links, clusters and their efficiency factors (torch-free).

The catalogue is a set of YAML files shipped in ``pdserve/data/hardware/`` — one per device
(``a100-80gb.yaml``, ``h100.yaml``, …) plus ``links.yaml`` — each citing its public sources.
:func:`load_hardware` takes a catalogue name *or* a YAML/JSON file of the same format (what
``pdserve calibrate`` writes), so a GPU the catalogue lacks is one file away. Conventions:

* ``DeviceSpec.peak_tflops`` is **dense** FP16/BF16 tensor throughput (NVIDIA sheets quote
  sparse numbers with an asterisk at twice the dense value; those are not used);
  ``fp8_tflops`` / ``fp32_tflops`` likewise (0 = not published / not supported).
* ``LinkSpec.bandwidth_gb_per_s`` is the **per-direction** data rate one GPU (or one NIC) can push,
  in GB/s (1e9 bytes/s). NVLink and PCIe sheets quote the *bidirectional* aggregate (A100:
  "600 GB/s"); a single transfer or one ring step of an all-reduce sees half of it. Network
  links are quoted in Gb/s: 25 Gb/s Ethernet (DistServe §6.1 testbed) = 3.125 GB/s.

A device file::

    format: pdserve-hardware
    version: 1
    name: H100                      # required: name, peak_tflops, memory_gib, memory_bw_gbs,
    peak_tflops: 989.0              #           intra_node_link
    memory_gib: 80.0
    memory_bw_gbs: 3350.0
    intra_node_link: nvlink4        # a catalogue link, or one defined under ``links:``
    fp8_tflops: 1979.0              # optional from here on
    fp32_tflops: 67.0
    aliases: [h100-sxm]
    sources: ["NVIDIA H100 datasheet ..."]
    efficiency: {mfu_gemm: 0.7, ...}           # Efficiency fields; missing ones take defaults
    cluster: {num_nodes: 1, gpus_per_node: 8, network: ib-ndr}
    links: [{name: my-link, bandwidth_gb_per_s: 100.0, latency_s: 5.0e-6}]
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from pdserve.config import Link, get_link, link_catalogue, load_data_file

_T = TypeVar("_T", "DeviceSpec", Link)
GIB = 1024**3
HARDWARE_FORMAT = "pdserve-hardware"
DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "hardware"


@dataclass(frozen=True)
class Efficiency:
    """A device's efficiency factors (fractions of its peaks) and fixed costs, as the analytic
    roofline (:mod:`pdserve.sim.analytic`) uses them; fitted by ``pdserve calibrate``.

    * ``mfu_gemm`` — achieved share of peak tensor FLOP/s in the linear layers;
    * ``mfu_attention`` — the same for attention FLOPs;
    * ``mbu_weights`` — achieved share of memory bandwidth streaming weights/activations;
    * ``mbu_kv`` — the same for paged KV reads in decode attention (scattered blocks);
    * ``comm`` — achieved share of the link bandwidth in an all-reduce, relative to a ring
      (up to 2: NVSwitch in-network reduction, NCCL's NVLS, moves about half a ring's bytes);
    * ``comm_latency_s`` — fixed seconds per collective (``None``: ``2·(tp−1)`` link
      latencies, one per ring hop);
    * ``step_overhead_s`` — fixed seconds per iteration (DistServe App. A's ``C_3``);
    * ``layer_overhead_s`` — fixed seconds per layer per iteration (kernel launches: the floor
      small batches hit; it makes the fixed cost scale with depth);
    * ``seq_overhead_s`` — seconds per sequence in the iteration (sampling, metadata);
    * ``overlap`` — share of the shorter of a kernel's compute and memory times hidden under
      the longer: ``max(c, m) + (1 − overlap)·min(c, m)`` (1 = the ideal roofline; real kernels
      near the ridge point overlap less);
    * ``attn_q_tile`` — query rows per attention tile (K/V re-read per tile).

    The defaults are A100-80GB's, chosen on OPT-13B / TP 1 against DistServe's profile.
    """

    mfu_gemm: float = 0.70
    mfu_attention: float = 0.35
    mbu_weights: float = 0.80
    mbu_kv: float = 0.65
    comm: float = 0.60
    comm_latency_s: float | None = None
    step_overhead_s: float = 4e-3
    layer_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    overlap: float = 1.0
    attn_q_tile: int = 128

    def __post_init__(self) -> None:
        for f in ("mfu_gemm", "mfu_attention", "mbu_weights", "mbu_kv", "comm", "overlap"):
            v, top = getattr(self, f), 2.0 if f == "comm" else 1.0
            if not 0.0 < v <= top:
                raise ValueError(f"{f} must be in (0, {top:g}], got {v}")
        if min(self.step_overhead_s, self.layer_overhead_s, self.seq_overhead_s) < 0 \
                or self.attn_q_tile < 1:
            raise ValueError("step_overhead_s, layer_overhead_s and seq_overhead_s must be "
                             ">= 0 and attn_q_tile >= 1")
        if self.comm_latency_s is not None and self.comm_latency_s < 0:
            raise ValueError(f"comm_latency_s must be >= 0, got {self.comm_latency_s}")


# one link type: a catalogue link is a :class:`pdserve.config.Link` with a name (the catalogue
# requires ``name`` and ``bandwidth_gb_per_s``; see _REQUIRED_LINK_FIELDS)
LinkSpec = Link
_REQUIRED_LINK_FIELDS = ("name", "bandwidth_gb_per_s")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator as the analytic roofline model sees it.

    ``peak_tflops``: dense FP16/BF16 tensor TFLOP/s; ``memory_gib``: device memory (GiB);
    ``memory_bw_gbs``: HBM/GDDR bandwidth (GB/s); ``intra_node_link``: name of the link joining
    GPUs of one node (tensor-parallel all-reduce, intra-node KV hand-off; resolved by
    :attr:`intra_link`, first among the file's own ``links``); ``fp32_tflops`` / ``fp8_tflops``:
    peaks for those dtypes (0 = unknown/unsupported); ``efficiency``: the roofline's factors.
    """

    name: str
    peak_tflops: float
    memory_gib: float
    memory_bw_gbs: float
    intra_node_link: str
    fp32_tflops: float = 0.0
    description: str = ""
    fp8_tflops: float = 0.0
    efficiency: Efficiency = field(default_factory=Efficiency)
    aliases: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    links: tuple[LinkSpec, ...] = ()

    def __post_init__(self) -> None:
        for f in ("peak_tflops", "memory_gib", "memory_bw_gbs"):
            if getattr(self, f) <= 0:
                raise ValueError(f"device {self.name!r}: {f} must be > 0")
        for f in ("fp32_tflops", "fp8_tflops"):
            if getattr(self, f) < 0:
                raise ValueError(f"device {self.name!r}: {f} must be >= 0")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    def flops_per_s(self, dtype: str = "float16") -> float:
        if dtype == "float32":
            return (self.fp32_tflops or self.peak_tflops / 16) * 1e12
        if dtype in ("float8", "fp8"):
            if not self.fp8_tflops:
                raise ValueError(f"device {self.name!r} has no FP8 peak (fp8_tflops = 0)")
            return self.fp8_tflops * 1e12
        return self.peak_tflops * 1e12

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound (DistServe App. A.2: 156 on
        A100)."""
        return self.peak_tflops * 1e12 / (self.memory_bw_gbs * 1e9)

    @property
    def intra_link(self) -> LinkSpec:
        for lk in self.links:
            if lk.name.lower() == self.intra_node_link.lower():
                return lk
        return get_link(self.intra_node_link)


@dataclass(frozen=True)
class ClusterSpec:
    """Where instances run: ``num_nodes`` nodes of ``gpus_per_node`` ``device`` GPUs, joined
    inside a node by the device's intra-node link and across nodes by ``network``."""

    device: DeviceSpec
    num_nodes: int = 1
    gpus_per_node: int = 8
    network: str = "ib-hdr"

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"cluster of {self.device.name!r}: num_nodes and gpus_per_node "
                             f"must be >= 1, got {self.num_nodes} and {self.gpus_per_node}")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def intra_node_link(self) -> LinkSpec:
        return self.device.intra_link

    @property
    def network_link(self) -> LinkSpec:
        for lk in self.device.links:
            if lk.name.lower() == self.network.lower():
                return lk
        return get_link(self.network)


# ------------------------------------------------------------------------- reading files
def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = os.fspath(path)
    d = load_data_file(p, "hardware file")
    if not isinstance(d, dict):
        raise ValueError(f"hardware file {p!r}: expected a mapping at the top level, "
                         f"got {type(d).__name__}")
    return d


def _build(cls: type, d: Any, where: str, what: str) -> Any:
    """``cls(**d)`` with a ValueError naming the file, the object and the bad/missing field."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: {what} must be a mapping, got {type(d).__name__}")
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown} in {what}; "
                         f"known: {sorted(names)}")
    missing = [n for n, f in names.items() if f.default is MISSING
               and f.default_factory is MISSING and n not in d]
    if cls is Link:
        missing += [n for n in _REQUIRED_LINK_FIELDS if d.get(n) is None]
    if missing:
        raise ValueError(f"{where}: {what} is missing required field(s) {missing}")
    for n, v in d.items():
        ftype = str(names[n].type)
        if ("float" in ftype or "int" in ftype) and v is not None and \
                (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{where}: {what} field {n!r} must be a number, got {v!r}")
    try:
        return cls(**d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {what}: {e}") from None


def device_from_dict(d: dict[str, Any], where: str = "<dict>") -> DeviceSpec:
    """A :class:`DeviceSpec` from a device file's mapping (``format``, ``version`` and
    ``cluster`` are ignored here); ``where`` names the file in error messages."""
    if d.get("format", HARDWARE_FORMAT) != HARDWARE_FORMAT:
        raise ValueError(f"{where}: not a {HARDWARE_FORMAT} file (format={d.get('format')!r})")
    body = {k: v for k, v in d.items() if k not in ("format", "version", "cluster")}
    if "efficiency" in body:
        body["efficiency"] = _build(Efficiency, body["efficiency"] or {}, where, "efficiency")
    if "links" in body:
        links = body["links"] or []
        if not isinstance(links, list):
            raise ValueError(f"{where}: links must be a list of link mappings")
        body["links"] = tuple(_build(LinkSpec, lk, where, f"links[{i}]")
                              for i, lk in enumerate(links))
    for k in ("aliases", "sources"):
        if k in body:
            v = body[k]
            body[k] = tuple(str(x) for x in (v if isinstance(v, list) else [v]))
    if "name" in body:
        body["name"] = str(body["name"])
    return _build(DeviceSpec, body, where, "device")


def device_to_dict(dev: DeviceSpec, cluster: ClusterSpec | None = None) -> dict[str, Any]:
    """The file form of ``dev`` (and ``cluster``): :func:`device_from_dict` reads it back."""
    d: dict[str, Any] = {"format": HARDWARE_FORMAT, "version": 1}
    for f in fields(DeviceSpec):
        v = getattr(dev, f.name)
        if f.name == "efficiency":
            v = {k: x for k, x in asdict(v).items() if x is not None}
        elif f.name == "links":
            if not v:
                continue
            v = [asdict(lk) for lk in v]
        elif isinstance(v, tuple):
            v = list(v)
        d[f.name] = v
    if cluster is not None:
        d["cluster"] = {"num_nodes": cluster.num_nodes, "gpus_per_node": cluster.gpus_per_node,
                        "network": cluster.network}
    return d


def save_hardware(path: str | os.PathLike[str], dev: DeviceSpec,
                  cluster: ClusterSpec | None = None, header: str = "") -> None:
    """Write ``dev`` (and ``cluster``) as YAML (``.json``: JSON); ``header`` becomes comment
    lines at the top of a YAML file."""
    d = device_to_dict(dev, cluster)
    p = os.fspath(path)
    with open(p, "w") as f:
        if p.endswith(".json"):
            json.dump(d, f, indent=2)
            f.write("\n")
            return
        import yaml

        for line in header.splitlines():
            f.write(f"# {line}\n".replace("# \n", "#\n"))
        yaml.safe_dump(d, f, sort_keys=False, allow_unicode=True, width=100)


# ------------------------------------------------------------------------------ catalogue
def _load_catalogue() -> tuple[dict[str, tuple[Any, ...]], dict[str, str]]:
    devices: dict[str, tuple[Any, ...]] = {}
    dev_aliases: dict[str, str] = {}
    for p in sorted(DATA_DIR.glob("*.yaml")):
        if p.name == "links.yaml":  # the link catalogue: pdserve.config.link_catalogue
            continue
        raw = _read(p)
        dev = device_from_dict(raw, str(p))
        devices[dev.name.lower()] = (dev, _cluster_of(dev, raw.get("cluster"), str(p)), p)
        for a in dev.aliases:
            dev_aliases[a.lower()] = dev.name.lower()
        dev_aliases.setdefault(p.stem.lower(), dev.name.lower())
    return devices, dev_aliases


def _cluster_of(dev: DeviceSpec, d: Any, where: str) -> ClusterSpec:
    return _build(ClusterSpec, {"device": dev, **(d or {})}, where, "cluster")


LINKS = link_catalogue()[0]
_CATALOGUE, _DEVICE_ALIASES = _load_catalogue()
DEVICES: dict[str, DeviceSpec] = {k: v[0] for k, v in _CATALOGUE.items()}


def _key(name: str, aliases: dict[str, str]) -> str:
    key = name.strip().lower().replace("_", "-")
    return aliases.get(key, key)


def _unknown(kind: str, name: str, table: dict[str, Any], aliases: dict[str, str]) -> ValueError:
    choices = sorted(getattr(v, "name", None) or v[0].name for v in table.values())
    hint = " (or a path to a .yaml/.json hardware file)" if kind == "device" else ""
    return ValueError(f"unknown {kind} {name!r}; choices: {', '.join(choices)} "
                      f"(aliases: {', '.join(sorted(aliases))}){hint}")


def _is_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml", ".json")) or os.sep in name


def load_hardware(name_or_path: str | os.PathLike[str] | DeviceSpec | ClusterSpec
                  ) -> ClusterSpec:
    """A catalogue device (case-insensitive name or alias: ``a100`` = A100-80GB SXM) or a
    YAML/JSON hardware file, as a :class:`ClusterSpec` (its ``device`` is the
    :class:`DeviceSpec`). Unknown names and malformed files raise a ValueError naming them."""
    if isinstance(name_or_path, ClusterSpec):
        return name_or_path
    if isinstance(name_or_path, DeviceSpec):
        return ClusterSpec(name_or_path)
    name = os.fspath(name_or_path)
    key = _key(name, _DEVICE_ALIASES)
    if _is_path(name) or (key not in _CATALOGUE and os.path.isfile(name)):
        if not os.path.isfile(name):
            raise ValueError(f"hardware file {name!r} does not exist")
        raw = _read(name)
        dev = device_from_dict(raw, name)
        return _cluster_of(dev, raw.get("cluster"), name)
    if key not in _CATALOGUE:
        raise _unknown("device", name, _CATALOGUE, _DEVICE_ALIASES)
    return _CATALOGUE[key][1]


def get_device(name: str | os.PathLike[str] | DeviceSpec) -> DeviceSpec:
    """Device by case-insensitive name, alias or hardware file (see :func:`load_hardware`)."""
    if isinstance(name, DeviceSpec):
        return name
    return load_hardware(name).device


def catalogue_file(name: str) -> Path:
    """The shipped file that defines catalogue device ``name``."""
    key = _key(name, _DEVICE_ALIASES)
    if key not in _CATALOGUE:
        raise _unknown("device", name, _CATALOGUE, _DEVICE_ALIASES)
    return _CATALOGUE[key][2]


# CUDA device names (``torch.cuda.get_device_name``) → catalogue devices: the first key found
# in the name with spaces removed, upper case (more specific keys first)
_CUDA_NAMES = (("H200", "H200"), ("B200", "B200"), ("H100PCIE", "H100-PCIe"), ("H100", "H100"),
               ("A100-SXM4-40GB", "A100-40GB"), ("A100-PCIE-40GB", "A100-40GB"),
               ("A100", "A100-80GB"), ("A800", "A800-80GB"), ("L40S", "L40S"), ("L20", "L20"),
               ("A10G", "A10G"), ("RTX4090", "RTX-4090"), ("RTXPRO6000", "RTX-PRO-6000"),
               ("MI300X", "MI300X"))


def device_for_cuda_name(cuda_name: str) -> str | None:
    """The catalogue device of a CUDA device name, e.g. ``"NVIDIA H100 80GB HBM3"`` → ``"H100"``
    (``None`` when the catalogue has none)."""
    n = cuda_name.upper().replace(" ", "")
    return next((name for key, name in _CUDA_NAMES if key in n), None)


def list_devices() -> list[str]:
    return [v[0].name for v in _CATALOGUE.values()]


def list_links() -> list[str]:
    return [lk.name for lk in LINKS.values()]
