"""pdserve's planner against NVIDIA aiconfigurator 0.12 on the same questions (issue 28,
deliverable 4): 8 × H100 SXM, vLLM kernels, fixed lengths, TTFT / TPOT SLOs.

For every question:

1. **The peer.** ``aiconfigurator cli default`` (its own virtual environment, ``--aic-python``
   or ``$PDSERVE_AICONFIGURATOR``: never a dependency of pdserve) searches aggregated and
   disaggregated layouts on 8 GPUs; its best of each (``best_config_topn.csv``) is read and the
   higher tokens/s/GPU is its choice. aiconfigurator prices a batch at steady state: no
   arrivals, no queue.
2. **The adapter check.** ``aiconfigurator cli estimate --estimate-mode static`` at the peer's
   aggregated choice (TP, PP 1, batch size) against pdserve's ``--aic-system`` source
   (:class:`~pdserve.sim.aic_latency.AicModel`, no serving terms) for the same static run: one
   prefill of ``bs`` prompts, then ``osl − 1`` decode steps whose mean is the TPOT. The issue's
   bound is 10 %.
3. **pdserve.** ``pdserve plan --aic-system h100_sxm --aic-backend vllm --step-overhead-ms 1.5
   --seq-overhead-ms 0.09`` without ``--rate`` (the placement with the most goodput per GPU on
   the cluster, aiconfigurator's default mode), open-loop Poisson arrivals, steady-state
   probes, 90 % of requests meeting both SLOs.
4. **The cross check.** aiconfigurator's aggregated choice simulated by pdserve at aiconfigurator's
   own rate (``--cross-requests``, seed 0), kernels alone and with the serving path: where the
   two answers part, this says whether queueing and tails or the serving costs part them.
5. **The long run.** ``pdserve simulate --config plan.yaml`` of the chosen placement at its
   planned goodput for 5 × the probe length (:class:`~pdserve.bench.steady.SteadyState` at that
   rate), its attainment against the same target.

tokens/s/GPU is aiconfigurator's: output tokens per second per GPU (req/s/GPU × osl).

    python benchmarks/vs_aiconfigurator.py \\
        --aic-python /root/.cache/pdserve/peers/aiconfigurator-0.12.0/bin/python \\
        --questions llama-8b,qwen-32b --workers 2

Results: docs/benchmarks.md, "pdserve plan vs aiconfigurator".
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import SLO
from pdserve.bench.report import write_json
from pdserve.bench.steady import DEFAULT as STEADY
from pdserve.sim.aic_latency import AicModel
from pdserve.sim.model_catalogue import get_model_config

SYSTEM, BACKEND, GPUS = "h100_sxm", "vllm", 8
SERVING = {"step_overhead_ms": 1.5, "seq_overhead_ms": 0.09}  # the vLLM serving path
LONG_RUN = 5  # the long run's length, in probe lengths
ENV = "PDSERVE_AICONFIGURATOR"
PEER_MAIN = "aiconfigurator.main"  # `python -m` entry point of the aiconfigurator CLI


@dataclass(frozen=True)
class Question:
    """One planning question: pdserve's catalogue name and aiconfigurator's id of one model,
    fixed input / output lengths and the SLOs."""

    key: str
    model: str
    aic_model: str
    isl: int
    osl: int
    ttft_s: float
    tpot_s: float
    kind: str = ""

    @property
    def label(self) -> str:
        return (f"{self.model}, {self.isl}/{self.osl}, TTFT {self.ttft_s * 1000:g} ms / "
                f"TPOT {self.tpot_s * 1000:g} ms")


QUESTIONS = (
    Question("llama-8b", "llama-3.1-8b", "meta-llama/Meta-Llama-3.1-8B", 4000, 500, 1.0, 0.020),
    Question("qwen-32b", "qwen3-32b", "Qwen/Qwen3-32B", 4000, 500, 0.6, 0.050),
    Question("llama-70b", "llama-3.1-70b", "meta-llama/Meta-Llama-3.1-70B", 1000, 1000, 1.0,
             0.050),
    Question("qwen-moe", "qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 4000, 500, 1.0, 0.020, "MoE"),
    Question("llama-8b-long", "llama-3.1-8b", "meta-llama/Meta-Llama-3.1-8B", 32000, 1000, 3.0,
             0.030, "long context"),
)
BY_KEY = {q.key: q for q in QUESTIONS}


# ------------------------------------------------------------------------------ the peer
@dataclass(frozen=True)
class PeerConfig:
    """One row of aiconfigurator's ``best_config_topn.csv``: a layout on the cluster and its
    static estimate (ms; tokens/s/GPU of output tokens)."""

    mode: str  # "agg" | "disagg"
    label: str
    tokens_per_gpu: float
    tokens_per_user: float
    req_s: float
    ttft_ms: float
    tpot_ms: float
    tp: int  # agg: the worker's TP; disagg: the decode worker's
    pp: int
    batch_size: int
    dp: int = 1  # attention data parallelism (MoE models)
    moe_tp: int = 1
    moe_ep: int = 1


def _int(row: dict[str, str], key: str) -> int:
    return int(float(row[key]))


def peer_config(row: dict[str, str], mode: str, gpus: int = GPUS) -> PeerConfig:
    """A ``best_config_topn.csv`` row of ``mode`` as a :class:`PeerConfig`. A row prices one
    replica (``num_total_gpus`` GPUs, ``request_rate`` req/s); the cluster holds
    ``gpus // num_total_gpus`` of them (aiconfigurator's "total_gpus (used)")."""

    def par(prefix: str) -> str:
        t, p = _int(row, f"{prefix}tp"), _int(row, f"{prefix}pp")
        d = _int(row, f"{prefix}dp") if f"{prefix}dp" in row else 1
        et, ep = (_int(row, f"{prefix}moe_{k}") if f"{prefix}moe_{k}" in row else 1
                  for k in ("tp", "ep"))
        moe = (f" MoE TP{et}" if et > 1 else "") + (f" EP{ep}" if ep > 1 else "")
        return (f"TP{t}" + (f" PP{p}" if p > 1 else "") + (f" DP{d}" if d > 1 else "")
                + (f",{moe}" if moe else ""))

    if mode not in ("agg", "disagg"):
        raise ValueError(f"mode must be agg or disagg, got {mode!r}")
    reps = gpus // _int(row, "num_total_gpus")
    if mode == "agg":
        tp, pp, bs = _int(row, "tp"), _int(row, "pp"), _int(row, "bs")
        dp, etp, eep = (_int(row, k) for k in ("dp", "moe_tp", "moe_ep"))
        label = f"aggregated {reps} × {par('')}"
    else:
        tp, pp, bs = _int(row, "(d)tp"), _int(row, "(d)pp"), _int(row, "(d)bs")
        dp, etp, eep = (_int(row, k) for k in ("(d)dp", "(d)moe_tp", "(d)moe_ep"))
        inner = (f"{_int(row, '(p)workers')}P({par('(p)')}) + "
                 f"{_int(row, '(d)workers')}D({par('(d)')})")
        label = f"disaggregated {reps} × [{inner}]" if reps > 1 else f"disaggregated {inner}"
    return PeerConfig(mode, label, float(row["tokens/s/gpu"]), float(row["tokens/s/user"]),
                      float(row["request_rate"]) * reps, float(row["ttft"]), float(row["tpot"]),
                      tp, pp, bs, dp, etp, eep)


