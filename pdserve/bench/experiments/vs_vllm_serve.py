"""Online serving: ``pdserve serve`` versus ``vllm serve`` (vLLM's CPU build) under the same
``pdserve bench`` workload (issue 14): TTFT, ITL, TPOT and throughput.

For every repeat, each system in turn (the order rotated per repeat):

1. its OpenAI-compatible server starts as a subprocess (its own session) on the same model
   directory, under the same served model name; the script waits until ``/v1/models`` answers;
2. a few requests of another seed warm it up (not measured);
3. for each machine condition (``quiet``; then ``busy``: one ``python -c 'while 1: pass'``
   started by this script beside the server; ``busy2``: two of them, so the server competes
   for every core of a 2-core machine) and each of ``--rates``, the same workload runs
   through :mod:`pdserve.bench`'s runner (the code behind ``pdserve bench``): open-loop Poisson
   arrivals, the same seeded prompt token ids, ``max_tokens`` = the requested length with
   ``ignore_eos`` (both servers honour it, so both produce the same token counts; the script
   counts mismatches), greedy, streamed. Run ``k`` of a server (conditions × rates) uses
   workload seed ``--seed + k``: the same prompts for every system, none served twice by one
   server, so prefix caching (on by default in both) never hits;
4. the server stops (SIGINT, then SIGKILL of its session and every descendant seen; the script
   fails if any process of it is left).

A server serves both conditions (vLLM compiles its model at start-up, minutes on a loaded
2-core machine); so the systems' runs of one condition are one server's lifetime apart at most.

Systems: ``pdserve`` is ``pdserve serve`` as it starts by default (``--backend ray``: one Ray
actor per instance with one torch thread); ``pdserve-inproc`` is ``--backend inproc`` (the
instance runs in the server process with torch's default thread count, 2 here); ``vllm`` is
``python -m vllm.entrypoints.openai.api_server`` from ``--vllm-python``'s environment with its
own defaults (on x86 it reserves one core for its scheduler process and pins one OpenMP thread
per remaining core; ``VLLM_CPU_KVCACHE_SPACE`` = ``--kv-gib``). vLLM is a benchmark peer only,
never a dependency of pdserve. pdserve servers also write ``--step-log``: each engine step's
elapsed time, which the report puts beside the ITL (what the engine computes per token vs what
the client sees).

    python benchmarks/vs_vllm_serve.py --vllm-python /work/vllm-venv/bin/python \\
        --models smollm2 --systems pdserve,pdserve-inproc,vllm --rates 0.1,0.5 \\
        --num-requests 16 --repeats 3 --output-json out/vs_vllm_serve.json \\
        --plot out/vs_vllm_serve.png
    # separate runs (e.g. one repeat each, --first-repeat k), reported together:
    python benchmarks/vs_vllm_serve.py --combine out/r0.json out/r1.json --plot out/cdf.png

Results: docs/benchmarks.md, "Online: pdserve serve vs vllm serve".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.bench.experiments.bench_models import BUSY_CODE, resolve_models
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.report import figure, save_figure, write_json
from pdserve.bench.runner import Settings, build_workload, run_workload
from pdserve.bench.targets import HttpTarget
from pdserve.config import ModelConfig

SYSTEMS = ("pdserve", "pdserve-inproc", "vllm")
CONDITIONS = ("quiet", "busy", "busy2")
BUSY_PROCESSES = {"quiet": 0, "busy": 1, "busy2": 2}  # busy2: one busy loop per core here
METRICS = ("ttft", "itl", "tpot", "e2e")
STATS = ("mean", "median", "p90", "p99")


# ---------------------------------------------------------------------------- arguments
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=None,
                   help="python of a virtual environment with vllm-cpu (omit: vLLM skipped)")
    p.add_argument("--models", type=_list, default=["smollm2"],
                   help="comma list: smollm2, llama56m, or Hugging Face directories "
                        "(default: smollm2)")
    p.add_argument("--systems", type=_list, default=["pdserve", "vllm"],
                   help=f"comma list of {', '.join(SYSTEMS)} (default: pdserve,vllm)")
    p.add_argument("--conditions", type=_list, default=["quiet", "busy"],
                   help="quiet, busy (one busy process beside the server), busy2 (two: the "
                        "server competes for every core) (default quiet,busy)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--first-repeat", type=int, default=0,
                   help="index of the first repeat (rotates the order; to add repeats later)")
    p.add_argument("--workload", default="fixed:input=128,output=32",
                   help="a pdserve bench workload (default: %(default)s)")
    p.add_argument("--rates", type=_rates, default=[0.1, 0.5],
                   help="Poisson rates in req/s, low load first (default: 0.1,0.5)")
    p.add_argument("--num-requests", type=int, default=16, help="requests per rate")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-gib", type=int, default=1, help="KV cache of each server (GiB)")
    p.add_argument("--served-model-name", default="model")
    p.add_argument("--no-step-log", action="store_true",
                   help="do not ask pdserve for its per-step log")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--work-dir", default="out/vs_vllm_serve",
                   help="server logs and step logs (default: %(default)s)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--output-md", default=None)
    p.add_argument("--plot", default=None, help="PNG: TTFT and ITL distributions")
    p.add_argument("--save-records", action="store_true",
                   help="every request's timeline in the JSON")
    p.add_argument("--combine", nargs="+", metavar="JSON",
                   help="measure nothing: aggregate, tabulate and plot the rows (and saved "
                        "records) of earlier runs' --output-json files, e.g. separate repeats")
    args = p.parse_args(argv)
    bad = [s for s in args.systems if s not in SYSTEMS]
    bad += [c for c in args.conditions if c not in CONDITIONS]
    if bad:
        p.error(f"unknown system or condition: {', '.join(bad)}")
    if args.repeats < 1 or args.num_requests < 1:
        p.error("--repeats and --num-requests must be >= 1")
    return args


def _list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _rates(text: str) -> list[float]:
    try:
        rates = [float(t) for t in _list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive, got {text!r}")
    return rates


def run_order(systems: Sequence[str], repeat: int) -> list[str]:
    """The systems of one repeat, rotated by the repeat index (as in vs_vllm.py)."""
    k = repeat % len(systems)
    return list(systems[k:]) + list(systems[:k])


# ---------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, model_dir: str, port: int, args: argparse.Namespace,
                   step_log: str | None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one system's server."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if system == "vllm":
        env.pop("OMP_WAIT_POLICY", None)  # vLLM's own defaults, not pdserve's
        env.pop("PYTHONPATH", None)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
               "--model", model_dir, "--served-model-name", args.served_model_name,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
               "--max-model-len", str(args.max_model_len), "--seed", str(args.seed)]
        return cmd, env
    env.pop("PDSERVE_ADAPTIVE_THREADS", None)
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model_dir,
           "--served-model-name", args.served_model_name, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype, "--max-model-len",
           str(args.max_model_len), "--seed", str(args.seed), "--cpu-kv-gib", str(args.kv_gib),
           "--log-level", "warning"]
    if system == "pdserve-inproc":
        cmd += ["--backend", "inproc"]
    if step_log:
        cmd += ["--step-log", step_log]
    return cmd, env


def _stat(pid: int) -> list[str] | None:
    """Fields 3 on of ``/proc/PID/stat`` (state, ppid, pgrp, session, ...), or ``None``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(root: int) -> dict[int, str]:
    """``root`` and all its live descendants now: pid → start time (from /proc; the start
    time tells a process from a later one that reuses its pid)."""
    children: dict[int, list[int]] = {}
    start: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None and st[0] != "Z":
            children.setdefault(int(st[1]), []).append(int(d))
            start[int(d)] = st[19]
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in start:
            out[pid] = start[pid]
        todo.extend(children.get(pid, []))
    return out


