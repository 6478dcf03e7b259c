"""Offline batch inference: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from pdserve.checkpoints import resolve_model
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.pipeline import make_engine
from pdserve.request import RequestOutput, SamplingParams
from pdserve.tokenizer import load_tokenizer


class LLM:
    """A model instance for offline generation.

    ``model`` is a local Hugging Face directory (config.json, *.safetensors, tokenizer.json), a
    ``.gguf`` file or a built-in name such as ``smollm2-135m-instruct`` (see
    :func:`pdserve.checkpoints.resolve_model`).
    Keyword arguments: ``device``, ``dtype``, ``seed``, ``block_size``, ``num_kv_blocks`` (None =
    size from available memory), ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``,
    ``enable_chunked_prefill``, ``enable_prefix_caching`` (see :class:`EngineConfig`), and
    ``tensor_parallel_size`` / ``pipeline_parallel_size`` (a layout the engine cannot run is a
    ``ValueError``).
    """

    def __init__(self, model: str, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, **engine_kwargs: Any) -> None:
        from pdserve.model.parallel import check_live_layout  # lazy: torch (pdserve.model)

        model = resolve_model(model)
        model_config = ModelConfig.from_dir(model)
        check_live_layout(model_config, tensor_parallel_size, pipeline_parallel_size,
                          device=engine_kwargs.get("device") or "cpu")
        self.config = EngineConfig.from_kwargs(
            model, model_max_len=model_config.max_position_embeddings, **engine_kwargs)
        self.tokenizer = load_tokenizer(model)
        from pdserve.engine.model_executor import ModelExecutor  # lazy: torch

        self.executor = ModelExecutor(self.config, tp=tensor_parallel_size,
                                      pp=pipeline_parallel_size)
        # pp > 1: pp virtual engines, micro-batches in flight (pdserve.engine.pipeline)
        self.engine = make_engine(self.config, self.executor, tokenizer=self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs are in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        token_lists: list[list[int]] = []
        for p in prompts:
            if isinstance(p, str):
                token_lists.append(self.tokenizer.encode(p))
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                token_lists.append(list(p))
            else:
                raise ValueError(f"prompt must be a string or a list of token ids, got {p!r:.80}")
        for toks, sp in zip(token_lists, plist):
            self.engine.validate(toks, sp)

        engine = self.engine
        start = time.perf_counter()
        ids = []
        for toks, sp in zip(token_lists, plist):
            rid = f"offline-{next(self._ids)}"
            engine.add_request(rid, toks, sp, now=time.perf_counter() - start)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        progress = _progress(len(ids)) if use_tqdm else None
        try:
            while len(final) < len(ids):
                res = engine.step(time.perf_counter() - start)
                for out in res.outputs:
                    if out.finished:
                        final[out.request_id] = out
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            for rid in ids:
                if rid not in final:
                    engine.abort(rid)
            raise
        finally:
            if progress is not None:
                progress.close()
        outs = []
        for rid, p in zip(ids, prompts):
            o = final[rid]
            o.prompt = p if isinstance(p, str) else None
            outs.append(o)
        return outs


    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel instance now (else when collected)."""
        self.executor.close()


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
