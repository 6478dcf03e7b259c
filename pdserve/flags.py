"""One set of command-line flags for every subcommand, generated from the config dataclasses,
and one error wrapper.

- :func:`add_engine_flags`: one flag per :attr:`EngineConfig.KWARGS` name (vLLM's names,
  ``--enable-prefix-caching/--no-enable-prefix-caching`` for booleans), help from the fields'
  ``metadata["help"]``, every default shown.
- :func:`add_deployment_flags`: ``--config FILE`` (YAML/JSON deployment spec), the engine flags
  and the cluster flags (strategy, counts, TP/PP, routers, links, nodes, backend).
- :func:`deployment_from_args`: the file, overlaid with the flags the user gave, through
  :meth:`ClusterConfig.from_dict` — the one construction path of a deployment.
- :func:`guarded`: runs a subcommand; bad values print ``pdserve CMD: error: ...`` and exit 2,
  run failures ``pdserve CMD: failed: ...`` and exit 1; :func:`subcommand` adds a subcommand
  that runs so.

Every flag's default is ``None`` (= "not given"), so that a flag overrides the file only when
the user typed it; the help text shows the effective default.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, NoReturn

from pdserve.cluster.routing import ROUTERS
from pdserve.config import (
    BACKENDS,
    DTYPES,
    FLAT_KEYS,
    STRATEGIES,
    CacheConfig,
    ClusterConfig,
    EngineConfig,
    Link,
    MacroConfig,
    SchedulerConfig,
    load_data_file,
)
from pdserve.engine.admission import ADMISSIONS
from pdserve.engine.policies import POLICIES
from pdserve.predict import PREDICTOR_NAMES

_FIELDS = {f.name: (cls, f) for cls in (EngineConfig, CacheConfig, SchedulerConfig)
           for f in fields(cls)}
# the help of a simulated or planned instance's dtype default (pdserve.sim.target.auto_dtype)
AUTO_DTYPE = ("auto: the checkpoint's, as a GPU engine serves it: bfloat16 for a bfloat16 model, "
              "float16 otherwise")
_CHOICES: dict[str, Iterable[str]] = {"dtype": DTYPES, "admission": sorted(ADMISSIONS),
                                      "policy": sorted(POLICIES)}


def say(msg: str) -> None:
    """A line on stderr (progress, notes, errors)."""
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- value types
def _number(text: str, kind: type = float) -> float:
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def positive(text: str) -> float:
    v = _number(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def positive_int(text: str) -> int:
    v = int(_number(text, int))
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return v


def nonnegative_int(text: str) -> int:
    v = int(_number(text, int))
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return v


def positive_int_list(text: str) -> list[int]:
    """``1,2,4``: integers >= 1, in order, each once."""
    out = [positive_int(t.strip()) for t in text.split(",") if t.strip()]
    if not out or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"expected distinct integers >= 1 separated by "
                                         f"commas, got {text!r}")
    return out


def nonnegative(text: str) -> float:
    v = _number(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return v


def share_or_zero(text: str) -> float:
    v = _number(text)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return v


def share(text: str) -> float:
    v = positive(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def _writable_folder(folder: Path, text: str) -> None:
    """Make ``folder`` and write a file in it (then removed): ``os.access`` says yes to root
    in a folder no file can be made in (``/proc``, a read-only bind mount)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {e.strerror or e}") from None
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(folder)!r} is not a "
                                         f"folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(folder)!r} is not a "
                                         f"writable folder ({e.strerror or e})") from None


