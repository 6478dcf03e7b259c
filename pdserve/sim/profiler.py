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
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.config import cdiv
from pdserve.sim.latency import FittedProfile, ProfileSample, fit_profile


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
            max_len: int):
    """An engine on the real executor, as the profiler times it: no prefix caching, a fixed
    torch thread count on CPU."""
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.model_executor import ModelExecutor

    cfg = EngineConfig.from_kwargs(model_dir, device=device, dtype=dtype, block_size=block_size,
                                   num_kv_blocks=num_blocks, max_model_len=max_len,
                                   enable_prefix_caching=False)
    import torch

    # a fixed thread count: the executor's load-adaptive one would change it between samples
    fixed = torch.get_num_threads() if device == "cpu" else None
    return Engine(cfg, ModelExecutor(cfg, num_threads=fixed))


def measure(engine, sample: ProfileSample, repeats: int, stat: str = "median") -> float:
    """Median (``stat="min"``: fastest) seconds of ``repeats`` timed executions of
    ``sample``'s shape (after one warm-up) on ``engine``'s executor, with block tables from its
    own pool. The minimum is the better estimate of the device's own time on a machine shared
    with other work."""
    from pdserve.engine.batch import ScheduledBatch, ScheduledSeq
    from pdserve.request import Request, SamplingParams

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
    ex = engine.executor
    try:
        ex.execute(batch)  # warm-up (allocator, kernels, caches)
        times = [ex.execute(batch).elapsed for _ in range(repeats)]
    finally:
        for r in reqs:
            kv.free(r)
    return min(times) if stat == "min" else statistics.median(times)


def measure_samples(model_dir: str, device: str = "cpu", dtype: str | None = None,
                    grid: ProfileGrid = FULL_GRID, repeats: int | None = None,
                    block_size: int = 16, log: Callable[[str], None] | None = None,
                    progress: bool = True, threads: int | None = 1,
                    stat: str = "median",
                    shapes: Sequence[ProfileSample] | None = None) -> list[ProfileSample]:
    """Time every shape of ``grid`` (or the given ``shapes``, in their order) on
    ``model_dir``'s real executor; the raw samples (what ``pdserve calibrate`` fits efficiency
    factors to).

    ``threads``: torch CPU threads while measuring (default 1, as each Ray instance actor runs;
    ``None`` keeps torch's setting)."""
    import torch

    from pdserve.config import ModelConfig

    if threads is not None and device == "cpu":
        torch.set_num_threads(threads)

    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    dtype = dtype or ("float32" if device == "cpu" else "float16")
    model = ModelConfig.from_dir(model_dir)
    max_len = min(model.max_position_embeddings, 4096)
    shapes = list(shapes) if shapes is not None else grid.shapes(max_len)
    need = max(sum(cdiv(s + n, block_size) for s, n in sh.prefill_chunks)
               + sum(cdiv(c, block_size) for c in sh.decode_context_lens) for sh in shapes)
    engine = profiling_engine(model_dir, device, dtype, need + 1, block_size, max_len)
    reps = repeats or grid.repeats
    say = log or (lambda m: None)
    say(f"profiling {model_dir} on {device} ({dtype}): {len(shapes)} shapes x {reps} repeats")
    samples = []
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(TextColumn("profiling"), BarColumn(), MofNCompleteColumn(),
                   console=Console(stderr=True), disable=not progress, transient=True)
    with bar:
        task = bar.add_task("", total=len(shapes))
        for sh in shapes:
            t = measure(engine, sh, reps, stat)
            samples.append(ProfileSample(sh.prefill_chunks, sh.decode_context_lens, t))
            bar.update(task, advance=1)
    return samples


def profile_executor(model_dir: str, device: str = "cpu", dtype: str | None = None,
                     quick: bool = False, repeats: int | None = None,
                     max_tokens: int | None = None, block_size: int = 16,
                     decode_threshold: int | None = None,
                     log: Callable[[str], None] | None = None,
                     progress: bool = True, threads: int | None = 1) -> FittedProfile:
    """Measure ``model_dir`` on ``device`` over the quick or full grid and fit a profile
    (see :func:`measure_samples`)."""
    grid = QUICK_GRID if quick else FULL_GRID
    if max_tokens is not None:
        grid = ProfileGrid(grid.prefill_lens, grid.prefill_batches, grid.decode_batches,
                           grid.decode_ctx, grid.mixed, max_tokens, grid.repeats)
    samples = measure_samples(model_dir, device, dtype, grid, repeats, block_size, log,
                              progress, threads)
    max_batch = max(len(s.decode_context_lens) for s in samples)
    threshold = decode_threshold or max(max_batch + 1, 2)  # one decode form unless asked
    if device == "cpu":
        hw = "cpu"
    else:
        import torch

        from pdserve.sim.hardware import device_for_cuda_name

        cuda_name = torch.cuda.get_device_name(torch.device(device))
        hw = device_for_cuda_name(cuda_name) or cuda_name  # a catalogue name when there is one
    from pdserve.config import ModelConfig

    return fit_profile(samples, threshold, model=ModelConfig.from_dir(model_dir).name,
                       hardware=hw, tp=1, dtype=dtype or ("float32" if device == "cpu"
                                                          else "float16"),
                       source=f"pdserve profile {'--quick ' if quick else ''}{model_dir}")


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
