"""Step-time measurements to calibrate the analytic model on, and where they come from
(torch-free).

A :class:`Measurement` is one measured time and what produced it. Loaders:

* raw step samples — ``pdserve-step-samples`` JSON (:func:`load_samples` /
  :func:`save_samples`), what ``pdserve calibrate --measure MODEL_DIR`` records with the
  profiler;
* fitted profiles — ours (``pdserve profile``) or DistServe's published A100 JSON, evaluated on
  the shapes they were fitted over (:func:`from_profile`, :func:`from_distserve_json`);
* SplitwiseSim's measured ``perf_model.csv`` (:func:`from_splitwise`);
* Vidur's per-operator H100 profiles (:func:`from_vidur_mlp`, :func:`from_vidur_allreduce`);
* a serving log of per-step times and batch shapes (:func:`from_step_log`);
* per-request timelines seen by a client of any OpenAI-compatible server with one instance
  (``pdserve bench --save-records`` JSON): steps reconstructed from arrivals and token times
  (:func:`from_request_timelines`).

The serving path around the steps (per-step, per-request and hand-off costs) is estimated from
the same files in :mod:`pdserve.sim.serving_path`.
"""

from __future__ import annotations

import bisect
import csv
import gzip
import json
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pdserve.config import ModelConfig, read_text
from pdserve.sim.latency import FittedProfile, ProfileSample
from pdserve.sim.model_catalogue import canonical_model_name, get_model_config

SAMPLES_FORMAT = "pdserve-step-samples"


@dataclass(frozen=True)
class Measurement:
    """One measured time and what produced it.

    A whole engine step (``sample``: its prefill chunks, decode contexts and seconds) of
    ``model`` at ``tp`` (``ep``) in ``dtype`` — or, with ``components``, only those parts of
    :meth:`AnalyticModel.breakdown` (an operator-level profile such as Vidur's linear layers) —
    or, with ``allreduce_bytes`` > 0, one all-reduce of that many bytes over ``tp`` GPUs.
    ``group`` labels where it came from (held-out splits and reports group by it).
    """

    sample: ProfileSample
    model: ModelConfig
    tp: int = 1
    ep: int = 1
    dtype: str = "float16"
    components: tuple[str, ...] = ()
    allreduce_bytes: float = 0.0
    group: str = ""

    @property
    def seconds(self) -> float:
        return self.sample.seconds


def model_config(spec: str | ModelConfig) -> ModelConfig:
    """A catalogue name or a checkpoint directory as a :class:`ModelConfig`."""
    if isinstance(spec, ModelConfig):
        return spec

    return get_model_config(spec)