def cpu_seconds(pids: Sequence[int]) -> dict[int, float]:
    """User + system CPU seconds of each of these processes that still exists."""
    out = {}
    for pid in pids:
        st = _stat(pid)
        if st is not None:
            out[pid] = (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")
    return out


def process_name(pid: int) -> str:
    """The process's title (``VLLM::Worker``, ``ray::_RayWorker.handle``, ``raylet``) or its
    ``comm``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return "?"
    args = [a.decode(errors="replace") for a in argv if a]
    if args and args[0].startswith(("VLLM::", "ray::")):
        return args[0].split()[0]
    if comm.startswith("python"):
        for i, a in enumerate(args[1:], 1):
            if a == "-m" and i + 1 < len(args):
                return "python -m " + args[i + 1]
            if a == "-c":
                return "python -c " + args[i + 1][:40] if i + 1 < len(args) else "python -c"
            if not a.startswith("-"):
                return "python " + os.path.basename(a)
    return comm


def cpu_by_process(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds between two :func:`cpu_seconds` samples, summed per process name, largest
    first (processes that started in between count from zero)."""
    by: dict[str, float] = {}
    for pid, t in after.items():
        name = process_name(pid)
        by[name] = by.get(name, 0.0) + t - before.get(pid, 0.0)
    return dict(sorted(by.items(), key=lambda kv: -kv[1]))


def _same_process(pid: int, start: str) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z" and st[19] == start


class ServerProcess:
    """One server in its own session; ``stop()`` leaves no process of it behind."""

    def __init__(self, system: str, cmd: list[str], env: dict[str, str], port: int,
                 log_path: Path) -> None:
        self.system, self.cmd, self.port = system, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.known: dict[int, str] = {}  # every descendant seen: pid → start time

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``GET /v1/models`` answered 200."""
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system} server exited with {self.proc.returncode}; "
                                   f"see {self.log_path}:\n{tail(self.log_path)}")
            self.tree()
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.system} server not ready within {timeout:g} s; "
                           f"see {self.log_path}")

    def tree(self) -> list[int]:
        pids = process_tree(self.proc.pid)
        self.known.update(pids)
        return list(pids)

    def stop(self, grace: float = 30.0) -> list[int]:
        """SIGINT (graceful shutdown), then SIGKILL to everything left of the tree, the
        session and every descendant seen while it ran; returns the pids still alive (none)."""
        self.tree()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid, start in self.known.items():  # descendants that left the session
            if _same_process(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.log.close()
        time.sleep(0.5)
        return [pid for pid, start in self.known.items() if _same_process(pid, start)]


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class LoadSampler:
    """``/proc/loadavg``'s one-minute value every ``period`` seconds in a thread."""

    def __init__(self, period: float = 2.0) -> None:
        self.period, self.samples = period, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])


