"""The deployment spec, :class:`ClusterConfig`: roles (count, parallelism, per-role engine
settings), routers, KV links (:class:`Link` and the link catalogue), node layout, TetriInfer's
length predictor (:class:`PredictorConfig`) and flip, EcoServe's macro instances
(:class:`MacroConfig`); both drivers build their instances from
:meth:`ClusterConfig.instance_specs`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

from pdserve.config.base import (
    FLIP_POLICIES,
    LENGTH_PREDICTORS,
    ROLES,
    Role,
    _help,
    _require,
    load_data_file,
)
from pdserve.config.engine import EngineConfig

STRATEGIES: tuple[str, ...] = ("colocated", "disaggregated", "partial")
_STRATEGY_ROLES: dict[str, list[Role]] = {"colocated": ["colocated"],
                                          "disaggregated": ["prefill", "decode"],
                                          "partial": ["temporal"]}
BACKENDS: tuple[str, ...] = ("inproc", "ray")


@dataclass(frozen=True)
class Link:
    """An interconnect — the one link type of the deployment spec, the hardware catalogue
    (``pdserve/data/hardware/links.yaml``: NVLink, PCIe, Ethernet, ...) and both drivers:
    ``bandwidth_gb_per_s`` in GB/s per direction (``None`` = unlimited) and ``latency_s`` per
    transfer; a transfer of ``n`` bytes takes at least ``n / bandwidth + latency``
    (TetriInfer's emulated network, DistServe §4.2's links). ``name``/``description`` label a
    catalogue entry."""

    bandwidth_gb_per_s: float | None = None
    latency_s: float = 0.0
    name: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        what = f"link {self.name!r}" if self.name else "link"
        _require(self.bandwidth_gb_per_s is None or self.bandwidth_gb_per_s > 0,
                 f"{what}: bandwidth_gb_per_s must be > 0, got {self.bandwidth_gb_per_s}")
        _require(self.latency_s >= 0, f"{what}: latency_s must be >= 0, got {self.latency_s}")

    @property
    def bytes_per_s(self) -> float:
        if self.bandwidth_gb_per_s is None:
            return float("inf")
        return self.bandwidth_gb_per_s * 1e9

    def min_time(self, nbytes: float) -> float:
        t = self.latency_s
        if self.bandwidth_gb_per_s is not None:
            t += nbytes / (self.bandwidth_gb_per_s * 1e9)
        return t

    @property
    def emulated(self) -> bool:
        return self.bandwidth_gb_per_s is not None or self.latency_s > 0


LINKS_FILE = Path(__file__).resolve().parent.parent / "data" / "hardware" / "links.yaml"


@cache
def link_catalogue() -> tuple[dict[str, Link], dict[str, str]]:
    """The shipped link catalogue (``data/hardware/links.yaml``): links by lower-case name, and
    aliases (lower case) -> names."""
    d = load_data_file(LINKS_FILE, "hardware file")
    where = str(LINKS_FILE)
    if not isinstance(d, dict):
        raise ValueError(f"hardware file {where!r}: expected a mapping at the top level")
    links: dict[str, Link] = {}
    for i, lk in enumerate(d.get("links") or []):
        if not isinstance(lk, dict) or lk.get("name") is None or \
                lk.get("bandwidth_gb_per_s") is None:
            raise ValueError(f"{where}: links[{i}] needs a name and a bandwidth_gb_per_s")
        try:
            spec = Link(**lk)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: links[{i}]: {e}") from None
        links[spec.name.lower()] = spec
    aliases = {str(k).lower(): str(v).lower() for k, v in (d.get("aliases") or {}).items()}
    return links, aliases


def get_link(name: str | Link) -> Link:
    """Link by case-insensitive name or alias (``nvlink`` = NVLink 3, ``ethernet`` = 25 Gb/s)."""
    if isinstance(name, Link):
        return name
    links, aliases = link_catalogue()
    key = name.strip().lower().replace("_", "-")
    key = aliases.get(key, key)
    if key in links:
        return links[key]
    raise ValueError(f"unknown link {name!r}; choices: "
                     f"{', '.join(sorted(lk.name for lk in links.values()))} "
                     f"(aliases: {', '.join(sorted(aliases))})")


def check_granularity(granularity: Any) -> int:
    """A length predictor's bucket size (TetriInfer §3.3.2), checked."""
    if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity < 1:
        raise ValueError(f"predictor granularity must be an integer >= 1 token, got "
                         f"{granularity!r}")
    return granularity