def load_samples(path: str | os.PathLike[str], model: str | ModelConfig | None = None
                 ) -> list[Measurement]:
    """A ``pdserve-step-samples`` JSON file (``model``: catalogue name or directory, unless
    the file names one)."""
    p = os.fspath(path)
    try:
        with open(p) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read samples file {p!r}: {e}") from None
    if not isinstance(d, dict) or d.get("format") != SAMPLES_FORMAT:
        raise ValueError(f"{p!r} is not a {SAMPLES_FORMAT} file")
    spec = model or d.get("model_dir") or d.get("model")
    if not spec:
        raise ValueError(f"{p!r} names no model: pass one")
    cfg = model_config(spec)
    out = []
    for i, s in enumerate(d.get("samples") or []):
        try:
            sample = ProfileSample(tuple((int(a), int(b)) for a, b in s["prefill_chunks"]),
                                   tuple(int(c) for c in s["decode_context_lens"]),
                                   float(s["seconds"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{p!r}: samples[{i}] is malformed ({e!r})") from None
        out.append(Measurement(sample, cfg, int(d.get("tp", 1)), 1, d.get("dtype", "float16"),
                               group=d.get("group", os.path.basename(p))))
    if not out:
        raise ValueError(f"{p!r} has no samples")
    return out


def save_samples(path: str | os.PathLike[str], samples: Sequence[ProfileSample],
                 **meta: Any) -> None:
    """Write raw samples as ``pdserve-step-samples`` JSON (``meta``: model, model_dir,
    hardware, dtype, tp, source)."""
    doc = {"format": SAMPLES_FORMAT, "version": 1, **meta,
           "samples": [{"prefill_chunks": [list(c) for c in s.prefill_chunks],
                        "decode_context_lens": list(s.decode_context_lens),
                        "seconds": s.seconds} for s in samples]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def profile_shapes(max_prefill_tokens: int = 4096, max_decode_batch: int = 128,
                   max_ctx: int = 2048) -> list[ProfileSample]:
    """Shapes a fitted profile is evaluated on to become measurements: DistServe's profiler
    range (prefill batches of 1–8 prompts of 16–2048 tokens; decode batches of 1–max at
    context 64–2048)."""
    out = [ProfileSample.prefill([n] * b, 0.0) for n in (16, 64, 128, 256, 512, 1024, 2048)
           for b in (1, 2, 4, 8) if n * b <= max_prefill_tokens]
    out += [ProfileSample.decode([c] * b, 0.0) for b in (1, 4, 16, 32, 64, 96, 128)
            for c in (64, 256, 512, 1024, 2048) if b <= max_decode_batch and c <= max_ctx]
    return out


def from_profile(profile: FittedProfile, model: str | ModelConfig,
                 shapes: Sequence[ProfileSample] | None = None, group: str = ""
                 ) -> list[Measurement]:
    """Measurements from a fitted profile's predictions on ``shapes`` (default
    :func:`profile_shapes`) — when only coefficients were published (DistServe)."""
    cfg = model_config(model)
    out = []
    for s in shapes or profile_shapes():
        t = profile.step_time(s.prefill_chunks, s.decode_context_lens)
        out.append(Measurement(replace(s, seconds=t), cfg, profile.tp, 1, profile.dtype,
                               group=group or f"{cfg.name} tp{profile.tp}"))
    return out


def from_distserve_json(path: str | os.PathLike[str],
                        models: Sequence[str] | None = None) -> list[Measurement]:
    """Every (model, TP) entry of a ``simdistserve`` profile file whose model the catalogue
    knows (or only ``models``), evaluated on :func:`profile_shapes`."""

    with open(path) as f:
        data = json.load(f)
    out = []
    for key, entries in data.items():
        canon = canonical_model_name(key)
        if canon is None or (models and canon not in models):
            continue
        for tp in sorted(entries, key=int):
            prof = FittedProfile.from_distserve_json(path, key, int(tp))
            out += from_profile(prof, canon, group=f"{canon} tp{tp}")
    if not out:
        raise ValueError(f"{os.fspath(path)!r}: no entry for a known model {models or ''}")
    return out


SPLITWISE_MODELS = {"llama2-70b": "llama-2-70b"}


def from_splitwise(path: str | os.PathLike[str], hardware: str) -> list[Measurement]:
    """SplitwiseSim's ``perf_model.csv`` rows for ``hardware`` (``a100-80gb``, ``h100-80gb``,
    ``h100-80gb-pcap``), median over repeats per shape:

    * ``prompt_time`` → a prefill step of ``batch_size`` prompts of ``prompt_size`` tokens;
    * ``token_time`` (mean time per generated token) → a decode step of ``batch_size``
      sequences at the mean context ``prompt_size + token_size / 2`` (exact for a model linear
      in the context, as decode attention is).

    Some rows are faster than any GPU could be (``64 × 512`` prompts in 0.36 s on two H100s);
    :func:`drop_unphysical` removes them."""
    rows: dict[tuple[str, int, int, int, int], list[tuple[float, float]]] = defaultdict(list)
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["hardware"] != hardware or r["model"] not in SPLITWISE_MODELS:
                continue
            key = (r["model"], int(r["tensor_parallel"]), int(r["prompt_size"]),
                   int(r["batch_size"]), int(r["token_size"]))
            rows[key].append((float(r["prompt_time"]), float(r["token_time"])))
    if not rows:
        raise ValueError(f"{os.fspath(path)!r}: no rows for hardware {hardware!r} "
                         f"(models {sorted(SPLITWISE_MODELS)})")
    out = []
    for (mname, tp, prompt, batch, tokens), vals in sorted(rows.items()):
        cfg = model_config(SPLITWISE_MODELS[mname])
        pt = float(np.median([v[0] for v in vals])) * 1e-3
        tt = float(np.median([v[1] for v in vals])) * 1e-3
        grp = f"{mname} tp{tp}"
        out.append(Measurement(ProfileSample.prefill([prompt] * batch, pt), cfg, tp,
                               group=grp))
        ctx = prompt + tokens // 2
        out.append(Measurement(ProfileSample.decode([ctx] * batch, tt), cfg, tp, group=grp))
    return out


VIDUR_LINEAR_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
                    "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def from_vidur_mlp(path: str | os.PathLike[str], model: str | ModelConfig = "llama-2-7b"
                   ) -> list[Measurement]:
    """Vidur's per-operator profile (``<model>_mlp.csv.gz``): per ``(num_tokens, TP)`` the
    median times of one layer's token-level operators (QKV, RoPE, output projection, MLP, norms,
    residual add; attention itself is not in the file) × layers + the embedding, compared with
    the roofline's ``linear`` component of a ``num_tokens``-token step. Duplicate rows
    (repeated profiling runs) are averaged."""
    cfg = model_config(model)
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    acc: dict[tuple[int, int], list[float]] = defaultdict(list)
    with opener(path, "rt") as f:
        for r in csv.DictReader(f):
            per_layer = sum(float(r[f"time_stats.{op}.median"]) for op in VIDUR_LINEAR_OPS)
            total = per_layer * cfg.num_layers + float(r["time_stats.emb.median"])
            acc[(int(r["num_tokens"]), int(r["num_tensor_parallel_workers"]))].append(total)
    out = []
    for (tokens, tp), ts in sorted(acc.items()):
        s = ProfileSample.prefill([tokens], float(np.mean(ts)) * 1e-3)
        out.append(Measurement(s, cfg, tp, components=("linear", "launch"),
                               group=f"linear tp{tp}"))
    return out


def from_vidur_allreduce(path: str | os.PathLike[str], model: str | ModelConfig = "llama-2-7b",
                         min_bytes: float = 0.0) -> list[Measurement]:
    """Vidur's all-reduce profile: median seconds per ``(num_workers, size)`` — ``size`` in
    FP16 elements (Vidur's ``GraphedCollective`` buffer), so bytes = 2 · size."""
    cfg = model_config(model)
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    out = []
    with opener(path, "rt") as f:
        for r in csv.DictReader(f):
            nbytes = 2.0 * int(r["size"])
            if nbytes < min_bytes:
                continue
            tp = int(r["num_workers"])
            s = ProfileSample((), (), float(r["time_stats.all_reduce.median"]) * 1e-3)
            out.append(Measurement(s, cfg, tp, allreduce_bytes=nbytes,
                                   group=f"allreduce tp{tp}"))
    return out


def from_step_log(path: str | os.PathLike[str], model: str | ModelConfig, tp: int = 1,
                  dtype: str = "float16",
                  window: tuple[float, float] | None = None) -> list[Measurement]:
    """A serving log: JSON lines, one per engine step, each ``{"elapsed": seconds,
    "prefill_chunks": [[start, n], ...], "decode_context_lens": [...]}`` (optionally
    ``"instance_id"`` and ``"now"``, the step's start in seconds since the epoch) — a live
    instance's ``StepReport.elapsed`` with its batch's ``ScheduledBatch.shape()``. Empty steps
    are skipped; every measurement is grouped by instance. ``window=(t0, t1)`` keeps only the
    steps that started within it (one serving run of a longer log)."""
    cfg = model_config(model)
    p = os.fspath(path)
    lines = read_text(p, "step log").splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            sample = ProfileSample(tuple((int(a), int(b)) for a, b in r["prefill_chunks"]),
                                   tuple(int(c) for c in r["decode_context_lens"]),
                                   float(r["elapsed"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{p!r} line {i}: not a step record ({e!r})") from None
        if window is not None and not window[0] <= float(r.get("now", window[0] - 1)) <= window[1]:
            continue
        if sample.seconds > 0 and (sample.prefill_chunks or sample.decode_context_lens):
            out.append(Measurement(sample, cfg, tp, 1, dtype,
                                   group=str(r.get("instance_id", "log"))))
    if not out:
        raise ValueError(f"{p!r} has no non-empty steps" + (f" in {window}" if window else ""))
    return out


def _records_lists(data: Any) -> list[list[dict[str, Any]]]:
    """Every ``records`` list in a bench JSON (one run's, or a search's runs), each on its
    own clock."""
    found: list[list[dict[str, Any]]] = []
    if isinstance(data, dict):
        recs = data.get("records")
        if isinstance(recs, list):
            found.append(recs)
        for k, v in data.items():
            if k != "records":
                found += _records_lists(v)
    elif isinstance(data, list):
        for v in data:
            found += _records_lists(v)
    return found


def records_of(path: str | os.PathLike[str]) -> list[list[dict[str, Any]]]:
    """The ``records`` lists of a ``pdserve bench`` JSON file (:func:`_records_lists`)."""
    p = os.fspath(path)
    try:
        return _records_lists(json.loads(read_text(p, "request timelines")))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p!r} is not JSON ({e})") from None


def from_request_timelines(path: str | os.PathLike[str], model: str | ModelConfig, tp: int = 1,
                           dtype: str = "float16") -> list[Measurement]:
    """Engine steps reconstructed from what a client saw of a server with **one** instance
    (``pdserve bench --save-records`` JSON against pdserve, vLLM or any OpenAI server): each
    request's arrival, prompt length and the time of each streamed token.

    * **Prefill**: a request that arrived while no other request was in flight and got its first
      token before the next one arrived — its TTFT is the prefill of its whole prompt (plus the
      serving path's fixed cost, which the fit's per-step overhead takes up).
    * **Decode**: a gap between two consecutive tokens of a request while no request was waiting
      for its first token (so no prefill shared that step) is one decode step of every request
      streaming across the gap, each at context prompt + tokens received so far. One sample per
      step: the gap is counted once, by the earliest-arrived request of the batch.

    Approximate by construction: client-side times include the HTTP path, a server that sends
    several tokens in one event, or a client that reads two at once, merges steps (a gap under
    :data:`BUNCHED` of the request's median is skipped with the gap before it), and with several
    instances behind one endpoint the batches cannot be told apart (use ``--step-log`` there).
    """
    cfg = model_config(model)
    p = os.fspath(path)
    runs = records_of(p)
    if not runs:
        raise ValueError(f"{p!r} has no per-request records (run `pdserve bench` with "
                         "--save-records)")
    out: list[Measurement] = []
    for k, recs in enumerate(runs):
        reqs = []
        for r in recs:
            tl = r.get("timeline") or {}
            times, arrival = tl.get("token_times") or [], tl.get("arrival")
            if r.get("ok", True) and times and arrival is not None:
                reqs.append((float(arrival), [float(t) for t in times], int(r["prompt_len"])))
        reqs.sort(key=lambda q: q[0])
        group = f"timelines run {k}" if len(runs) > 1 else "timelines"
        out += _steps_from_timelines(reqs, cfg, tp, dtype, group)
    if not out:
        raise ValueError(f"{p!r}: no request ran alone and no decode gap was free of prefills; "
                         "record a run at a lower rate")
    return out


BUNCHED = 0.25  # a token gap under this share of its request's median gap: delivered together


def _steps_from_timelines(reqs: list[tuple[float, list[float], int]], cfg: ModelConfig, tp: int,
                          dtype: str, group: str) -> list[Measurement]:
    """:func:`from_request_timelines` for one run: ``(arrival, token times, prompt length)``
    sorted by arrival."""
    out: list[Measurement] = []
    for i, (a, ts, plen) in enumerate(reqs):
        # the requests in flight at some moment of i's life, in arrival order: only they can
        # share a step with i (O(n) once per request, not per token gap)
        near = [j for j, (a2, ts2, _) in enumerate(reqs)
                if j != i and a2 < ts[-1] and ts2[-1] > a]
        members = sorted((*near, i))  # the candidates of a step's batch, i included
        # prefill alone: nothing else in flight over [a, first token]
        if all(reqs[j][1][-1] <= a or reqs[j][0] >= ts[0] for j in near):
            out.append(Measurement(ProfileSample(((0, plen),), (), ts[0] - a), cfg, tp, 1,
                                   dtype, group=group))
        gaps = np.diff(ts)
        typical = float(np.median(gaps[gaps > 0])) if np.any(gaps > 0) else 0.0
        for n in range(1, len(ts)):
            t0, t1 = ts[n - 1], ts[n]
            if t1 - t0 <= BUNCHED * typical or (n + 1 < len(ts)
                                                and ts[n + 1] - t1 <= BUNCHED * typical):
                # tokens delivered together (a slow client or stream reads two events at once):
                # this gap holds no step, the one before it two; neither is one step
                continue
            # anyone waiting for a first token during the gap had a prefill in some step of it
            if any(reqs[j][0] < t1 and reqs[j][1][0] > t0 for j in near):
                continue
            batch, leader = [], None
            for j in members:
                a2, ts2, p2 = reqs[j]
                if a2 < t1 and ts2[0] <= t0 and ts2[-1] >= t1:  # streaming across the gap
                    leader = j if leader is None else leader
                    batch.append(p2 + bisect.bisect_right(ts2, t0))
            if leader == i and batch:
                out.append(Measurement(ProfileSample((), tuple(batch), t1 - t0), cfg, tp, 1,
                                       dtype, group=group))
    return out


# Prometheus series of a serving process: the first name present is used (pdserve's own, then
# vLLM's; both expose counters with the ``_total`` suffix)
_SERIES = {
    "running": ("pdserve:num_requests_running", "vllm:num_requests_running"),
    "waiting": ("pdserve:num_requests_waiting", "vllm:num_requests_waiting"),
    "generation": ("pdserve:generation_tokens_total", "vllm:generation_tokens_total"),
    "prompt": ("pdserve:prompt_tokens_total", "vllm:prompt_tokens_total"),
    "finished": ("pdserve:request_success_total", "vllm:request_success_total"),
    "prefill_sum": ("pdserve:request_prefill_time_seconds_sum",
                    "vllm:request_prefill_time_seconds_sum"),
    "prefill_count": ("pdserve:request_prefill_time_seconds_count",
                      "vllm:request_prefill_time_seconds_count"),
}


def _scrape_values(text: str) -> dict[str, float]:
    """One scrape's series of :data:`_SERIES`, each summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
    out = {}
    for key, names in _SERIES.items():
        name = next((n for n in names if n in sums), None)
        if name is not None:
            out[key] = sums[name]
        elif names[0].endswith(("_total", "_sum", "_count")):
            out[key] = 0.0  # a labelled counter has no sample before its first increment
    return out


def from_metrics_log(path: str | os.PathLike[str], model: str | ModelConfig, tp: int = 1,
                     dtype: str = "float16") -> list[Measurement]:
    """Engine steps estimated from Prometheus scrapes of a serving process with **one**
    instance — pdserve's or vLLM's ``/metrics`` (``pdserve bench --scrape-metrics FILE`` writes
    them: JSON lines ``{"time": seconds, "metrics": "<text exposition>"}``).

    Counters and gauges are aggregates, so only what they pin down is taken:

    * **Decode**: between two scrapes with the same ``n`` requests running, none waiting at
      either, and no prompt token, finished request or prefill counted in between, the batch
      was the same ``n`` requests decoding the whole time: ``generated`` tokens came from
      ``generated / n`` steps, so one step took ``n·Δt / generated``. Their contexts are not
      in the series: each is taken as the log's mean prompt plus half its mean output
      (prompt and generated tokens over finished requests).
    * **Prefill**: the prefill-time histogram's mean over the whole log (``_sum / _count``)
      as one prefill of the mean prompt.

    Approximate by construction (contexts are means; a prefill's mean time includes whatever
    it shared its steps with); use ``--step-log`` where the server writes one.
    """
    cfg = model_config(model)
    p = os.fspath(path)
    scrapes: list[tuple[float, dict[str, float]]] = []
    for i, line in enumerate(read_text(p, "metrics log").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            scrapes.append((float(r["time"]), _scrape_values(str(r["metrics"]))))
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"{p!r} line {i}: not a metrics scrape ({e!r})") from None
    scrapes.sort(key=lambda x: x[0])
    if len(scrapes) < 2:
        raise ValueError(f"{p!r}: need at least two scrapes, found {len(scrapes)}")
    first, last = scrapes[0][1], scrapes[-1][1]
    if "running" not in last or not last["generation"]:
        raise ValueError(f"{p!r}: the last scrape has no {_SERIES['running'][0]} or no "
                         f"{_SERIES['generation'][0]} (pdserve's or vLLM's /metrics expected)")
    done = last["finished"] - first["finished"]
    if done <= 0:
        raise ValueError(f"{p!r}: no request finished between the first and last scrape")
    mean_prompt = (last["prompt"] - first["prompt"]) / done
    mean_output = (last["generation"] - first["generation"]) / done
    ctx = max(1, round(mean_prompt + mean_output / 2))
    out: list[Measurement] = []
    for (t0, a), (t1, b) in zip(scrapes, scrapes[1:]):
        n = a.get("running", 0)
        gen = b["generation"] - a["generation"]
        steady = (n >= 1 and b.get("running") == n and not a.get("waiting")
                  and not b.get("waiting") and b["prompt"] == a["prompt"]
                  and b["finished"] == a["finished"]
                  and b.get("prefill_count") == a.get("prefill_count"))
        if steady and gen >= n and t1 > t0:
            n = int(n)
            out.append(Measurement(ProfileSample((), (ctx,) * n, n * (t1 - t0) / gen), cfg, tp,
                                   1, dtype, group="metrics"))
    count = last["prefill_count"] - first["prefill_count"]
    if count > 0 and mean_prompt >= 1:
        secs = (last["prefill_sum"] - first["prefill_sum"]) / count
        out.append(Measurement(ProfileSample.prefill([round(mean_prompt)], secs), cfg, tp, 1,
                               dtype, group="metrics"))
    if not out:
        raise ValueError(f"{p!r}: no interval between scrapes had a steady decode batch; "
                         "scrape more often (e.g. every 0.5 s) or at a lower rate")
    return out
