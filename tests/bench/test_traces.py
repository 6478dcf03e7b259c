"""Every shipped trace loads with the row counts and statistics of traces/README.md."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.traces import (
    TRACE_NAMES,
    TraceNotFoundError,
    estimate_tokens,
    find_traces_dir,
    load_trace,
)

ROWS = {
    "azure-code": 8819, "azure-conv": 19366, "splitwise-code": 8819, "splitwise-conv": 19366,
    "mooncake": 12031, "humaneval": 164, "sharegpt": 30731, "arxiv": 28257, "bwb": 33768,
    "apex-lmsys-llama": 1024, "apex-lmsys-mistral": 1024, "apex-creation-llama": 512,
    "apex-creation-mistral": 725, "apex-summarization-llama": 1302,
    "apex-summarization-mistral": 1039,
}


def test_every_trace_is_covered() -> None:
    assert set(TRACE_NAMES) == set(ROWS)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_trace_loads(name: str, traces_dir: str) -> None:
    t = load_trace(name, traces_dir)
    assert len(t) == ROWS[name] == len(t.output_lens)
    assert t.input_lens.min() >= 1 and t.output_lens.min() >= 1
    if t.arrivals is not None:
        assert t.arrivals[0] == 0.0 and np.all(np.diff(t.arrivals) >= 0)
    if t.hash_ids is not None:
        assert len(t.hash_ids) == len(t)
    if t.prompts is not None:
        assert len(t.prompts) == len(t) and all(t.prompts)


def test_statistics_match_readme(traces_dir: str) -> None:
    code = load_trace("azure-code", traces_dir)
    assert code.input_lens.mean() == pytest.approx(2047.8, abs=0.1)
    assert (len(code) - 1) / code.arrivals[-1] == pytest.approx(2.57, abs=0.01)
    conv = load_trace("azure-conv", traces_dir)
    assert (len(conv) - 1) / conv.arrivals[-1] == pytest.approx(5.53, abs=0.01)
    mc = load_trace("mooncake", traces_dir)
    assert mc.input_lens.mean() == pytest.approx(12035, abs=1)
    assert mc.arrivals[-1] == pytest.approx(3537, abs=1)
    assert all(len(h) == -(-n // 512) for h, n in zip(mc.hash_ids, mc.input_lens))
    assert np.array_equal(load_trace("splitwise-code", traces_dir).input_lens, code.input_lens)
    he = load_trace("humaneval", traces_dir)
    assert he.prompts[0].startswith("from typing import List")
    assert he.input_lens[0] == estimate_tokens(he.prompts[0])


def test_apex_alias_and_unknown(traces_dir: str) -> None:
    assert load_trace("apex-lmsys", traces_dir) is load_trace("apex-lmsys-llama", traces_dir)
    with pytest.raises(ValueError, match="unknown trace"):
        load_trace("nope", traces_dir)


def test_traces_dir_resolution(traces_dir: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_TRACES", traces_dir)
    assert str(find_traces_dir()) == traces_dir
    monkeypatch.setenv("PDSERVE_TRACES", str(tmp_path / "missing"))
    with pytest.raises(TraceNotFoundError, match="does not exist"):
        find_traces_dir()
    with pytest.raises(TraceNotFoundError, match="is missing"):
        load_trace("sharegpt", tmp_path)


def test_bundled_sharegpt_sample_without_traces_folder(monkeypatch) -> None:
    import pdserve.bench.traces as traces

    def missing(path=None):
        raise TraceNotFoundError("no traces here")

    monkeypatch.setattr(traces, "find_traces_dir", missing)
    with pytest.warns(UserWarning, match="bundled"):
        t = load_trace("sharegpt")
    assert len(t) == 4000 and t.input_lens.min() >= 1
    assert t.input_lens.mean() == pytest.approx(2340, rel=0.05)  # README mean
    with pytest.raises(TraceNotFoundError):
        load_trace("mooncake")