def parse_topn(text: str, mode: str, gpus: int = GPUS) -> list[PeerConfig]:
    """Every row of a ``best_config_topn.csv`` (best first, as aiconfigurator ranks them)."""
    return [peer_config(r, mode, gpus) for r in csv.DictReader(io.StringIO(text))]


def peer_choice(agg: Sequence[PeerConfig], disagg: Sequence[PeerConfig]) -> PeerConfig:
    """aiconfigurator's choice: the best of each mode, the more tokens/s/GPU (ties: agg)."""
    best = [c[0] for c in (agg, disagg) if c]
    if not best:
        raise ValueError("aiconfigurator found no configuration meeting the SLOs")
    return max(best, key=lambda c: (c.tokens_per_gpu, c.mode == "agg"))


def peer_python(arg: str | None) -> str:
    """The peer environment's Python: ``--aic-python`` or ``$PDSERVE_AICONFIGURATOR``."""
    path = arg or os.environ.get(ENV)
    if not path:
        raise SystemExit(f"give --aic-python PATH (the Python of a venv with "
                         f"`pip install aiconfigurator==0.12.0`) or set ${ENV}")
    return path


def peer_command(python: str, q: Question, save_dir: str, gpus: int = GPUS) -> list[str]:
    """``aiconfigurator cli default`` on question ``q`` (ms SLOs; results under ``save_dir``)."""
    return [python, "-m", PEER_MAIN, "cli", "default", "--model", q.aic_model,
            "--total-gpus", str(gpus), "--system", SYSTEM, "--backend", BACKEND,
            "--isl", str(q.isl), "--osl", str(q.osl), "--ttft", f"{q.ttft_s * 1000:g}",
            "--tpot", f"{q.tpot_s * 1000:g}", "--save-dir", save_dir, "--no-color"]


