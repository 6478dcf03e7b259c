"""Step-time models for the simulated executor (DESIGN.md "Simulator"; torch-free).

A :class:`LatencyModel` maps one engine iteration — prefill chunks ``(start, num_new_tokens)``
and decode context lengths — to seconds. Two families share that interface:

* :class:`FittedProfile` — DistServe's fitted form (Appendix A; ``simdistserve`` profiles):
  prefill batch ``a + b·Σl + c·Σl²``, decode step ``a + b·Σctx + c·batch`` with separate
  coefficients below/above a batch-size threshold. Loaded from DistServe's JSON as it is, from
  our own profile JSON, or fitted by :func:`fit_profile` (relative least squares).
* :class:`~pdserve.sim.analytic.AnalyticModel` — a roofline model from FLOPs and bytes.

:class:`PipelineModel` turns a whole-model step time into pipeline-parallel stage times
(DistServe §3.1 Eq. 2, §3.3 "variable prefill length"), and :func:`kv_transfer_time` prices a
KV hand-off (DistServe §3.3 "communication overhead").
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.config import DTYPE_BYTES, ModelConfig
from pdserve.sim.hardware import LinkSpec

if TYPE_CHECKING:
    from pdserve.engine.batch import ScheduledBatch

Chunks = Sequence[tuple[int, int]]
Coeffs = tuple[float, float, float]
PROFILE_FORMAT = "pdserve-latency-profile"
DISTSERVE_DECODE_THRESHOLD = 95  # simdistserve profiles: "decoding_large_small_bs_threshold"


class LatencyModel(ABC):
    """Seconds for one engine iteration. Implementations are pure functions of their inputs."""

    @abstractmethod
    def step_time(self, prefill_chunks: Chunks, decode_context_lens: Sequence[int]) -> float:
        """``prefill_chunks``: ``(start, num_new_tokens)`` per prefill / chunk / recompute entry
        (the entry attends to ``start + num_new_tokens`` positions); ``decode_context_lens``:
        context length per decoding sequence, the new token included. Empty step → 0."""

    def batch_time(self, batch: ScheduledBatch) -> float:
        prefills, decodes = batch.shape()  # one pass over the batch (the simulator's hot path)
        return self.step_time(prefills, decodes)

    def prefill_time(self, prompt_lens: Sequence[int]) -> float:
        """A batch of whole prompts (no cached prefix)."""
        return self.step_time([(0, n) for n in prompt_lens], [])

    def decode_time(self, context_lens: Sequence[int]) -> float:
        return self.step_time([], context_lens)

    def decode_sum_time(self, batch_size: int, total_context: int) -> float | None:
        """``decode_time`` of ``batch_size`` sequences whose contexts sum to ``total_context``,
        bit for bit, where the model reads nothing else of the contexts; else ``None`` (the
        simulator's decode fast path then passes the list)."""
        return None


def kv_transfer_time(num_tokens: int, model: ModelConfig, dtype: str, link: LinkSpec,
                     streams: int = 1) -> float:
    """``bytes / bandwidth + latency`` for the KV of ``num_tokens`` tokens (all layers, K and V).

    ``streams`` > 1 splits the bytes over that many links used at once — a TP-sharded instance
    whose GPUs each send their own shard over their own NVLink (DistServe §4.2 puts the prefill
    and decode segments of one stage on one node for exactly this).
    """
    if num_tokens <= 0:
        return 0.0
    nbytes = num_tokens * model.kv_bytes_per_token(dtype)
    return nbytes / (link.bytes_per_s * max(streams, 1)) + link.latency_s


# ------------------------------------------------------------------------- fitted profile
def _chunk_sq(start: int, n: int) -> int:
    """Quadratic feature of a chunk: ``(start + n)² − start²`` = ``n² + 2·n·start``.

    A whole prompt of ``l`` tokens gives ``l²`` (DistServe's Σl²); chunks of one prompt add up
    to the same ``l²``, so chunking neither creates nor loses attention work.
    """
    return n * n + 2 * n * start


@dataclass(frozen=True)
class FittedProfile(LatencyModel):
    """DistServe's fitted step-time form, in **seconds** (their JSON is in milliseconds).

    * prefill-only step: ``a_p + b_p·Σn + c_p·Σ(n² + 2·n·start)`` over the chunks; for whole
      prompts (``start = 0``) this is exactly DistServe's ``a + b·Σl + c·Σl²``.
    * decode-only step with ``B`` sequences: ``a_d + b_d·Σctx + c_d·B`` where ``(a_d, b_d, c_d)``
      is ``decode_small`` if ``B < decode_threshold`` else ``decode_large``.
    * **mixed step** (chunked prefill + decodes): the prefill formula plus the decode *marginal*
      terms ``b_d·Σctx + c_d·B`` — no second constant. Why: the constants ``a_p``/``a_d`` are
      what one iteration pays regardless of its contents (reading every weight once, kernel
      launches, Python); a mixed iteration reads the weights once, so it pays one constant.
      Each decode still adds its KV read (``b_d·ctx``, the attention of a memory-bound decode)
      and its per-sequence cost (``c_d``). A chunk's attention to its earlier context
      (``start > 0``) enters through the quadratic feature ``2·n·start``. DistServe's simulator
      (``simdistserve``) prices a mixed step as the prefill chunks alone; this rule is ≥ that.
      Caveat: a fitted ``c_p`` also carries non-attention curvature, so a short chunk behind a
      long cached prefix is overestimated (docs/fidelity.md: up to 40 % vs the roofline).

    A profile measured on a pipeline (``pdserve profile --pp N``: ``pp`` > 1) is the fit of
    one micro-batch's pass through all stages; ``stage`` is the fit of the pipeline's stage
    time (seconds per micro-batch when ``pp`` are in flight). :class:`PipelineModel` splits the
    two, shape by shape, into its stage compute and hand-off (:func:`pipeline_send`).
    """

    prefill: Coeffs
    decode_small: Coeffs
    decode_large: Coeffs
    decode_threshold: int = DISTSERVE_DECODE_THRESHOLD
    model: str = ""
    hardware: str = ""
    tp: int = 1
    dtype: str = "float16"
    source: str = ""
    fit_error: dict[str, Any] = field(default_factory=dict, compare=False)
    pp: int = 1
    stage: FittedProfile | None = None

    def __post_init__(self) -> None:
        if self.pp < 1 or (self.pp > 1) != (self.stage is not None):
            raise ValueError(f"a pipeline profile (pp={self.pp}) needs its stage fit, and only "
                             "it has one")
        for name in ("prefill", "decode_small", "decode_large"):
            c = tuple(float(x) for x in getattr(self, name))
            if len(c) != 3:
                raise ValueError(f"{name} needs 3 coefficients (a, b, c), got {len(c)}")
            object.__setattr__(self, name, c)
        if self.decode_threshold < 1:
            raise ValueError(f"decode_threshold must be >= 1, got {self.decode_threshold}")

    def decode_coeffs(self, batch_size: int) -> Coeffs:
        return self.decode_small if batch_size < self.decode_threshold else self.decode_large

    def step_time(self, prefill_chunks: Chunks, decode_context_lens: Sequence[int]) -> float:
        t = 0.0
        if prefill_chunks:
            a, b, c = self.prefill
            t = (a + b * sum(n for _, n in prefill_chunks)
                 + c * sum(_chunk_sq(s, n) for s, n in prefill_chunks))
        if decode_context_lens:
            bs = len(decode_context_lens)
            a, b, c = self.decode_coeffs(bs)
            t += b * sum(decode_context_lens) + c * bs + (0.0 if prefill_chunks else a)
        return t

    def decode_sum_time(self, batch_size: int, total_context: int) -> float | None:
        if type(self).step_time is not FittedProfile.step_time:  # a subclass prices its own way
            return None
        a, b, c = self.decode_coeffs(batch_size)
        return 0.0 + (b * total_context + c * batch_size + a)  # step_time's operations

    # ---- DistServe's JSON (milliseconds, keyed model → tp) ----
    @classmethod
    def from_distserve_json(cls, path: str | os.PathLike[str], model: str | ModelConfig,
                            tp: int, hardware: str = "A100-80GB") -> FittedProfile:
        """Load one ``(model, tp)`` entry of a ``simdistserve`` profile file, unchanged but for
        ms → s. ``model`` is a key (``facebook/opt-13b``), a catalogue name or a ModelConfig."""
        data = _read_json(path)
        key = match_model_key(data, model)
        entry = data[key].get(str(tp))
        if entry is None:
            raise ValueError(f"{os.fspath(path)!r} has no tp={tp} for {key!r}; "
                             f"available: {sorted(data[key], key=int)}")
        return cls(
            prefill=_coeffs(entry["prefill"], 1e-3),
            decode_small=_coeffs(entry["decoding_smallbs"], 1e-3),
            decode_large=_coeffs(entry["decoding_largebs"], 1e-3),
            decode_threshold=int(entry.get("decoding_large_small_bs_threshold",
                                           DISTSERVE_DECODE_THRESHOLD)),
            model=key, hardware=hardware, tp=tp, dtype="float16",
            source=f"distserve:{os.path.basename(os.fspath(path))}",
        )

    # ---- our own format (seconds; written by the profiler) ----
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("prefill", "decode_small", "decode_large"):
            d[k] = list(d[k])
        if self.pp == 1:  # a file without a pipeline reads as before
            del d["pp"], d["stage"]
        else:
            d["stage"] = self.stage.to_dict() if self.stage is not None else None
        return {"format": PROFILE_FORMAT, "version": 1, "units": "s", **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FittedProfile:
        if d.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a {PROFILE_FORMAT} document (format={d.get('format')!r})")
        scale = {"s": 1.0, "ms": 1e-3}[d.get("units", "s")]
        kw = {k: d[k] for k in ("decode_threshold", "model", "hardware", "tp", "dtype", "source",
                                "fit_error", "pp") if k in d}
        if d.get("stage") is not None:
            kw["stage"] = cls.from_dict(d["stage"])
        return cls(prefill=_coeffs(d["prefill"], scale),
                   decode_small=_coeffs(d["decode_small"], scale),
                   decode_large=_coeffs(d["decode_large"], scale), **kw)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: str | ModelConfig | None = None,
             tp: int | None = None, pp: int = 1) -> FittedProfile:
        """Our format — one profile, or one per layout (``by_tp``, ``pdserve profile --tp
        1,2 [--pp 1,2]``: the entry of ``tp`` and ``pp``, else of ``tp`` measured without a
        pipeline) — or (given ``model`` and ``tp``) a DistServe profile."""
        d = _read_json(path)
        if d.get("format") == PROFILE_FORMAT and "by_tp" in d:
            entries = d["by_tp"]
            key = next((k for k in (layout_key(tp or 1, pp), str(tp)) if k in entries), None)
            if tp is None or key is None:
                have = sorted(entries, key=_layout_order)
                tps = sorted({int(_layout_order(k)[0]) for k in have} | {tp or 1})
                raise ValueError(f"{os.fspath(path)!r} has no tp={tp} profile; measured at "
                                 f"tp={', '.join(have)} (`pdserve profile --tp "
                                 f"{','.join(map(str, tps))}` measures them all into one file)")
            return cls.from_dict(entries[key])
        if d.get("format") == PROFILE_FORMAT:
            return cls.from_dict(d)
        if model is None or tp is None:
            raise ValueError(f"{os.fspath(path)!r} looks like a DistServe profile: pass model "
                             "and tp to pick an entry")
        return cls.from_distserve_json(path, model, tp)


def pipeline_send(pass_s: float, stage_s: float, pp: int) -> float:
    """The hand-off ``send`` between stages that, with every stage computing ``stage_s`` (the
    pipeline's measured seconds per micro-batch when ``pp`` are in flight), makes one
    micro-batch's pass through all stages take the measured ``pass_s``: ``pp·stage + (pp −
    1)·send = pass``. It is negative where the stages are not equal — the driver's stage also
    plans and samples, so it sets the throughput and the later stages wait less — and bounded
    below so that a pass takes at least one stage time."""
    if pp <= 1:
        return 0.0
    return max(-stage_s, (pass_s - pp * stage_s) / (pp - 1))


def layout_key(tp: int, pp: int = 1) -> str:
    """A profile file's key for an instance layout: ``"2"`` (tp=2), ``"2x2"`` (tp=2, pp=2)."""
    return str(tp) if pp == 1 else f"{tp}x{pp}"


def _layout_order(key: str) -> tuple[int, int]:
    tp, _, pp = key.partition("x")
    return int(tp), int(pp or 1)


def _read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A profile file's JSON object; ``ValueError`` naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{os.fspath(path)!r} is not a JSON profile ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{os.fspath(path)!r} is not a profile: a JSON object was expected")
    return d


def _coeffs(xs: Sequence[float], scale: float) -> Coeffs:
    if len(xs) != 3:
        raise ValueError(f"expected 3 coefficients (a, b, c), got {list(xs)}")
    return (xs[0] * scale, xs[1] * scale, xs[2] * scale)


def _norm_model_key(name: str) -> str:
    return name.strip().lower().rsplit("/", 1)[-1]


def match_model_key(data: dict[str, Any], model: str | ModelConfig) -> str:
    names = [model] if isinstance(model, str) else [
        model.name, str(model.hf_config.get("_name_or_path", ""))]
    wanted = {_norm_model_key(n) for n in names if n}
    for key in data:
        if _norm_model_key(key) in wanted:
            return key
    raise ValueError(f"model {sorted(wanted)} not in profile; available: {sorted(data)}")


# ------------------------------------------------------------------------------- fitting
@dataclass(frozen=True)
class ProfileSample:
    """One measured (or predicted) step: the ``step_time`` inputs and the seconds it took."""

    prefill_chunks: tuple[tuple[int, int], ...] = ()
    decode_context_lens: tuple[int, ...] = ()
    seconds: float = 0.0

    @classmethod
    def prefill(cls, prompt_lens: Sequence[int], seconds: float) -> ProfileSample:
        return cls(tuple((0, int(n)) for n in prompt_lens), (), float(seconds))

    @classmethod
    def decode(cls, context_lens: Sequence[int], seconds: float) -> ProfileSample:
        return cls((), tuple(int(c) for c in context_lens), float(seconds))

    @property
    def kind(self) -> str:
        if self.prefill_chunks and self.decode_context_lens:
            return "mixed"
        return "prefill" if self.prefill_chunks else "decode"


def fit_relative(features: np.ndarray, seconds: np.ndarray,
                 nonneg: bool = True) -> tuple[np.ndarray, dict[str, float]]:
    """Least squares on **relative** error: minimise ``Σ ((X·β − y) / y)²``.

    Each row is divided by its target (weighted least squares with weights ``1/y²``), so a 20 ms
    step and a 2 s step count alike — what SLO attainment cares about. ``nonneg`` solves it with
    ``scipy.optimize.nnls`` (coefficients ≥ 0, so the model stays monotone when extrapolated).
    Returns ``β`` and ``{"max_rel", "mean_rel", "n"}`` on the fitted samples.
    """
    x = np.asarray(features, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if x.ndim != 2 or len(x) != len(y) or not len(y):
        raise ValueError("need a non-empty (n, k) feature matrix and n targets")
    if np.any(y <= 0):
        raise ValueError("measured times must be > 0")
    xs, ones = x / y[:, None], np.ones_like(y)
    col = np.abs(xs).max(axis=0)
    col[col == 0] = 1.0  # column scaling for conditioning (features span 1 … 1e7)
    if nonneg:
        from scipy.optimize import nnls

        beta = nnls(xs / col, ones)[0] / col
    else:
        beta = np.linalg.lstsq(xs / col, ones, rcond=None)[0] / col
    rel = np.abs(x @ beta - y) / y
    return beta, {"max_rel": float(rel.max()), "mean_rel": float(rel.mean()), "n": int(len(y))}


def _prefill_features(s: ProfileSample) -> list[float]:
    return [1.0, float(sum(n for _, n in s.prefill_chunks)),
            float(sum(_chunk_sq(st, n) for st, n in s.prefill_chunks))]


def _decode_features(s: ProfileSample) -> list[float]:
    return [1.0, float(sum(s.decode_context_lens)), float(len(s.decode_context_lens))]


def fit_profile(samples: Sequence[ProfileSample],
                decode_threshold: int = DISTSERVE_DECODE_THRESHOLD, nonneg: bool = True,
                min_samples: int = 3, **meta: Any) -> FittedProfile:
    """Fit DistServe's prefill and decode forms to samples (relative least squares).

    Prefill-only samples fit ``(a_p, b_p, c_p)``; decode-only samples with batch size below /
    at least ``decode_threshold`` fit ``decode_small`` / ``decode_large``. A decode side with
    fewer than ``min_samples`` samples takes the fit over all decode samples. Mixed samples are
    not fitted; their relative error under the mixed-step rule is reported as ``mixed``.
    ``meta`` (model, hardware, tp, dtype, source) is stored on the profile; ``fit_error`` holds
    ``{"max_rel", "mean_rel", "n"}`` per part.
    """
    pre = [s for s in samples if s.kind == "prefill"]
    dec = [s for s in samples if s.kind == "decode"]
    if len(pre) < min_samples or len(dec) < min_samples:
        raise ValueError(f"need >= {min_samples} prefill and decode samples, got {len(pre)} "
                         f"and {len(dec)}")
    errors: dict[str, Any] = {}

    def fit(part: str, ss: list[ProfileSample], feat: Any) -> Coeffs:
        beta, err = fit_relative(np.array([feat(s) for s in ss]),
                                 np.array([s.seconds for s in ss]), nonneg)
        errors[part] = err
        return (float(beta[0]), float(beta[1]), float(beta[2]))

    prefill = fit("prefill", pre, _prefill_features)
    small = [s for s in dec if len(s.decode_context_lens) < decode_threshold]
    large = [s for s in dec if len(s.decode_context_lens) >= decode_threshold]
    if len(small) >= min_samples and len(large) >= min_samples:
        d_small = fit("decode_small", small, _decode_features)
        d_large = fit("decode_large", large, _decode_features)
    else:
        d_small = d_large = fit("decode", dec, _decode_features)
    prof = FittedProfile(prefill, d_small, d_large, decode_threshold, **meta)
    mixed = [s for s in samples if s.kind == "mixed"]
    if mixed:
        rel = [abs(prof.step_time(s.prefill_chunks, s.decode_context_lens) - s.seconds)
               / s.seconds for s in mixed]
        errors["mixed"] = {"max_rel": max(rel), "mean_rel": sum(rel) / len(rel),
                           "n": len(rel)}
    return replace(prof, fit_error=errors)


def profile_grid(prefill_lens: Sequence[int] = (16, 64, 128, 256, 512, 1024, 2048),
                 prefill_batches: Sequence[int] = (1, 2, 4, 8),
                 decode_batches: Sequence[int] = (1, 4, 16, 32, 64, 94, 95, 128, 192, 256),
                 decode_ctx: Sequence[int] = (64, 256, 512, 1024, 2048),
                 max_prefill_tokens: int = 8192) -> list[ProfileSample]:
    """Shapes (``seconds`` = 0) that the profiler measures and the analytic model predicts."""
    out = [ProfileSample.prefill([n] * b, 0.0) for n in prefill_lens for b in prefill_batches
           if n * b <= max_prefill_tokens]
    out += [ProfileSample.decode([c] * b, 0.0) for b in decode_batches for c in decode_ctx]
    return out


def profile_model(latency: LatencyModel, grid: Sequence[ProfileSample] | None = None,
                  decode_threshold: int = DISTSERVE_DECODE_THRESHOLD,
                  **meta: Any) -> FittedProfile:
    """Fit a :class:`FittedProfile` to ``latency``'s own predictions on ``grid`` — so an
    analytic model can be used anywhere a profile is expected (and saved like a measured one)."""
    shapes = profile_grid() if grid is None else grid
    samples = [ProfileSample(s.prefill_chunks, s.decode_context_lens,
                             latency.step_time(s.prefill_chunks, s.decode_context_lens))
               for s in shapes]
    return fit_profile(samples, decode_threshold, **meta)


# ------------------------------------------------------------------- driver overhead
@dataclass(frozen=True)
class DriverOverhead(LatencyModel):
    """A step as the serving driver sees it: the executor's time plus the serving path's cost
    that an executor-only profile leaves out — ``overhead_s`` per step (the runtime's call into
    the instance, e.g. a Ray actor round trip, and scheduling) and ``per_seq_s`` per sequence
    in the step (detokenizing and reporting its token). DistServe's fitted intercepts fold this
    cost into their measurements of the whole engine; pdserve's profiler times the executor
    alone, and ``benchmarks/fidelity.py`` measures both constants from requests outside the
    workload against a live server. Empty steps stay free."""

    base: LatencyModel
    overhead_s: float = 0.0
    per_seq_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.overhead_s >= 0 and self.per_seq_s >= 0):
            raise ValueError(f"step overheads must be >= 0 s, got {self.overhead_s} per step "
                             f"and {self.per_seq_s} per sequence")

    def step_time(self, prefill_chunks: Chunks, decode_context_lens: Sequence[int]) -> float:
        t = self.base.step_time(prefill_chunks, decode_context_lens)
        if t <= 0.0:
            return 0.0
        return t + self.overhead_s + self.per_seq_s * (len(prefill_chunks)
                                                       + len(decode_context_lens))

    def decode_sum_time(self, batch_size: int, total_context: int) -> float | None:
        if type(self).step_time is not DriverOverhead.step_time:
            return None
        t = self.base.decode_sum_time(batch_size, total_context)
        if t is None:
            return None
        if t <= 0.0:
            return 0.0
        return t + self.overhead_s + self.per_seq_s * (0 + batch_size)


# ------------------------------------------------------------------- pipeline parallelism
@dataclass(frozen=True)
class PipelineModel(LatencyModel):
    """Pipeline (inter-op) parallelism of degree ``pp`` over a whole-model ``base`` model.

    Layers split evenly, so one stage computes ``base / pp`` of a step, then sends the batch's
    activations (``tokens × hidden × dtype`` bytes) to the next stage over ``link``
    (DistServe §3.1: ``D ≈ D_s ≈ pp·D_m``, inter-layer activation traffic being small):

    * :meth:`stage_time` = ``base/pp + send`` — how often the pipeline can take a new batch
      (its throughput; the service time ``D_m`` of DistServe's Eq. 2 M/D/1 queue);
    * :meth:`step_time` = ``base + (pp − 1)·send`` — one pass through all stages, what a
      request's token waits for (its latency; ``D_s`` of Eq. 2).

    Batches of unequal size leave bubbles (DistServe §3.3 "variable prefill length"):
    :func:`pipeline_finish_times` gives when each of a sequence of batches leaves the pipeline.
    DistServe's ``simdistserve`` uses the same per-stage ``time / pp`` (with no send term).

    A ``base`` measured on a pipeline of this ``pp`` (``pdserve profile --pp``,
    :attr:`measured`) replaces ``base / pp`` and the link by its measured stage time and pass:
    :meth:`split` gives each stage's compute and the hand-off (:func:`pipeline_send`) that
    reproduce both; the simulator's stages are free again after their compute, so the stage
    time is the pipeline's throughput.
    """

    base: LatencyModel
    pp: int = 1
    model: ModelConfig | None = None
    link: LinkSpec | None = None
    dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ValueError(f"pp must be >= 1, got {self.pp}")

    def send_time(self, num_tokens: int) -> float:
        if self.pp == 1 or self.link is None or self.model is None or num_tokens == 0:
            return 0.0
        return self.link.min_time(num_tokens * self.model.hidden_size * DTYPE_BYTES[self.dtype])

    @property
    def measured(self) -> FittedProfile | None:
        """The base when it was measured on a pipeline of this ``pp`` (``pdserve profile
        --pp``): its pass and stage fits price the stages, not ``base / pp`` and the link."""
        b = self.base
        if isinstance(b, FittedProfile) and b.pp == self.pp and b.stage is not None:
            return b
        return None

    def split(self, prefill_chunks: Chunks, decode_context_lens: Sequence[int],
              ) -> tuple[float, float]:
        """``(stage, send)``: what each stage computes of this step, and each hand-off."""
        m = self.measured
        return self._split(self.base.step_time(prefill_chunks, decode_context_lens),
                           None if m is None or m.stage is None
                           else m.stage.step_time(prefill_chunks, decode_context_lens),
                           sum(n for _, n in prefill_chunks) + len(decode_context_lens))

    def split_decode_sum(self, batch_size: int, total_context: int
                         ) -> tuple[float, float] | None:
        """:meth:`split` of a decode-only step from its batch size and summed context
        (``None`` where the base needs every context)."""
        t = self.base.decode_sum_time(batch_size, total_context)
        m = self.measured
        stage = None if m is None or m.stage is None else m.stage.decode_sum_time(
            batch_size, total_context)
        if t is None or (m is not None and stage is None):
            return None
        return self._split(t, stage, batch_size)

    def _split(self, t: float, stage: float | None, tokens: int) -> tuple[float, float]:
        """A step of ``t`` seconds unpipelined (the measured pass, when ``stage`` is the
        measured stage time) as ``(stage, send)``."""
        if t <= 0.0:
            return 0.0, 0.0
        if stage is not None:
            return stage, pipeline_send(t, stage, self.pp)
        return t / self.pp, self.send_time(tokens)

    def stage_time(self, prefill_chunks: Chunks, decode_context_lens: Sequence[int]) -> float:
        stage, send = self.split(prefill_chunks, decode_context_lens)
        return stage + max(0.0, send) if stage > 0.0 else 0.0

    def step_time(self, prefill_chunks: Chunks, decode_context_lens: Sequence[int]) -> float:
        stage, send = self.split(prefill_chunks, decode_context_lens)
        return self.pp * stage + (self.pp - 1) * send if stage > 0.0 else 0.0


def pipeline_finish_times(stage_times: Sequence[float], pp: int) -> list[float]:
    """Exit times of batches entering a ``pp``-stage pipeline back to back at time 0, batch
    ``i`` taking ``stage_times[i]`` on every stage: ``f[i][s] = max(f[i−1][s], f[i][s−1]) + t_i``.

    Equal times give ``(i + pp)·t``; a long batch behind short ones stalls them (bubbles):
    ``finish[-1] − sum(stage_times) − (pp − 1)·stage_times[0]`` is the last stage's idle time
    beyond the unavoidable pipeline fill.
    """
    prev = [0.0] * pp
    out = []
    for t in stage_times:
        cur, ready = [0.0] * pp, 0.0
        for s in range(pp):
            ready = max(prev[s], ready) + t
            cur[s] = ready
        prev = cur
        out.append(cur[-1])
    return out