def output_file(text: str) -> str:
    """A file an output will be written to: its folder is made (or found writable), and an
    existing file found writable, when the flag is read, so that a bad path fails before the
    work, not after it."""
    p = Path(text)
    if not text or p.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}")
    _writable_folder(p.parent, text)
    if p.exists() and not os.access(p, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the file is read-only")
    return text


def output_dir(text: str) -> str:
    """A folder outputs will be written into, made (or found writable) when the flag is read."""
    if not text or (Path(text).exists() and not Path(text).is_dir()):
        raise argparse.ArgumentTypeError(f"expected a folder, got {text!r}")
    _writable_folder(Path(text), text)
    return text


def link_value(text: str) -> Any:
    """``GBps[:latency_ms]`` (numbers) → :class:`Link`, else a catalogue link name (kept as a
    string; the simulator resolves it)."""
    bw, _, lat = text.partition(":")
    try:
        bandwidth = float(bw)
    except ValueError:
        if lat:
            raise argparse.ArgumentTypeError(f"expected GBps[:ms] or a link name, "
                                             f"got {text!r}") from None
        return text
    try:
        return Link(bandwidth, _number(lat) / 1000 if lat else 0.0)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ------------------------------------------------------------------------------------ engine
def _flag_type(hint: Any) -> tuple[Any, list[str] | None]:
    """``(argparse type, choices)`` of a field's type hint (``int | None`` → ``int``)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return str, [str(a) for a in args]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    if hint is int:
        return positive_int, None
    if hint is float:
        return positive, None
    return hint, None


def add_engine_flags(parser: argparse.ArgumentParser,
                     exclude: Iterable[str] = ("role", "prefill_token_target"),
                     defaults: Mapping[str, Any] | None = None) -> argparse._ArgumentGroup:
    """One flag per :attr:`EngineConfig.KWARGS` name minus ``exclude`` (``--block-size N``...);
    ``defaults``: what the command applies where it differs from ``EngineConfig``'s (shown in
    ``--help``)."""
    group = parser.add_argument_group("engine (every instance)")
    skip = set(exclude)
    for name in EngineConfig.KWARGS:
        if name in skip:
            continue
        cls, f = _FIELDS[name]
        default = f.default if f.default is not MISSING else None
        help_ = f.metadata.get("help", name)
        if defaults and name in defaults:
            default = defaults[name]
            help_ = help_.split(" (default")[0]
        _add_field_flag(group, name, typing.get_type_hints(cls)[name], help_, default,
                        kind=int if name == "seed" else None, choices=_CHOICES.get(name))
    return group


def _add_field_flag(group: argparse._ArgumentGroup, key: str, hint: Any, help_: str,
                    default: Any, *, kind: Any = None,
                    choices: Iterable[str] | None = None) -> None:
    """``--KEY`` for a config field: type and choices from its type hint (``kind``/``choices``
    where given), ``default`` shown in the help (its value stays ``None`` = not given); a
    boolean is ``--KEY/--no-KEY``."""
    hint_kind, hint_choices = _flag_type(hint)
    kind = kind or hint_kind
    if default is not None and "default:" not in help_:
        help_ += f" (default: {default})"
    flag = "--" + key.replace("_", "-")
    if kind is bool:
        group.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction,
                           default=None, help=help_)
    else:
        group.add_argument(flag, dest=key, type=kind, default=None,
                           choices=list(choices or hint_choices or []) or None, help=help_)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keyword arguments the user set (for ``EngineConfig.from_kwargs``)."""
    return {k: getattr(args, k) for k in EngineConfig.KWARGS
            if getattr(args, k, None) is not None}


# -------------------------------------------------------------------------------- deployment
_DEFAULT = ClusterConfig()


