"""``--step-log``: a real engine writes one JSON line per step with the batch it computed, and
``pdserve calibrate --step-log`` reads it back (hand-counted shapes)."""

import json

import pytest

from pdserve.llm import LLM
from pdserve.request import SamplingParams
from pdserve.sim.measurements import from_step_log


def test_engine_writes_the_steps_it_computed(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path is pinned to an absolute one
    llm = LLM(tiny_dirs["llama"], step_log="steps.jsonl", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(5, 15))], params)  # 10 prompt tokens, 3 new tokens
    llm.generate([list(range(5, 12)), list(range(20, 24))], params)
    lines = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    shapes = [(r["prefill_chunks"], r["decode_context_lens"]) for r in lines]
    # prefill 10 (token 1), decode at context 11 and 12 (tokens 2, 3); then both prompts
    # prefilled in one step, then two decode steps of both
    assert shapes == [([[0, 10]], []), ([], [11]), ([], [12]),
                      ([[0, 7], [0, 4]], []), ([], [8, 5]), ([], [9, 6])]
    assert all(r["elapsed"] > 0 and r["instance_id"] == "engine" for r in lines)
    ms = from_step_log(tmp_path / "steps.jsonl", tiny_dirs["llama"])
    assert len(ms) == 6 and ms[4].sample.decode_context_lens == (8, 5)


def test_step_log_must_be_a_string(tiny_dirs):
    with pytest.raises(ValueError, match="step_log must be a string"):
        LLM(tiny_dirs["llama"], step_log=3)


def test_a_full_disk_or_a_rotated_step_log_never_fails_a_step(tiny_dirs, tmp_path):
    """A step log that cannot be written (``/dev/full``: ENOSPC on every write) costs its lines,
    counted in the engine's stats, never the step; a file rotated away (renamed, then deleted)
    is reopened at its path."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    full = LLM(tiny_dirs["llama"], step_log="/dev/full", enable_prefix_caching=False)
    [out] = full.generate([list(range(5, 9))], params)
    assert len(out.token_ids) == 2 and full.engine.stats().step_log_errors == 2

    path = tmp_path / "steps.jsonl"
    llm = LLM(tiny_dirs["llama"], step_log=str(path), enable_prefix_caching=False)
    llm.generate([list(range(5, 9))], params)  # 2 steps
    path.rename(tmp_path / "steps.1.jsonl")  # logrotate
    llm.generate([list(range(5, 9))], params)
    assert len((tmp_path / "steps.1.jsonl").read_text().splitlines()) == 2
    assert len(path.read_text().splitlines()) == 2  # a new file at the path
    path.unlink()
    path.symlink_to("/dev/full")  # the disk fills up
    llm.generate([list(range(5, 9))], params)
    assert llm.engine.stats().step_log_errors == 2
    path.unlink()  # space again
    llm.generate([list(range(5, 9))], params)
    assert len(path.read_text().splitlines()) == 2 and llm.engine.stats().step_log_errors == 2
