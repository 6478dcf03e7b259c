"""Hand-driving a ModelExecutor (no scheduler) and the transformers reference."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.batch import ScheduledBatch, ScheduledSeq
from pdserve.engine.model_executor import ModelExecutor
from pdserve.request import Request, SamplingParams

PROMPT_LENS = (1, 7, 33, 150, 300)
NEW_TOKENS = 8
# EOS is banned for the first NEW_TOKENS tokens, as min_new_tokens does in the reference
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=NEW_TOKENS)


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def write_json(path, obj) -> None:
    Path(path).write_text(json.dumps(obj))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def make_prompts(lens=PROMPT_LENS, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]


def make_executor(model_dir: str, num_blocks: int = 256, block_size: int = 16,
                  dtype: str = "float32", device: str = "cpu", seed: int = 0) -> ModelExecutor:
    cfg = EngineConfig(model=model_dir, device=device, dtype=dtype, seed=seed,
                       cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks))
    ex = ModelExecutor(cfg)
    ex.capture_logits = True
    return ex


@dataclass
class Reference:
    """transformers' greedy continuation of one prompt and the logits that chose each token."""

    tokens: list[int]
    logits: torch.Tensor  # [new tokens, vocab]


def hf_reference(hf_model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS
                 ) -> list[Reference]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  output_logits=True, return_dict_in_generate=True,
                                  pad_token_id=0)
            out.append(Reference(g.sequences[0, len(p):].tolist(),
                                 torch.stack(g.logits, 0)[:, 0].float()))
    return out


@dataclass
class HandDriver:
    """Builds ScheduledBatches by hand and does the scheduler's bookkeeping.

    Each request gets ``blocks_per_req`` blocks, interleaved across requests so that no block
    table is contiguous. ``force`` (request -> tokens) appends those tokens instead of the sampled
    ones (teacher forcing). Sampled tokens and their logits are recorded per request.
    """

    ex: ModelExecutor
    max_len: int = 320
    first_block: int = 0
    stride: int = 0
    force: dict[str, list[int]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    reqs: list[Request] = field(default_factory=list)
    step_id: int = 0

    def add(self, prompt: list[int], params: SamplingParams = GREEDY,
            request_id: str | None = None) -> Request:
        req = Request(request_id or f"r{len(self.reqs)}", prompt, params)
        n = math.ceil(self.max_len / self.ex.block_size)
        stride = self.stride or 8
        assert len(self.reqs) < stride, "more requests than the block interleave allows"
        req.block_ids = [self.first_block + len(self.reqs) + j * stride for j in range(n)]
        assert max(req.block_ids) < self.ex.num_kv_blocks
        self.reqs.append(req)
        self.tokens[req.request_id] = []
        self.logits[req.request_id] = []
        return req

    def step(self, plan: list[tuple[Request, int | None]]):
        """``plan``: (request, tokens to compute; ``None`` = everything still missing)."""
        seqs = []
        for req, n in plan:
            n = req.num_tokens - req.num_computed_tokens if n is None else n
            start = req.num_computed_tokens
            seqs.append(ScheduledSeq(req, start, n, start + n == req.num_tokens))
        res = self.ex.execute(ScheduledBatch(self.step_id, seqs))
        self.step_id += 1
        k = 0
        for s in seqs:
            s.request.num_computed_tokens += s.num_tokens
            if s.sample:
                rid = s.request_id
                tok = res.sampled[k]
                self.tokens[rid].append(tok)
                self.logits[rid].append(self.ex.last_logits[k])
                forced = self.force.get(rid)
                s.request.append_token(forced[len(self.tokens[rid]) - 1] if forced else tok)
                k += 1
        assert k == len(res.sampled)
        return res

    def decode_all(self, reqs: list[Request], until: int) -> None:
        """Batched decode steps until every request in ``reqs`` has ``until`` sampled tokens."""
        while True:
            live = [r for r in reqs if len(self.tokens[r.request_id]) < until]
            if not live:
                return
            self.step([(r, 1) for r in live])