def flip_settings(spec: str) -> tuple[str, tuple[float, ...]]:
    """TetriInfer §3.5's flip policy as a deployment names it — ``none`` | ``idle[:SECONDS]`` |
    ``load[:SHARE[:SECONDS]]`` — as ``(name, values)``, checked (clear errors);
    :func:`pdserve.cluster.flip.parse_flip` builds the policy from them."""
    name, *args = str(spec).split(":")
    if name not in FLIP_POLICIES:
        raise ValueError(f"unknown flip policy {spec!r}; use none, idle[:SECONDS] or "
                         f"load[:SHARE[:SECONDS]]")
    try:
        values = tuple(float(a) for a in args)
    except ValueError as e:
        raise ValueError(f"bad flip policy {spec!r}: {e}") from None
    most = {"none": 0, "idle": 1, "load": 2}[name]
    if len(values) > most:
        raise ValueError(f"bad flip policy {spec!r}: {name} takes at most {most} value(s)")
    if name == "idle" and values and not values[0] > 0:
        raise ValueError(f"flip idle time must be > 0 s, got {values[0]}")
    if name == "load" and values and not 0 < values[0] <= 1:
        raise ValueError(f"flip load threshold must be in (0, 1], got {values[0]}")
    if name == "load" and len(values) > 1 and not values[1] > 0:
        raise ValueError(f"flip window must be > 0 s, got {values[1]}")
    return name, values


