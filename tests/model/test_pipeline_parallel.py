"""Pipeline parallelism (gloo on CPU, ranks as processes): the greedy tokens of a PP2 and a
TP2 x PP2 instance running its two virtual engines (two micro-batches in flight) equal TP1's
and transformers', stage 0 starts a micro-batch before the previous one has come back from the
last stage, each stage reads only its layers' weights (plus the embedding on the first stage and
the final norm and head on the last), and KV moves between PP2 and PP1 instances unchanged (byte
for byte), continuing as it would have."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, cdiv
from pdserve.engine.batch import ScheduledBatch, ScheduledSeq
from pdserve.engine.model_executor import ModelExecutor
from pdserve.engine.pipeline import PipelinedEngine, make_engine
from pdserve.model.parallel import check_live_layout, stage_layers
from tests.model.helpers import NEW_TOKENS, HandDriver, hf_reference, make_prompts
from tests.model.test_tensor_parallel import PROMPTS, _continue, _prefill, generate


def executor(model_dir: str, tp: int = 1, pp: int = 1, blocks: int = 64) -> ModelExecutor:
    cfg = EngineConfig(model=model_dir, cache=CacheConfig(num_kv_blocks=blocks))
    ex = ModelExecutor(cfg, num_threads=1, tp=tp, pp=pp)
    ex.capture_logits = True
    return ex


# six requests: three per virtual engine, so that both lanes have a micro-batch in flight
LANE_PROMPTS = (3, 37, 90, 20, 55, 8)


def generate_lanes(ex: ModelExecutor, prompts: list[list[int]]) -> list[list[int]]:
    """:func:`generate` through the instance's ``pp`` virtual engines, as a live instance runs
    (up to ``pp`` micro-batches in flight); every lane computes some of the requests."""
    eng = make_engine(ex.config, ex)
    assert isinstance(eng, PipelinedEngine)
    out = generate(ex, prompts, eng)
    assert all(lane.num_steps > 0 for lane in eng.lanes)
    return out


def test_stage_layers_balanced() -> None:
    assert stage_layers(2, 2) == [(0, 1), (1, 2)]
    assert stage_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]  # hand-worked: 3 + 2 + 2
    assert stage_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="pp=3"):
        stage_layers(2, 3)


_SLOW = pytest.mark.slow  # 4 rank processes: ~25 s each on a busy 2-core machine


@pytest.mark.parametrize(("arch", "tp", "pp"), [
    ("llama", 1, 2), ("qwen3", 1, 2), ("opt", 1, 2), ("opt", 2, 2),
    pytest.param("llama", 2, 2, marks=_SLOW), pytest.param("qwen3", 2, 2, marks=_SLOW),
], ids=["llama-pp2", "qwen3-pp2", "opt-pp2", "opt-tp2xpp2", "llama-tp2xpp2", "qwen3-tp2xpp2"])
def test_pp_greedy_equals_tp1_and_transformers(tiny_dirs, hf_models, arch, tp, pp) -> None:
    """With ``pp`` micro-batches in flight (both virtual engines busy)."""
    prompts = make_prompts(LANE_PROMPTS)
    want = generate(executor(tiny_dirs[arch]), prompts)
    ex = executor(tiny_dirs[arch], tp, pp, blocks=128)
    try:
        got = generate_lanes(ex, prompts)
    finally:
        ex.close()
    assert ex.max_in_flight == pp
    assert got == want  # all 64 tokens of each request
    ref = hf_reference(hf_models(arch), prompts)
    assert [t[:NEW_TOKENS] for t in got] == [r.tokens for r in ref]
    assert ex.local_config.num_layers == ex.model_config.num_layers // pp


def test_stage0_starts_a_micro_batch_before_the_last_stage_returns_the_previous(
        tiny_dirs) -> None:
    """Ordering, not timing: rank 0's event log (``trace``) has stage 0 start the forward of
    micro-batch j+1 before micro-batch j's logits come back from the last stage — the only
    message by which rank 0 learns that the last stage has finished j — so two micro-batches
    are in the pipeline at once. Run one at a time (each step collected before the next
    starts) the log alternates forward j, logits j, and this fails."""
    ex = executor(tiny_dirs["llama"], pp=2, blocks=128)
    ex.trace = []
    try:
        generate_lanes(ex, make_prompts(LANE_PROMPTS))
    finally:
        ex.close()
    n = ex.num_submitted
    log = ex.trace
    assert sorted(log) == sorted([("forward", j) for j in range(n)]
                                 + [("logits", j) for j in range(n)])
    # the pipeline's steady state: forward 0, forward 1, then logits j, forward j + 2, ...
    steady = [("forward", 0), ("forward", 1)]
    for j in range(n - 2):
        steady += [("logits", j), ("forward", j + 2)]
    k = next((i for i, (a, b) in enumerate(zip(log, steady)) if a != b), len(steady))
    assert k >= n, f"one micro-batch at a time from event {k} of {len(log)}: {log[:8]}"
    at = {e: i for i, e in enumerate(log)}
    overlapped = sum(at[("forward", j + 1)] < at[("logits", j)] for j in range(n - 1))
    assert overlapped >= n // 2
    assert ex.num_collected == n and ex.max_in_flight == 2  # rank 0's counters agree


def _file_bytes(model_dir: str) -> dict[str, int]:
    """Bytes of each tensor of the checkpoint (float32), read from the file's header."""
    from safetensors import safe_open

    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as f:
        return {n: 4 * math.prod(f.get_slice(n).get_shape())
                for n in f.keys()}  # noqa: SIM118 - safe_open is not a mapping


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_each_stage_loads_its_layers(tiny_dirs, arch) -> None:
    """Stage 0 reads the embedding and layer 0 and nothing else; stage 1 reads layer 1, the
    final norm and the head (the embedding again when the head is tied to it, as qwen3's is),
    counted from the file's header."""
    sizes = _file_bytes(tiny_dirs[arch])
    layer = [sum(v for k, v in sizes.items() if f".layers.{i}." in k) for i in range(2)]
    emb = sizes["model.embed_tokens.weight"]
    head = sizes.get("lm_head.weight", emb)
    ex = executor(tiny_dirs[arch], pp=2)
    try:
        assert ex.loaded_bytes == ex.weight_bytes == emb + layer[0]
        assert ex.rank_bytes == [emb + layer[0], layer[1] + sizes["model.norm.weight"] + head]
        assert ex.loaded_bytes < 0.75 * sum(sizes.values())
        assert ex.kv_cache.shape[0] == 1  # one layer's KV
    finally:
        ex.close()


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=_SLOW)], ids=["pp2", "tp2xpp2"])
def test_kv_hand_off_between_pp2_and_pp1(tiny_dirs, tp) -> None:
    """PP2 (TP1 or TP2 stages) -> PP1 and back: the KV arrives byte-identical (re-exported from
    the destination it is the source's payload) and the destination continues the request
    exactly as the source would have."""
    model = tiny_dirs["llama"]
    p1, p2 = make_prompts((45, 70), seed=3)
    one, two = executor(model, 1, 1, 256), executor(model, tp, 2, 256)
    try:
        for src, dst, prompt in ((two, one, p1), (one, two, p2)):
            hd, req, blocks = _prefill(src, prompt)
            payload = src.export_kv(blocks)
            assert payload["kv"].shape[:3] == (2, 2, src.model_config.num_kv_heads)
            dst_blocks = [b + 20 for b in blocks]
            dst.import_kv(dst_blocks, payload)
            assert torch.equal(dst.export_kv(dst_blocks)["kv"], payload["kv"])
            first = hd.tokens[req.request_id][0]
            hd.decode_all([req], NEW_TOKENS)
            assert _continue(dst, prompt, dst_blocks, first) == hd.tokens[req.request_id]
    finally:
        two.close()


