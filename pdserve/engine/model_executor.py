"""The torch executor: runs scheduled batches of a real model against a paged KV cache."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import torch

from pdserve.config import EngineConfig, ModelConfig, cdiv, kv_cache_blocks
from pdserve.engine.batch import ExecuteResult, ScheduledBatch
from pdserve.engine.cpu_threads import ThreadGovernor
from pdserve.grammar import GrammarCompiler, GrammarState
from pdserve.model import cpu_kernels
from pdserve.model.layers import (
    build_attention_metadata,
    gather_elements_per_block,
    prepack_linears,
)
from pdserve.model.loader import DTYPES, load_model
from pdserve.model.sampler import Sampler, SampleRow
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

    def __init__(self, config: EngineConfig, num_threads: int | None = None) -> None:
        """``num_threads``: torch's CPU threads for this process, fixed (a Ray instance actor
        uses 1). ``None``: torch's count; with ``PDSERVE_ADAPTIVE_THREADS=1`` on CPU each step
        runs as many threads as there are idle cores instead, up to torch's count at start
        (:class:`pdserve.engine.cpu_threads.ThreadGovernor`; opt-in: measured faster under heavy
        load from other sessions, slower beside a single busy process: docs/benchmarks.md,
        "pdserve vs vLLM CPU")."""
        self.config = config
        self.governor: ThreadGovernor | None = None
        if num_threads is not None and config.device == "cpu":
            torch.set_num_threads(num_threads)
        elif config.device == "cpu" and os.environ.get("PDSERVE_ADAPTIVE_THREADS") == "1":
            self.governor = ThreadGovernor(torch.get_num_threads())
        self.thread_steps: Counter[int] = Counter()  # steps run per thread count (CPU)
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        self.model, self.model_config = load_model(config.model, config.dtype, str(self.device))
        if self.device.type == "cpu":
            prepack_linears(self.model)  # oneDNN layout for decode-sized matmuls
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

    # ------------------------------------------------------------------ memory
    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers (K and V)."""
        return self.block_size * self.model_config.kv_bytes_per_token(self.config.dtype)

    def _allocate(self, num_blocks: int) -> torch.Tensor:
        c = self.model_config
        return torch.zeros(c.num_layers, 2, c.num_kv_heads, num_blocks, self.block_size,
                           c.head_dim, dtype=self.dtype, device=self.device)

    def _plan_num_blocks(self) -> int:
        if self.config.cache.num_kv_blocks is not None or self.device.type != "cuda":
            return kv_cache_blocks(self.model_config, self.config, device_memory_bytes=None)
        peak = self._profile_activation_bytes()
        _, total = torch.cuda.mem_get_info(self.device)
        return kv_cache_blocks(self.model_config, self.config, device_memory_bytes=total,
                               weight_bytes=torch.cuda.memory_allocated(self.device),
                               reserved_bytes=peak)

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
            self.model.compute_logits(self.model(meta, kv)).float().softmax(-1)
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
        t0 = time.perf_counter()
        if self.governor is not None:
            n = self.governor.threads()
            if n != torch.get_num_threads():
                torch.set_num_threads(n)
            self.thread_steps[n] += 1
        with torch.inference_mode():
            meta = build_attention_metadata(batch.seqs, self.block_size, self.device,
                                            self.dtype, self.sliding_window,
                                            decode_kernel=self.decode_kernel)
            meta.workspace = self._gather_workspace(meta.max_gather_blocks)
            hidden = self.model(meta, self.kv_cache)
            sampled: list[int] = []
            logprobs = None
            if any(s.sample for s in batch.seqs):
                logits = self.model.compute_logits(hidden)
                rows = [self._sample_row(s.request, logits.shape[-1])
                        for s in batch.seqs if s.sample]
                if self.capture_logits:
                    self.last_logits = logits.float().cpu()
                out = self.sampler(logits, rows)
                sampled, logprobs = out.token_ids, out.logprobs
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return ExecuteResult(sampled=sampled, elapsed=time.perf_counter() - t0,
                             logprobs=logprobs)

    def _gather_workspace(self, num_blocks: int) -> torch.Tensor:
        """A buffer for ``num_blocks`` gathered KV blocks of one layer, reused across layers and
        steps (grown geometrically) so that attention does not allocate per layer."""
        need = num_blocks * gather_elements_per_block(self.kv_cache)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(max(need, self._workspace.numel() * 3 // 2),
                                          dtype=self.dtype, device=self.device)
        return self._workspace

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
        """``{"kv": CPU tensor [layers, 2, kv_heads, len(block_ids), block_size, head_dim], ...}``
        in the cache's dtype, plus the shape facts :meth:`import_kv` checks."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        with torch.no_grad():  # not inference_mode: the payload is an ordinary tensor
            kv = self.kv_cache.index_select(3, idx).cpu()
        c = self.model_config
        return {"kv": kv, "num_blocks": len(block_ids), "num_layers": c.num_layers,
                "block_size": self.block_size, "num_kv_heads": c.num_kv_heads,
                "head_dim": c.head_dim, "dtype": self.config.dtype}

    def import_kv(self, block_ids: list[int], payload: dict[str, Any]) -> None:
        """Write a payload of :meth:`export_kv` (from any executor of the same model) into
        ``block_ids``; a different cache dtype is converted."""
        kv = payload["kv"]
        want = (*self.kv_cache.shape[:3], len(block_ids), *self.kv_cache.shape[4:])
        if tuple(kv.shape) != want:
            raise ValueError(f"KV payload of shape {tuple(kv.shape)} does not fit "
                             f"{len(block_ids)} blocks of this cache (expected {want})")
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            self.kv_cache.index_copy_(3, idx, kv.to(self.device, self.dtype))