@dataclass(frozen=True)
class RoleSpec:
    """The instances of one role: how many, their parallelism (TP × PP GPUs each; ``ep``: the
    expert-parallel degree of a mixture-of-experts model, dividing ``tp`` — experts sit whole on
    ``ep`` of the TP GPUs instead of being sharded, simulated by the analytic model) and the
    engine settings they change from the deployment's (``engine``: :attr:`EngineConfig.KWARGS`
    names)."""

    role: Role
    count: int = 1
    tp: int = 1
    pp: int = 1
    engine: Mapping[str, Any] = field(default_factory=dict)
    ep: int = 1

    def __post_init__(self) -> None:
        _require(self.role in ROLES, f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("count", "tp", "pp", "ep"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 1, f"{self.role} {name} must be an integer "
                                                    f">= 1, got {v!r}")
        _require(self.tp % self.ep == 0,
                 f"{self.role} ep={self.ep} must divide tp={self.tp} (experts are spread over "
                 f"ep of the instance's TP GPUs)")
        bad = set(self.engine) - set(EngineConfig.KWARGS) | ({"role"} & set(self.engine))
        _require(not bad, f"{self.role} engine: unknown setting(s) {sorted(bad)}; known: "
                          f"{', '.join(k for k in EngineConfig.KWARGS if k != 'role')}")
        object.__setattr__(self, "engine", dict(self.engine))


@dataclass(frozen=True)
class InstanceSpec:
    """One instance of a deployment, as both drivers build it."""

    instance_id: str
    role: Role
    engine: EngineConfig
    tp: int = 1
    pp: int = 1
    node: int = 0
    ep: int = 1

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp


# A prefill instance batches whole prompts (DistServe §4.3): it never chunks; a temporal
# instance never mixes phases (EcoServe §4.2.1), so it does not chunk either.
_ROLE_DEFAULTS: dict[str, dict[str, Any]] = {"prefill": {"enable_chunked_prefill": False},
                                             "temporal": {"enable_chunked_prefill": False}}


@dataclass(frozen=True)
class PredictorConfig:
    """TetriInfer's length predictor (§3.3.2; :mod:`pdserve.predict`): ``name`` (``none``,
    ``oracle``, ...), the bucket ``granularity`` in tokens, the oracle's ``accuracy`` and the
    ``data`` it is fitted on (a trained classifier, logged pairs or a trace name)."""

    name: str = "none"
    granularity: int = 200
    accuracy: float = 1.0
    data: str | None = None

    def __post_init__(self) -> None:
        _require(self.name in LENGTH_PREDICTORS,
                 f"unknown length predictor {self.name!r}; available: "
                 f"{list(LENGTH_PREDICTORS)}")
        check_granularity(self.granularity)
        _require(isinstance(self.accuracy, (int, float)) and 0.0 <= self.accuracy <= 1.0,
                 f"predictor_accuracy must be in [0, 1], got {self.accuracy}")
        # settings the chosen predictor would ignore
        _require(self.accuracy == 1.0 or self.name == "oracle",
                 f"predictor_accuracy sets the oracle's accuracy; length_predictor is "
                 f"{self.name!r}")
        _require(self.data is None or self.name not in ("none", "oracle"),
                 f"predictor_data trains a length predictor; length_predictor {self.name!r} "
                 f"takes none")
        _require(self.name != "none" or self.granularity == PredictorConfig.granularity,
                 "predictor_granularity buckets a length predictor's output; "
                 "length_predictor is 'none'")


@dataclass(frozen=True)
class MacroConfig:
    """EcoServe's macro instances (strategy ``partial``): ``size`` temporal instances each, routed
    by ``macro_rolling`` against ``slo_ttft``/``slo_tpot`` (Alg. 2); ``mitosis`` scales them
    between ``mitosis_lower`` (N_l) and ``mitosis_upper`` (N_u) instances each (§4.2.4)."""

    slo_ttft: float = _help("TTFT objective the macro_rolling router admits against, s "
                            "(EcoServe Alg. 2)", default=5.0)
    slo_tpot: float = _help("TPOT objective the macro_rolling router admits against, s "
                            "(EcoServe Alg. 2)", default=0.1)
    size: int = _help("temporal instances per macro instance (EcoServe §4.2.1)", default=4)
    mitosis: bool = _help("scale macro instances with mitosis (EcoServe §4.2.4): start with "
                          "mitosis_initial instances, park the rest", default=False)
    mitosis_lower: int = _help("N_l: fewest instances of a macro instance", default=2)
    mitosis_upper: int = _help("N_u: most instances of a macro instance", default=4)
    mitosis_initial: int | None = _help(
        "instances serving at the start with mitosis (default: mitosis_lower)", default=None)
    mitosis_interval: float = _help("seconds between mitosis scaling decisions", default=10.0)

    def __post_init__(self) -> None:
        flat = {name: key for key, (_, name) in FLAT_KEYS.items()}  # messages say the flags
        for name in ("slo_ttft", "slo_tpot", "mitosis_interval"):
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and v > 0,
                     f"{flat[name]} must be > 0, got {v!r}")
        for name in ("size", "mitosis_lower", "mitosis_upper"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 1,
                     f"{flat[name]} must be an integer >= 1, got {v!r}")
        _require(self.mitosis_lower <= self.mitosis_upper,
                 f"mitosis_lower (N_l={self.mitosis_lower}) must be <= mitosis_upper "
                 f"(N_u={self.mitosis_upper})")
        _require(self.mitosis_upper >= 2 * self.mitosis_lower - 1,
                 f"mitosis_upper (N_u={self.mitosis_upper}) must be >= 2*N_l - 1 = "
                 f"{2 * self.mitosis_lower - 1}: a split past N_u leaves two macro instances "
                 f"of at least N_l")
        _require(self.mitosis_initial is None or self.mitosis_initial >= 1,
                 f"mitosis_initial must be >= 1, got {self.mitosis_initial}")


# The flat deployment keys of the nested settings -> (ClusterConfig field, nested field): the
# command line's flags (``--predictor-granularity``, ``--mitosis-lower``, ...) and deployment
# files written before the nesting use them; :meth:`ClusterConfig.from_dict` accepts both forms.
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "length_predictor": ("predictor", "name"),
    "predictor_granularity": ("predictor", "granularity"),
    "predictor_accuracy": ("predictor", "accuracy"),
    "predictor_data": ("predictor", "data"),
    "slo_ttft": ("macro", "slo_ttft"),
    "slo_tpot": ("macro", "slo_tpot"),
    "macro_instance_size": ("macro", "size"),
    "mitosis": ("macro", "mitosis"),
    "mitosis_lower": ("macro", "mitosis_lower"),
    "mitosis_upper": ("macro", "mitosis_upper"),
    "mitosis_initial": ("macro", "mitosis_initial"),
    "mitosis_interval": ("macro", "mitosis_interval"),
}
_NESTED: dict[str, type[PredictorConfig] | type[MacroConfig]] = {
    "predictor": PredictorConfig, "macro": MacroConfig}


