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
