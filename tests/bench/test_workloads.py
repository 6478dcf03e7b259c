"""Workloads: presets, exact prefix sharing from Mooncake hash ids, scaling and clipping."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from pdserve.bench.traces import load_trace
from pdserve.bench.workloads import (
    WorkloadRequest,
    chained_block_ids,
    make_workload,
    segment_tokens,
)


def blocks(ids: list[int], bs: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i:i + bs]) for i in range(0, len(ids), bs)]


def assert_blocks_match_hashes(reqs: list[WorkloadRequest], bs: int) -> None:
    """Block b of two prompts is equal exactly when their hash ids at b are equal."""
    content: dict[int, tuple[int, ...]] = {}
    for r in reqs:
        bl = blocks(r.prompt_token_ids, bs)
        assert len(bl) == len(r.prefix_block_ids)
        for h, b in zip(r.prefix_block_ids, bl):
            full = content.get(h)
            if full is None or len(b) > len(full):
                content[h] = b
    for r in reqs:  # same id -> same tokens (a short last block is a prefix of the full one)
        for h, b in zip(r.prefix_block_ids, blocks(r.prompt_token_ids, bs)):
            assert content[h][:len(b)] == b
    seen: dict[tuple[int, ...], int] = {}
    for h, b in content.items():  # different ids -> different tokens
        assert seen.setdefault(b, h) == h


@pytest.mark.parametrize("scale", [1.0, 1 / 32])
def test_mooncake_prompts_share_exactly_their_hash_blocks(traces_dir: str, scale: float) -> None:
    w = make_workload("mooncake", 150, seed=3, length_scale=scale, traces_dir=traces_dir)
    bs = w.scaling.block_size
    assert bs == max(1, round(512 * scale))
    trace = load_trace("mooncake", traces_dir)
    for i, r in enumerate(w.requests):
        assert r.prefix_block_ids == trace.hash_ids[i]
        assert len(r.prompt_token_ids) == r.prompt_len
    if scale == 1.0:
        assert [r.prompt_len for r in w.requests] == trace.input_lens[:150].tolist()
    assert_blocks_match_hashes(w.requests, bs)
    first = {tuple(r.prompt_token_ids[:bs]) for r in w.requests}
    assert len(first) == 1  # every Mooncake request starts with block 0
    assert w.arrival == "trace" and w.requests[0].arrival_time == 0.0


def test_mooncake_clipping_keeps_prefix_structure(traces_dir: str) -> None:
    full = make_workload("mooncake", 100, length_scale=1 / 64, traces_dir=traces_dir)
    w = make_workload("mooncake", 100, length_scale=1 / 64, max_model_len=128,
                      traces_dir=traces_dir)
    assert w.scaling.num_clipped == sum(r.prompt_len + r.output_len > 128 for r in full.requests)
    assert w.scaling.num_clipped > 0
    for a, b in zip(full.requests, w.requests):
        assert b.prompt_len + b.output_len <= 128
        assert a.prompt_token_ids[:b.prompt_len] == b.prompt_token_ids
    assert_blocks_match_hashes(w.requests, w.scaling.block_size)


def test_clipping_keeps_the_ratio() -> None:
    w = make_workload("fixed:input=3000,output=1000", 5, rate=1.0, max_model_len=400)
    r = w.requests[0]
    assert (r.prompt_len, r.output_len) == (300, 100)
    assert w.scaling.num_clipped == 5
    assert w.requests[0].prompt_token_ids == w.requests[0].prompt_token_ids[:300]


def test_fit_scale_uses_p99(sharegpt_dir: str | None) -> None:
    w = make_workload("chatbot", 400, rate=1.0, length_scale="fit", max_model_len=512,
                      traces_dir=sharegpt_dir)
    totals = np.array([r.prompt_len + r.output_len for r in w.requests])
    assert w.scaling.scale < 0.1
    assert totals.max() <= 512
    assert w.scaling.num_clipped <= 0.02 * 400 + 1
    with pytest.raises(ValueError, match="max_model_len"):
        make_workload("chatbot", 10, rate=1.0, length_scale="fit", traces_dir=sharegpt_dir)


def test_deterministic_and_in_vocab(sharegpt_dir: str | None) -> None:
    a = make_workload("chatbot", 50, rate=2.0, seed=5, vocab_size=512, traces_dir=sharegpt_dir,
                      length_scale=0.1)
    b = make_workload("chatbot", 50, rate=2.0, seed=5, vocab_size=512, traces_dir=sharegpt_dir,
                      length_scale=0.1)
    c = make_workload("chatbot", 50, rate=2.0, seed=6, vocab_size=512, traces_dir=sharegpt_dir,
                      length_scale=0.1)
    assert a.requests == b.requests
    assert [r.prompt_token_ids for r in a.requests] != [r.prompt_token_ids for r in c.requests]
    ids = np.concatenate([r.prompt_token_ids for r in a.requests])
    assert ids.min() >= 4 and ids.max() < 512
    firsts = Counter(r.prompt_token_ids[0] for r in a.requests)
    assert max(firsts.values()) <= 3  # private prompts do not share prefixes


def test_retimed_keeps_requests_and_scales_arrivals(sharegpt_dir: str | None) -> None:
    w = make_workload("chatbot", 100, rate=1.0, traces_dir=sharegpt_dir)
    fast = w.retimed(4.0)
    assert fast.rate == 4.0 and fast.arrival == "poisson"
    assert [r.prompt_token_ids for r in fast.requests] == [r.prompt_token_ids
                                                           for r in w.requests]
    assert np.allclose([r.arrival_time * 4 for r in fast.requests],
                       [r.arrival_time for r in w.requests])
    g = w.retimed(2.0, "gamma", cv=3.0)
    assert g.arrival == "gamma"


def test_trace_replay_rate_override(traces_dir: str) -> None:
    native = make_workload("azure-conv", 500, traces_dir=traces_dir)
    fast = make_workload("azure-conv", 500, rate=20.0, traces_dir=traces_dir)
    t = np.array([r.arrival_time for r in fast.requests])
    assert (len(t) - 1) / t[-1] == pytest.approx(20.0)
    t0 = np.array([r.arrival_time for r in native.requests])
    assert np.allclose(t / t[-1], t0 / t0[-1])
    start = make_workload("azure-conv:start=1000", 10, traces_dir=traces_dir)
    assert start.requests[0].prompt_len == load_trace("azure-conv").input_lens[1000]
    with pytest.raises(ValueError, match="requested"):
        make_workload("apex-creation", 600, traces_dir=traces_dir)


@pytest.mark.parametrize("name,heavy_in,heavy_out", [
    ("lpld", False, False), ("lphd", False, True), ("hpld", True, False), ("hphd", True, True)])
def test_tetriinfer_classes(sharegpt_dir: str | None, name: str, heavy_in: bool,
                            heavy_out: bool) -> None:
    w = make_workload(name, 200, rate=1.0, traces_dir=sharegpt_dir)
    assert all((r.prompt_len > 512) == heavy_in and (r.output_len > 128) == heavy_out
               for r in w.requests)
    assert w.default_slo is not None


def test_mixed_contains_every_class(sharegpt_dir: str | None) -> None:
    w = make_workload("mixed", 2000, rate=1.0, traces_dir=sharegpt_dir)
    classes = Counter((r.prompt_len > 512, r.output_len > 128) for r in w.requests)
    assert len(classes) == 4


def test_distserve_presets(traces_dir: str) -> None:
    code = make_workload("code", 200, rate=1.0, traces_dir=traces_dir)
    texts = load_trace("humaneval", traces_dir).prompts
    assert all(r.prompt in texts for r in code.requests)
    assert len({r.prompt for r in code.requests[:164]}) == 164  # all problems before repeats
    assert code.default_slo.ttft == 0.125 and code.default_slo.tpot == 0.2
    ids_only = make_workload("code", 5, rate=1.0, prompt_mode="ids", traces_dir=traces_dir)
    assert all(r.prompt is None and r.prompt_token_ids for r in ids_only.requests)
    summ = make_workload("summarization", 300, rate=1.0, traces_dir=traces_dir)
    assert all(r.output_len <= r.prompt_len for r in summ.requests)
    assert summ.default_slo.ttft == 15.0
    chat = make_workload("chatbot", 10, rate=1.0, traces_dir=traces_dir)
    assert chat.default_slo.ttft == 0.25 and chat.default_slo.tpot == 0.1


def test_text_prompts_are_truncated_with_their_lengths(traces_dir: str) -> None:
    w = make_workload("code", 20, rate=1.0, length_scale=0.5, traces_dir=traces_dir)
    texts = load_trace("humaneval", traces_dir).prompts
    for r in w.requests:
        assert any(t.startswith(r.prompt) and len(r.prompt) < len(t) for t in texts)
    tok = lambda s: list(range(4, 4 + len(s.split())))
    exact = make_workload("code", 5, rate=1.0, tokenizer=tok, traces_dir=traces_dir)
    assert all(r.prompt_len == len(r.prompt.split()) == len(r.prompt_token_ids)
               for r in exact.requests)


def test_alpaca_is_short_in_long_out() -> None:
    w = make_workload("alpaca", 5000, rate=1.0)
    p = np.array([r.prompt_len for r in w.requests])
    o = np.array([r.output_len for r in w.requests])
    assert np.median(p) == pytest.approx(17, abs=1.5) and p.mean() == pytest.approx(20.6, rel=0.1)
    assert np.median(o) == pytest.approx(119, rel=0.06) and o.mean() == pytest.approx(164, rel=0.1)


def test_prefix_sharing_generator() -> None:
    w = make_workload("prefix:num_prefixes=4,zipf=1.5,shared_len=64,unique_len=24,"
                      "output_len=8,block_size=16", 400, rate=1.0, vocab_size=1000)
    assert all(r.prompt_len == 88 and r.output_len == 8 for r in w.requests)
    groups = Counter(tuple(r.prompt_token_ids[:64]) for r in w.requests)
    counts = sorted(groups.values(), reverse=True)
    assert len(groups) == 4 and counts[0] > counts[1] > counts[-1]  # Zipf popularity
    assert counts[0] / 400 == pytest.approx(1 / sum(1 / k**1.5 for k in range(1, 5)), abs=0.07)
    assert len({tuple(r.prompt_token_ids[64:]) for r in w.requests}) == 400
    assert_blocks_match_hashes(w.requests, 16)
    shared = Counter(r.prefix_block_ids[3] for r in w.requests)  # 4 shared blocks of 16
    assert len(shared) == 4
    assert len({r.prefix_block_ids[4] for r in w.requests}) == 400


def test_chained_block_ids() -> None:
    table: dict = {}
    assert chained_block_ids([1, 2, 3, 4, 5], 2, table) == [0, 1, 2]
    assert chained_block_ids([1, 2, 3, 4, 9], 2, table) == [0, 1, 3]
    assert chained_block_ids([3, 4], 2, table) == [4]  # same tokens, different parent


def test_segment_tokens_prefix_property() -> None:
    a = segment_tokens(1, 99, 100, 32000)
    assert np.array_equal(segment_tokens(1, 99, 10, 32000), a[:10])
    assert not np.array_equal(segment_tokens(2, 99, 100, 32000), a)


def test_workload_file(tmp_path) -> None:
    path = tmp_path / "w.jsonl"
    rows = [{"prompt_token_ids": [5, 6, 7], "output_len": 4, "arrival_time": 1.0},
            {"prompt": "hello world", "output_len": 2, "arrival_time": 3.0},
            {"prompt_len": 9, "output_len": 1, "arrival_time": 2.0}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = make_workload(str(path), 10)
    assert [r.arrival_time for r in w.requests] == [0.0, 2.0, 1.0]
    assert w.requests[1].prompt == "hello world" and w.requests[1].prompt_len >= 1
    assert len(w.requests[2].prompt_token_ids) == 9
    w2 = make_workload(str(path), 10, rate=2.0, arrival="constant")
    assert [r.arrival_time for r in w2.requests] == [0.0, 0.5, 1.0]
    path.write_text('{"output_len": 3}\n')
    with pytest.raises(ValueError, match="w.jsonl:1"):
        make_workload(str(path), 10)


def test_a_workload_line_s_unknown_keys_are_named_once(tmp_path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_len": 4, "output_len": 2, "arrival": 3}\n'
                    '{"prompt_len": 4, "output_len": 2, "arrival": 5, "task": "qa"}\n')
    with pytest.warns(UserWarning) as seen:
        w = make_workload(str(path), 10)
    assert [str(x.message).split(": ", 1)[1][:35] for x in seen] == [
        "ignoring key(s) ['arrival'] (a work", "ignoring key(s) ['task'] (a workloa"]
    assert [r.arrival_time for r in w.requests] == [0.0, 1.0]  # not the 'arrival' values


@pytest.mark.parametrize(("line", "says"), [
    ("[1, 2]", "a JSON object was expected, got list"),
    ('{"prompt_token_ids": [1, -2], "output_len": 2}', "prompt_token_ids must be a list"),
    ('{"prompt_token_ids": "abc", "output_len": 2}', "prompt_token_ids must be a list"),
    ('{"prompt_len": 4, "output_len": 0}', "output_len must be >= 1"),
    ('{"prompt_len": 4, "output_len": 2, "arrival_time": -1}', "arrival_time must be"),
    ('{"prompt_len": 4, "output_len": 2, "arrival_time": NaN}', "arrival_time must be"),
])
def test_a_bad_workload_line_is_named(tmp_path, line: str, says: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_len": 4, "output_len": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match="w.jsonl:2: bad workload line") as e:
        make_workload(str(path), 10)
    assert says in str(e.value)


@pytest.mark.parametrize("spec,msg", [
    ("nope", "unknown workload"), ("prefix:zipf", "no parameter"), ("prefix:foo=1", "foo"),
    ("prefix:zipf=x", "not a number"), ("fixed:input=0", "out of range")])
def test_bad_specs(spec: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        make_workload(spec, 10, rate=1.0)


def test_bad_arguments(sharegpt_dir: str | None) -> None:
    with pytest.raises(ValueError, match="needs a rate"):
        make_workload("chatbot", 10, traces_dir=sharegpt_dir)
    with pytest.raises(ValueError, match="num_requests"):
        make_workload("fixed", 0, rate=1.0)
    with pytest.raises(ValueError, match="length scale"):
        make_workload("fixed", 2, rate=1.0, length_scale=-1.0)


def test_distserve_chatbot_on_the_bundled_sample_reuses_rows_only_past_its_size(
        tmp_path, monkeypatch) -> None:
    """Without the traces folder the bundled ShareGPT sample leaves 1,871 rows after
    DistServe's filters. Up to that many requests the recipe samples without replacement, as
    before; past it (a planner probe at a high rate) every row is used once before any twice,
    with a warning, instead of refusing the workload."""
    import warnings

    monkeypatch.setenv("PDSERVE_TRACES", str(tmp_path / "absent"))
    pairs = lambda w: Counter((r.prompt_len, r.output_len) for r in w.requests)  # noqa: E731
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        all_rows = make_workload("distserve-chatbot", 1871, rate=1.0)
    assert not [w for w in seen if "once before any twice" in str(w.message)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        twice = make_workload("distserve-chatbot", 2 * 1871, rate=1.0)
    assert [w for w in seen if "every row is used once before any twice" in str(w.message)]
    assert pairs(twice) == Counter({k: 2 * v for k, v in pairs(all_rows).items()})
