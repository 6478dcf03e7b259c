"""Bad input is refused with a ValueError that names the offending value (torch-free)."""

import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.request import SamplingParams
from tests.engine.fakes import FakeExecutor


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
    ({"max_tokens": -3}, r"max_tokens must be >= 1, got -3"),
    ({"max_tokens": 2.5}, r"max_tokens must be an integer, got 2\.5"),
    ({"temperature": -0.1}, r"temperature must be >= 0, got -0\.1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0\.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1\.5"),
    ({"top_p": -0.2}, r"top_p must be in \(0, 1\], got -0\.2"),
    ({"top_k": -2}, r"top_k .*got -2"),
    ({"min_p": 1.2}, r"min_p .*got 1\.2"),
    ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens must be <= max_tokens \(4\), got 5"),
    ({"stop": 123}, r"stop must be a list or a string, got 123"),  # once: not iterable
    ({"stop_token_ids": 7}, r"stop_token_ids must be a list, got 7"),
])
def test_bad_sampling_params_name_the_value(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_a_max_model_len_of_zero_is_refused_not_taken_for_the_default():
    with pytest.raises(ValueError, match=r"max_model_len must be >= 1, got 0"):
        EngineConfig.from_kwargs("m", model_max_len=1024, max_model_len=0)
    assert EngineConfig.from_kwargs("m", model_max_len=1024).scheduler.max_model_len == 1024


def test_boundary_sampling_params_are_accepted():
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0)
    SamplingParams(top_p=1e-9, min_p=1.0, top_k=1)


def engine(max_len=16, vocab=None):
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_kv_blocks=16),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=max_len))
    eng = Engine(cfg, executor=FakeExecutor(16, 4))
    eng.vocab_size = vocab
    return eng


def test_bad_prompts_name_the_value():
    eng = engine(max_len=16, vocab=50)
    p = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match=r"prompt is empty \(0 tokens\)"):
        eng.add_request("a", [], p)
    with pytest.raises(ValueError, match=r"prompt has 16 tokens.*max_model_len=16"):
        eng.add_request("b", list(range(16)), p)
    with pytest.raises(ValueError, match=r"prompt has 40 tokens.*max_model_len=16"):
        eng.add_request("c", [1] * 40, p)
    with pytest.raises(ValueError, match=r"token id 50 is outside the vocabulary \[0, 50\)"):
        eng.add_request("d", [1, 50], p)
    with pytest.raises(ValueError, match=r"token id -1 "):
        eng.add_request("e", [-1], p)
    # nothing was queued by the refused requests
    assert not eng.has_unfinished()
    eng.check_integrity()
    eng.add_request("ok", list(range(15)), p)  # the longest prompt that leaves room for one