@dataclass(frozen=True)
class ClusterConfig:
    """A deployment: the one spec from which the live runtime and the simulator build instances.

    ``engine`` holds the engine settings every role shares (``EngineConfig.KWARGS`` names, vLLM's);
    ``roles`` the instances — colocated (vLLM-style) or prefill + decode (DistServe), each role
    with its count, TP/PP and engine overrides. ``kv_link`` joins instances on one node (live: an
    emulated link, ``None`` = as fast as the transport goes; simulated: ``None`` = the device's
    intra-node link), ``inter_node_link`` instances on different nodes; instances fill nodes of
    ``gpus_per_node`` GPUs in order (``None``: one node). ``max_waiting_requests`` bounds
    requests accepted but not yet started. Build it with :meth:`from_dict` (files, flags).

    ``predictor`` (:class:`PredictorConfig`) and ``flip`` are TetriInfer's length predictor and
    instance flip; ``macro`` (:class:`MacroConfig`) holds partial disaggregation's settings
    (EcoServe, strategy ``partial``: ``temporal`` instances in macro instances, mitosis).
    """

    model: str = ""
    engine: Mapping[str, Any] = field(default_factory=dict)
    roles: tuple[RoleSpec, ...] = (RoleSpec("colocated"),)
    prefill_router: str = "shortest_queue"
    decode_router: str = "least_load"
    kv_link: Link | None = None
    inter_node_link: Link | None = None
    gpus_per_node: int | None = None
    backend: str = "ray"
    ray_address: str | None = None
    max_waiting_requests: int = 1024
    # TetriInfer (§3.3.2 length predictor, §3.5 instance flip; pdserve/predict, cluster/flip.py)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    flip: str = "none"
    # EcoServe (strategy partial: macro instances, rolling activation, mitosis)
    macro: MacroConfig = field(default_factory=MacroConfig)

    def __post_init__(self) -> None:
        _require(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got "
                 f"{self.backend!r}")
        _require(self.max_waiting_requests >= 1,
                 f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        _require(self.gpus_per_node is None or self.gpus_per_node >= 1,
                 f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        object.__setattr__(self, "roles", tuple(self.roles))
        names = [r.role for r in self.roles]
        _require(len(set(names)) == len(names), f"each role may appear once, got {names}")
        _require(sorted(names) in (["colocated"], ["decode", "prefill"], ["temporal"]),
                 f"roles must be [colocated], [prefill, decode] or [temporal], got {names}")
        object.__setattr__(self, "engine", dict(self.engine))
        self.engine_config()  # validates the shared engine settings now
        _require(isinstance(self.predictor, PredictorConfig),
                 f"predictor must be a PredictorConfig, got {self.predictor!r}")
        _require(isinstance(self.macro, MacroConfig),
                 f"macro must be a MacroConfig, got {self.macro!r}")
        flip_settings(self.flip)
        # TetriInfer's settings act on prefill and decode instances only: elsewhere they
        # would be ignored, which a deployment never does silently
        strategy = self.strategy
        _require(self.predictor.name == "none" or strategy == "disaggregated",
                 f"length_predictor {self.predictor.name!r} predicts for a disaggregated "
                 f"deployment's decode routing (TetriInfer); this one is {strategy}")
        _require(self.flip == "none" or strategy == "disaggregated",
                 f"flip {self.flip!r} flips prefill and decode instances (TetriInfer); this "
                 f"deployment is {strategy}")
        _require(self.decode_router == ClusterConfig.decode_router
                 or strategy == "disaggregated",
                 f"decode_router {self.decode_router!r} routes to decode instances; this "
                 f"deployment is {strategy} (prefill_router routes its requests)")
        if self.gpus_per_node is not None:
            for r in self.roles:
                _require(r.tp * r.pp <= self.gpus_per_node,
                         f"a {r.role} instance needs tp*pp={r.tp * r.pp} GPUs, more than "
                         f"gpus_per_node={self.gpus_per_node}")

    @property
    def strategy(self) -> str:
        return _strategy_of(self.roles)

    def router_options(self) -> dict[str, Any]:
        """Settings a router may take as constructor keywords (``make_routers`` passes each to
        the routers whose constructor names it): EcoServe's SLOs, macro size and mitosis."""
        return {key: getattr(self.macro, name) for key, (group, name) in FLAT_KEYS.items()
                if group == "macro"}

    def role(self, name: str) -> RoleSpec | None:
        return next((r for r in self.roles if r.role == name), None)

    def engine_config(self, role: RoleSpec | None = None,
                      model_max_len: int | None = None) -> EngineConfig:
        """The engine of ``role``'s instances (``None``: the shared settings, colocated)."""
        kw = dict(self.engine)
        if role is not None:
            kw.update(_ROLE_DEFAULTS.get(role.role, {}))
            kw.update(role.engine)
            kw["role"] = role.role
        return EngineConfig.from_kwargs(self.model, model_max_len=model_max_len, **kw)

    def instance_specs(self, model_max_len: int | None = None) -> list[InstanceSpec]:
        """Every instance, roles applied, placed on nodes in order."""
        out: list[InstanceSpec] = []
        gpus = 0
        for r in self.roles:
            engine = self.engine_config(r, model_max_len)
            for i in range(r.count):
                need = r.tp * r.pp
                if self.gpus_per_node is not None and gpus % self.gpus_per_node + need > \
                        self.gpus_per_node:
                    gpus += self.gpus_per_node - gpus % self.gpus_per_node  # next node
                node = gpus // self.gpus_per_node if self.gpus_per_node else 0
                out.append(InstanceSpec(f"{r.role}-{i}", r.role, engine, r.tp, r.pp, node, r.ep))
                gpus += need
        return out

    @property
    def num_gpus(self) -> int:
        return sum(r.count * r.tp * r.pp for r in self.roles)

    # ---- files and flags ----
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterConfig:
        """From a deployment file's mapping or the flags' values (``None`` = not given).

        Besides the fields, the shorthand of the command line is accepted: ``strategy``,
        ``num_instances`` (colocated or temporal), ``num_prefill``/``num_decode``,
        ``tp``/``pp``/``ep`` (every role), ``prefill_tp``/``prefill_pp``/``prefill_ep`` and the
        same for ``decode``,
        ``prefill_token_target`` (L_m of prefill instances), engine settings at the top level,
        links as ``{bandwidth_gb_per_s, latency_s}`` mappings, and the nested settings as
        mappings (``predictor: {name: oracle}``) or by their flat keys (:data:`FLAT_KEYS`:
        ``length_predictor: oracle``, the flags' names); a flat key overrides the same setting
        given nested (a flag over a file). Shorthand overrides ``roles``.
        """
        d = {k.replace("-", "_"): v for k, v in d.items() if v is not None}
        known = {f.name for f in fields(cls)}
        short = {k: d.pop(k) for k in _SHORTHAND if k in d}
        flat_macro: list[str] = []  # macro settings given by their flat keys (flags)
        for group, sub in _NESTED.items():
            given = d.get(group, {})
            if isinstance(given, sub):
                given = {f.name: getattr(given, f.name) for f in fields(sub)}
            _require(isinstance(given, Mapping),
                     f"{group} must be a mapping of {', '.join(f.name for f in fields(sub))}, "
                     f"got {given!r}")
            nested = {k.replace("-", "_"): v for k, v in given.items() if v is not None}
            bad = set(nested) - {f.name for f in fields(sub)}
            _require(not bad, f"{group}: unknown setting(s) {sorted(bad)}; known: "
                              f"{', '.join(f.name for f in fields(sub))}")
            flat = {key: d.pop(key) for key, (g, _) in FLAT_KEYS.items()
                    if g == group and key in d}
            nested.update({FLAT_KEYS[key][1]: v for key, v in flat.items()})
            d[group] = sub(**nested)
            if group == "macro":  # (the SLOs are also what a run is judged on)
                flat_macro = sorted(set(flat) - {"slo_ttft", "slo_tpot"})
                idle = sorted(k for k in flat if k.startswith("mitosis_"))
                _require(not idle or d[group].mitosis,  # given, and ignored
                         f"{', '.join(idle)}: settings of mitosis scaling, which is off; add "
                         f"mitosis (--mitosis)")
        engine = d.pop("engine", None) or {}
        if isinstance(engine, EngineConfig):
            d.setdefault("model", engine.model)
            engine = engine.to_kwargs()
        engine = dict(engine)
        for k in list(d):
            if k in EngineConfig.KWARGS:
                engine[k] = d.pop(k)
        roles = [r if isinstance(r, RoleSpec) else _role_from_dict(r)
                 for r in d.pop("roles", None) or []]
        roles = _apply_shorthand(roles, short)
        _require(not flat_macro or _strategy_of(roles) == "partial",
                 f"{', '.join(flat_macro)}: macro instances' settings (EcoServe), for strategy "
                 f"partial; this deployment is {_strategy_of(roles)}")
        if roles and _strategy_of(roles) == "partial":
            d.setdefault("prefill_router", "macro_rolling")  # EcoServe's router by default
        unknown = set(d) - known
        _require(not unknown, f"unknown deployment setting(s) {sorted(unknown)}; known: "
                              f"{', '.join(sorted(known | set(_SHORTHAND) | set(FLAT_KEYS)))}")
        for name in ("kv_link", "inter_node_link"):
            if isinstance(d.get(name), Mapping):
                d[name] = Link(**d[name])
            elif isinstance(d.get(name), str):  # a catalogue link (nvlink3, eth-25g, ...)
                d[name] = get_link(d[name])
        return cls(engine=engine, roles=tuple(roles), **d)

    def to_dict(self) -> dict[str, Any]:
        """The mapping :meth:`from_dict` reads back (a deployment file's content)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "roles":
                v = [{"role": r.role, "count": r.count, "tp": r.tp, "pp": r.pp,
                      **({"ep": r.ep} if r.ep != 1 else {}),
                      **({"engine": dict(r.engine)} if r.engine else {})} for r in v]
            elif isinstance(v, Link):
                v = {"bandwidth_gb_per_s": v.bandwidth_gb_per_s, "latency_s": v.latency_s}
            elif isinstance(v, (PredictorConfig, MacroConfig)):
                v = {g.name: getattr(v, g.name) for g in fields(v)}
            elif isinstance(v, Mapping):
                v = dict(v)
            out[f.name] = v
        return out


_SHORTHAND = ("strategy", "num_instances", "num_prefill", "num_decode", "tp", "pp", "ep",
              "prefill_tp", "prefill_pp", "prefill_ep", "decode_tp", "decode_pp", "decode_ep",
              "prefill_token_target")


def _strategy_of(roles: Any) -> str:
    return {"colocated": "colocated", "temporal": "partial"}.get(roles[0].role, "disaggregated")


def _role_from_dict(d: Any) -> RoleSpec:
    _require(isinstance(d, Mapping) and "role" in d,
             f"each entry of roles must be a mapping with a 'role', got {d!r}")
    unknown = set(d) - {f.name for f in fields(RoleSpec)}
    _require(not unknown, f"role {d['role']!r}: unknown key(s) {sorted(unknown)}")
    return RoleSpec(**d)


def _apply_shorthand(roles: list[RoleSpec], short: dict[str, Any]) -> list[RoleSpec]:
    strategy = short.get("strategy")
    _require(strategy is None or strategy in STRATEGIES,
             f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    current = _strategy_of(roles) if roles else "colocated"
    if strategy is not None and strategy != current or not roles:
        strategy = strategy or "colocated"
        roles = [RoleSpec(n) for n in _STRATEGY_ROLES[strategy]]
    out = []
    for r in roles:
        kw: dict[str, Any] = {}
        count = short.get({"colocated": "num_instances", "prefill": "num_prefill",
                           "decode": "num_decode", "temporal": "num_instances"}[r.role])
        if count is not None:
            kw["count"] = count
        for dim in ("tp", "pp", "ep"):
            v = short.get(f"{r.role}_{dim}", short.get(dim))
            if v is not None:
                kw[dim] = v
        engine = dict(r.engine)
        if r.role == "prefill" and short.get("prefill_token_target") is not None:
            engine["prefill_token_target"] = short["prefill_token_target"]
        out.append(replace(r, engine=engine, **kw))
    # a setting of a role the deployment does not have would be ignored: refused instead
    have = {r.role for r in out}
    for key in _SHORTHAND:
        role = ("prefill" if key.startswith("prefill_") or key == "num_prefill" else
                "decode" if key.startswith("decode_") or key == "num_decode" else
                "instances" if key == "num_instances" else None)
        if short.get(key) is None or role is None:
            continue
        if role == "instances":
            _require(bool(have & {"colocated", "temporal"}),
                     "num_instances counts colocated or temporal instances; this deployment "
                     "is disaggregated (num_prefill, num_decode)")
        else:
            _require(role in have, f"{key} sets {role} instances; this deployment is "
                                   f"{_strategy_of(out)} (strategy disaggregated has them)")
    return out