# ---------------------------------------------------------------------------- one server
@dataclass
class BenchPlan:
    """What every server is asked: the workloads per rate (same for every system)."""

    settings: Any  # pdserve.bench.runner.Settings
    rates: list[float]
    warmup_requests: int


def bench_settings(args: argparse.Namespace, vocab_size: int) -> Any:
    return Settings(workload=args.workload, num_requests=args.num_requests, seed=args.seed,
                    vocab_size=vocab_size, max_model_len=args.max_model_len, prompt_mode="ids")


def workload(target: Any, plan: BenchPlan, index: int, rate: float) -> Any:
    """The ``index``-th run's requests at ``rate``, seed ``seed + index``: the same prompts for
    every system, none served twice by one server (so prefix caching never hits)."""

    s = plan.settings
    return build_workload(target, replace(s, seed=s.seed + index), rate)


def warm_up(target: Any, plan: BenchPlan) -> None:
    """Requests of another seed, first one by one, then together (not measured)."""

    n = plan.warmup_requests
    if n < 1:
        return
    s = replace(plan.settings, seed=plan.settings.seed + 1000, num_requests=n)
    w = build_workload(target, s, 1000.0)
    for r in w.requests[: max(1, n // 2)]:
        asyncio.run(target.run([replace(r, arrival_time=0.0)]))
    asyncio.run(target.run(list(w.requests)))


def step_stats(lines: Sequence[str]) -> dict[str, Any] | None:
    """Engine steps of one run (pdserve's ``--step-log`` lines): count, busy seconds, the
    elapsed time of decode-only steps (what a token costs the executor) and of steps with a
    prefill chunk, and the step cycle: ``now`` to the next step's ``now`` (the server's clock
    when it issued each step) between two decode-only steps of the same requests. The cycle
    less the executor's time is the per-step overhead outside the forward pass (scheduling,
    the round trip to the instance, the server's token handling)."""
    steps = [json.loads(x) for x in lines if x.strip()]
    if not steps:
        return None
    dec = [s["elapsed"] for s in steps if not s.get("prefill_chunks")]
    pre = [s["elapsed"] for s in steps if s.get("prefill_chunks")]
    batch = [len(s.get("decode_context_lens") or []) for s in steps if not s.get("prefill_chunks")]
    cycles, gaps = [], []
    for a, b in zip(steps, steps[1:]):
        ca, cb = a.get("decode_context_lens") or [], b.get("decode_context_lens") or []
        if (a.get("instance_id") == b.get("instance_id") and not a.get("prefill_chunks")
                and not b.get("prefill_chunks") and ca and {c + 1 for c in ca} & set(cb)):
            cycles.append(b["now"] - a["now"])
            gaps.append(b["now"] - a["now"] - a["elapsed"])
    med = statistics.median
    return {"num_steps": len(steps), "busy_s": sum(s["elapsed"] for s in steps),
            "num_decode_steps": len(dec),
            "decode_step_mean_s": statistics.fmean(dec) if dec else None,
            "decode_step_median_s": med(dec) if dec else None,
            "decode_batch_mean": statistics.fmean(batch) if batch else None,
            "num_prefill_steps": len(pre),
            "prefill_step_mean_s": statistics.fmean(pre) if pre else None,
            "num_cycles": len(cycles),
            "decode_cycle_median_s": med(cycles) if cycles else None,
            "decode_gap_median_s": med(gaps) if gaps else None,
            "decode_gap_mean_s": statistics.fmean(gaps) if gaps else None}


def read_lines(path: str | None) -> list[str]:
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return f.readlines()


def bench_server(server: ServerProcess, plan: BenchPlan, step_log: str | None,
                 request_timeout: float, conditions: Sequence[str],
                 busy_cmd: list[str]) -> list[dict[str, Any]]:
    """Warm up, then every condition (``busy``: ``busy_cmd`` runs beside the server) and every
    rate; one result per (condition, rate): summary, records, engine steps, load, server CPU."""

    target = HttpTarget(server.url, timeout=request_timeout, name=server.system,
                        progress=False)
    asyncio.run(target.prepare())
    warm_up(target, plan)
    out = []
    for ci, cond in enumerate(conditions):
        busy = [subprocess.Popen(busy_cmd) for _ in range(BUSY_PROCESSES[cond])]
        try:
            if busy:
                time.sleep(2.0)  # let the scheduler spread the newcomers
            for i, rate in enumerate(plan.rates):
                w = workload(target, plan, ci * len(plan.rates) + i, rate)
                before = len(read_lines(step_log))
                cpu0 = cpu_seconds(server.tree())
                with LoadSampler() as load:
                    run = run_workload(target, w, plan.settings)
                by_proc = cpu_by_process(cpu0, cpu_seconds(server.tree()))
                out.append({"condition": cond, "rate": rate, "run": run, "load": load.samples,
                            "server_cpu_s": sum(by_proc.values()), "server_cpu_by_process":
                            {k: round(v, 3) for k, v in by_proc.items() if v >= 0.01},
                            "steps": step_stats(read_lines(step_log)[before:])})
        finally:
            for b in busy:
                b.kill()
                b.wait()
    return out


# ---------------------------------------------------------------------------- aggregation
def run_row(repeat: int, condition: str, system: str, model: str, res: dict[str, Any],
            startup_s: float) -> dict[str, Any]:
    """One (repeat, condition, system, rate) row: the bench summary's latency statistics,
    throughput, token-count check, load, server CPU and engine steps."""
    run = res["run"]
    sm = run.summary
    recs = run.records
    row: dict[str, Any] = {
        "model": model, "repeat": repeat, "condition": condition, "system": system,
        "rate": res["rate"], "startup_s": startup_s,
        "num_requests": sm.num_requests, "num_failed": sm.num_failed,
        "output_tokens": sum(r.output_len for r in recs if r.ok),
        "expected_output_tokens": sum(r.expected_output_len or 0 for r in recs),
        "wrong_length": sum(1 for r in recs if r.ok and r.output_len != r.expected_output_len),
        "duration_s": sm.duration_s, "throughput_rps": sm.throughput_rps,
        "output_tokens_per_s": sm.output_tokens_per_s,
        "load_mean": statistics.fmean(res["load"]), "load_max": max(res["load"]),
        "server_cpu_s": res["server_cpu_s"],
        "server_cpu_by_process": res.get("server_cpu_by_process"), "steps": res["steps"],
        "errors": sm.errors,
    }
    for m in METRICS:
        st = getattr(sm, m)
        for k in STATS:
            row[f"{m}_{k}_s"] = getattr(st, k)
    steps = res["steps"]
    if steps and steps.get("decode_step_mean_s") and row["itl_mean_s"]:
        row["itl_minus_decode_step_s"] = row["itl_mean_s"] - steps["decode_step_mean_s"]
    if row["output_tokens"]:
        row["server_cpu_ms_per_token"] = 1000 * res["server_cpu_s"] / row["output_tokens"]
    return row


def spread(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def aggregate(rows: Sequence[dict[str, Any]], baseline: str = "vllm") -> dict[str, Any]:
    """Per (model, condition, rate, system): each metric's median and range over repeats; per
    (model, condition, rate, system ≠ baseline): the per-repeat ratio system / baseline of
    each metric (runs of one repeat were minutes apart at most)."""
    keys = [f"{m}_{k}_s" for m in METRICS for k in STATS] + [
        "output_tokens_per_s", "throughput_rps", "load_mean", "server_cpu_ms_per_token"]
    groups: dict[tuple[str, str, float, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["condition"], r["rate"], r["system"]), []).append(r)
    per: list[dict[str, Any]] = []
    for (model, cond, rate, system), rs in groups.items():
        entry: dict[str, Any] = {"model": model, "condition": cond, "rate": rate,
                                 "system": system, "repeats": len(rs)}
        for k in keys:
            xs = [r[k] for r in rs if r.get(k) is not None]
            if xs:
                entry[k] = spread(xs)
        for k in ("decode_step_mean_s", "decode_step_median_s", "decode_cycle_median_s",
                  "decode_gap_median_s"):
            xs = [r["steps"][k] for r in rs if r.get("steps") and r["steps"].get(k) is not None]
            if xs:
                entry[k] = spread(xs)
        per.append(entry)
    ratios: list[dict[str, Any]] = []
    for (model, cond, rate, system), rs in groups.items():
        if system == baseline or (model, cond, rate, baseline) not in groups:
            continue
        base = {r["repeat"]: r for r in groups[(model, cond, rate, baseline)]}
        entry = {"model": model, "condition": cond, "rate": rate, "system": system,
                 "over": baseline}
        for k in keys[:-2]:
            xs = [r[k] / base[r["repeat"]][k] for r in rs if r["repeat"] in base
                  and r.get(k) and base[r["repeat"]].get(k)]
            if xs:
                entry[k] = spread(xs)
        ratios.append(entry)
    return {"per_system": per, "ratios": ratios}


# ---------------------------------------------------------------------------- reports
def _ms(x: dict[str, float] | None) -> str:
    if not x:
        return "–"
    s = f"{1000 * x['median']:.0f}"
    return s if x["n"] == 1 else f"{s} ({1000 * x['min']:.0f}–{1000 * x['max']:.0f})"


def _x(x: dict[str, float] | None) -> str:
    if not x:
        return "–"
    s = f"{x['median']:.2f}×"
    return s if x["n"] == 1 else f"{s} ({x['min']:.2f}–{x['max']:.2f})"


def _num(x: dict[str, float] | None, fmt: str = "{:.1f}") -> str:
    return "–" if not x else fmt.format(x["median"])


LATENCY_COLS = [("TTFT mean", "ttft_mean_s"), ("TTFT P50", "ttft_median_s"),
                ("TTFT P90", "ttft_p90_s"), ("ITL mean", "itl_mean_s"),
                ("ITL P50", "itl_median_s"), ("ITL P90", "itl_p90_s"),
                ("TPOT mean", "tpot_mean_s"), ("TPOT P90", "tpot_p90_s")]


def tables(agg: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the latency table and the ratio table."""
    head = ["condition", "rate", "system"] + [f"{n} (ms)" for n, _ in LATENCY_COLS] + [
        "out tok/s", "server CPU ms/tok", "decode step: executor P50 (ms)",
        "step cycle P50 (ms)", "load"]
    order = {s: i for i, s in enumerate(SYSTEMS)}
    per = sorted(agg["per_system"], key=lambda e: (e["model"], CONDITIONS.index(e["condition"]),
                                                   e["rate"], order.get(e["system"], 9)))
    out = []
    for model in dict.fromkeys(e["model"] for e in per):
        rows = [[e["condition"], f"{e['rate']:g}", e["system"]]
                + [_ms(e.get(k)) for _, k in LATENCY_COLS]
                + [_num(e.get("output_tokens_per_s")),
                   _num(e.get("server_cpu_ms_per_token"), "{:.0f}"),
                   _ms(e.get("decode_step_median_s")), _ms(e.get("decode_cycle_median_s")),
                   _num(e.get("load_mean"))]
                for e in per if e["model"] == model]
        out.append((f"{model}: median over repeats (range)", head, rows))
        rat = [e for e in agg["ratios"] if e["model"] == model]
        rat.sort(key=lambda e: (CONDITIONS.index(e["condition"]), e["rate"], e["system"]))
        rh = ["condition", "rate", "system / vLLM"] + [n for n, _ in LATENCY_COLS] + [
            "out tok/s"]
        rrows = [[e["condition"], f"{e['rate']:g}", e["system"]]
                 + [_x(e.get(k)) for _, k in LATENCY_COLS] + [_x(e.get("output_tokens_per_s"))]
                 for e in rat]
        if rrows:
            out.append((f"{model}: per-repeat ratio to vLLM (< 1: faster than vLLM; median, "
                        "range)", rh, rrows))
    return out


def markdown(agg: dict[str, Any]) -> str:
    parts = []
    for title, head, rows in tables(agg):
        parts.append(f"{title}\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
                     + "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n")
    return "\n".join(parts)


def print_rich(agg: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=260)  # wide tables: let the terminal wrap rather than truncate
    for title, head, rows in tables(agg):
        t = Table(title=title)
        for h in head:
            t.add_column(h, justify="left" if h in ("condition", "system") else "right")
        for r in rows:
            t.add_row(*r)
        con.print(t)


def plot(records: dict[tuple[str, str, float, str], list[Any]], path: str) -> None:
    """CDFs of TTFT and ITL: one column per (condition, rate), one line per system (requests
    of all repeats together)."""
    import numpy as np

    cols = sorted({(c, r) for (_, c, r, _) in records},
                  key=lambda cr: (CONDITIONS.index(cr[0]), cr[1]))
    models = list(dict.fromkeys(m for (m, _, _, _) in records))
    fig = figure(3.6 * len(cols), 2.8 * 2 * len(models))
    axes = fig.subplots(2 * len(models), len(cols), squeeze=False)
    colors = {"pdserve": "tab:blue", "pdserve-inproc": "tab:green", "vllm": "tab:orange"}
    for mi, model in enumerate(models):
        for j, (cond, rate) in enumerate(cols):
            for i, (label, get) in enumerate((("TTFT", lambda r: [r.ttft]),
                                              ("ITL", lambda r: r.itls))):
                ax = axes[2 * mi + i][j]
                for system in SYSTEMS:
                    recs = records.get((model, cond, rate, system))
                    if not recs:
                        continue
                    v = np.sort([x for r in recs if r.ok for x in get(r) if x is not None])
                    if len(v):
                        ax.step(v * 1000, np.arange(1, len(v) + 1) / len(v), where="post",
                                label=system, color=colors.get(system))
                ax.set_xlabel(f"{label} (ms)")
                ax.set_ylabel("CDF")
                ax.set_title(f"{model}, {cond}, {rate:g} req/s", fontsize=9)
                if label == "ITL":
                    ax.set_xscale("log")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


# ---------------------------------------------------------------------------- driver
def combine(args: argparse.Namespace) -> int:
    """``--combine``: the report of several earlier runs' JSON files together."""

    rows: list[dict[str, Any]] = []
    saved: list[dict[str, Any]] = []
    records: dict[tuple[str, str, float, str], list[Any]] = {}
    for path in args.combine:
        rep = json.loads(Path(path).read_text())
        rows += rep["rows"]
        for e in rep.get("records", []):
            saved.append(e)
            records.setdefault((e["model"], e["condition"], e["rate"], e["system"]), []).extend(
                RequestRecord.from_dict(r) for r in e["records"])
    agg = write_report(args, None, rows, saved, time.time())
    print_rich(agg)
    if args.output_md:
        Path(args.output_md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_md).write_text(markdown(agg))
    if args.plot and records:
        plot(records, args.plot)
    return 0


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.combine:
        return combine(args)
    if threading.current_thread() is not threading.main_thread():
        return measure(args, argv)
    # servers run in their own sessions: unwind (and stop them) on SIGTERM, and on SIGINT even
    # when started in the background (where the shell ignores SIGINT)
    old = {sig: signal.signal(sig, h) for sig, h in ((signal.SIGTERM, _exit_on_signal),
                                                     (signal.SIGINT, signal.default_int_handler))}
    try:
        return measure(args, argv)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def measure(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    systems = [s for s in args.systems if s != "vllm" or args.vllm_python]
    if "vllm" in args.systems and not args.vllm_python:
        print("note: no --vllm-python, vLLM skipped", file=sys.stderr)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    records: dict[tuple[str, str, float, str], list[Any]] = {}
    saved: list[dict[str, Any]] = []
    t_start = time.time()
    for name, model_dir in resolve_models(args.models, args.seed).items():
        model = Path(name).name if os.sep in name else name  # a label for files and tables
        plan = BenchPlan(bench_settings(args, ModelConfig.from_dir(model_dir).vocab_size),
                         args.rates, args.warmup_requests)
        print(f"== {model}: {model_dir}; workload {args.workload}, {args.num_requests} "
              f"requests per rate at {', '.join(f'{r:g}' for r in args.rates)} req/s",
              flush=True)
        for rep in range(args.first_repeat, args.first_repeat + args.repeats):
            for system in run_order(systems, rep):
                tag = f"{model}-{system}-r{rep}"
                step_log = (None if system == "vllm" or args.no_step_log
                            else str((work / f"steps-{tag}.jsonl").resolve()))
                if step_log and os.path.exists(step_log):
                    os.unlink(step_log)
                port = free_port()
                cmd, env = server_command(system, model_dir, port, args, step_log)
                print(f"  r{rep} {system}: starting {' '.join(cmd[1:4])} ... (load "
                      f"{os.getloadavg()[0]:.2f})", flush=True)
                server = ServerProcess(system, cmd, env, port, work / f"serve-{tag}.log")
                try:
                    startup = server.wait_ready(args.startup_timeout)
                    print(f"  r{rep} {system}: ready after {startup:.0f} s", flush=True)
                    results = bench_server(server, plan, step_log, args.request_timeout,
                                           args.conditions, [sys.executable, "-c", BUSY_CODE])
                finally:
                    left = server.stop()
                if left:
                    raise RuntimeError(f"{system}: processes left after stop: {left}")
                for res in results:
                    cond = res["condition"]
                    row = run_row(rep, cond, system, model, res, startup)
                    rows.append(row)
                    records.setdefault((model, cond, res["rate"], system),
                                       []).extend(res["run"].records)
                    if args.save_records:
                        saved.append({"model": model, "repeat": rep, "condition": cond,
                                      "system": system, "rate": res["rate"],
                                      "records": [r.to_dict() for r in res["run"].records]})
                    print(progress_line(row), flush=True)
                write_report(args, argv, rows, saved, t_start)
    agg = write_report(args, argv, rows, saved, t_start)
    print_rich(agg)
    md = markdown(agg)
    if args.output_md:
        Path(args.output_md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_md).write_text(md)
    if args.plot:
        plot(records, args.plot)
    return 0


def write_report(args: argparse.Namespace, argv: Sequence[str] | None,
                 rows: list[dict[str, Any]], saved: list[dict[str, Any]],
                 t_start: float) -> dict[str, Any]:
    """Aggregate and (with ``--output-json``) write everything so far; called after every
    server, so that an interrupted run keeps what it measured."""

    agg = aggregate(rows)
    if args.output_json:
        rep: dict[str, Any] = {
            "command": "python benchmarks/vs_vllm_serve.py " + " ".join(
                argv if argv is not None else sys.argv[1:]),
            "load_at_end": os.getloadavg(),
            "args": vars(args), "machine": machine(), "wall_s": time.time() - t_start,
            "rows": rows, "aggregate": agg}
        if args.save_records:
            rep["records"] = saved
        write_json(args.output_json, rep)
    return agg


def progress_line(row: dict[str, Any]) -> str:
    steps = row.get("steps") or {}
    dec, cyc = steps.get("decode_step_median_s"), steps.get("decode_cycle_median_s")
    return (f"  r{row['repeat']} {row['condition']:5s} {row['rate']:g} req/s "
            f"{row['system']:14s} TTFT mean {1000 * (row['ttft_mean_s'] or 0):6.0f} ms "
            f"P90 {1000 * (row['ttft_p90_s'] or 0):6.0f}; ITL mean "
            f"{1000 * (row['itl_mean_s'] or 0):5.1f} ms P90 {1000 * (row['itl_p90_s'] or 0):5.1f}"
            f"; {row['output_tokens_per_s']:.1f} tok/s; failed {row['num_failed']}, wrong "
            f"length {row['wrong_length']}"
            + (f"; decode step P50 {1000 * dec:.1f} ms" if dec else "")
            + (f", cycle P50 {1000 * cyc:.1f} ms" if cyc else "")
            + f"; load {row['load_mean']:.2f}")


def machine() -> dict[str, Any]:
    import platform

    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


if __name__ == "__main__":
    sys.exit(main())
