"""Parity with transformers on the same weights (float32): tokens and logits, through whole and
chunked prefill mixed with batched decodes."""

from __future__ import annotations

import pytest
import torch

from tests.model.conftest import ARCHS
from tests.model.helpers import (
    NEW_TOKENS,
    HandDriver,
    hf_reference,
    make_executor,
    make_prompts,
    rel_err,
)

TOL = 1e-4


@pytest.fixture(scope="module")
def refs(hf_models):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = hf_reference(hf_models(arch), make_prompts())
        return cache[arch]

    return get


def check(drv: HandDriver, reqs, refs) -> None:
    for req, ref in zip(reqs, refs):
        rid = req.request_id
        assert drv.tokens[rid] == ref.tokens, f"{rid} (prompt {req.num_prompt_tokens} tokens)"
        for j, got in enumerate(drv.logits[rid]):
            err = rel_err(got, ref.logits[j])
            assert err <= TOL, f"{rid} token {j}: relative logit error {err:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_prefill_then_batched_decode(arch, tiny_dirs, refs):
    drv = HandDriver(make_executor(tiny_dirs[arch]))
    reqs = [drv.add(p) for p in make_prompts()]
    drv.step([(r, None) for r in reqs])  # every prompt in one batch
    drv.decode_all(reqs, NEW_TOKENS)
    check(drv, reqs, refs(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_mixed_with_decodes(arch, tiny_dirs, refs):
    drv = HandDriver(make_executor(tiny_dirs[arch]))
    r1, r7, r33, r150, r300 = reqs = [drv.add(p) for p in make_prompts()]
    drv.step([(r33, None), (r7, None)])
    # r300 in three chunks (not block aligned; one of them a single token), decodes interleaved
    drv.step([(r33, 1), (r300, 101), (r7, 1)])
    drv.step([(r300, 1), (r7, 1), (r33, 1), (r150, None)])
    drv.step([(r33, 1), (r1, None), (r150, 1), (r300, None), (r7, 1)])
    assert len(drv.tokens[r300.request_id]) == 1
    drv.decode_all(reqs, NEW_TOKENS)
    check(drv, reqs, refs(arch))


def test_odd_block_size_and_prefix_chunks(tiny_dirs, refs):
    """Block size 5, prompts computed in chunks of 1, 2, 3, ... tokens."""
    drv = HandDriver(make_executor(tiny_dirs["llama"], num_blocks=600, block_size=5))
    reqs = [drv.add(p) for p in make_prompts()[:4]]
    chunk = 1
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        plan = [(r, min(chunk, r.num_prompt_tokens - r.num_computed_tokens)) for r in reqs
                if r.num_computed_tokens < r.num_prompt_tokens]
        plan += [(r, 1) for r in reqs if r.num_computed_tokens == r.num_tokens - 1
                 and r.num_output_tokens]
        drv.step(plan)
        chunk += 7
    drv.decode_all(reqs, NEW_TOKENS)
    check(drv, reqs, refs("llama")[:4])


def test_recompute_after_preemption(tiny_dirs, refs):
    """A request preempted after 3 outputs recomputes prompt + outputs into new blocks holding
    garbage, and continues exactly."""
    ex = make_executor(tiny_dirs["qwen2"])
    drv = HandDriver(ex)
    prompt = make_prompts()[2]
    req = drv.add(prompt)
    drv.step([(req, None)])
    drv.decode_all([req], 3)
    req.num_computed_tokens = 0
    req.block_ids = [b + 1 for b in req.block_ids]
    ex.kv_cache[:, :, :, req.block_ids] = torch.randn(ex.kv_cache[:, :, :, req.block_ids].shape)
    drv.step([(req, 20)])
    drv.step([(req, None)])
    drv.decode_all([req], NEW_TOKENS)
    check(drv, [req], [refs("qwen2")[2]])


def test_only_sampled_rows_reach_the_lm_head(tiny_dirs):
    ex = make_executor(tiny_dirs["llama"])
    drv = HandDriver(ex)
    a, b = drv.add(make_prompts()[3]), drv.add(make_prompts()[4])
    res = drv.step([(a, 50), (b, None)])
    assert len(res.sampled) == 1 and ex.last_logits.shape == (1, 512)
    assert res.elapsed > 0


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_parity(arch, tiny_dirs, refs):
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    drv = HandDriver(make_executor(tiny_dirs[arch], device="cuda"))
    r1, r7, r33, r150, r300 = reqs = [drv.add(p) for p in make_prompts()]
    drv.step([(r33, None), (r7, None), (r150, None)])
    drv.step([(r33, 1), (r300, 101), (r7, 1), (r1, None), (r150, 1)])
    drv.step([(r300, None), (r7, 1), (r33, 1), (r1, 1), (r150, 1)])
    drv.decode_all(reqs, NEW_TOKENS)
    check(drv, reqs, refs(arch))