def test_kv_export_behind_micro_batches_in_flight(tiny_dirs) -> None:
    """A KV export issued while two micro-batches are in the pipeline travels behind them
    (every rank takes it after their stages): it returns the KV the blocks hold, and the two
    micro-batches then sample what PP1 samples for them."""
    model = tiny_dirs["llama"]
    pa, pb, pc = make_prompts((45, 30, 21), seed=7)
    one, two = executor(model, 1, 1, 256), executor(model, 1, 2, 256)
    try:
        got = []
        for ex in (one, two):
            hd = HandDriver(ex)
            a, b, c = hd.add(pa), hd.add(pb), hd.add(pc)
            hd.step([(a, None)])
            blocks = a.block_ids[: cdiv(len(pa), ex.block_size)]
            fb = ex.submit(ScheduledBatch(1, [ScheduledSeq(b, 0, len(pb), True)]))
            fc = ex.submit(ScheduledBatch(2, [ScheduledSeq(c, 0, len(pc), True)]))
            kv = ex.export_kv(blocks)["kv"]
            sampled = ex.collect(fb).sampled + ex.collect(fc).sampled
            assert torch.equal(ex.export_kv(blocks)["kv"], kv)
            got.append((sampled, hd.tokens[a.request_id]))
        assert two.max_in_flight == 2
        assert got[1] == got[0]
    finally:
        two.close()


def test_live_checks_keep_refusing_bad_pp(tiny_dirs) -> None:
    cfg = ModelConfig.from_dir(tiny_dirs["llama"])
    check_live_layout(cfg, tp=1, pp=2, ranks_available=2)  # runs now
    with pytest.raises(ValueError, match="pp=3 exceeds the 2 layers"):
        check_live_layout(cfg, pp=3, ranks_available=8)
    with pytest.raises(ValueError, match="needs 4 ranks"):
        check_live_layout(cfg, tp=2, pp=2, ranks_available=2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="pipeline parallelism over NCCL needs 2 CUDA devices")
def test_pp2_over_nccl_equals_tp1_on_cuda(tiny_dirs) -> None:
    """The same code path on CUDA: NCCL for the hidden states, gloo for plans and KV."""
    prompts = make_prompts(PROMPTS)

    def on_cuda(pp: int) -> ModelExecutor:
        cfg = EngineConfig(model=tiny_dirs["llama"], device="cuda",
                           cache=CacheConfig(num_kv_blocks=64))
        return ModelExecutor(cfg, pp=pp)

    want = generate(on_cuda(1), prompts)
    ex = on_cuda(2)
    try:
        assert generate(ex, prompts) == want
    finally:
        ex.close()


def test_uneven_stages_and_kv_across_them(tmp_path) -> None:
    """3 layers over 3 and over 2 stages (2 + 1): greedy tokens equal PP1's, and KV moves
    PP3 -> PP2 byte-identical although their stage boundaries differ."""
    from pdserve.model.tiny import make_tiny_model

    model = make_tiny_model(str(tmp_path / "llama3"), "llama", num_layers=3)
    prompts = make_prompts((3, 37))
    want = generate(executor(model), prompts)
    three, two = executor(model, pp=3, blocks=256), executor(model, pp=2, blocks=256)
    try:
        assert generate(three, prompts) == want
        hd, req, blocks = _prefill(three, make_prompts((50,), seed=5)[0])
        payload = three.export_kv(blocks)
        dst = [b + 40 for b in blocks]
        two.import_kv(dst, payload)
        assert two.kv_cache.shape[0] == 2 and three.kv_cache.shape[0] == 1
        assert torch.equal(two.export_kv(dst)["kv"], payload["kv"])
    finally:
        three.close()
        two.close()
