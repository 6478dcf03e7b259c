"""``--target sim``: benchmark workloads run through the simulator (DESIGN.md "Simulator").

:class:`SimSetup` describes a simulated deployment; :func:`build_simulator` turns it into a
:class:`~pdserve.sim.simulator.Simulator`; :class:`SimTarget` is the benchmark toolkit's
``Target`` (``pdserve bench|goodput|compare --target sim``) and ``pdserve simulate`` uses the
same pieces. Records carry the full simulated timeline (also as ``server_timeline``), so the
latency breakdown works as it does for a live server.

``--target-option KEY=VALUE`` keys (``pdserve simulate`` has a flag for each, ``_`` → ``-``):

=========================  =====================================================================
``model``                  catalogue name (``opt-13b``, ``llama-2-7b``, ...) or a model directory
                           (default ``opt-13b``)
``profile``                a fitted profile: ours (``pdserve profile``) or DistServe's JSON as
                           it is (the model's entry at each role's TP is picked)
``hardware``               device for the analytic roofline model (``A100-80GB``, ``H100``, ...);
                           default when no profile is given: ``A100-80GB``
``strategy``               ``colocated`` (default) or ``disaggregated``
``num_instances``          colocated instances (default 1)
``num_prefill``            ``num_decode``: disaggregated instance counts (default 1 each)
``tp`` ``pp``              parallelism of every instance (default 1); per role:
                           ``prefill_tp`` ``prefill_pp`` ``decode_tp`` ``decode_pp``
``block_size``             KV block size in tokens (default 16)
``num_kv_blocks``          KV blocks per instance (default: device memory × ``memory_utilization``
                           − weights, over the KV of one block; a CPU profile gets
                           ``cpu_kv_gib`` GiB like the real executor; both capped at what
                           ``max_num_seqs`` full-length requests can use)
``memory_utilization``     share of device memory for weights + KV (default 0.9)
``max_num_batched_tokens`` token budget per step (default 2048, or ``max_model_len`` without
                           chunked prefill)
``max_num_seqs``           requests per step (default 256)
``max_model_len``          context limit (default the model's, at most 4096)
``chunked_prefill``        ``true``/``false`` (default true; prefill instances never chunk)
``prefill_token_target``   DistServe's ``L_m`` on prefill instances (default: the budget)
``prefill_router``         ``shortest_queue`` (default) / ``round_robin`` / ``least_load``
``decode_router``          ``least_load`` (default) / ...
``link``                   the KV link between instances (default: the device's intra-node link,
                           DistServe §4.2 low node-affinity; ``eth-25g`` for cross-node)
``dtype``                  weights and KV dtype (default float16)
``step_overhead_ms``       serving-path cost added to every step, and ``seq_overhead_ms`` per
                           sequence in the step (:class:`~pdserve.sim.latency.DriverOverhead`;
                           default 0)
=========================  =====================================================================

Pipeline parallelism uses :class:`~pdserve.sim.latency.PipelineModel`: a step takes the
pipeline's latency (``base + (pp − 1)·send``); the engine runs one batch at a time, so the
extra throughput of micro-batches in flight on different stages is not modelled.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import WorkloadRequest
from pdserve.cluster.transport import Link
from pdserve.config import DTYPE_BYTES, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.sim.hardware import DeviceSpec, LinkSpec, get_device, get_link
from pdserve.sim.latency import (
    DriverOverhead,
    FittedProfile,
    LatencyModel,
    PipelineModel,
)
from pdserve.sim.models import get_model_config
from pdserve.sim.simulator import SimInstance, SimRequest, SimResult, Simulator

DEFAULT_HARDWARE = "A100-80GB"
MAX_DEFAULT_MODEL_LEN = 4096


@dataclass(frozen=True)
class SimSetup:
    """A simulated deployment (see the module docstring for every field)."""

    model: str = "opt-13b"
    profile: str | None = None
    hardware: str | None = None
    strategy: str = "colocated"
    num_instances: int = 1
    num_prefill: int = 1
    num_decode: int = 1
    tp: int = 1
    pp: int = 1
    prefill_tp: int | None = None
    prefill_pp: int | None = None
    decode_tp: int | None = None
    decode_pp: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    memory_utilization: float = 0.9
    cpu_kv_gib: float = 1.0
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    chunked_prefill: bool = True
    prefill_token_target: int | None = None
    prefill_router: str = "shortest_queue"
    decode_router: str = "least_load"
    link: str | None = None
    dtype: str = "float16"
    step_overhead_ms: float = 0.0
    seq_overhead_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.strategy not in ("colocated", "disaggregated"):
            raise ValueError(f"strategy must be colocated or disaggregated, got "
                             f"{self.strategy!r}")
        if self.profile is not None and self.hardware is not None:
            raise ValueError("give either profile or hardware, not both")
        if self.profile is not None and not os.path.isfile(self.profile):
            raise ValueError(f"profile file {self.profile!r} does not exist")
        for name in ("num_instances", "num_prefill", "num_decode", "tp", "pp", "prefill_tp",
                     "prefill_pp", "decode_tp", "decode_pp", "block_size", "num_kv_blocks",
                     "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                     "prefill_token_target"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got "
                             f"{self.memory_utilization!r}")
        for name in ("step_overhead_ms", "seq_overhead_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    # ---- construction from KEY=VALUE options ----
    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SimSetup:
        """From ``--target-option`` pairs (strings are converted to each field's type)."""
        known = {f.name: f for f in fields(cls)}
        kw: dict[str, Any] = {}
        for key, value in options.items():
            name = key.strip().replace("-", "_")
            if name not in known:
                raise ValueError(f"unknown sim option {key!r}; known: {', '.join(known)}")
            kw[name] = _convert(name, value, cls)
        return cls(**kw)

    def role_parallelism(self, role: str) -> tuple[int, int]:
        if role == "prefill":
            return self.prefill_tp or self.tp, self.prefill_pp or self.pp
        if role == "decode":
            return self.decode_tp or self.tp, self.decode_pp or self.pp
        return self.tp, self.pp


def _convert(name: str, value: Any, cls: type) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    default = getattr(cls, name, None) if name in cls.__dataclass_fields__ else None
    if name == "chunked_prefill":
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if name in ("memory_utilization", "cpu_kv_gib"):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    if isinstance(default, int) or name in _INT_OPTIONS:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    return text or None


_INT_OPTIONS = {"prefill_tp", "prefill_pp", "decode_tp", "decode_pp", "num_kv_blocks",
                "max_num_batched_tokens", "max_model_len", "prefill_token_target"}


# ------------------------------------------------------------------------- building blocks
def load_model(spec: str) -> ModelConfig:
    return get_model_config(spec)


def _device_of(setup: SimSetup, base: LatencyModel) -> DeviceSpec | None:
    name = setup.hardware
    if name is None and isinstance(base, FittedProfile):
        name = base.hardware or None
    if name is None:
        return None
    try:
        return get_device(name)
    except ValueError:
        return None  # a profile measured on a device the catalogue does not know


def step_model(setup: SimSetup, model: ModelConfig, tp: int, pp: int) -> LatencyModel:
    """The step-time model of one instance: a fitted profile or the analytic roofline at ``tp``,
    wrapped in a :class:`PipelineModel` when ``pp`` > 1 and in a :class:`DriverOverhead` when
    ``step_overhead_ms`` > 0."""
    from pdserve.sim.analytic import AnalyticModel

    base: LatencyModel
    if setup.profile is not None:
        base = FittedProfile.load(setup.profile, model, tp)
        if base.tp != tp:
            raise ValueError(f"profile {setup.profile!r} was measured at tp={base.tp}, "
                             f"not tp={tp}")
    else:
        base = AnalyticModel(model, setup.hardware or DEFAULT_HARDWARE, tp, dtype=setup.dtype)
    latency = base
    if pp > 1:
        dev = _device_of(setup, base)
        link = get_link(dev.intra_node_link) if dev is not None else None
        latency = PipelineModel(base, pp, model, link, setup.dtype)
    if setup.step_overhead_ms > 0 or setup.seq_overhead_ms > 0:
        latency = DriverOverhead(latency, setup.step_overhead_ms / 1000,
                                 setup.seq_overhead_ms / 1000)
    return latency


def base_model(latency: LatencyModel) -> LatencyModel:
    """The profile or roofline model inside any pipeline / overhead wrappers."""
    while isinstance(latency, (PipelineModel, DriverOverhead)):
        latency = latency.base
    return latency


def default_num_kv_blocks(setup: SimSetup, model: ModelConfig, device: DeviceSpec | None,
                          tp: int, pp: int, max_model_len: int) -> int:
    """KV blocks of one instance of ``tp × pp`` devices (module docstring)."""
    block_bytes = setup.block_size * model.kv_bytes_per_token(setup.dtype)
    useful = math.ceil(max_model_len / setup.block_size) * setup.max_num_seqs + 1
    if device is None or device.name == "cpu":
        budget = setup.cpu_kv_gib * (1 << 30)
    else:
        weights = model.num_params() * DTYPE_BYTES[setup.dtype]
        budget = tp * pp * device.memory_bytes * setup.memory_utilization - weights
    blocks = min(int(budget // block_bytes), useful)
    if blocks < 1:
        where = device.name if device is not None else "cpu"
        raise ValueError(f"{model.name or 'the model'} does not fit on {tp * pp} × {where} "
                         f"(tp={tp}, pp={pp}): no memory left for the KV cache")
    return blocks


def kv_link(setup: SimSetup, device: DeviceSpec | None, streams: int) -> Link:
    """The KV link between two instances; a TP-sharded transfer uses ``streams`` links at once
    (each GPU sends its own shard, DistServe §4.2)."""
    if setup.link is not None:
        spec: LinkSpec = get_link(setup.link)
    elif device is not None and device.name != "cpu":
        spec = get_link(device.intra_node_link)
    else:
        spec = get_link("loopback")
    return Link(spec.bandwidth_gbs * max(streams, 1), spec.latency_s)


@dataclass
class BuiltCluster:
    simulator: Simulator
    model: ModelConfig
    max_model_len: int
    describe: dict[str, Any]


def build_simulator(setup: SimSetup, record_batches: bool = False) -> BuiltCluster:
    """A fresh simulator for ``setup`` (every run needs its own: request ids are per run)."""
    model = load_model(setup.model)
    max_len = setup.max_model_len or min(model.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
    if max_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds the model's "
                         f"max_position_embeddings ({model.max_position_embeddings})")
    if setup.strategy == "colocated":
        roles = [("colocated", setup.num_instances)]
    else:
        roles = [("prefill", setup.num_prefill), ("decode", setup.num_decode)]
    instances, info, devices, tps = [], {}, [], []
    for role, count in roles:
        tp, pp = setup.role_parallelism(role)
        latency = step_model(setup, model, tp, pp)
        base = base_model(latency)
        device = _device_of(setup, base)
        blocks = setup.num_kv_blocks or default_num_kv_blocks(setup, model, device, tp, pp,
                                                              max_len)
        engine = _engine_config(setup, role, max_len, blocks)
        for i in range(count):
            instances.append(SimInstance(f"{role}-{i}", engine, latency, blocks, tp * pp))
        devices.append(device)
        tps.append(tp)
        info[role] = {"count": count, "tp": tp, "pp": pp, "num_kv_blocks": blocks,
                      "latency_model": _describe_latency(latency),
                      "device": device.name if device is not None else None}
    link = kv_link(setup, devices[0], min(tps))
    sim = Simulator(instances, model, setup.prefill_router, setup.decode_router,
                    intra_node_link=link, inter_node_link=link, kv_dtype=setup.dtype,
                    record_batches=record_batches)
    describe = {"model": model.name, "strategy": setup.strategy, "roles": info,
                "num_gpus": sim.num_gpus, "max_model_len": max_len,
                "kv_link": {"bandwidth_gbps": link.bandwidth_gbps, "latency_s": link.latency_s},
                "routers": [setup.prefill_router, setup.decode_router]}
    return BuiltCluster(sim, model, max_len, describe)


def _engine_config(setup: SimSetup, role: str, max_len: int, blocks: int) -> EngineConfig:
    chunked = setup.chunked_prefill and role != "prefill"
    budget = setup.max_num_batched_tokens or (2048 if chunked else max(2048, max_len))
    sched = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=setup.max_num_seqs,
                            max_model_len=max_len, enable_chunked_prefill=chunked, role=role,
                            prefill_token_target=setup.prefill_token_target
                            if role == "prefill" else None)
    return EngineConfig(model=setup.model, dtype=setup.dtype,
                        cache=CacheConfig(block_size=setup.block_size, num_kv_blocks=blocks),
                        scheduler=sched)


def _describe_latency(m: LatencyModel) -> str:
    if isinstance(m, PipelineModel):
        return f"pipeline(pp={m.pp}) of {_describe_latency(m.base)}"
    if isinstance(m, DriverOverhead):
        return (f"{_describe_latency(m.base)} + {1000 * m.overhead_s:g} ms per step + "
                f"{1000 * m.per_seq_s:g} ms per sequence")
    if isinstance(m, FittedProfile):
        return f"profile {m.source or m.model} tp={m.tp}"
    return repr(m)


# ------------------------------------------------------------------------------- running
def to_sim_requests(requests: Sequence[WorkloadRequest], vocab_size: int) -> list[SimRequest]:
    out = []
    for r in requests:
        ids = r.prompt_token_ids
        if ids is None:  # text-only request: a stand-in of the right length
            ids = [(hash((r.request_id, j)) % (vocab_size - 4)) + 4 for j in range(r.prompt_len)]
        out.append(SimRequest(r.request_id, float(r.arrival_time), list(ids), r.output_len))
    return out


def to_records(requests: Sequence[WorkloadRequest], result: SimResult) -> list[RequestRecord]:
    """One record per request, in order; the simulated timeline is both the client's and the
    server's (one clock)."""
    by_id = {r.request_id: r for r in result.records}
    out = []
    for w in requests:
        r = by_id.get(w.request_id)
        if r is None:
            out.append(RequestRecord(w.request_id, w.prompt_len, 0, _timeline(w), False,
                                     "not simulated", expected_output_len=w.output_len))
            continue
        ok = r.error is None and r.finish_reason in ("length", "stop")
        err = r.error if r.error is not None else (
            None if ok else f"request ended with {r.finish_reason!r}")
        out.append(RequestRecord(w.request_id, r.prompt_len, r.output_len, r.timeline, ok, err,
                                 server_timeline=r.timeline, expected_output_len=w.output_len,
                                 sent_time=r.timeline.arrival))
    return out


def _timeline(w: WorkloadRequest) -> Any:
    from pdserve.request import Timeline

    return Timeline(arrival=w.arrival_time)


def simulate(setup: SimSetup, requests: Sequence[WorkloadRequest],
             progress: Callable[[int], None] | None = None,
             vocab_size: int = 32000) -> tuple[list[RequestRecord], SimResult, BuiltCluster]:
    built = build_simulator(setup)
    result = built.simulator.run(to_sim_requests(requests, vocab_size), progress)
    return to_records(requests, result), result, built


class SimTarget:
    """The benchmark toolkit's ``Target`` over the simulator (one fresh simulator per run)."""

    def __init__(self, setup: SimSetup, name: str = "sim", progress: bool = True) -> None:
        self.setup = setup
        built = build_simulator(setup)  # validates the setup now
        self.name = name
        self.num_gpus = built.simulator.num_gpus
        self.max_model_len = built.max_model_len
        self.vocab_size = built.model.vocab_size
        self.describe = built.describe
        self.progress = progress
        self.last_result: SimResult | None = None

    async def run(self, requests: list[WorkloadRequest]) -> list[RequestRecord]:
        with sim_progress(len(requests), self.name, self.progress) as advance:
            records, result, _ = simulate(self.setup, requests, advance, self.vocab_size)
        self.last_result = result
        return records


class sim_progress:  # noqa: N801 - used as a context manager function
    """A rich progress bar on stderr over finished requests (``enabled=False``: none)."""

    def __init__(self, total: int, description: str, enabled: bool = True) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=Console(stderr=True),
                            disable=not enabled, transient=True)
        self.total, self.description = total, description

    def __enter__(self) -> Callable[[int], None]:
        self.bar.__enter__()
        task = self.bar.add_task(f"simulating {self.description}", total=self.total)
        return lambda n: self.bar.update(task, advance=n)

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)


def make_sim_target(args: Any) -> SimTarget:
    """``--target sim`` (see :func:`pdserve.bench.targets.register_target`): the deployment from
    ``args.target_options``."""
    options = dict(getattr(args, "target_options", None) or {})
    if "model" not in options and getattr(args, "model", None):
        options["model"] = args.model  # the client's --model names the simulated model
    setup = SimSetup.from_options(options)
    return SimTarget(setup, progress=not getattr(args, "no_progress", False))


def with_overrides(setup: SimSetup, **kw: Any) -> SimSetup:
    return replace(setup, **{k: v for k, v in kw.items() if v is not None})