def worker_tp(peer: PeerConfig) -> int:
    """The TP at which pdserve prices the peer's worker: attention DP as TP of as many GPUs
    (pdserve has no attention DP); a MoE model's experts then at that TP, no EP (``AicModel``:
    moe_tp = tp / ep), which is the peer's own MoE TP where it is TP·DP (Qwen3-30B-A3B's
    TP1 DP4, MoE TP4)."""
    return peer.tp * peer.dp


def estimate_command(python: str, q: Question, tp: int, batch_size: int) -> list[str]:
    """``aiconfigurator cli estimate`` of its static run (one batch, no IFB) at ``tp`` (a MoE
    model's experts at the same TP, no expert parallelism)."""
    moe = ["--moe-tp-size", str(tp), "--moe-ep-size", "1"] if q.kind == "MoE" else []
    return [python, "-m", PEER_MAIN, "cli", "estimate", "--estimate-mode", "static",
            "--model", q.aic_model, "--system", SYSTEM, "--backend", BACKEND,
            "--isl", str(q.isl), "--osl", str(q.osl), "--batch-size", str(batch_size),
            "--tp-size", str(tp), *moe, "--no-color"]


def parse_estimate(text: str) -> dict[str, float]:
    """TTFT and TPOT (ms) of an ``aiconfigurator cli estimate`` report."""
    out = {}
    for key in ("TTFT", "TPOT"):
        m = re.search(rf"^\s*{key}:\s+([\d.,]+)\s*ms", text, re.MULTILINE)
        if not m:
            raise ValueError(f"no {key} line in the aiconfigurator estimate")
        out[key.lower() + "_ms"] = float(m.group(1).replace(",", ""))
    return out


NOISE = ("DeprecationWarning", "deprecated AIConfigurator", "low-fidelity fallback",
         "sys.exit(main())", "main(sys.argv")


def peer_report(text: str) -> str:
    """aiconfigurator's console output without its per-table deprecation and fallback
    warnings (what the results file keeps of it)."""
    return "\n".join(ln for ln in text.splitlines() if not any(n in ln for n in NOISE))


def topn_files(save_dir: Path) -> dict[str, Path]:
    """The ``best_config_topn.csv`` of each mode under a ``cli default`` save directory."""
    found = {p.parent.name: p for p in save_dir.rglob("best_config_topn.csv")}
    return {m: found[m] for m in ("agg", "disagg") if m in found}


# ------------------------------------------------------------------- the adapter check
def adapter_static(q: Question, tp: int, batch_size: int) -> dict[str, float]:
    """pdserve's ``--aic-system`` source (kernels only) on aiconfigurator's static run: the
    prefill of ``batch_size`` prompts, then the mean of the ``osl − 1`` decode steps (each
    sequence holding its prompt and the tokens so far), ms."""
    m = AicModel(get_model_config(q.model), SYSTEM, BACKEND, tp)
    ttft = 1000 * m.prefill_time([q.isl] * batch_size)
    steps = [1000 * m.decode_time([q.isl + k] * batch_size) for k in range(1, q.osl)]
    return {"ttft_ms": ttft, "tpot_ms": sum(steps) / len(steps)}


