"""Measure the real model executor and fit a latency profile (``pdserve profile``).

The engine is built as for serving (:class:`~pdserve.engine.engine.Engine` with the torch
:class:`~pdserve.engine.model_executor.ModelExecutor`); for every shape of the grid the profiler
allocates real block tables from the engine's own block pool, builds the
:class:`~pdserve.engine.batch.ScheduledBatch` the scheduler would build for it and times
``executor.execute`` — once to warm up, then ``repeats`` times, keeping the median. Three kinds
of step are measured:

* prefill batches: ``b`` whole prompts of ``l`` tokens;
* decode steps: ``b`` sequences at context ``c``;
* mixed steps (chunked prefill): one prompt chunk riding along with ``b`` decodes.

Prefill and decode samples fit DistServe's forms (:func:`~pdserve.sim.latency.fit_profile`,
relative least squares); mixed samples check the mixed-step rule and are reported as ``mixed``.

``tp`` > 1 measures a tensor-parallel instance: the sharded executor (rank 0 here, the other
ranks as processes, gloo on CPU, NCCL on CUDA), so the fitted times are those of real sharded
steps, collectives included. The profile carries its ``tp`` (``pdserve simulate`` uses it for
instances of that degree only) and, per kind of step, the share of the step rank 0 spent in
all-reduce / all-gather, waits for the other ranks included (``collectives`` in the file).

``pp`` > 1 measures a pipeline of ``pp`` stages (each of ``tp`` ranks): per shape, one
micro-batch's pass through all stages and the stage time (seconds per micro-batch while the
pipeline is kept full), each fitted to DistServe's forms; the simulator prices a pp instance
with both (:meth:`~pdserve.sim.latency.PipelineModel.split`), not with ``step / pp``.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.config import EngineConfig, ModelConfig, cdiv
from pdserve.engine.batch import ScheduledBatch, ScheduledSeq
from pdserve.engine.engine import Engine
from pdserve.request import Request, SamplingParams
from pdserve.sim.hardware import device_for_cuda_name
from pdserve.sim.latency import (
    PROFILE_FORMAT,
    FittedProfile,
    ProfileSample,
    fit_profile,
    layout_key,
)


@dataclass(frozen=True)
class ProfileGrid:
    """Shapes to measure. ``mixed`` entries are ``(chunk_start, chunk_len, decodes, ctx)``."""

    prefill_lens: Sequence[int]
    prefill_batches: Sequence[int]
    decode_batches: Sequence[int]
    decode_ctx: Sequence[int]
    mixed: Sequence[tuple[int, int, int, int]]
    max_prefill_tokens: int
    repeats: int

    def shapes(self, max_len: int) -> list[ProfileSample]:
        out = [ProfileSample.prefill([n] * b, 0.0)
               for n in self.prefill_lens for b in self.prefill_batches
               if n * b <= self.max_prefill_tokens and n < max_len]
        out += [ProfileSample.decode([c] * b, 0.0)
                for b in self.decode_batches for c in self.decode_ctx if c <= max_len]
        out += [ProfileSample(((s, n),), (c,) * b, 0.0) for s, n, b, c in self.mixed
                if s + n < max_len and c <= max_len]
        return out


FULL_GRID = ProfileGrid(
    prefill_lens=(16, 32, 64, 128, 256, 512, 1024), prefill_batches=(1, 2, 4, 8),
    decode_batches=(1, 2, 4, 8, 16, 32, 64), decode_ctx=(32, 128, 256, 512, 1024),
    mixed=((0, 64, 4, 128), (0, 256, 8, 256), (128, 128, 16, 256), (0, 512, 32, 512),
           (256, 256, 4, 1024)),
    max_prefill_tokens=2048, repeats=5)
QUICK_GRID = ProfileGrid(
    prefill_lens=(16, 64, 128, 256), prefill_batches=(1, 2, 4), decode_batches=(1, 4, 16),
    decode_ctx=(32, 128, 256), mixed=((0, 64, 4, 128), (64, 64, 8, 128)),
    max_prefill_tokens=512, repeats=3)


def profiling_engine(model_dir: str, device: str, dtype: str, num_blocks: int, block_size: int,
            max_len: int, tp: int = 1, pp: int = 1):
    """An engine on the real executor, as the profiler times it: no prefix caching, a fixed
    torch thread count on CPU (each rank's, for ``tp·pp`` > 1; close the executor after)."""
    from pdserve.engine.model_executor import ModelExecutor  # lazy: torch

    cfg = EngineConfig.from_kwargs(model_dir, device=device, dtype=dtype, block_size=block_size,
                                   num_kv_blocks=num_blocks, max_model_len=max_len,
                                   enable_prefix_caching=False)
    import torch

    # a fixed thread count: the executor's load-adaptive one would change it between samples
    fixed = torch.get_num_threads() if device == "cpu" else None
    return Engine(cfg, ModelExecutor(cfg, num_threads=fixed, tp=tp, pp=pp))


def measure(engine, sample: ProfileSample, repeats: int, stat: str = "median") -> float:
    """Median (``stat="min"``: fastest) seconds of ``repeats`` timed executions of
    ``sample``'s shape (after one warm-up) on ``engine``'s executor, with block tables from its
    own pool. The minimum is the better estimate of the device's own time on a machine shared
    with other work."""
    return measure_split(engine, sample, repeats, stat)[0]


def measure_split(engine, sample: ProfileSample, repeats: int, stat: str = "median",
                  ) -> tuple[float, float, float]:
    """:func:`measure`'s seconds, the median share of a run rank 0 spent in collectives (0 for
    one rank) and, on a pipeline, its stage time (:func:`_time_batch`)."""

    kv = engine.scheduler.kv
    vocab = engine.vocab_size or 100
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    reqs, seqs = [], []
    counter = itertools.count()

    def new_request(prompt_len: int, outputs: int) -> Request:
        k = next(counter)
        ids = [(7 * k + 13 * j) % (vocab - 4) + 4 for j in range(prompt_len)]
        r = Request(f"profile-{k}", ids, params)
        for j in range(outputs):
            r.append_token((k + j) % (vocab - 4) + 4)
        reqs.append(r)
        return r

    for start, n in sample.prefill_chunks:
        r = new_request(start + n, 0)
        if not kv.allocate(r, start + n):
            raise ValueError("KV pool too small for the profiling grid")
        r.num_computed_tokens = start
        seqs.append(ScheduledSeq(r, start, n, True))
    for c in sample.decode_context_lens:
        r = new_request(c - 1, 1)
        if not kv.allocate(r, c):
            raise ValueError("KV pool too small for the profiling grid")
        r.num_computed_tokens = c - 1
        seqs.append(ScheduledSeq(r, c - 1, 1, True))
    batch = ScheduledBatch(0, seqs)
    try:
        return _time_batch(engine.executor, batch, repeats, stat)
    finally:
        for r in reqs:
            kv.free(r)


def _time_batch(ex: Any, batch: ScheduledBatch, repeats: int, stat: str,
                ) -> tuple[float, float, float]:
    """Seconds of one ``batch`` on ``ex`` (median, or ``stat="min"``), the median share of it
    rank 0 spent in collectives and, for a pipeline (``ex.pp`` > 1), the seconds per
    micro-batch of ``n`` copies of it through the full pipeline (the stage time, its
    throughput: ``(T_n − T_1) / (n − 1)``; 0 for one stage)."""
    pp = getattr(ex, "pp", 1)
    comm = getattr(ex, "comm", None)  # the TP group's communicator (seconds in collectives)
    pick = min if stat == "min" else statistics.median
    times, shares, bursts = [], [], []
    ex.execute(batch)  # warm-up (allocator, kernels, caches)
    for _ in range(repeats):
        c0 = comm.seconds if comm is not None else 0.0
        t = ex.execute(batch).elapsed
        times.append(t)
        shares.append((comm.seconds - c0) / t if comm is not None and t > 0 else 0.0)
        if pp > 1:
            bursts.append(_burst(ex, batch, STAGE_BURST * pp))
    one = pick(times)
    stage = max(0.0, (pick(bursts) - one) / (STAGE_BURST * pp - 1)) if pp > 1 else 0.0
    return one, statistics.median(shares), stage


STAGE_BURST = 4  # micro-batches per stage a stage-time measurement runs through the pipeline


def _burst(ex: Any, batch: ScheduledBatch, n: int) -> float:
    """Seconds for ``n`` copies of ``batch`` through a pipeline kept full (``ex.pp`` in
    flight, the oldest collected before the next is submitted)."""
    t0 = time.perf_counter()
    flying: deque[Any] = deque()
    for _ in range(n):
        if len(flying) == ex.pp:
            ex.collect(flying.popleft())
        flying.append(ex.submit(batch))
    while flying:
        ex.collect(flying.popleft())
    return time.perf_counter() - t0


def measure_samples(model_dir: str, device: str = "cpu", dtype: str | None = None,
                    grid: ProfileGrid = FULL_GRID, repeats: int | None = None,
                    block_size: int = 16, log: Callable[[str], None] | None = None,
                    progress: bool = True, threads: int | None = 1,
                    stat: str = "median",
                    shapes: Sequence[ProfileSample] | None = None,
                    tp: int = 1) -> list[ProfileSample]:
    """Time every shape of ``grid`` (or the given ``shapes``, in their order) on
    ``model_dir``'s real executor (``tp`` ranks); the raw samples (what ``pdserve calibrate``
    fits efficiency factors to).

    ``threads``: torch CPU threads while measuring, per rank (default 1, as each Ray instance
    actor runs; ``None`` keeps torch's setting)."""
    return [s for s, _, _ in _measure_all(model_dir, device, dtype, grid, repeats, block_size,
                                          log, progress, threads, stat, shapes, tp)]


def _measure_all(model_dir: str, device: str, dtype: str | None, grid: ProfileGrid,
                 repeats: int | None, block_size: int, log: Callable[[str], None] | None,
                 progress: bool, threads: int | None, stat: str,
                 shapes: Sequence[ProfileSample] | None, tp: int, pp: int = 1,
                 ) -> list[tuple[ProfileSample, float, float]]:
    """:func:`measure_samples`, each sample (one micro-batch's pass through all stages) with
    its collective share and, for ``pp`` > 1, the pipeline's stage time."""
    import torch

    from pdserve.model.parallel import check_live_layout  # lazy: torch

    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    model = ModelConfig.from_dir(model_dir)
    check_live_layout(model, tp, pp, device=device)  # before anything loads
    if threads is not None and device == "cpu":
        torch.set_num_threads(threads)
    dtype = dtype or ("float32" if device == "cpu" else "float16")
    max_len = min(model.max_position_embeddings, 4096)
    shapes = list(shapes) if shapes is not None else grid.shapes(max_len)
    need = max(sum(cdiv(s + n, block_size) for s, n in sh.prefill_chunks)
               + sum(cdiv(c, block_size) for c in sh.decode_context_lens) for sh in shapes)
    engine = profiling_engine(model_dir, device, dtype, need + 1, block_size, max_len, tp, pp)
    reps = repeats or grid.repeats
    say = log or (lambda m: None)
    say(f"profiling {model_dir} on {device} ({dtype}{f', tp={tp}' if tp > 1 else ''}"
        f"{f', pp={pp}' if pp > 1 else ''}): "
        f"{len(shapes)} shapes x {reps} repeats")
    samples = []
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(TextColumn("profiling"), BarColumn(), MofNCompleteColumn(),
                   console=Console(stderr=True), disable=not progress, transient=True)
    try:
        with bar:
            task = bar.add_task("", total=len(shapes))
            for sh in shapes:
                t, share, stage = measure_split(engine, sh, reps, stat)
                samples.append((ProfileSample(sh.prefill_chunks, sh.decode_context_lens, t),
                                share, stage))
                bar.update(task, advance=1)
    finally:
        engine.executor.close()  # the other ranks of a TP/PP instance
    return samples


@dataclass(frozen=True)
class MeasuredProfile:
    """A fitted profile and what the fit does not keep: per kind of step (prefill, decode,
    mixed), the share of a step rank 0 spent in collectives (``{"n", "mean", "max"}``; 0 for
    ``tp`` = 1). Saved as the profile's JSON plus a ``collectives`` entry, which
    :meth:`FittedProfile.load` ignores."""

    profile: FittedProfile
    collectives: dict[str, dict[str, float]]

    def to_dict(self) -> dict[str, Any]:
        return {**self.profile.to_dict(), "collectives": self.collectives}

    def save(self, path: str) -> None:
        save_profiles(path, [self])


def save_profiles(path: str, measured: Sequence[MeasuredProfile]) -> None:
    """One profile's file, or (several layouts) one file holding each under ``by_tp`` (keys
    ``"2"`` for tp=2, ``"2x2"`` for tp=2 pp=2: :func:`~pdserve.sim.latency.layout_key`), which
    :meth:`FittedProfile.load` reads for the instance's ``tp`` and ``pp``."""
    if len(measured) == 1:
        doc = measured[0].to_dict()
    else:
        doc = {"format": PROFILE_FORMAT, "version": 1,
               "by_tp": {layout_key(m.profile.tp, m.profile.pp): m.to_dict()
                         for m in measured}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def profile_instance(model_dir: str, device: str = "cpu", dtype: str | None = None,
                     quick: bool = False, repeats: int | None = None,
                     max_tokens: int | None = None, block_size: int = 16,
                     decode_threshold: int | None = None,
                     log: Callable[[str], None] | None = None,
                     progress: bool = True, threads: int | None = 1, tp: int = 1,
                     grid: ProfileGrid | None = None, pp: int = 1) -> MeasuredProfile:
    """Measure ``model_dir`` on ``device`` as an instance of ``tp × pp`` ranks over the quick
    or full grid (or ``grid``) and fit a profile at that layout (see :func:`measure_samples`).

    ``pp`` > 1: every shape is timed as one micro-batch through all stages (the pass: the
    profile's fit) and as a stream of micro-batches through the full pipeline (the stage time,
    fitted as the profile's ``stage``), so that ``pdserve simulate`` prices pp instances with
    this pipeline's measured pass and throughput
    (:meth:`~pdserve.sim.latency.PipelineModel.split`)."""
    grid = grid or (QUICK_GRID if quick else FULL_GRID)
    if max_tokens is not None:
        grid = ProfileGrid(grid.prefill_lens, grid.prefill_batches, grid.decode_batches,
                           grid.decode_ctx, grid.mixed, max_tokens, grid.repeats)
    measured = _measure_all(model_dir, device, dtype, grid, repeats, block_size, log,
                            progress, threads, "median", None, tp, pp)
    model = ModelConfig.from_dir(model_dir)
    dtype = dtype or ("float32" if device == "cpu" else "float16")
    samples = [s for s, _, _ in measured]
    max_batch = max(len(s.decode_context_lens) for s in samples)
    threshold = decode_threshold or max(max_batch + 1, 2)  # one decode form unless asked
    if device == "cpu":
        hw = "cpu"
    else:
        import torch  # lazy: torch

        cuda_name = torch.cuda.get_device_name(torch.device(device))
        hw = device_for_cuda_name(cuda_name) or cuda_name  # a catalogue name when there is one

    flags = (("--quick " if quick else "") + (f"--tp {tp} " if tp > 1 else "")
             + (f"--pp {pp} " if pp > 1 else ""))
    prof = fit_profile(samples, threshold, model=model.name, hardware=hw, tp=tp, dtype=dtype,
                       source=f"pdserve profile {flags}{model_dir}")
    if pp > 1:  # the pass is `prof`; the stage time is fitted beside it
        stages = [replace(s, seconds=stage) for s, _, stage in measured]
        prof = replace(prof, pp=pp, stage=fit_profile(
            stages, threshold, model=model.name, hardware=hw, tp=tp, dtype=dtype,
            source=f"{prof.source} (stage time)"))
    collectives = {}
    for kind in ("prefill", "decode", "mixed"):
        shares = [share for s, share, _ in measured if s.kind == kind]
        if shares:
            collectives[kind] = {"n": len(shares), "mean": sum(shares) / len(shares),
                                 "max": max(shares)}
    return MeasuredProfile(prof, collectives)


def profile_executor(model_dir: str, device: str = "cpu", dtype: str | None = None,
                     quick: bool = False, repeats: int | None = None,
                     max_tokens: int | None = None, block_size: int = 16,
                     decode_threshold: int | None = None,
                     log: Callable[[str], None] | None = None,
                     progress: bool = True, threads: int | None = 1,
                     tp: int = 1) -> FittedProfile:
    """:func:`profile_instance`'s fitted profile."""
    return profile_instance(model_dir, device, dtype, quick, repeats, max_tokens, block_size,
                            decode_threshold, log, progress, threads, tp).profile


def saturation_chunk_size(latency: Any, max_tokens: int = 4096, share: float = 0.9,
                          ) -> tuple[int, list[tuple[int, float]]]:
    """TetriInfer's ChunkSize (§3.3.3): the fewest prefill tokens per step (powers of two from
    16) at which step throughput reaches ``share`` of its peak — past it, more tokens per step
    add latency, not throughput. Returns it and the ``(tokens, tokens/s)`` curve."""
    curve = []
    n = 16
    while n <= max_tokens:
        curve.append((n, n / latency.prefill_time([n])))
        n *= 2
    peak = max(t for _, t in curve)
    return next(n for n, t in curve if t >= share * peak), curve
