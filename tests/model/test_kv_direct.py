"""The direct KV hand-off: every destination rank pulls its own slices from the source ranks
that hold them (no funnel through rank 0), and the KV it writes is byte for byte the KV the
funnel path writes, for TP2 -> TP1, TP1 -> TP2 and PP2 -> PP1. The ranks here are threads of
this process (the executor's rank launcher), so a test can reach every rank's executor the way
the Ray runtime reaches its rank actors; a source rank is named by a picklable handle."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, cdiv
from pdserve.engine.executor import KVPullError
from pdserve.engine.model_executor import ModelExecutor, serve_rank
from tests.model.helpers import HandDriver, make_prompts

RANKS: dict[tuple[str, int], ModelExecutor] = {}  # (instance, global rank) -> its executor


def fetch(pieces: list[tuple[Any, list[int], tuple[int, int], tuple[int, int]]]) -> list[Any]:
    """The test's transport: call the named source rank's ``kv_part`` in this process."""
    return [RANKS[handle].kv_part(ids, layers, heads) for handle, ids, layers, heads in pieces]


class ThreadRanks:
    """Ranks 1 .. of a group as threads of this process, registered in ``RANKS``."""

    host = "127.0.0.1"

    def __init__(self, name: str) -> None:
        self.name = name
        self.threads: list[threading.Thread] = []

    def start(self, config: EngineConfig, tp: int, pp: int, address: tuple[str, int],
              num_threads: int) -> None:
        for r in range(1, tp * pp):
            def loaded(ex: ModelExecutor, r: int = r) -> None:
                ex.kv_fetch = fetch
                RANKS[self.name, r] = ex

            t = threading.Thread(target=serve_rank, daemon=True,
                                 args=(config, tp, pp, r, address, num_threads),
                                 kwargs={"loaded": loaded})
            t.start()
            self.threads.append(t)

    def stop(self, wait_s: float = 10.0) -> None:
        for t in self.threads:
            t.join(wait_s)


def instance(name: str, model_dir: str, tp: int, pp: int) -> ModelExecutor:
    cfg = EngineConfig(model=model_dir, cache=CacheConfig(num_kv_blocks=256))
    ex = ModelExecutor(cfg, num_threads=1, tp=tp, pp=pp, ranks=ThreadRanks(name))
    ex.kv_fetch = fetch
    ex.capture_logits = True  # (HandDriver records them)
    RANKS[name, 0] = ex
    return ex


def direct(ex: ModelExecutor, name: str, block_ids: list[int]) -> dict[str, Any]:
    ex.kv_sources = [(name, g) for g in range(ex.world)]
    try:
        return ex.export_kv(block_ids)
    finally:
        ex.kv_sources = None


@pytest.mark.parametrize(("src_layout", "dst_layout"), [
    ((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (1, 1)), ((2, 1), (1, 2)), ((2, 1), (4, 1))],
    ids=["tp2-tp1", "tp1-tp2", "pp2-pp1", "tp2-pp2", "tp2-tp4"])
def test_direct_pull_writes_the_funnels_bytes(tiny_dirs, src_layout, dst_layout) -> None:
    """(tp, pp) -> (tp, pp); tp4 replicates the tiny llama's 2 KV heads on two ranks each."""
    model = tiny_dirs["llama"]
    src = instance("src", model, *src_layout)
    dst = instance("dst", model, *dst_layout)
    try:
        prompt = make_prompts((45,), seed=3)[0]
        hd = HandDriver(src)
        req = hd.add(prompt)
        hd.step([(req, None)])
        blocks = req.block_ids[: cdiv(len(prompt), src.block_size)]
        funnel = src.export_kv(blocks)
        desc = direct(src, "src", blocks)
        assert desc["kv"] is None and len(desc["sources"]) == src.world
        via_funnel, via_direct = [b + 20 for b in blocks], [b + 60 for b in blocks]
        dst.import_kv(via_funnel, funnel)
        dst.import_kv(via_direct, desc)
        assert dst.kv_imports == {"funnel": 1, "direct": 1}
        got = dst.export_kv(via_direct)["kv"]
        assert torch.equal(got, dst.export_kv(via_funnel)["kv"])
        assert torch.equal(got, funnel["kv"])
        assert got.abs().sum() > 0
    finally:
        src.close()
        dst.close()


def test_a_failed_pull_on_a_rank_fails_the_transfer_not_the_instance(tiny_dirs) -> None:
    """TP1 -> TP2 with rank 1's pull failing (its source gone): rank 0 raises
    ``KVPullError`` after every rank reported, and the group still serves the next import."""
    model = tiny_dirs["llama"]
    src = instance("src", model, 1, 1)
    dst = instance("dst", model, 2, 1)
    try:
        hd = HandDriver(src)
        req = hd.add(make_prompts((40,), seed=4)[0])
        hd.step([(req, None)])
        blocks = req.block_ids[:2]
        desc = direct(src, "src", blocks)

        def dead(pieces: list[Any]) -> list[Any]:
            raise RuntimeError("the source rank died")

        RANKS["dst", 1].kv_fetch = dead
        with pytest.raises(KVPullError, match=r"ranks \[1\]"):
            dst.import_kv([30, 31], desc)
        RANKS["dst", 1].kv_fetch = fetch
        dst.import_kv([30, 31], desc)
        assert torch.equal(dst.export_kv([30, 31])["kv"], src.export_kv(blocks)["kv"])
    finally:
        src.close()
        dst.close()