# ---------------------------------------------------------------------------- pdserve
def plan_args(q: Question, out_yaml: str, out_json: str, workers: int,
              gpus: int = GPUS, joint: bool = True) -> list[str]:
    """``pdserve plan``'s arguments for ``q``: the kernel database with the serving path,
    no rate (the most goodput per GPU on one node of ``gpus``); ``joint=False`` ranks by the
    estimates from units simulated alone (``--no-joint``: no whole-cluster simulation)."""
    return ["plan", *([] if joint else ["--no-joint"]), "--aic-system", SYSTEM,
            "--aic-backend", BACKEND, *serving_flags(), "--model", q.model,
            "--workload", f"fixed:input={q.isl},output={q.osl}",
            "--slo-ttft", f"{q.ttft_s:g}", "--slo-tpot", f"{q.tpot_s:g}",
            "--nodes", "1", "--gpus-per-node", str(gpus), "--workers", str(workers),
            "--out", out_yaml, "--output-json", out_json]


def long_run_requests(q: Question, rate: float, factor: int = LONG_RUN) -> int:
    """``factor`` × the steady-state probe's requests at ``rate`` (warm-up + judged)."""
    life = STEADY.lifetime(SLO(ttft=q.ttft_s, tpot=q.tpot_s), q.osl)
    return factor * STEADY.num_requests(rate, life)


def simulate_args(q: Question, plan_yaml: str, rate: float, num_requests: int,
                  out_json: str) -> list[str]:
    """``pdserve simulate`` of the plan's deployment at ``rate`` (its ``simulation:`` section
    carries the latency source and serving path)."""
    return ["simulate", "--config", plan_yaml, "--workload",
            f"fixed:input={q.isl},output={q.osl}", "--slo-ttft", f"{q.ttft_s:g}",
            "--slo-tpot", f"{q.tpot_s:g}", "--rate", f"{rate:.6g}", "--num-requests",
            str(num_requests), "--seed", "0", "--output-json", out_json, "--no-progress"]


def serving_flags() -> list[str]:
    """The serving-path flags of every pdserve run here."""
    return ["--step-overhead-ms", f"{SERVING['step_overhead_ms']:g}",
            "--seq-overhead-ms", f"{SERVING['seq_overhead_ms']:g}"]


