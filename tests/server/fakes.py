"""A deterministic ``ServingRuntime`` and character-level tokenizer for server tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from pdserve.cluster.serving_api import InstanceStatus, QueueFullError, RequestFailedError
from pdserve.engine.engine import EngineStats
from pdserve.request import RequestOutput, SamplingParams, Timeline, validate_prompt

EOS = 0
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?'-\n<>|ABCDEFGHIJKLMNOPQRSTUVWXYZ{}[]\""


class CharTokenizer:
    """Token 0 is ``</s>`` (EOS, special); token ``i >= 1`` is ``ALPHABET[i - 1]``. Characters
    outside the alphabet encode as ``?``."""

    chat_template = "{role}: {content}\\n ... assistant: "
    eos_token_id = EOS
    all_special_ids = [EOS]
    name_or_path = "char-tokenizer"

    def __init__(self) -> None:
        self.vocab_size = len(ALPHABET) + 1
        self._ids = {c: i + 1 for i, c in enumerate(ALPHABET)}

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return {"</s>": EOS, **self._ids}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        text.encode("utf-8")  # like a Rust tokenizer: a lone surrogate raises
        return [self._ids.get(c, self._ids["?"]) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: Any) -> str:
        out = []
        for t in ids:
            if t == EOS:
                if not skip_special_tokens:
                    out.append("</s>")
            else:
                out.append(ALPHABET[t - 1])
        return "".join(out)

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


class FakeRuntime:
    """Generates ``(last + 1) % vocab`` after the prompt, one token per delta.

    ``token_delay`` sleeps between tokens; ``max_waiting`` bounds requests in flight (more raise
    :class:`QueueFullError`); ``fail_after=k`` ends a request after ``k`` tokens with an error
    output (``fail_mode="output"``) or by raising :class:`RequestFailedError` (``"raise"``).
    ``disaggregated`` makes the first token come from ``prefill-0`` and the rest from
    ``decode-0``, with a KV transfer in the timeline. Requests whose iterator was closed before
    they finished are recorded in ``aborted``. ``lazy`` defers validation (and
    ``QueueFullError``) to the first iteration, as an async-generator runtime would.
    """

    def __init__(self, max_model_len: int = 64, token_delay: float = 0.0,
                 max_waiting: int | None = None, cached_tokens: int = 0,
                 disaggregated: bool = False, model_name: str = "/models/fake") -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = CharTokenizer()
        self.num_gpus = 2 if disaggregated else 1
        self.token_delay = token_delay
        self.max_waiting = max_waiting
        self.cached_tokens = cached_tokens
        self.disaggregated = disaggregated
        self.fail_after: int | None = None
        self.fail_mode = "output"
        self.lazy = False  # validate at the first iteration instead of at the call
        self.alive = True
        self.started = False
        self.active: set[str] = set()
        self.submitted: list[tuple[str, list[int], SamplingParams]] = []
        self.finished: list[str] = []
        self.aborted: list[str] = []

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

    @property
    def max_waiting_requests(self) -> int | None:
        return None if self.lazy else self.max_waiting  # a lazy runtime tells only later

    def num_waiting(self) -> int:
        return len(self.active)

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, admitted: bool = False
                 ) -> AsyncIterator[RequestOutput]:
        if self.lazy:
            return self._lazy(request_id, prompt_token_ids, params, admitted)
        return self._generate(request_id, prompt_token_ids, params, admitted)

    async def _lazy(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, admitted: bool) -> AsyncIterator[RequestOutput]:
        async for out in self._generate(request_id, prompt_token_ids, params, admitted):
            yield out

    def _generate(self, request_id: str, prompt_token_ids: list[int],
                  params: SamplingParams, admitted: bool = False
                  ) -> AsyncIterator[RequestOutput]:
        validate_prompt(prompt_token_ids, self.max_model_len, self.tokenizer.vocab_size)
        if (self.max_waiting is not None and not admitted
                and len(self.active) >= self.max_waiting):
            raise QueueFullError(f"{len(self.active)} requests are waiting (limit "
                                 f"{self.max_waiting}); retry later")
        self.active.add(request_id)
        self.submitted.append((request_id, list(prompt_token_ids), params))
        return self._run(request_id, list(prompt_token_ids), params)

    async def abort(self, request_id: str) -> None:
        if request_id in self.active:
            self.active.discard(request_id)
            self.aborted.append(request_id)

    def _instance(self, index: int) -> str:
        if not self.disaggregated:
            return "colocated-0"
        return "prefill-0" if index == 0 else "decode-0"

    async def _run(self, rid: str, prompt: list[int],
                   params: SamplingParams) -> AsyncIterator[RequestOutput]:
        tl = Timeline(arrival=time.time())
        tl.prefill_queued = tl.prefill_start = time.time()
        tokens: list[int] = []
        text = ""
        logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        finished = False
        vocab = self.tokenizer.vocab_size
        try:
            last = prompt[-1]
            while True:
                await asyncio.sleep(self.token_delay)
                if self.fail_after is not None and len(tokens) >= self.fail_after:
                    if self.fail_mode == "raise":
                        raise RequestFailedError("every decode instance died")
                    finished = True
                    tl.finish = time.time()
                    yield RequestOutput(rid, prompt, list(tokens), text, finished=True,
                                        finish_reason="error", error="instance lost",
                                        timeline=tl)
                    return
                tok = (last + 1) % vocab
                last = tok
                if not tokens:
                    tl.prefill_end = time.time()
                    if self.disaggregated:
                        tl.transfer_start = tl.decode_queued = time.time()
                        tl.transfer_end = tl.decode_admitted = time.time()
                tl.token_times.append(time.time())
                tokens.append(tok)
                if logprobs is not None:
                    alts = {(tok + j) % vocab: -0.5 * (j + 1) for j in range(params.logprobs + 1)}
                    logprobs.append(alts)
                new_text = self.tokenizer.decode([tok], params.skip_special_tokens)
                reason = None
                if tok == EOS and not params.ignore_eos and len(tokens) >= params.min_tokens:
                    reason = "stop"
                for s in params.stop:
                    at = (text + new_text).find(s)
                    if at >= 0:
                        end = at + len(s) if params.include_stop_str_in_output else at
                        new_text = (text + new_text)[:end][len(text):]
                        reason = "stop"
                        break
                text += new_text
                if reason is None and len(tokens) >= params.max_tokens:
                    reason = "length"
                if reason is not None:
                    finished = True
                    tl.finish = time.time()
                    self.finished.append(rid)
                yield RequestOutput(
                    rid, prompt, list(tokens), text, new_token_ids=[tok], new_text=new_text,
                    finished=finished, finish_reason=reason,
                    num_cached_tokens=self.cached_tokens,
                    logprobs=list(logprobs) if logprobs is not None else None, timeline=tl,
                    instance_id=self._instance(len(tokens) - 1))
                if finished:
                    return
        finally:
            self.active.discard(rid)
            if not finished:
                self.aborted.append(rid)

    def instance_status(self) -> list[InstanceStatus]:
        stats = EngineStats(num_running=len(self.active), num_waiting=1, num_held=0,
                            num_pending_kv=0, num_kv_blocks=100, num_free_blocks=75,
                            num_used_blocks=25, kv_usage=0.25, prefix_queries=40,
                            prefix_hits=10, num_preemptions=2, num_steps=7)
        if not self.disaggregated:
            return [InstanceStatus("colocated-0", "colocated", self.alive, stats)]
        return [InstanceStatus("prefill-0", "prefill", True, stats),
                InstanceStatus("decode-0", "decode", self.alive, stats if self.alive else None)]
