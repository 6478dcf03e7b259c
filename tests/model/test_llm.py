"""``LLM.generate`` (offline entry point) and ``pdserve generate``: parity, seeds, bad input."""

from __future__ import annotations

import pytest
import torch

from pdserve.cli import main as cli_main
from pdserve.llm import LLM
from pdserve.request import SamplingParams
from tests.model.helpers import make_prompts


@pytest.fixture(scope="module")
def llm(tiny_dirs) -> LLM:
    return LLM(tiny_dirs["llama"], num_kv_blocks=128, max_model_len=320,
               max_num_batched_tokens=64)


def test_text_prompts_match_transformers(llm, tiny_dirs, hf_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    prompts = ["Hello, how are you today?", "The capital of France is", "def fibonacci(n"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6))
    for p, o in zip(prompts, outs):
        ids = tok(p, return_tensors="pt")
        with torch.no_grad():
            ref = hf_models("llama").generate(**ids, do_sample=False, max_new_tokens=6,
                                              min_new_tokens=6, pad_token_id=0)
        assert o.token_ids == ref[0, ids["input_ids"].shape[1]:].tolist()
        assert o.prompt == p and o.prompt_token_ids == ids["input_ids"][0].tolist()
        assert o.finish_reason == "length" and o.text == llm.tokenizer.decode(o.token_ids)


def test_fixed_seed_reproduces_alone_or_batched(llm):
    prompt = make_prompts((25,), seed=9)[0]
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=12)
    first = llm.generate([prompt], seeded)[0].token_ids
    again = llm.generate([prompt], seeded)[0].token_ids
    others = make_prompts((7, 80, 3), seed=10)
    crowd = llm.generate(others + [prompt], [SamplingParams(temperature=1.0, max_tokens=12)] * 3
                         + [seeded])
    assert first == again == crowd[-1].token_ids
    other_seed = SamplingParams(temperature=1.0, top_k=50, seed=124, max_tokens=12)
    assert llm.generate([prompt], other_seed)[0].token_ids != first


def test_bad_input_names_the_value(llm):
    with pytest.raises(ValueError, match=r"prompt is empty \(0 tokens\)"):
        llm.generate([[]])
    with pytest.raises(ValueError, match=r"prompt has 400 tokens.*max_model_len=320"):
        llm.generate([[5] * 400])
    with pytest.raises(ValueError, match=r"prompt has 320 tokens.*max_model_len=320"):
        llm.generate([[5] * 10, [5] * 320])
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        llm.generate([[5]], [SamplingParams(), SamplingParams()])
    # a refused batch leaves nothing behind: the engine is idle and consistent
    assert not llm.engine.has_unfinished()
    llm.engine.check_integrity()
    with pytest.raises(ValueError, match=r"max_tokens must be >= 1, got 0"):
        llm.generate([[5]], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1\.01"):
        SamplingParams(top_p=1.01)
    with pytest.raises(ValueError, match=r"max_model_len=5000 exceeds"):
        LLM(llm.config.model, max_model_len=5000)


def test_cli_generate(tiny_dirs, capsys):
    rc = cli_main(["generate", "--prompt", "hi", "--model", tiny_dirs["llama"],
                   "--max-tokens", "5", "--ignore-eos", "--num-kv-blocks", "64"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "--- prompt: 'hi'" in out and "5 tokens, finish_reason=length" in out
    rc = cli_main(["generate", "--prompt", "hi", "--model", tiny_dirs["llama"],
                   "--top-p", "0", "--num-kv-blocks", "64"])
    assert rc == 2 and "top_p must be in (0, 1], got 0.0" in capsys.readouterr().err