def cross_args(q: Question, peer: PeerConfig, num_requests: int, out_json: str,
               serving: bool, gpus: int = GPUS) -> list[str]:
    """``pdserve simulate`` of aiconfigurator's aggregated choice (``gpus // (tp·pp·dp)``
    colocated instances of TP ``tp·dp``, chunked prefill) at its own rate: kernels alone, or
    with the serving path (``serving``). Where the two answers part, this says why."""
    if peer.mode != "agg":
        raise ValueError("only an aggregated choice is a colocated deployment")
    tp = worker_tp(peer)
    return ["simulate", "--model", q.model, "--num-instances", str(gpus // (tp * peer.pp)),
            "--tp", str(tp), "--pp", str(peer.pp), "--aic-system", SYSTEM,
            "--aic-backend", BACKEND,
            *(serving_flags() if serving else []),
            "--workload", f"fixed:input={q.isl},output={q.osl}", "--slo-ttft", f"{q.ttft_s:g}",
            "--slo-tpot", f"{q.tpot_s:g}", "--rate", f"{peer.req_s:.6g}", "--num-requests",
            str(num_requests), "--seed", "0", "--output-json", out_json, "--no-progress"]


@dataclass(frozen=True)
class PdserveChoice:
    """The plan's choice: its deployment name, GPUs, goodput (req/s on the cluster)."""

    label: str
    strategy: str
    num_gpus: int
    goodput_rps: float
    per_gpu_rps: float
    tokens_per_gpu: float
    simulated: bool
    wall_s: float


def parse_plan(data: dict[str, Any], osl: int) -> PdserveChoice:
    """The chosen placement of a ``pdserve plan --output-json`` file."""
    b = data["best"]
    return PdserveChoice(b["name"], b["strategy"], int(b["num_gpus"]), float(b["goodput_rps"]),
                         float(b["per_gpu_rps"]), float(b["per_gpu_rps"]) * osl,
                         bool(b.get("simulated")), float(data.get("wall_s") or 0.0))


def summary_of(data: Any) -> dict[str, Any]:
    """The run summary (``attainment``, ``ttft``, ``tpot`` ...) inside a ``pdserve simulate
    --output-json`` file, wherever its report nests it."""
    if isinstance(data, dict):
        if "attainment" in data and "ttft" in data and "tpot" in data:
            return data
        for v in data.values():
            try:
                return summary_of(v)
            except ValueError:
                pass
    elif isinstance(data, list):
        for v in data:
            try:
                return summary_of(v)
            except ValueError:
                pass
    raise ValueError("no run summary in the simulate output")


def long_run_result(data: Any, target: float = 0.9) -> dict[str, Any]:
    """Attainment and latency percentiles (ms) of the long run, and whether it holds."""
    s = summary_of(data)

    def ms(stat: str, key: str) -> float | None:
        v = (s.get(stat) or {}).get(key)
        return None if v is None else 1000 * float(v)

    a = float(s["attainment"])
    return {"num_requests": s.get("num_requests"), "attainment": a, "meets": a >= target,
            "ttft_mean_ms": ms("ttft", "mean"), "ttft_p90_ms": ms("ttft", "p90"),
            "tpot_mean_ms": ms("tpot", "mean"), "tpot_p90_ms": ms("tpot", "p90")}


# ----------------------------------------------------------------------------- report
def table(rows: Sequence[dict[str, Any]]) -> str:
    """The side-by-side table (markdown), one row per question."""
    head = ("| question | aiconfigurator choice | tok/s/GPU | TTFT / TPOT ms | pdserve choice "
            "| tok/s/GPU | req/s | long run: attainment, P90 TTFT / TPOT ms |")
    out = [head, "|" + "---|" * 8]
    for r in rows:
        q, peer, pd, lr = r["question"], r.get("peer"), r.get("pdserve"), r.get("long_run")
        cells = [q["label"]]
        if peer:
            cells += [peer["label"], f"{peer['tokens_per_gpu']:,.0f}",
                      f"{peer['ttft_ms']:.0f} / {peer['tpot_ms']:.1f}"]
        else:
            cells += ["–"] * 3
        if pd:
            cells += [pd["label"], f"{pd['tokens_per_gpu']:,.0f}", f"{pd['goodput_rps']:.2f}"]
        else:
            cells += ["–"] * 3
        if lr:
            cells.append(f"{lr['attainment']:.1%} of {lr['num_requests']:,}, "
                         f"{lr['ttft_p90_ms']:.0f} / {lr['tpot_p90_ms']:.1f}")
        else:
            cells.append("–")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def adapter_table(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| question | static run | aiconfigurator TTFT / TPOT ms | pdserve aic source | "
           "error TTFT / TPOT |", "|---|---|---|---|---|"]
    for r in rows:
        a = r.get("adapter")
        if not a:
            continue
        out.append(f"| {r['question']['label']} | TP{a['tp']}, bs {a['batch_size']} | "
                   f"{a['peer']['ttft_ms']:.1f} / {a['peer']['tpot_ms']:.2f} | "
                   f"{a['pdserve']['ttft_ms']:.1f} / {a['pdserve']['tpot_ms']:.2f} | "
                   f"{a['error']['ttft']:+.1%} / {a['error']['tpot']:+.1%} |")
    return "\n".join(out)


# ---------------------------------------------------------------------------- running
def pdserve_command(args: Sequence[str]) -> list[str]:
    """The ``pdserve`` command line (the console script, else this interpreter)."""
    exe = shutil.which("pdserve")
    if exe:
        return [exe, *args]
    return [sys.executable, "-c", "import sys; from pdserve.cli import main; "
            "sys.exit(main(sys.argv[1:]))", *args]


def _run(cmd: Sequence[str], log: Path, say: Callable[[str], None],
         done: Path | None = None) -> float | None:
    """Run ``cmd``, its stdout and stderr into ``log``; wall seconds. Fails loudly. With
    ``done`` (the output it writes) already there, runs nothing (``--resume``): ``None``."""
    if done is not None and done.exists():
        say(f"reusing {done}")
        return None
    say("$ " + " ".join(cmd))
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    took = time.perf_counter() - t0
    if rc:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"exit {rc} after {took:.0f} s: {' '.join(cmd[:6])} ...\n"
                           + "\n".join(tail))
    return took


