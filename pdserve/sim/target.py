"""The simulator as a deployment target: a deployment spec plus what simulation adds.

:class:`SimulationConfig` = a :class:`~pdserve.config.ClusterConfig` (the same spec the live
runtime serves) + the latency source (a profile file, or a hardware spec for the analytic
roofline model) + the serving-path overhead. :func:`build_simulator` turns it into a
:class:`~pdserve.sim.simulator.Simulator`: every instance comes from
:meth:`ClusterConfig.instance_specs`, its KV pool from
:func:`~pdserve.config.simulated_kv_blocks` on the hardware's memory (less what a vLLM-like engine
reserves). :class:`SimTarget` is the benchmark toolkit's ``Target`` (``pdserve
bench|goodput|compare --target sim``); ``pdserve simulate`` uses the same pieces.
Records carry the full simulated timeline (also as ``server_timeline``), so the latency
breakdown works as it does for a live server.

Simulation defaults that differ from a live CPU run: weights and KV in the checkpoint's dtype
as a GPU engine serves it (:func:`auto_dtype`: bfloat16 for a bfloat16 checkpoint, float16
otherwise) unless ``dtype`` is given, and the model ``opt-13b`` unless given.

Pipeline parallelism uses :class:`~pdserve.sim.latency.PipelineModel`; the simulator runs a
PP = k instance as k virtual engines sharing k stages, so up to k batches are in flight (each
waits one pass, ``base + (k − 1)·send``; the pipeline completes one every ``base / k``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.targets import register_target
from pdserve.bench.workloads import WorkloadRequest
from pdserve.cluster.routing import routers_for
from pdserve.config import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    ClusterConfig,
    InstanceSpec,
    Link,
    ModelConfig,
    simulated_kv_blocks,
)
from pdserve.flags import add_deployment_flags, deployment_dict, nonnegative
from pdserve.request import Timeline
from pdserve.sim.aic_latency import BACKENDS, AicModel, aic_version
from pdserve.sim.analytic import AnalyticModel
from pdserve.sim.hardware import DeviceSpec, get_device, get_link
from pdserve.sim.latency import DriverOverhead, FittedProfile, LatencyModel, PipelineModel
from pdserve.sim.model_catalogue import get_model_config
from pdserve.sim.simulator import SimInstance, SimRequest, SimResult, Simulator

DEFAULT_HARDWARE = "A100-80GB"
DEFAULT_MODEL = "opt-13b"
PROFILES_ENV = "PDSERVE_PROFILES"
# aiconfigurator's system -> the catalogue device whose memory sizes the KV pool
AIC_DEVICES = {"h100_sxm": "H100", "h100_pcie": "H100-PCIe", "h200_sxm": "H200",
               "b200_sxm": "B200", "a100_sxm": "A100-80GB", "l40s": "L40S",
               "rtx_pro_6000_server": "RTX-PRO-6000"}
_SHIPPED_PROFILES = Path(__file__).resolve().parent.parent / "data" / "profiles"


def resolve_profile(name: str) -> str:
    """A profile file: ``name`` as a path, else a file of that name (``.json`` optional) among
    the profiles shipped with pdserve, in ``$PDSERVE_PROFILES`` or in a ``shared/profiles``
    folder found walking up from the current directory (as traces are found)."""
    if os.path.isfile(name):
        return name
    dirs = [_SHIPPED_PROFILES]
    if os.environ.get(PROFILES_ENV):
        dirs.append(Path(os.environ[PROFILES_ENV]))
    cwd = Path.cwd().resolve()
    dirs += [d / "shared" / "profiles" for d in (cwd, *cwd.parents)]
    for d in dirs:
        for cand in (d / name, d / f"{name}.json"):
            if cand.is_file():
                return str(cand)
    shipped = sorted(p.name for p in _SHIPPED_PROFILES.glob("*.json"))
    raise ValueError(f"profile {name!r} is neither a file nor a known profile (shipped: "
                     f"{', '.join(shipped)}; also searched ${PROFILES_ENV} and shared/profiles)")


@dataclass(frozen=True)
class SimulationConfig:
    """A simulated deployment: ``deployment`` plus the latency source (``profile``: ours from
    ``pdserve profile`` or DistServe's JSON, the model's entry at each instance's TP; or
    ``hardware``: the analytic roofline on that device, default A100-80GB) and the serving-path
    cost (``step_overhead_ms`` per step, ``seq_overhead_ms`` per sequence in a step;
    :class:`~pdserve.sim.latency.DriverOverhead`) and the front end's fixed cost per request
    (``request_overhead_ms``: HTTP, tokenizing and routing on the way in, the report and the
    stream on the way out; added to every request's TTFT and end-to-end latency, see
    :func:`to_records`). ``quantization`` ``fp8`` (fp8 weights and GEMMs, vLLM's
    ``--quantization fp8``) and ``kv_cache_dtype`` ``fp8`` (vLLM's ``--kv-cache-dtype fp8``) are
    priced by the kernel database only (``aic_system``: its fp8 GEMM, attention and KV
    tables) and size the KV pool as such a checkpoint leaves it; the other sources price the
    engine's dtype and refuse them."""

    deployment: ClusterConfig
    profile: str | None = None
    hardware: str | None = None
    aic_system: str | None = None
    aic_backend: str = "vllm"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    step_overhead_ms: float = 0.0
    seq_overhead_ms: float = 0.0
    request_overhead_ms: float = 0.0

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.profile, self.hardware, self.aic_system)) > 1:
            raise ValueError("give one latency source: a profile, a hardware spec or an aic "
                             "system")
        if self.profile is not None:
            object.__setattr__(self, "profile", resolve_profile(self.profile))
        if self.hardware is not None:
            get_device(self.hardware)  # a clear error for an unknown name
        if self.aic_system is None and self.aic_backend != SimulationConfig.aic_backend:
            raise ValueError(f"aic_backend {self.aic_backend!r} (--aic-backend) picks the "
                             f"kernel database's backend: give aic_system (--aic-system) too")
        if self.aic_system is not None:
            aic_version()  # a clear error (pip install 'pdserve[aic]') when it is absent
            if self.aic_backend not in BACKENDS:
                raise ValueError(f"aic backend {self.aic_backend!r} is not one of "
                                 f"{', '.join(BACKENDS)}")
        for name in ("step_overhead_ms", "seq_overhead_ms", "request_overhead_ms"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        check_fp8(self.quantization, self.kv_cache_dtype, self.aic_system)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SimulationConfig:
        """From a deployment spec's mapping whose ``simulation`` section (or top level) holds
        ``profile``, ``hardware``, ``step_overhead_ms``, ``seq_overhead_ms``,
        ``request_overhead_ms``."""
        d = {k.replace("-", "_"): v for k, v in d.items() if v is not None}
        sim = simulation_section(d)
        names = [f.name for f in fields(cls) if f.name != "deployment"]
        unknown = set(sim) - set(names)
        if unknown:
            raise ValueError(f"unknown simulation setting(s) {sorted(unknown)}; known: {names}")
        for k in names:
            if k in d:
                sim[k] = d.pop(k)
        return cls(ClusterConfig.from_dict(d), **sim)


def check_fp8(quantization: str | None, kv_cache_dtype: str, aic_system: str | None) -> None:
    """``quantization`` / ``kv_cache_dtype`` are known values, and fp8 comes with the kernel
    database that prices it (:class:`SimulationConfig`)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of "
                         f"{', '.join(QUANTIZATIONS)} (or none)")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    asked = [f"{k} fp8" for k, v in (("quantization", quantization),
                                     ("kv_cache_dtype", kv_cache_dtype)) if v == "fp8"]
    if asked and aic_system is None:
        raise ValueError(f"{' and '.join(asked)}: only the kernel database prices fp8 "
                         f"(--aic-system); the analytic roofline and measured profiles price "
                         f"the engine's dtype")


def fp8_settings(quantization: str | None, kv_cache_dtype: str) -> dict[str, str]:
    """The fp8 modes that are set, as ``simulation:`` keys (none for the defaults)."""
    return {k: v for k, v in (("quantization", quantization), ("kv_cache_dtype", kv_cache_dtype))
            if v not in (None, "auto")}


# ------------------------------------------------------------------------- building blocks
def step_model(sim: SimulationConfig, model: ModelConfig, tp: int, pp: int,
               dtype: str, ep: int = 1) -> LatencyModel:
    """The step-time model of one instance: the profile, the kernel database or the analytic
    roofline at ``tp`` (``ep``: expert parallelism, kernel database and roofline only),
    wrapped in a :class:`PipelineModel` when ``pp`` > 1 and in a :class:`DriverOverhead` when
    an overhead is set."""

    base: LatencyModel
    if sim.aic_system is not None:
        base = AicModel(model, sim.aic_system, sim.aic_backend, tp, dtype, ep,
                        quantization=sim.quantization, kv_cache_dtype=sim.kv_cache_dtype)
    elif sim.profile is not None:
        if ep > 1:
            raise ValueError(f"ep={ep}: a measured profile has no expert-parallel entries; "
                             f"simulate expert parallelism with --hardware")
        base = FittedProfile.load(sim.profile, model, tp, pp)
        if base.tp != tp:
            raise ValueError(f"profile {sim.profile!r} was measured at tp={base.tp}, "
                             f"not tp={tp}; measure both with `pdserve profile --tp "
                             f"{','.join(map(str, sorted({base.tp, tp})))}` (one file)")
        if base.pp not in (1, pp):
            raise ValueError(f"profile {sim.profile!r} was measured on a pipeline of "
                             f"pp={base.pp}, not pp={pp}; measure both with `pdserve profile "
                             f"--tp {tp} --pp {','.join(map(str, sorted({base.pp, pp})))}` "
                             f"(one file)")
    else:
        base = AnalyticModel(model, sim.hardware or DEFAULT_HARDWARE, tp, dtype=dtype, ep=ep)
    latency: LatencyModel = base
    if pp > 1:
        dev = device_of(sim, base)
        link = dev.intra_link if dev is not None else None
        latency = PipelineModel(base, pp, model, link, dtype)
    if sim.step_overhead_ms > 0 or sim.seq_overhead_ms > 0:
        latency = DriverOverhead(latency, sim.step_overhead_ms / 1000, sim.seq_overhead_ms / 1000)
    return latency


def base_model(latency: LatencyModel) -> LatencyModel:
    """The profile or roofline model inside any pipeline / overhead wrappers."""
    while isinstance(latency, (PipelineModel, DriverOverhead)):
        latency = latency.base
    return latency


def device_of(sim: SimulationConfig, base: LatencyModel) -> DeviceSpec | None:
    """The simulated device: ``hardware``, else the profile's, else A100-80GB; ``None`` for a
    CPU profile or a device the catalogue does not know (then pools are sized as on CPU)."""
    name = sim.hardware
    if name is None and sim.aic_system is not None:
        name = AIC_DEVICES.get(sim.aic_system)
        if name is None:  # no catalogue entry to size the KV pool on
            raise ValueError(f"aic system {sim.aic_system!r} has no pdserve catalogue device "
                             f"to size KV pools on (known: {', '.join(sorted(AIC_DEVICES))})")
    if name is None and isinstance(base, FittedProfile):
        name = base.hardware or None
    try:
        dev = get_device(name or DEFAULT_HARDWARE)
    except ValueError:
        return None
    return None if dev.name == "cpu" else dev


def _resolve_link(link: Link | None, device: DeviceSpec | None, streams: int) -> Link:
    """``link`` if the spec sets one, else the device's intra-node link; a TP-sharded transfer
    uses ``streams`` such links at once (each GPU sends its own shard, DistServe §4.2)."""
    if link is not None:
        return link
    spec = device.intra_link if device is not None else get_link("loopback")
    assert spec.bandwidth_gb_per_s is not None
    return Link(spec.bandwidth_gb_per_s * max(streams, 1), spec.latency_s, spec.name)


@dataclass
class BuiltCluster:
    simulator: Simulator
    model: ModelConfig
    max_model_len: int
    describe: dict[str, Any]


@cache
def _model(name: str) -> ModelConfig:
    return get_model_config(name)


def auto_dtype(model: ModelConfig) -> str:
    """The dtype a GPU engine serves a checkpoint in when none is given (vLLM's ``auto``): the
    checkpoint's own ``torch_dtype``, float16 for a float32 (or unnamed) one."""
    hf = model.hf_config
    given = str(hf.get("torch_dtype") or hf.get("dtype") or "").removeprefix("torch.")
    return "bfloat16" if given == "bfloat16" else "float16"


def sim_deployment(sim: SimulationConfig) -> ClusterConfig:
    """The deployment with the simulation defaults applied (module docstring)."""
    dep = sim.deployment
    model = dep.model or DEFAULT_MODEL
    engine = dict(dep.engine)
    if "dtype" not in engine:
        engine["dtype"] = auto_dtype(_model(model))
    return replace(dep, model=model, engine=engine)


def build_simulator(sim: SimulationConfig, record_batches: bool = False) -> BuiltCluster:
    """A fresh simulator for ``sim`` (every run needs its own: request ids are per run)."""
    dep = sim_deployment(sim)
    model = _model(dep.model)
    specs: list[InstanceSpec] = dep.instance_specs(model.max_position_embeddings)
    instances, info, devices = [], {}, []
    for s in specs:
        dtype = s.engine.dtype
        latency = step_model(sim, model, s.tp, s.pp, dtype, s.ep)
        device = device_of(sim, base_model(latency))
        blocks = simulated_kv_blocks(model, s.engine, tp=s.tp, pp=s.pp, ep=s.ep,
                                     device_memory_bytes=device.memory_bytes if device else None,
                                     quantization=sim.quantization,
                                     kv_cache_dtype=sim.kv_cache_dtype)
        instances.append(SimInstance(s.instance_id, s.engine, latency, blocks, s.num_gpus,
                                     s.node))
        devices.append(device)
        if s.role not in info:
            info[s.role] = {"count": 0, "tp": s.tp, "pp": s.pp, "num_kv_blocks": blocks,
                            "latency_model": _describe_latency(latency),
                            "device": device.name if device is not None else None}
        info[s.role]["count"] += 1
    streams = min(s.tp for s in specs)
    intra = _resolve_link(dep.kv_link, devices[0], streams)
    inter = _resolve_link(dep.inter_node_link, devices[0], streams) \
        if dep.inter_node_link is not None else intra
    entry = instances[0].latency  # the colocated or prefill instances' step-time model
    routers = routers_for(dep, prefill_time=lambda n: entry.prefill_time([n]),
                          prefill_batch_time=entry.prefill_time, step_time=entry.step_time,
                          batch_tokens=specs[0].engine.scheduler.token_budget)
    simulator = Simulator(instances, model, *routers,
                          intra_node_link=intra, inter_node_link=inter,
                          kv_dtype=(specs[0].engine.dtype if sim.kv_cache_dtype == "auto"
                                    else sim.kv_cache_dtype), record_batches=record_batches,
                          deployment=dep)
    max_len = specs[0].engine.scheduler.max_model_len
    describe = {"model": model.name, "strategy": dep.strategy, "roles": info,
                "num_gpus": simulator.num_gpus, "max_model_len": max_len,
                "kv_link": {"bandwidth_gb_per_s": intra.bandwidth_gb_per_s,
                            "latency_s": intra.latency_s},
                "routers": [dep.prefill_router, dep.decode_router],
                "latency_source": _latency_source(sim, instances[0].latency),
                "spec": dep.to_dict()}
    return BuiltCluster(simulator, model, max_len, describe)


def _latency_source(sim: SimulationConfig, latency: Any) -> str:
    base = base_model(latency)
    if isinstance(base, AicModel):
        return base.source
    return sim.profile or sim.hardware or DEFAULT_HARDWARE


def _describe_latency(m: LatencyModel) -> str:
    if isinstance(m, PipelineModel):
        return f"pipeline(pp={m.pp}) of {_describe_latency(m.base)}"
    if isinstance(m, DriverOverhead):
        return (f"{_describe_latency(m.base)} + {1000 * m.overhead_s:g} ms per step + "
                f"{1000 * m.per_seq_s:g} ms per sequence")
    if isinstance(m, FittedProfile):
        return f"profile {m.source or m.model} tp={m.tp}" + (f" pp={m.pp}" if m.pp > 1 else "")
    if isinstance(m, AicModel):
        return m.source
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


def to_records(requests: Sequence[WorkloadRequest], result: SimResult,
               request_overhead_s: float = 0.0) -> list[RequestRecord]:
    """One record per request, in order; the simulated timeline is the server's, and the
    client's too (one clock) but for ``request_overhead_s``, the front end's fixed cost per
    request: the client receives every token (and the end) that much later than the instance
    made it. A constant delay before the instance's queue would only shift the whole arrival
    process, so where it falls between the way in and the way out changes no queueing: it is
    all put on the way out, and token gaps (TPOT) are unchanged."""
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
        client = r.timeline
        if request_overhead_s:
            client = replace(client, token_times=[t + request_overhead_s
                                                  for t in client.token_times],
                             finish=None if client.finish is None
                             else client.finish + request_overhead_s)
        out.append(RequestRecord(w.request_id, r.prompt_len, r.output_len, client, ok, err,
                                 server_timeline=r.timeline, expected_output_len=w.output_len,
                                 sent_time=r.timeline.arrival))
    return out


def _timeline(w: WorkloadRequest) -> Any:
    return Timeline(arrival=w.arrival_time)


def simulate(sim: SimulationConfig, requests: Sequence[WorkloadRequest],
             progress: Callable[[int], None] | None = None,
             vocab_size: int = 32000) -> tuple[list[RequestRecord], SimResult, BuiltCluster]:
    built = build_simulator(sim)
    result = built.simulator.run(to_sim_requests(requests, vocab_size), progress)
    return to_records(requests, result, sim.request_overhead_ms / 1000), result, built


class SimTarget:
    """The benchmark toolkit's ``Target`` over the simulator (one fresh simulator per run)."""

    def __init__(self, sim: SimulationConfig, name: str = "sim", progress: bool = True) -> None:
        self.sim = sim
        built = build_simulator(sim)  # validates the deployment now
        self.name = name
        self.num_gpus = built.simulator.num_gpus
        self.max_model_len = built.max_model_len
        self.vocab_size = built.model.vocab_size
        self.describe = built.describe
        self.progress = progress
        self.last_result: SimResult | None = None

    async def run(self, requests: list[WorkloadRequest]) -> list[RequestRecord]:
        with sim_progress(len(requests), self.name, self.progress) as advance:
            records, result, _ = simulate(self.sim, requests, advance, self.vocab_size)
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


# ------------------------------------------------- `pdserve simulate` flags and `--target sim`
def add_simulation_flags(p: argparse.ArgumentParser) -> None:
    """The deployment flags (live ones aside) and what simulation adds."""
    add_deployment_flags(p, live=False,
                         model_help="catalogue model (opt-13b, llama-2-7b, ...) or a model "
                                    "directory (default: opt-13b)")
    g = p.add_argument_group("simulation (a --config file's `simulation:` section)")
    add_latency_source_flags(g)
    add_serving_path_flags(g)


def add_serving_path_flags(g: Any, prefix: str = "") -> None:
    """``--step-overhead-ms``, ``--seq-overhead-ms``, ``--request-overhead-ms``: the serving
    path's costs that a latency source leaves out (``SimulationConfig`` names; unset = the
    ``--config`` file's, else 0). ``simulate``, ``plan`` and ``advise`` share them; ``serve``'s
    replanner takes them as ``--replan-step-overhead-ms``... (``prefix="replan-"``)."""
    for name, what in (
            ("step-overhead-ms", "serving-path cost added to every step (see "
                                 "benchmarks/fidelity.py; pdserve calibrate measures it)"),
            ("seq-overhead-ms", "serving-path cost per sequence in a step"),
            ("request-overhead-ms", "the front end's fixed cost per request (HTTP, "
                                    "tokenizing, routing, streaming), added to every TTFT "
                                    "and end-to-end latency")):
        g.add_argument(f"--{prefix}{name}", type=nonnegative, metavar="MS",
                       help=f"{what} (default: 0)")


def add_latency_source_flags(g: Any) -> None:
    """``--profile FILE|NAME``, ``--hardware NAME|FILE`` or ``--aic-system SYSTEM`` (one of
    them, ``--aic-backend`` with the last): what prices a step."""
    src = g.add_mutually_exclusive_group()
    src.add_argument("--profile", metavar="FILE|NAME",
                     help="fitted profile: ours (pdserve profile) or DistServe's JSON; a path or "
                          "a shipped/shared profile's name, e.g. "
                          "distserve_profiler-a100-80g.distserve")
    src.add_argument("--hardware", metavar="NAME|FILE",
                     help="analytic roofline on this device: a catalogue name (A100-80GB, H100, "
                          "L40S, ...) or a hardware spec file (pdserve calibrate writes one) "
                          "(default: A100-80GB when no --profile)")
    g.add_argument("--aic-system", metavar="SYSTEM",
                   help="price steps with aiconfigurator-core's measured kernel database for "
                        "this system (h100_sxm, h200_sxm, b200_sxm, a100_sxm, l40s, "
                        "rtx_pro_6000_server, ...; pip install 'pdserve[aic]'): kernel "
                        "sums; add the serving path with --step-overhead-ms / "
                        "--seq-overhead-ms")
    g.add_argument("--aic-backend", choices=("vllm", "sglang", "trtllm"),
                   help="the engine whose kernels --aic-system prices (default: vllm)")
    g.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="fp8: fp8 weights and GEMMs, as vLLM's --quantization fp8 (priced by "
                        "--aic-system only; default: the engine's dtype)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="fp8: an fp8 KV cache, as vLLM's --kv-cache-dtype fp8: half the bytes "
                        "per block and fp8 attention kernels (--aic-system only; default: "
                        "auto, the engine's dtype)")


def simulation_section(d: dict[str, Any]) -> dict[str, Any]:
    """``d``'s ``simulation`` mapping, popped (``{}`` if absent); anything else is an
    error."""
    sim = d.pop("simulation", None)
    if sim is not None and not isinstance(sim, Mapping):
        raise ValueError(f"simulation must be a mapping (profile, hardware, ...), got {sim!r}")
    return dict(sim or {})


def simulation_from_args(args: argparse.Namespace) -> Any:
    """The simulated deployment: ``--config`` overlaid with the flags."""
    d = deployment_dict(args)
    sim = simulation_section(d)
    given = {k: getattr(args, k, None) for k in (
        "profile", "hardware", "aic_system", "aic_backend", "quantization", "kv_cache_dtype",
        "step_overhead_ms", "seq_overhead_ms", "request_overhead_ms")
        if getattr(args, k, None) is not None}
    if given.keys() & {"profile", "hardware", "aic_system"}:  # a flag's source replaces the file's
        sim.pop("profile", None)
        sim.pop("hardware", None)
        sim.pop("aic_system", None)
    d["simulation"] = {**sim, **given}
    return SimulationConfig.from_dict(d)


def make_sim_target(args: Any) -> SimTarget:
    """``--target sim`` (:func:`pdserve.bench.targets.register_target`): the deployment from
    ``--target-option KEY=VALUE`` pairs (any deployment-spec key, ``config=FILE``, and the
    simulation's ``profile``, ``hardware``, ``step_overhead_ms``, ``seq_overhead_ms``,
    ``request_overhead_ms``), read as ``pdserve simulate`` reads the same flags."""
    options = {k.replace("-", "_"): v for k, v in
               (getattr(args, "target_options", None) or {}).items()}
    if "model" not in options and getattr(args, "model", None):
        options["model"] = args.model  # the client's --model names the simulated model
    return SimTarget(simulation_from_args(_parse_options(options)),
                     progress=not getattr(args, "no_progress", False))


def _parse_options(options: dict[str, Any]) -> Any:
    """``KEY=VALUE`` strings parsed by ``pdserve simulate``'s own flags."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_simulation_flags(p)
    argv: list[str] = []
    for k, v in options.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, str) and v.lower() in ("true", "false") and \
                k in ("enable_prefix_caching", "enable_chunked_prefill"):
            argv.append(flag if v.lower() == "true" else "--no-" + flag[2:])
        else:
            argv += [flag, str(v)]
    try:
        ns, rest = p.parse_known_args(argv)
    except (SystemExit, argparse.ArgumentError) as e:
        raise ValueError(f"bad sim target option in {options}: {e}") from None
    if rest:
        raise ValueError(f"unknown sim target option(s): {rest}")
    return ns


register_target("sim", make_sim_target)