def add_deployment_flags(parser: argparse.ArgumentParser, *, model_help: str,
                         live: bool = True) -> None:
    """``--config``, ``--model``, the engine flags and the cluster flags (module docstring).
    ``live=False`` (the simulator) leaves out the backend and Ray flags and the engine's
    ``--device`` and ``--seed`` (a simulated step samples nothing)."""
    d = parser.add_argument_group("deployment (flags override --config)")
    d.add_argument("--config", metavar="FILE",
                   help="deployment spec, YAML or JSON (ClusterConfig.from_dict keys: model, "
                        "engine, roles, routers, links; `pdserve plan` writes one)")
    d.add_argument("--model", metavar="NAME|DIR", help=model_help)
    d.add_argument("--strategy", choices=STRATEGIES,
                   help="colocated (vLLM-style), disaggregated (DistServe) or partial "
                        "(EcoServe: temporal instances in macro instances) "
                        "(default: colocated)")
    d.add_argument("--num-instances", type=positive_int,
                   help="colocated or temporal instances (default: 1)")
    d.add_argument("--num-prefill", type=positive_int,
                   help="prefill instances when disaggregated (default: 1)")
    d.add_argument("--num-decode", type=positive_int,
                   help="decode instances when disaggregated (default: 1)")
    d.add_argument("-tp", "--tp", "--tensor-parallel-size", dest="tp", type=positive_int,
                   help="tensor-parallel degree of every instance (default: 1)")
    d.add_argument("-pp", "--pp", "--pipeline-parallel-size", dest="pp", type=positive_int,
                   help="pipeline-parallel degree of every instance (default: 1)")
    d.add_argument("-ep", "--ep", "--expert-parallel-size", dest="ep", type=positive_int,
                   help="expert-parallel degree of every instance of a mixture-of-experts "
                        "model; divides -tp (simulated by the analytic model; default: 1)")
    for role in ("prefill", "decode"):
        for dim, what in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert")):
            d.add_argument(f"--{role}-{dim}", type=positive_int,
                           help=f"{what}-parallel degree of {role} instances (default: -{dim})")
    d.add_argument("--prefill-token-target", type=positive_int, metavar="L_M",
                   help="DistServe's L_m: prefill instances batch whole prompts up to this "
                        "many tokens (default: the token budget)")
    d.add_argument("--prefill-router", choices=sorted(ROUTERS),
                   help=f"picks the prefill (or colocated) instance "
                        f"(default: {_DEFAULT.prefill_router})")
    d.add_argument("--decode-router", choices=sorted(ROUTERS),
                   help=f"picks the decode instance (default: {_DEFAULT.decode_router})")
    d.add_argument("--kv-link", type=link_value, metavar="GBps[:ms]|NAME",
                   help="KV link between instances on one node: bandwidth in GB/s and latency "
                        "in ms, or a catalogue link (nvlink3, pcie4, eth-25g...) (default: live "
                        "unlimited; simulated the device's intra-node link)")
    d.add_argument("--inter-node-link", type=link_value, metavar="GBps[:ms]|NAME",
                   help="KV link between nodes (default: as --kv-link)")
    d.add_argument("--gpus-per-node", type=positive_int,
                   help="instances fill nodes of this many GPUs in order (default: one node)")
    t = parser.add_argument_group("TetriInfer (length prediction, instance flip)")
    t.add_argument("--length-predictor", choices=PREDICTOR_NAMES,
                   help="predicts each request's output length bucket beside the prefill "
                        "(TetriInfer section 3.3.2): oracle (simulations), prompt-length, "
                        "majority, classifier (default: none)")
    t.add_argument("--predictor-granularity", type=positive_int, metavar="TOKENS",
                   help=f"bucket width of the predicted length "
                        f"(default: {_DEFAULT.predictor.granularity})")
    t.add_argument("--predictor-accuracy", type=share_or_zero, metavar="SHARE",
                   help="the oracle's accuracy (default: 1.0; the paper's classifier: 0.749)")
    t.add_argument("--predictor-data", metavar="FILE|TRACE",
                   help="a trained classifier (.npz), or logged (prompt, length) pairs (JSONL) "
                        "or a trace name to fit the predictor on at start")
    t.add_argument("--flip", metavar="POLICY",
                   help="instance flip (TetriInfer section 3.5): none, idle[:SECONDS] or "
                        "load[:SHARE[:SECONDS]] (default: none)")
    hints = typing.get_type_hints(MacroConfig)
    macro = {f.name: f for f in fields(MacroConfig)}
    for key in _ECO_FIELDS:  # EcoServe's settings under their flat names, from the fields' help
        f = macro[FLAT_KEYS[key][1]]
        _add_field_flag(d, key, hints[f.name], f.metadata["help"], f.default)
    if live:
        d.add_argument("--backend", choices=BACKENDS,
                       help=f"instances as Ray actors or threads in this process "
                            f"(default: {_DEFAULT.backend})")
        d.add_argument("--ray-address", help="join this Ray cluster (default: start one)")
        d.add_argument("--max-waiting-requests", type=positive_int,
                       help=f"waiting requests beyond this get HTTP 429 "
                            f"(default: {_DEFAULT.max_waiting_requests})")
    if live:
        add_engine_flags(parser, ("role", "prefill_token_target"))
    else:  # the simulator's own default (pdserve.sim.target.auto_dtype)
        add_engine_flags(parser, ("role", "prefill_token_target", "device", "seed"),
                         {"dtype": AUTO_DTYPE})