def run_question(q: Question, python: str | None, work: Path, workers: int,
                 parts: set[str], say: Callable[[str], None],
                 resume: bool = False, joint: bool = True,
                 cross_requests: int = 2000) -> dict[str, Any]:
    """Everything of one question (module docstring); each part's raw output under ``work``
    (``resume``: a part whose output is there is read, not run again)."""
    work.mkdir(parents=True, exist_ok=True)

    def kept(path: Path) -> Path | None:
        return path if resume else None

    row: dict[str, Any] = {"question": {**asdict(q), "label": q.label}, "timings_s": {}}
    if "peer" in parts:
        assert python is not None
        save = work / "peer"
        row["timings_s"]["peer"] = _run(peer_command(python, q, str(save)), work / "peer.log",
                                        say, kept(save))
        files = topn_files(save)
        topn = {m: files[m].read_text() for m in files}
        agg = parse_topn(topn.get("agg", ""), "agg") if "agg" in topn else []
        dis = parse_topn(topn.get("disagg", ""), "disagg") if "disagg" in topn else []
        choice = peer_choice(agg, dis)
        row["peer"] = asdict(choice)
        row["peer_best"] = {"agg": asdict(agg[0]) if agg else None,
                            "disagg": asdict(dis[0]) if dis else None}
        row["peer_raw"] = {"command": peer_command(python, q, str(save)), "topn_csv": topn,
                           "stdout": peer_report((work / "peer.log").read_text())}
        say(f"aiconfigurator: {choice.label}, {choice.tokens_per_gpu:,.0f} tok/s/GPU")
        if agg and "adapter" in parts:
            a = agg[0]
            tp = worker_tp(a)
            est_log = work / "estimate.log"
            row["timings_s"]["estimate"] = _run(estimate_command(python, q, tp, a.batch_size),
                                                est_log, say, kept(est_log))
            peer_est = parse_estimate(est_log.read_text())
            ours = adapter_static(q, tp, a.batch_size)
            row["peer_raw"]["estimate"] = peer_report(est_log.read_text())
            row["adapter"] = {"tp": tp, "batch_size": a.batch_size, "peer": peer_est,
                              "pdserve": ours,
                              "error": {k: ours[f"{k}_ms"] / peer_est[f"{k}_ms"] - 1
                                        for k in ("ttft", "tpot")}}
            say(f"adapter: TTFT {row['adapter']['error']['ttft']:+.1%}, "
                f"TPOT {row['adapter']['error']['tpot']:+.1%}")
    if "cross" in parts and row.get("peer_best", {}).get("agg"):
        a = PeerConfig(**row["peer_best"]["agg"])
        row["cross"] = {}
        for serving in (False, True):
            name = "serving" if serving else "kernels"
            out = work / f"cross_{name}.json"
            row["timings_s"][f"cross_{name}"] = _run(
                pdserve_command(cross_args(q, a, cross_requests, str(out), serving)),
                work / f"cross_{name}.log", say, kept(out))
            row["cross"][name] = long_run_result(json.loads(out.read_text()))
            say(f"aiconfigurator's choice at its {a.req_s:.2f} req/s, {name}: "
                f"{row['cross'][name]['attainment']:.1%}")
    if "plan" in parts:
        plan_yaml, plan_json = work / "plan.yaml", work / "plan.json"
        row["timings_s"]["plan"] = _run(
            pdserve_command(plan_args(q, str(plan_yaml), str(plan_json), workers,
                                      joint=joint)),
            work / "plan.log", say, kept(plan_json))
        choice_pd = parse_plan(json.loads(plan_json.read_text()), q.osl)
        row["pdserve"] = {**asdict(choice_pd), "joint": joint}
        row["plan_deployment"] = plan_yaml.read_text()
        say(f"pdserve: {choice_pd.label}, {choice_pd.tokens_per_gpu:,.0f} tok/s/GPU "
            f"({choice_pd.goodput_rps:.2f} req/s)")
        if "long" in parts:
            n = long_run_requests(q, choice_pd.goodput_rps)
            sim_json = work / "long_run.json"
            row["timings_s"]["long_run"] = _run(
                pdserve_command(simulate_args(q, str(plan_yaml), choice_pd.goodput_rps, n,
                                              str(sim_json))), work / "long_run.log", say,
                kept(sim_json))
            row["long_run"] = {**long_run_result(json.loads(sim_json.read_text())),
                               "rate_rps": choice_pd.goodput_rps, "factor": LONG_RUN}
            say(f"long run: {row['long_run']['attainment']:.1%} of {n} requests")
    return row


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--aic-python", default=None,
                   help=f"Python of aiconfigurator's own venv (default ${ENV})")
    p.add_argument("--questions", default=",".join(q.key for q in QUESTIONS),
                   help=f"comma-separated, of {', '.join(BY_KEY)}")
    p.add_argument("--parts", default="peer,adapter,cross,plan,long",
                   help="peer (aiconfigurator cli default), adapter (its static estimate vs "
                        "ours), cross (its aggregated choice simulated by pdserve at its rate, "
                        "kernels alone and with the serving path), plan (pdserve plan), long "
                        "(the 5x-length simulate)")
    p.add_argument("--cross-requests", type=int, default=2000,
                   help="requests of each cross simulation")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--work-dir", default="out/vs_aiconfigurator",
                   help="raw outputs of every command, one folder per question")
    p.add_argument("--no-joint", dest="joint", action="store_false",
                   help="pdserve plan --no-joint: rank by the units' estimates, simulate no "
                        "whole cluster (the long run still simulates the choice whole)")
    p.add_argument("--resume", action="store_true",
                   help="read the outputs already in --work-dir instead of running them again")
    p.add_argument("--output-json", default=None,
                   help="default benchmarks/results/vs_aiconfigurator/<date>_<commit>_<q>.json")
    return p.parse_args(argv)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    keys = [k.strip() for k in args.questions.split(",") if k.strip()]
    bad = [k for k in keys if k not in BY_KEY]
    if bad:
        raise SystemExit(f"unknown question(s) {bad}; choose from {', '.join(BY_KEY)}")
    parts = {s.strip() for s in args.parts.split(",") if s.strip()}
    python = peer_python(args.aic_python) if parts & {"peer", "adapter"} else None
    day, rev = time.strftime("%Y-%m-%d", time.gmtime()), commit()
    rows = []
    for i, k in enumerate(keys, 1):
        q = BY_KEY[k]

        def say(text: str, i: int = i) -> None:
            print(f"[{i}/{len(keys)} {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr,
                  flush=True)

        say(q.label)
        row = run_question(q, python, Path(args.work_dir) / k, args.workers, parts, say,
                           args.resume, args.joint, args.cross_requests)
        row.update(date=day, commit=rev, system=SYSTEM, backend=BACKEND, gpus=GPUS,
                   serving_path=SERVING)
        path = args.output_json or (f"benchmarks/results/vs_aiconfigurator/"
                                    f"{day}_{rev}_{k}.json")
        if args.output_json and len(keys) > 1:
            path = str(Path(path).with_name(f"{Path(path).stem}_{k}.json"))
        write_json(path, row)
        say(f"wrote {path}")
        rows.append(row)
    print(table(rows))
    if any(r.get("adapter") for r in rows):
        print("\n" + adapter_table(rows))
    return 0
