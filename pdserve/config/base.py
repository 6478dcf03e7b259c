"""What every config module shares: the names the configs validate against and small helpers
(checks, ceiling division, a flag's help text, reading data files)."""

from __future__ import annotations

import json
import os
from dataclasses import field
from typing import Any, Literal

Role = Literal["colocated", "prefill", "decode", "temporal"]
ROLES: tuple[str, ...] = ("colocated", "prefill", "decode", "temporal")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Priced only in simulation, and only by the kernel-database source (pdserve.sim.aic_latency):
# fp8 weights and GEMMs (vLLM's ``--quantization fp8``) and an fp8 KV cache (``--kv-cache-dtype
# fp8``); the live engine serves neither and refuses a spec that asks for them.
QUANTIZATIONS: tuple[str, ...] = ("fp8",)
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")
KV_DTYPE_BYTES = {**DTYPE_BYTES, "fp8": 1}

# Names of the registered policies that the configs validate against. They live here, below the
# packages that register the classes (pdserve.engine, pdserve.predict, pdserve.cluster.flip),
# so that a config imports nothing above it; each registry refuses a class whose name is not
# in its table (pdserve.registry.Registry ``names``).
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "preble", "sjf", "ljf")
ADMISSION_POLICIES: tuple[str, ...] = ("greedy", "reserve-static", "reserve-dynamic")
LENGTH_PREDICTORS: tuple[str, ...] = ("none", "oracle", "majority", "prompt-length",
                                      "classifier")
FLIP_POLICIES: tuple[str, ...] = ("none", "idle", "load")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def _help(text: str, **kw: Any) -> Any:
    """A dataclass field whose ``metadata["help"]`` becomes its flag's help text."""
    return field(metadata={"help": text}, **kw)


GiB = 1 << 30


def read_text(path: str | os.PathLike[str], what: str) -> str:
    """A file's text; ``ValueError`` naming ``what`` and the file when it cannot be read."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise ValueError(f"{what} {p!r} " + ("is not a file" if os.path.exists(p)
                                             else "does not exist"))
    try:
        with open(p) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} {p!r}: {e.strerror}") from None


def load_data_file(path: str | os.PathLike[str], what: str) -> Any:
    """A JSON (``.json``) or YAML (any other name) file's content — deployment specs, hardware
    specs, target lists; ``ValueError`` naming ``what`` and the file on any problem."""
    p = os.fspath(path)
    text = read_text(p, what)
    kind = "JSON" if p.endswith(".json") else "YAML"
    try:
        if kind == "JSON":
            return json.loads(text)
        import yaml

        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except Exception as e:  # yaml.YAMLError, json.JSONDecodeError
        raise ValueError(f"{what} {p!r} is not valid {kind}: {e}") from None