_ECO_FIELDS = tuple(k for k, (group, _) in FLAT_KEYS.items() if group == "macro")
_CLUSTER_FLAGS = _ECO_FIELDS + (
                  "model", "strategy", "num_instances", "num_prefill", "num_decode", "tp", "pp",
                  "ep", "prefill_tp", "prefill_pp", "prefill_ep", "decode_tp", "decode_pp",
                  "decode_ep", "prefill_token_target",
                  "prefill_router", "decode_router", "kv_link", "inter_node_link",
                  "gpus_per_node", "backend", "ray_address", "max_waiting_requests",
                  "length_predictor", "predictor_granularity", "predictor_accuracy",
                  "predictor_data", "flip")


def deployment_dict(args: argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    """The ``--config`` file's mapping overlaid with the flags the user gave."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    spec = load_data_file(values["config"], "deployment spec") if values.get("config") else {}
    if not isinstance(spec, dict):
        raise ValueError(f"deployment spec {values['config']!r} must be a mapping")
    spec = dict(spec)
    engine = dict(spec.pop("engine", None) or {})
    for k in EngineConfig.KWARGS:
        if values.get(k) is not None:
            engine[k] = values[k]
    for k in _CLUSTER_FLAGS:
        if values.get(k) is not None:
            spec[k] = values[k]
    spec["engine"] = engine
    return spec


def deployment_from_args(args: argparse.Namespace | dict[str, Any]) -> ClusterConfig:
    d = deployment_dict(args)
    sim = d.pop("simulation", None) or {}  # how `simulate` / `plan` priced it; a live run
    fp8 = [f"{k}: fp8" for k in ("quantization", "kv_cache_dtype")  # ignores the rest of it
           if isinstance(sim, dict) and sim.get(k) == "fp8"]
    if fp8:
        raise ValueError(f"the spec's simulation section prices {' and '.join(fp8)}, which the "
                         f"live engine does not serve (it runs float32/float16/bfloat16 "
                         f"weights and KV); plan without fp8 to serve the plan")
    return ClusterConfig.from_dict(d)


# ---------------------------------------------------------------------------------- running
class UsageError(ValueError):
    """A bad command-line value."""


def one_line_errors(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse prints the usage and the message; pdserve prints only the message."""

    def error(self: argparse.ArgumentParser, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)

    p.error = types.MethodType(error, p)  # type: ignore[method-assign]
    return p


def _one_line(msg: object) -> str:
    """A message on one line (a YAML parser's, say, spans several)."""
    return " ".join(part.strip() for part in str(msg).splitlines() if part.strip())


def guarded(cmd: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[Any], int]:
    """``fn`` as a subcommand ``func``: bad values → exit 2, failed runs → exit 1, one line."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except (ValueError, TypeError, KeyError, FileNotFoundError, NotImplementedError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else e
            say(f"pdserve {cmd}: error: {_one_line(msg)}")
            return 2
        except (ConnectionError, RuntimeError) as e:
            say(f"pdserve {cmd}: failed: {_one_line(e)}")
            return 1

    return run


def subcommand(subparsers: Any, name: str, fn: Callable[[argparse.Namespace], int], *,
               help: str, description: str | None = None,
               cmd: str | None = None) -> argparse.ArgumentParser:
    """A subcommand parser whose bad flags are one line (:func:`one_line_errors`) and whose
    ``func`` runs ``fn`` :func:`guarded` as ``pdserve CMD`` (``cmd``, default ``name``).
    ``description`` (``--help``'s paragraph) defaults to ``fn``'s docstring."""
    if description is None and fn.__doc__:
        description = " ".join(inspect.getdoc(fn).split())  # type: ignore[union-attr]
    p = one_line_errors(subparsers.add_parser(name, help=help, description=description))
    p.set_defaults(func=guarded(cmd or name, fn))
    return p
