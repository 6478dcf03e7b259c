"""The torch executor: runs scheduled batches of a real model against a paged KV cache."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Protocol

import torch

from pdserve.checkpoints import resolve_model
from pdserve.config import EngineConfig, ModelConfig, cdiv, kv_cache_blocks
from pdserve.engine.batch import ExecuteResult, ScheduledBatch
from pdserve.engine.cpu_threads import ThreadGovernor
from pdserve.engine.executor import KVPullError
from pdserve.engine.kv_reshard import reshard_plan
from pdserve.grammar import GrammarCompiler, GrammarState
from pdserve.model import cpu_kernels
from pdserve.model.layers import (
    build_attention_metadata,
    gather_elements_per_block,
    prepack_linears,
)
from pdserve.model.loader import DTYPES, MODEL_CLASSES, load_model, load_weights, weight_files
from pdserve.model.parallel import Communicator, TPLayout, master_store, stage_layers
from pdserve.model.sampler import Sampler, SampleRow
from pdserve.model.tp import build_sharded, iter_shard, stage_renamer
from pdserve.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def sliding_window(cfg: ModelConfig) -> int | None:
    """The attention window every layer uses, or ``None`` for full attention.

    Mistral-style configs apply ``sliding_window`` to all layers. Qwen2's per-layer windows
    (``use_sliding_window=True``) are not supported."""
    hf = cfg.hf_config
    if cfg.family == "qwen2":
        if hf.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=True is not supported")
        return None
    if cfg.family == "llama" and hf.get("sliding_window"):
        return int(hf["sliding_window"])
    return None


def read_eos_token_ids(model_dir: str, model_config: ModelConfig) -> tuple[int, ...]:
    """EOS ids of ``config.json`` followed by any extra ones in ``generation_config.json``."""
    ids = list(model_config.eos_token_ids)
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        for t in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if int(t) not in ids:
                ids.append(int(t))
    return tuple(ids)


class ModelExecutor:
    """Implements :class:`pdserve.engine.executor.Executor` with a torch model on CPU or CUDA.

    The KV cache is one tensor ``[layers, 2, kv_heads, num_kv_blocks, block_size, head_dim]``
    (head-major; see :func:`pdserve.model.layers.paged_attention`).
    Set ``capture_logits = True`` to keep the float32 logits of the last step's sampled rows in
    ``last_logits`` (``[num_sampled, vocab]``, on CPU) for tests.
    """

    def __init__(self, config: EngineConfig, num_threads: int | None = None, tp: int = 1,
                 rank: int = 0, address: tuple[str, int] | None = None, pp: int = 1,
                 ranks: RankLauncher | None = None, own_device: bool = False) -> None:
        """``num_threads``: torch's CPU threads for this process, fixed (a Ray instance actor
        uses 1). ``None``: torch's count; with ``PDSERVE_ADAPTIVE_THREADS=1`` on CPU each step
        runs as many threads as there are idle cores instead, up to torch's count at start
        (:class:`pdserve.engine.cpu_threads.ThreadGovernor`; opt-in: measured faster under heavy
        load from other sessions, slower beside a single busy process: docs/benchmarks.md,
        "pdserve vs vLLM CPU").

        ``tp > 1``: a tensor-parallel instance (:mod:`pdserve.model.tp`). Rank 0 (the default)
        is the driver: it starts the other ranks through ``ranks`` (default
        :class:`ChildRanks`: processes on this machine; the Ray runtime passes actors in the
        instance's placement group), sends each of them every step's batch once
        (:meth:`execute`) and alone samples. A rank started with ``rank > 0`` and the driver's
        rendezvous ``address`` serves it in :meth:`serve_ranks` (:func:`serve_rank`);
        ``own_device``: this process was given one CUDA device of its own (a Ray actor's
        ``num_gpus=1``), which it uses instead of the ``rank``-th from the current one.
        One rank dying fails the next step (the instance is dead). In float32 a TP instance's
        greedy tokens equal TP1's (tests); in bfloat16/float16 the partial products are rounded
        before they are summed, so a near tie between two logits may break the other way.

        ``pp > 1``: the layers split into ``pp`` balanced stages, each a TP group of ``tp``
        ranks (global rank ``stage * tp + r``); each stage loads only its layers' weights (the
        embedding on the first, the final norm and LM head on the last) and holds only its
        layers' KV. A step's hidden states go stage to stage point to point, and the last
        stage sends the sampled rows' logits to the driver (rank 0, on the first stage). Up to
        ``pp`` micro-batches are in flight: :meth:`submit` runs stage 0 of one and returns
        before the later stages are done with it, :meth:`collect` waits for its logits and
        samples (:class:`pdserve.engine.pipeline.PipelinedEngine` drives ``pp`` virtual
        engines over one such executor). Every message of a PP instance is point to point,
        stage to stage beside the hidden states, so that stage 0 never waits on a later one."""
        self.config = config
        self.tp, self.pp, self.rank = tp, pp, rank
        self.world = tp * pp
        self.stage, self.tp_rank = divmod(rank, tp)
        self.last_stage = self.stage == pp - 1
        self.ranks: RankLauncher | None = None  # rank 0 of a group: how the others run
        if self.world > 1 and num_threads is None and config.device == "cpu":
            num_threads = max(1, (os.cpu_count() or 1) // self.world)
        self.governor: ThreadGovernor | None = None
        if num_threads is not None and config.device == "cpu":
            torch.set_num_threads(num_threads)
        elif config.device == "cpu" and os.environ.get("PDSERVE_ADAPTIVE_THREADS") == "1":
            self.governor = ThreadGovernor(torch.get_num_threads())
        self.thread_steps: Counter[int] = Counter()  # steps run per thread count (CPU)
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            base = self.device.index  # rank r of a group takes the r-th device from there
            if base is None:
                base = torch.cuda.current_device()
            self.device = torch.device("cuda", base + (0 if own_device else rank))
            torch.cuda.set_device(self.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        # serialises the group's collectives: a KV export (another thread) waits for the step
        self._group_lock = threading.Lock() if self.world > 1 else contextlib.nullcontext()
        # PP: micro-batches submitted / collected so far, the most in flight at once, sends not
        # yet waited for ((step, work, tensor)), and (``trace = []``) rank 0's event log
        self.num_submitted = self.num_collected = self.max_in_flight = 0
        self._outbox: deque[tuple[int, Any, Any]] = deque()
        self.trace: list[tuple[str, int]] | None = None
        self.loaded_bytes = 0  # checkpoint bytes this rank read
        self.rank_bytes = [0]  # on the driver: every rank's loaded_bytes, in rank order
        # direct KV hand-off (set by the Ray runtime, :meth:`export_kv`): on rank 0 the handle
        # through which each rank of this instance serves :meth:`kv_part`, in rank order; on
        # every rank, how to fetch pieces from another instance's ranks
        self.kv_sources: list[Any] | None = None
        self.kv_fetch: KVFetch | None = None
        self.kv_imports: Counter[str] = Counter()  # rank 0: imports by path (direct, funnel)
        if self.world == 1:
            self.comm = self.group = Communicator()
            self.model, self.model_config = load_model(config.model, config.dtype,
                                                       str(self.device))
            self.local_config = self.model_config
            self.loaded_bytes = sum(p.numel() * p.element_size()
                                    for p in self.model.parameters())
            self.rank_bytes = [self.loaded_bytes]
        else:
            self._load_sharded(address, ranks)
        if self.device.type == "cpu":
            prepack_linears(getattr(self.model, "model", self.model))  # oneDNN layout
        self.eos_token_ids = read_eos_token_ids(config.model, self.model_config)
        self.sliding_window = sliding_window(self.model_config)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(self.generator)
        self.capture_logits = False
        self._grammar_compiler: Any = None
        self.last_logits: torch.Tensor | None = None
        self.num_kv_blocks = self._plan_num_blocks()
        self.kv_cache = self._allocate(self.num_kv_blocks)
        self._workspace = torch.empty(0, dtype=self.dtype, device=self.device)
        # decode attention reads the paged cache in place (CPU, float32) when the kernel builds
        self.decode_kernel = (self.device.type == "cpu" and self.dtype == torch.float32
                              and cpu_kernels.available())

    def _load_sharded(self, address: tuple[str, int] | None,
                      ranks: RankLauncher | None) -> None:
        model_dir = resolve_model(self.config.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.layout = TPLayout(self.model_config, self.tp, self.tp_rank)
        self.stages = stage_layers(self.model_config.num_layers, self.pp)
        lo, hi = self.stages[self.stage]
        self.local_config = replace(self.layout.local_config(), num_layers=hi - lo)
        store = None
        if self.rank == 0:
            self.ranks = ranks if ranks is not None else ChildRanks()
            store = master_store(self.world)
            self.ranks.start(self.config, self.tp, self.pp, (self.ranks.host, store.port),
                             torch.get_num_threads() if self.governor is None else 1)
            weakref.finalize(self, self.ranks.stop, 0.0)
        device = self.config.device
        if self.pp == 1:
            self.comm = self.group = Communicator(self.rank, self.tp, store, address, device)
        else:  # the whole instance, and this stage's TP group
            self.group = Communicator(self.rank, self.world, store, address, device)
            self.comm = (Communicator(self.tp_rank, self.tp, self.group._store, None, device,
                                      prefix=f"stage{self.stage}/")
                         if self.tp > 1 else Communicator())
        cls = MODEL_CLASSES.get(self.model_config.family)
        if cls is None:
            raise ValueError(f"unsupported model family {self.model_config.family!r}")
        layers = (lo, hi) if self.pp > 1 else None
        self.model = build_sharded(cls, self.layout, self.comm, self.dtype, str(self.device),
                                   layers)
        rename = (stage_renamer(cls, self.model_config, (lo, hi), self.model) if self.pp > 1
                  else None)
        counter = [0]
        load_weights(self.model, iter_shard(weight_files(model_dir), self.layout, counter,
                                            rename))
        self.loaded_bytes = counter[0]
        got = self.group.gather_cpu(torch.tensor([counter[0]], dtype=torch.int64))
        self.rank_bytes = [int(t.item()) for t in got] if got is not None else []
        log.info("rank %d/%d (stage %d, layers %d-%d) loaded %.1f MiB of weights", self.rank,
                 self.world, self.stage, lo, hi - 1, counter[0] / 2**20)

    # ------------------------------------------------------------------ memory
    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers (K and V) on this rank."""
        return self.block_size * self.local_config.kv_bytes_per_token(self.config.dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _allocate(self, num_blocks: int) -> torch.Tensor:
        c = self.local_config
        return torch.zeros(c.num_layers, 2, c.num_kv_heads, num_blocks, self.block_size,
                           c.head_dim, dtype=self.dtype, device=self.device)

    def _plan_num_blocks(self) -> int:
        """Every rank of a group holds the same blocks (of its own KV heads): on CPU as many as
        the unsharded model would, on CUDA as many as rank 0's memory allows."""
        if self.config.cache.num_kv_blocks is not None or self.device.type != "cuda":
            return kv_cache_blocks(self.model_config, self.config, device_memory_bytes=None)
        peak = self._profile_activation_bytes()
        _, total = torch.cuda.mem_get_info(self.device)
        n = kv_cache_blocks(self.local_config, self.config, device_memory_bytes=total,
                            weight_bytes=torch.cuda.memory_allocated(self.device),
                            reserved_bytes=peak)
        return int(self.group.broadcast_object(n))

    def _profile_activation_bytes(self) -> int:
        """Peak extra CUDA memory of a forward over a full token budget (weights excluded)."""
        sched = self.config.scheduler
        total = sched.token_budget
        seq_len = min(sched.max_model_len, self.model_config.max_position_embeddings, total)
        lens = [seq_len] * (total // seq_len) + ([total % seq_len] if total % seq_len else [])
        per_seq = cdiv(seq_len, self.block_size)
        seqs = []
        for i, n in enumerate(lens):
            req = SimpleNamespace(request_id=f"profile-{i}", all_token_ids=[0] * n,
                                  block_ids=list(range(i * per_seq, (i + 1) * per_seq)))
            seqs.append(SimpleNamespace(request=req, start=0, num_tokens=n, sample=True))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        kv = self._allocate(per_seq * len(lens))
        with torch.inference_mode():
            meta = build_attention_metadata(seqs, self.block_size, self.device, self.dtype,
                                            self.sliding_window)
            hidden = None
            if self.stage > 0:  # a stage's activations without its predecessors
                hidden = torch.zeros(total, self.model_config.hidden_size, dtype=self.dtype,
                                     device=self.device)
            out = self.model(meta, kv, hidden) if hidden is not None else self.model(meta, kv)
            if self.last_stage:
                self.model.compute_logits(out).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before - kv.numel() * kv.itemsize
        del kv, meta
        torch.cuda.empty_cache()
        return max(int(peak), 0)

    # ------------------------------------------------------------------ execution
    def execute(self, batch: ScheduledBatch) -> ExecuteResult:
        """One batched forward over ``batch.seqs``; one sampled token per ``seq.sample``."""
        if not batch.seqs:
            return ExecuteResult(sampled=[], elapsed=0.0)
        if self.pp > 1:  # one micro-batch through the whole pipeline
            return self.collect(self.submit(batch))
        t0 = time.perf_counter()
        self._govern()
        sampled: list[int] = []
        logprobs = None
        with self._group_lock, torch.inference_mode():
            if self.world > 1:
                self.group.broadcast_object(("step", step_plan(batch.seqs, self.block_size)))
            logits = self._forward(batch.seqs)
            if logits is not None:
                sampled, logprobs = self._sample(logits, batch.seqs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return ExecuteResult(sampled=sampled, elapsed=time.perf_counter() - t0,
                             logprobs=logprobs)

    def _govern(self) -> None:
        if self.governor is not None:
            n = self.governor.threads()
            if n != torch.get_num_threads():
                torch.set_num_threads(n)
            self.thread_steps[n] += 1

    def _forward(self, seqs: Any) -> torch.Tensor | None:
        """One forward of ``seqs`` on this rank (pp = 1); the logits of the sampled rows
        (``None`` when none samples)."""
        meta = build_attention_metadata(seqs, self.block_size, self.device, self.dtype,
                                         self.sliding_window, decode_kernel=self.decode_kernel)
        meta.workspace = self._gather_workspace(meta.max_gather_blocks)
        hidden = self.model(meta, self.kv_cache)
        if not any(s.sample for s in seqs):
            return None
        return self.model.compute_logits(hidden)

    # ------------------------------------------------------------------ pipeline (pp > 1)
    def submit(self, batch: ScheduledBatch, block_offset: int = 0) -> InFlight:
        """Start ``batch`` (its block ids shifted by ``block_offset``: a virtual engine's share
        of the cache) down the pipeline: rank 0 posts the receive of its logits, sends its plan
        on and computes stage 0, then returns while the later stages work. :meth:`collect` it,
        in the order submitted. With pp = 1 the whole step runs here."""
        t0 = time.perf_counter()
        if self.pp == 1:
            if block_offset:
                raise ValueError("a block offset needs a pipeline-parallel executor")
            return InFlight(batch, -1, t0, result=self.execute(batch))
        self._govern()
        plan = step_plan(batch.seqs, self.block_size, block_offset)
        n_sample = sum(1 for s in batch.seqs if s.sample)
        with self._group_lock, torch.inference_mode():
            seq = self.num_submitted
            self.num_submitted += 1
            self.max_in_flight = max(self.max_in_flight, seq + 1 - self.num_collected)
            if self.trace is not None:
                self.trace.append(("forward", seq))
            work = buf = None
            if n_sample:  # posted first: the last stage's send never waits for rank 0
                buf = torch.empty(n_sample, self.model_config.vocab_size, dtype=self.dtype)
                work = self.group.irecv(buf, self._last_rank, TAG_LOGITS, cpu=True)
            self._post(("step", seq, plan))
            self._stage_forward(plan_seqs(plan), seq)
        return InFlight(batch, seq, t0, work, buf)

    def collect(self, f: InFlight) -> ExecuteResult:
        """Wait for a submitted micro-batch's logits and sample them."""
        if f.result is not None:
            return f.result
        sampled: list[int] = []
        logprobs = None
        if f.work is not None:
            f.work.wait()
            with torch.inference_mode():
                sampled, logprobs = self._sample(f.logits.to(self.device), f.batch.seqs)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        self.num_collected += 1
        if self.trace is not None:
            self.trace.append(("logits", f.seq))
        return ExecuteResult(sampled=sampled, elapsed=time.perf_counter() - f.t0,
                             logprobs=logprobs)

    @property
    def _last_rank(self) -> int:
        """TP rank 0 of the last stage: it sends the logits."""
        return (self.pp - 1) * self.tp

    def _post(self, msg: tuple[Any, ...]) -> None:
        """Send a message (``(kind, step, ...)``) on down the pipeline: from rank 0 to the other
        ranks of stage 0 and to the next stage, from any other rank to the next stage."""
        dsts = list(range(1, self.tp)) if self.rank == 0 else []
        if not self.last_stage:
            dsts.append(self.rank + self.tp)
        for d in dsts:
            for work, t in self.group.isend_object(msg, d, TAG_MSG):
                self._outbox.append((msg[1], work, t))

    def _reap(self, seq: int | None = None) -> None:
        """Wait for this rank's sends of micro-batches before ``seq - pp`` (all when ``None``):
        their receivers are past them (at most ``pp`` are in flight), so this returns at once
        and bounds what the outbox holds."""
        box = self._outbox
        while box and (seq is None or box[0][0] <= seq - self.pp):
            box.popleft()[1].wait()

    def _stage_forward(self, seqs: Any, seq: int) -> None:
        """This rank's stage of micro-batch ``seq``: hidden states in from the previous stage,
        out to the next (without waiting for it); the last stage sends the logits to rank 0."""
        self._reap(seq)
        meta = build_attention_metadata(seqs, self.block_size, self.device, self.dtype,
                                         self.sliding_window, decode_kernel=self.decode_kernel)
        meta.workspace = self._gather_workspace(meta.max_gather_blocks)
        if self.stage > 0:
            like = torch.empty(meta.input_ids.shape[0], self.model_config.hidden_size,
                               dtype=self.dtype, device=self.device)
            hidden = self.model(meta, self.kv_cache,
                                self.group.recv(like, self.rank - self.tp, tag=TAG_HIDDEN))
        else:
            hidden = self.model(meta, self.kv_cache)
        if not self.last_stage:
            hidden = hidden.contiguous()
            self._outbox.append((seq, self.group.isend(hidden, self.rank + self.tp,
                                                       TAG_HIDDEN), hidden))
        elif any(s.sample for s in seqs):
            logits = self.model.compute_logits(hidden)
            if self.rank == self._last_rank:
                self.group.send(logits.cpu(), 0, cpu=True, tag=TAG_LOGITS)

    # ------------------------------------------------------------------ tensor-parallel group
    def serve_ranks(self) -> None:
        """A rank > 0: follow the driver's steps and KV moves until it stops (or dies)."""
        if self.pp > 1:
            self._serve_stage()
            return
        while True:
            msg = self.group.broadcast_object()
            kind = msg[0]
            if kind == "step":
                with torch.inference_mode():
                    self._forward(plan_seqs(msg[1]))
            elif kind == "export":
                self._export(msg[1])
            elif kind == "import":
                self._import(msg[1], self.comm.scatter_cpu(None, torch.empty(
                    msg[2], dtype=DTYPES[msg[3]])))
            elif kind == "pull":
                failed = self._pull(msg[1], msg[2]) is not None
                self.group.gather_cpu(torch.tensor([int(failed)]))
            elif kind == "stop":
                return

    def _serve_stage(self) -> None:
        """A rank > 0 of a PP instance: take each message from the rank before it in the
        pipeline, pass it on, and do its part (a stage of a step, a KV export or import)."""
        src = self.rank - self.tp if self.stage > 0 else 0
        while True:
            msg = self.group.recv_object(src, TAG_MSG)
            self._post(msg)
            kind = msg[0]
            if kind == "step":
                with torch.inference_mode():
                    self._stage_forward(plan_seqs(msg[2]), msg[1])
            elif kind == "export":
                self.group.send(self._export_local(msg[2]), 0, cpu=True, tag=TAG_KV)
            elif kind == "import":
                like = torch.empty(self.local_config.num_layers, 2,
                                   self.local_config.num_kv_heads, len(msg[2]),
                                   *self.kv_cache.shape[4:], dtype=DTYPES[msg[3]])
                self._import(msg[2], self.group.recv(like, 0, cpu=True, tag=TAG_KV))
            elif kind == "pull":
                failed = self._pull(msg[2], msg[3]) is not None
                self.group.send(torch.tensor([int(failed)]), 0, cpu=True, tag=TAG_KV)
            elif kind == "stop":
                self._reap()
                return

    def close(self) -> None:
        """Stop the other ranks of a group (rank 0; nothing to do for one rank; once)."""
        ranks, self.ranks = self.ranks, None
        if self.rank == 0 and ranks is not None:
            with contextlib.suppress(Exception), self._group_lock:
                if self.pp > 1:
                    self._post(("stop", self.num_submitted))
                    self._reap()
                else:
                    self.group.broadcast_object(("stop",))
            ranks.stop()

    def _gather_workspace(self, num_blocks: int) -> torch.Tensor:
        """A buffer for ``num_blocks`` gathered KV blocks of one layer, reused across layers and
        steps (grown geometrically) so that attention does not allocate per layer."""
        need = num_blocks * gather_elements_per_block(self.kv_cache)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(max(need, self._workspace.numel() * 3 // 2),
                                          dtype=self.dtype, device=self.device)
        return self._workspace

    def _sample(self, logits: torch.Tensor, seqs: Any) -> tuple[list[int], Any]:
        """One token (and its logprobs) per sampling row of ``seqs`` from their ``logits``."""
        rows = [self._sample_row(s.request, logits.shape[-1]) for s in seqs if s.sample]
        if self.capture_logits:
            self.last_logits = logits.float().cpu()
        out = self.sampler(logits, rows)
        return out.token_ids, out.logprobs

    def _sample_row(self, req: Any, vocab: int | None = None) -> SampleRow:
        p = req.params
        index = req.num_output_tokens
        stop: tuple[int, ...] = ()
        if index < p.min_tokens:
            stop = tuple(p.stop_token_ids) + (() if p.ignore_eos else self.eos_token_ids)
        # per-request logit processing: the request's tokens and its grammar state
        allowed = None
        if p.guided_regex is not None:
            allowed = self._grammar_mask(req, vocab or self.model_config.vocab_size)
        return SampleRow(p, index, stop, req.prompt_token_ids, req.output_token_ids, allowed)

    def _grammar_mask(self, req: Any, vocab: int) -> Any:
        """The structured-output mask of ``req``'s next token; its guide lives on the request
        (``req.grammar``) and follows the output tokens, wherever they were sampled."""
        if req.grammar is None:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler.for_tokenizer(
                    load_tokenizer(self.config.model), self.eos_token_ids[0])
            try:
                index = self._grammar_compiler.compile(req.params.guided_regex)
            except ValueError as e:  # the server checks first; direct engine users may not
                log.error("request %s: %s; it ends now", req.request_id, e)
                index = None
            req.grammar = GrammarState(index, self.eos_token_ids[0])
        return req.grammar.bitmask(req.output_token_ids, vocab)

    # ------------------------------------------------------------------ KV hand-off
    def export_kv(self, block_ids: list[int]) -> dict[str, Any]:
        """The shape facts :meth:`import_kv` checks and either ``"kv"``: the blocks' KV with
        every layer and KV head, a CPU tensor ``[layers, 2, kv_heads, len(block_ids),
        block_size, head_dim]`` in the cache's dtype, gathered on rank 0 (the funnel); or, when
        this instance's ranks serve their own slices (``kv_sources``), ``"sources"``: their
        handles, this instance's ``tp`` and ``pp`` and the source ``block_ids``, from which each
        destination rank pulls its part (:meth:`kv_part`) with nothing gathered here. The
        blocks must stay held until the destination has imported them (the prefill role keeps
        them until ``Release``)."""
        c = self.model_config
        facts = {"num_blocks": len(block_ids), "num_layers": c.num_layers,
                 "block_size": self.block_size, "num_kv_heads": c.num_kv_heads,
                 "head_dim": c.head_dim, "dtype": self.config.dtype}
        if self.kv_sources is not None:
            return {**facts, "kv": None, "sources": list(self.kv_sources), "tp": self.tp,
                    "pp": self.pp, "block_ids": list(block_ids)}
        with self._group_lock:
            if self.pp > 1:
                self._post(("export", self.num_submitted, block_ids))
            elif self.world > 1:
                self.group.broadcast_object(("export", block_ids))
            kv = self._export(block_ids)
        return {**facts, "kv": kv}

    def kv_part(self, block_ids: list[int], layers: tuple[int, int],
                heads: tuple[int, int]) -> torch.Tensor:
        """Layers ``[layers[0], layers[1])`` and KV heads ``[heads[0], heads[1])`` (model-wide
        indices, within this rank's) of the blocks, on the CPU: what a destination rank pulls
        in a direct hand-off. Runs beside the step loop without a lock: it reads only held
        blocks, which no step writes, and takes no collective."""
        lo = self.stages[self.stage][0] if self.world > 1 else 0
        h0 = self.layout.kv_head_range()[0] if self.world > 1 else 0
        n_layers, n_heads = self.local_config.num_layers, self.local_config.num_kv_heads
        if not (lo <= layers[0] < layers[1] <= lo + n_layers
                and h0 <= heads[0] < heads[1] <= h0 + n_heads):
            raise ValueError(f"rank {self.rank} holds layers {lo}-{lo + n_layers - 1} and KV "
                             f"heads {h0}-{h0 + n_heads - 1}, not {layers} x {heads}")
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        with torch.no_grad():
            part = self.kv_cache[layers[0] - lo : layers[1] - lo, :,
                                 heads[0] - h0 : heads[1] - h0]
            return part.index_select(3, idx).cpu()

    def _export_local(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's layers and KV heads of the blocks, on the CPU."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        with torch.no_grad():  # not inference_mode: the payload is an ordinary tensor
            return self.kv_cache.index_select(3, idx).cpu()

    def _export(self, block_ids: list[int]) -> torch.Tensor | None:
        """The blocks' KV with every layer and KV head, in order, on rank 0 (the layout of an
        unsharded instance, so that instances of any TP and PP degrees exchange it); ``None``
        on the other ranks."""
        kv = self._export_local(block_ids)
        if self.world == 1:
            return kv
        if self.pp > 1:  # on rank 0: every rank sends its (layers, KV heads) piece here
            stages = []
            for s, (lo, hi) in enumerate(self.stages):
                parts = [kv if s == 0 and r == 0 else self.group.recv(
                    torch.empty(hi - lo, *kv.shape[1:], dtype=kv.dtype), s * self.tp + r,
                    cpu=True, tag=TAG_KV) for r in range(self.tp)]
                stages.append(torch.cat(parts[:: self.layout.kv_replicas], dim=2))
            return torch.cat(stages, dim=0)
        gathered = self.comm.gather_cpu(kv)
        if gathered is None:
            return None
        # one copy of each KV head: the first rank of each replica set
        return torch.cat(gathered[:: self.layout.kv_replicas], dim=2)

    def import_kv(self, block_ids: list[int], payload: dict[str, Any]) -> None:
        """Write a payload of :meth:`export_kv` (from any executor of the same model) into
        ``block_ids``; a different cache dtype is converted. A direct payload (``"sources"``)
        is pulled by every rank, each taking its own slices from the source ranks that hold
        them (:func:`pdserve.engine.kv_reshard.reshard_plan`); ``KVPullError`` when any rank's
        pull failed (a source rank died: the transfer failed, this instance lives on)."""
        c = self.model_config
        if payload.get("sources") is not None:
            self._check_facts(block_ids, payload)
            self._import_direct(block_ids, payload)
            self.kv_imports["direct"] += 1
            return
        kv = payload["kv"]
        want = (c.num_layers, 2, c.num_kv_heads, len(block_ids), *self.kv_cache.shape[4:])
        if tuple(kv.shape) != want:
            raise ValueError(f"KV payload of shape {tuple(kv.shape)} does not fit "
                             f"{len(block_ids)} blocks of this cache (expected {want})")
        with self._group_lock:
            if self.pp > 1:  # each rank is sent its own layers' KV heads only
                dtype = next(k for k, v in DTYPES.items() if v == kv.dtype)
                self._post(("import", self.num_submitted, block_ids, dtype))
                for g in range(1, self.world):
                    s, r = divmod(g, self.tp)
                    self.group.send(kv[slice(*self.stages[s]), :,
                                       slice(*self.layout.kv_head_range(r))], g, cpu=True,
                                    tag=TAG_KV)
                kv = kv[slice(*self.stages[0]), :, slice(*self.layout.kv_head_range(0))]
            elif self.tp > 1:  # each rank is sent its own KV heads only
                parts = [kv[:, :, slice(*self.layout.kv_head_range(r))]
                         for r in range(self.tp)]
                dtype = next(k for k, v in DTYPES.items() if v == kv.dtype)
                self.comm.broadcast_object(("import", block_ids, tuple(parts[0].shape), dtype))
                kv = self.comm.scatter_cpu(parts, parts[0])
            self._import(block_ids, kv)
        self.kv_imports["funnel"] += 1

    def _check_facts(self, block_ids: list[int], payload: dict[str, Any]) -> None:
        c = self.model_config
        want = (len(block_ids), c.num_layers, self.block_size, c.num_kv_heads, c.head_dim)
        got = tuple(payload[k] for k in ("num_blocks", "num_layers", "block_size",
                                         "num_kv_heads", "head_dim"))
        if got != want:
            raise ValueError(f"KV of (blocks, layers, block size, KV heads, head dim) {got} "
                             f"does not fit {want} of this cache")

    def _import_direct(self, block_ids: list[int], desc: dict[str, Any]) -> None:
        """Rank 0 of a direct import: every rank pulls its part; then all report."""
        with self._group_lock:
            if self.pp > 1:
                self._post(("pull", self.num_submitted, block_ids, desc))
            elif self.world > 1:
                self.group.broadcast_object(("pull", block_ids, desc))
            error = self._pull(block_ids, desc)
            if self.pp > 1:
                flags = [int(self.group.recv(torch.zeros(1, dtype=torch.int64), g, cpu=True,
                                             tag=TAG_KV).item()) for g in range(1, self.world)]
            elif self.world > 1:
                got = self.group.gather_cpu(torch.tensor([int(error is not None)]))
                flags = [int(t.item()) for t in (got or [])[1:]]
            else:
                flags = []
        failed = [g + 1 for g, f in enumerate(flags) if f]
        if error is not None or failed:
            raise KVPullError(error or f"ranks {failed} failed to pull their KV slices")

    def _pull(self, block_ids: list[int], desc: dict[str, Any]) -> str | None:
        """Fetch this rank's slices of a direct payload and write them; why not, or ``None``."""
        c = self.model_config
        plan = reshard_plan(c.num_layers, c.num_kv_heads, (desc["tp"], desc["pp"]),
                            (self.tp, self.pp), self.rank)
        try:
            if self.kv_fetch is None:
                raise RuntimeError("this instance cannot pull KV from another one's ranks")
            got = self.kv_fetch([(desc["sources"][p.src_rank], desc["block_ids"], p.layers,
                                  p.heads) for p in plan])
        except Exception as e:  # a source rank died, or no longer answers
            log.info("rank %d: KV pull failed: %s", self.rank, e)
            return f"{type(e).__name__}: {e}"
        rows: list[list[torch.Tensor]] = []
        for i, (p, t) in enumerate(zip(plan, got, strict=True)):
            if i == 0 or p.layers != plan[i - 1].layers:
                rows.append([])
            rows[-1].append(t)
        kv = torch.cat([torch.cat(r, dim=2) for r in rows], dim=0)
        self._import(block_ids, kv)
        return None

    def _import(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write this rank's KV heads of ``block_ids``."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            self.kv_cache.index_copy_(3, idx, kv.to(self.device, self.dtype))


# Fetches the pieces of a direct KV hand-off, each ``(source handle, block ids, layers, KV
# heads)`` answered by that source rank's :meth:`ModelExecutor.kv_part`, in order (the Ray
# runtime's: pdserve.cluster.rank_group.fetch_kv_parts).
KVFetch = Callable[[list[tuple[Any, list[int], tuple[int, int], tuple[int, int]]]],
                   list[torch.Tensor]]


# ---------------------------------------------------------------------- tensor-parallel ranks
# point-to-point tags of a PP instance's group (a message takes two: its size, its bytes)
TAG_HIDDEN, TAG_LOGITS, TAG_KV, TAG_MSG = 0, 1, 2, 3


@dataclass(slots=True)
class InFlight:
    """A micro-batch :meth:`ModelExecutor.submit` started: its number, when, and the pending
    receive of its sampled rows' logits (``result``: already complete, pp = 1)."""

    batch: ScheduledBatch
    seq: int
    t0: float
    work: Any = None
    logits: Any = None
    result: ExecuteResult | None = None


def step_plan(seqs: Any, block_size: int, block_offset: int = 0
              ) -> list[tuple[str, int, int, bool, list[int], list[int]]]:
    """What the other ranks need of a step's sequences (sent once per step): request id, start,
    tokens to compute, whether it samples, those tokens and the block ids they reach (shifted
    by ``block_offset``)."""
    out = []
    for s in seqs:
        r, end = s.request, s.start + s.num_tokens
        blocks = r.block_ids[: cdiv(end, block_size)]
        if block_offset:
            blocks = [b + block_offset for b in blocks]
        out.append((r.request_id, s.start, s.num_tokens, s.sample,
                    r.all_token_ids[s.start : end], blocks))
    return out


class _Window:
    """Tokens ``[start, start + len(tokens))`` of a request, indexable as its full list is by
    :func:`pdserve.model.layers.build_attention_metadata`."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, sl: slice) -> list[int]:
        if sl.start != self.start or sl.stop != self.start + len(self.tokens):
            raise IndexError(f"a rank holds tokens {self.start}.., not {sl}")
        return self.tokens


def plan_seqs(plan: list[tuple[str, int, int, bool, list[int], list[int]]]) -> list[Any]:
    """:func:`step_plan`'s entries as the scheduled sequences metadata is built from."""
    return [SimpleNamespace(request=SimpleNamespace(request_id=rid, block_ids=blocks,
                                                    all_token_ids=_Window(start, toks)),
                            start=start, num_tokens=n, sample=sample)
            for rid, start, n, sample, toks, blocks in plan]


class RankLauncher(Protocol):
    """How a group's driver rank (rank 0) runs ranks ``1 .. tp * pp - 1``, each of which
    calls :func:`serve_rank` with the driver's rendezvous ``address`` and returns when told
    to stop or when the driver is gone. :class:`ChildRanks` starts them as child processes
    (the default: offline ``LLM``, ``pdserve generate``, in-process instances); the Ray
    runtime's is actors in the instance's placement group
    (:class:`pdserve.cluster.rank_group.RayRanks`)."""

    host: str  # where the other ranks reach rank 0's rendezvous store

    def start(self, config: EngineConfig, tp: int, pp: int, address: tuple[str, int],
              num_threads: int) -> None: ...

    def stop(self, wait_s: float = 10.0) -> None:
        """Wait up to ``wait_s`` for the ranks to end, then end those left."""
        ...


class ChildRanks:
    """The other ranks as child processes of this one, on this machine."""

    host = "127.0.0.1"

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, config: EngineConfig, tp: int, pp: int, address: tuple[str, int],
              num_threads: int) -> None:
        self.procs = [_start_rank(config, tp, pp, r, address, num_threads)
                      for r in range(1, tp * pp)]

    def stop(self, wait_s: float = 10.0) -> None:
        _stop_ranks(self.procs, wait_s)


def serve_rank(config: EngineConfig, tp: int, pp: int, rank: int, address: tuple[str, int],
               num_threads: int, own_device: bool = False,
               loaded: Callable[[ModelExecutor], None] | None = None) -> int:
    """Load rank ``rank`` of a group and follow its driver until it stops (0) or goes away
    (1): the body of every rank > 0, a child process or a Ray actor. ``loaded`` is called
    with the rank's executor before it serves (a Ray rank actor serves KV slices from it)."""
    executor = ModelExecutor(config, num_threads=num_threads, tp=tp, rank=rank, address=address,
                             pp=pp, own_device=own_device)
    if loaded is not None:
        loaded(executor)
    try:
        executor.serve_ranks()
    except RuntimeError as e:  # the driver went away: the instance is over
        log.info("rank %d of %d ends: %s", rank, tp * pp, e)
        return 1
    return 0


def _start_rank(config: EngineConfig, tp: int, pp: int, rank: int, address: tuple[str, int],
                num_threads: int) -> subprocess.Popen:
    """Rank ``rank`` of a group as a child process (``python -m`` this module: no re-import of
    the caller's main script), its settings on stdin."""
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.model_executor"],
                            stdin=subprocess.PIPE)
    assert proc.stdin is not None
    pickle.dump((config, tp, pp, rank, address, num_threads), proc.stdin)
    proc.stdin.close()
    return proc


def _stop_ranks(procs: list[subprocess.Popen], wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(deadline - time.monotonic(), 0.1))
        if p.poll() is None:
            p.kill()
            p.wait()


def _exit_with_parent(interval_s: float = 1.0) -> None:
    """End this rank when the process that started it is gone (killed, not only stopped: an
    idle rank waiting for the next step would not notice otherwise)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="pdserve-rank-watchdog").start()


def _rank_main() -> int:
    _exit_with_parent()
    return serve_rank(*pickle.load(sys.stdin.buffer))


if __name__ == "__main__":
    sys.exit(_rank_main())
