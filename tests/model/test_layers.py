"""Attention metadata: row order, decode groups by context length, masks, sample indices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.model.layers import build_attention_metadata


def seq(rid: str, ctx: int, n: int = 1, first_block: int = 0, sample: bool = True):
    blocks = list(range(first_block, first_block + -(-ctx // 4)))
    req = SimpleNamespace(request_id=rid, all_token_ids=list(range(ctx)), block_ids=blocks)
    return SimpleNamespace(request=req, start=ctx - n, num_tokens=n, sample=sample)


def test_decodes_grouped_by_context_and_rows_mapped_back():
    # block size 4; decode contexts 5 (2 blocks), 40 (10), 8 (2, full), 30 (8), 4 (1, full)
    a, b, c = seq("a", 5), seq("b", 40, first_block=10), seq("c", 8, first_block=30)
    d, e = seq("d", 30, first_block=40), seq("e", 4, first_block=50)
    p = seq("p", 12, n=6, first_block=60, sample=False)
    meta = build_attention_metadata([a, p, b, c, d, e], block_size=4)
    # rows: decodes longest first (b, d, c, a, e), then the chunk of p
    assert meta.input_ids.tolist() == [39, 29, 7, 4, 3, 6, 7, 8, 9, 10, 11]
    assert meta.positions.tolist() == [39, 29, 7, 4, 3, 6, 7, 8, 9, 10, 11]
    assert meta.num_decode == 5
    # groups: b and d (8 >= 0.6 * 10 blocks), then c and a (2 blocks), then e (1 block)
    assert [(g.lo, g.hi) for g in meta.decodes] == [(0, 2), (2, 4), (4, 5)]
    assert meta.decodes[0].blocks.shape == (2, 10)
    assert meta.decodes[0].blocks[1].tolist() == list(range(40, 48)) + [0, 0]
    assert meta.decodes[1].blocks.tolist() == [[30, 31], [0, 1]]
    visible = meta.decodes[1].mask[0, :, 0] == 0
    assert visible.sum(-1).tolist() == [8, 5]
    assert meta.decodes[2].mask is None  # one full block: nothing to hide
    # sample rows follow the batch order a, b, c, d, e (p does not sample)
    assert meta.sample_indices.tolist() == [3, 0, 2, 1, 4]
    assert meta.slot_mapping[:2].tolist() == [19 * 4 + 3, 47 * 4 + 1]
    (chunk,) = meta.prefills
    assert (chunk.lo, chunk.hi, chunk.start) == (5, 11, 6)
    assert chunk.blocks.tolist() == [60, 61, 62]
    assert torch.equal(chunk.mask == 0, torch.arange(12)[None, :] <= torch.arange(6, 12)[:, None])


def _attention_inputs(heads: int, kv_heads: int, hd: int = 16, blocks: int = 80):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, kv_heads, blocks, 4, hd, generator=g)
    # decode contexts 5, 40, 8, 30, 4, 17 and a chunk with earlier context, blocks shuffled
    order = torch.randperm(blocks, generator=g).tolist()
    seqs, used = [], 0
    for i, (ctx, n) in enumerate([(5, 1), (40, 1), (12, 6), (8, 1), (30, 1), (4, 1), (17, 1)]):
        nb = -(-ctx // 4)
        req = SimpleNamespace(request_id=str(i), all_token_ids=list(range(ctx)),
                              block_ids=order[used : used + nb])
        used += nb
        seqs.append(SimpleNamespace(request=req, start=ctx - n, num_tokens=n, sample=True))
    total = sum(s.num_tokens for s in seqs)
    q = torch.randn(total, heads + kv_heads, hd, generator=g)[:, :heads]  # a strided view
    k = torch.randn(total, kv_heads, hd, generator=g)
    v = torch.randn(total, kv_heads, hd, generator=g)
    return seqs, kv, q, k, v


def test_decode_kernel_matches_the_torch_path():
    from pdserve.model import cpu_kernels
    from pdserve.model.layers import paged_attention

    if not cpu_kernels.available():
        pytest.skip("no C compiler: the CPU decode kernel cannot be built here")
    for heads, kv_heads in ((4, 2), (3, 3), (6, 2)):
        for window in (None, 7):
            seqs, kv, q, k, v = _attention_inputs(heads, kv_heads)
            outs = []
            for kernel in (False, True):
                meta = build_attention_metadata(seqs, 4, sliding_window=window,
                                                decode_kernel=kernel)
                assert (meta.decode_table is not None) == kernel
                assert (len(meta.decodes) == 0) == kernel
                cache = kv.clone()
                outs.append(paged_attention(q, k, v, cache, meta))
            assert meta.decode_ctx.tolist() == [40, 30, 17, 8, 5, 4]
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_decode_kernel_can_be_switched_off(monkeypatch):
    from pdserve.model import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    assert not cpu_kernels.available()
    q = torch.zeros(1, 2, 16)
    kv = torch.zeros(2, 2, 4, 4, 16)
    table = torch.zeros(1, 1, dtype=torch.int64)
    assert cpu_kernels.paged_decode_kernel(q, kv, table, torch.ones(1, dtype=torch.int64),
                                           0.25) is None


def test_packed_linear_matches_f_linear_and_is_used_for_decode_rows(monkeypatch):
    import torch.nn.functional as F

    from pdserve.model import layers

    lin = layers.Linear(24, 40)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 24, generator=g))
        lin.bias.copy_(torch.randn(40, generator=g))
    lin.prepack()
    if lin.packed is None:
        pytest.skip("no oneDNN in this torch build")
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Ops:  # counts calls of the packed path
        @staticmethod
        def _linear_pointwise(*a):
            calls.append(a[0].shape[0])
            return real(*a)

    monkeypatch.setattr(layers.torch.ops, "mkldnn", Ops, raising=False)
    monkeypatch.setattr(layers, "PACKED_ROWS", (1, 256))  # prefill on F.linear (MKL) here
    for rows in (1, 2, 17, 256, 300):
        x = torch.randn(rows, 24, generator=g)
        with torch.inference_mode():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias),
                                       rtol=1e-5, atol=1e-5)
    assert calls == [1, 2, 17, 256]  # decode batches, one row included; prefill on F.linear
    monkeypatch.setenv("PDSERVE_ONEDNN_LINEAR", "0")
    lin.prepack()
    assert lin.packed is None


def test_the_prefill_path_is_chosen_once_by_timing_both(monkeypatch):
    """``choose_prefill_path`` widens the packed rows to prefill sizes only when oneDNN is at
    least 10 % faster here (stand-in clocks decide), ``PDSERVE_ONEDNN_PREFILL`` overrides the
    measurement, and ``prepack_linears`` runs it once per process."""
    import sys

    import torch

    from pdserve.model import layers

    lin = layers.Linear(16, 32)
    lin.prepack()
    if lin.packed is None:
        pytest.skip("no oneDNN in this torch build")
    # prepack_linears chooses once per process, on its largest packed weight
    choose, seen = layers.choose_prefill_path, []
    model = torch.nn.Module()
    model.small, model.big = layers.Linear(8, 8), lin
    monkeypatch.setattr(layers, "choose_prefill_path", seen.append)
    monkeypatch.setattr(layers, "_prefill_chosen", True)
    layers.prepack_linears(model)
    assert seen == []
    monkeypatch.setattr(layers, "_prefill_chosen", False)
    layers.prepack_linears(model)
    assert seen == [lin]
    monkeypatch.setattr(layers, "choose_prefill_path", choose)
    monkeypatch.setattr(layers, "PACKED_ROWS", (1, 256))
    monkeypatch.setattr(layers, "_prefill_chosen", False)
    monkeypatch.delenv("PDSERVE_ONEDNN_PREFILL", raising=False)
    clock = {"t": 0.0}
    monkeypatch.setattr(layers.time, "perf_counter", lambda: clock["t"])
    for packed_ms, plain_ms, want in ((1.0, 2.0, True), (1.0, 1.05, False), (2.0, 1.0, False)):
        def plain(*a, cost=plain_ms):
            clock["t"] += cost / 1e3

        class Ops:
            @staticmethod
            def _linear_pointwise(*a, cost=packed_ms):
                clock["t"] += cost / 1e3

        monkeypatch.setattr(layers.F, "linear", plain)
        monkeypatch.setattr(layers.torch.ops, "mkldnn", Ops, raising=False)
        assert layers.choose_prefill_path(lin) is want
        assert layers.PACKED_ROWS[1] == (sys.maxsize if want else 256)
    monkeypatch.setenv("PDSERVE_ONEDNN_PREFILL", "1")
    assert layers.choose_prefill_path(lin) and layers.PACKED_ROWS[1] == sys.maxsize
    monkeypatch.setenv("PDSERVE_ONEDNN_PREFILL", "0")
    assert not layers.choose_prefill_path(lin) and layers.PACKED_ROWS[1] == 256
