"""Random tiny models in the Hugging Face layout, for tests, demos and benchmarks.

:func:`make_tiny_model` writes ``config.json``, ``generation_config.json``, ``model.safetensors``
and a byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a chat
template) that ``transformers`` loads offline. Everything is deterministic: the same arguments
give byte-identical files.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from pdserve.cache import build_once, cache_root

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0, 1, 2, 3
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "opt": "OPTForCausalLM"}

# Training text for the tokenizer: plain English, chat turns and a little code.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model predicts the next token
from the tokens that came before it. Serving such a model well means batching many requests
together, keeping the key and value cache of every request in small blocks of memory, and
deciding at every step which requests run. The time to the first token is set by the prefill
phase, which reads the whole prompt at once; the time per output token is set by the decode
phase, which produces one token for every running request in each step. When both phases share
one machine they interfere with each other, so some systems place them on different machines and
move the cache between them over a fast link. Goodput is the number of requests per second that
meet both latency objectives. Users ask questions, and the assistant answers them politely.
What is the capital of France? The capital of France is Paris. How many legs does a spider have?
A spider has eight legs. Please write a short poem about the sea. The sea is wide and deep and
blue, it sings at night and shines at noon. Thank you! You are welcome. Hello, how are you today?
I am fine, thanks for asking. Tell me a story about a robot who learned to paint. Once upon a
time there was a small robot that lived in a quiet town near the mountains and the river.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 3.14 2.71 -1 +1 = 3 * 4 / 5 % 6.
<|system|> <|user|> <|assistant|> system user assistant
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Scheduler:
    def __init__(self, budget):
        self.budget = budget
        self.queue = []

    def schedule(self, requests):
        batch = [r for r in requests if r.tokens <= self.budget]
        return sorted(batch, key=lambda r: r.arrival)

for i in range(10):
    print(f"step {i}: {i * i}")
import torch
x = torch.zeros(4, 8)
result = {"name": "pdserve", "version": [0, 1, 0], "ok": true, "value": null}
int main(void) { printf("hello, world\\n"); return 0; }
SELECT id, name FROM users WHERE age > 30 ORDER BY name;
"""


def _train_tokenizer(vocab_size: int, add_bos: bool) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    return tok


def _hf_config(arch: str, vocab: int, hidden: int, inter: int, layers: int, heads: int,
               kv_heads: int, max_pos: int, tie: bool, head_dim: int) -> dict[str, Any]:
    common: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": max_pos,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": tie,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "opt":
        common.update({
            "ffn_dim": inter,
            "word_embed_proj_dim": hidden,
            "do_layer_norm_before": True,
            "activation_function": "relu",
            "enable_bias": True,
            "layer_norm_elementwise_affine": True,
            "_remove_final_layer_norm": False,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
            "layerdrop": 0.0,
            "init_std": 0.02,
        })
        return common
    common.update({
        "intermediate_size": inter,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    })
    if arch in ("qwen2", "qwen3"):
        common.update({"use_sliding_window": False, "sliding_window": None,
                       "max_window_layers": layers})
    if arch == "qwen3":
        common.update({"head_dim": head_dim, "attention_bias": False})
    elif arch == "llama":
        common.update({"attention_bias": False, "mlp_bias": False})
    return common


def _random_weights(arch: str, cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    w: dict[str, torch.Tensor] = {}

    def normal(name: str, *shape: int, std: float) -> None:
        w[name] = torch.randn(*shape, generator=g) * std

    def norm(name: str, bias: bool = False) -> None:
        w[name + ".weight"] = 1.0 + 0.2 * torch.randn(h, generator=g)
        if bias:
            w[name + ".bias"] = 0.05 * torch.randn(h, generator=g)

    std = 2.0 / h**0.5  # large enough that greedy decoding does not settle on one token
    if arch == "opt":
        inter = cfg["ffn_dim"]
        p = "model.decoder."
        normal(p + "embed_tokens.weight", v, h, std=0.5)
        normal(p + "embed_positions.weight", cfg["max_position_embeddings"] + 2, h, std=0.1)
        for i in range(n):
            lp = f"{p}layers.{i}."
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                normal(lp + f"self_attn.{proj}.weight", h, h, std=std)
                normal(lp + f"self_attn.{proj}.bias", h, std=0.02)
            norm(lp + "self_attn_layer_norm", bias=True)
            normal(lp + "fc1.weight", inter, h, std=std)
            normal(lp + "fc1.bias", inter, std=0.02)
            normal(lp + "fc2.weight", h, inter, std=2.0 / inter**0.5)
            normal(lp + "fc2.bias", h, std=0.02)
            norm(lp + "final_layer_norm", bias=True)
        norm(p + "final_layer_norm", bias=True)
        w[p + "final_layer_norm.weight"] *= 4.0
        if not cfg["tie_word_embeddings"]:
            normal("lm_head.weight", v, h, std=0.5)
        return w

    inter, kvh = cfg["intermediate_size"], cfg["num_key_value_heads"]
    bias = arch == "qwen2"
    normal("model.embed_tokens.weight", v, h, std=0.5)
    for i in range(n):
        lp = f"model.layers.{i}."
        normal(lp + "self_attn.q_proj.weight", heads * hd, h, std=std)
        normal(lp + "self_attn.k_proj.weight", kvh * hd, h, std=std)
        normal(lp + "self_attn.v_proj.weight", kvh * hd, h, std=std)
        if bias:
            normal(lp + "self_attn.q_proj.bias", heads * hd, std=0.1)
            normal(lp + "self_attn.k_proj.bias", kvh * hd, std=0.1)
            normal(lp + "self_attn.v_proj.bias", kvh * hd, std=0.1)
        normal(lp + "self_attn.o_proj.weight", h, heads * hd, std=std)
        normal(lp + "mlp.gate_proj.weight", inter, h, std=std)
        normal(lp + "mlp.up_proj.weight", inter, h, std=std)
        normal(lp + "mlp.down_proj.weight", h, inter, std=2.0 / inter**0.5)
        norm(lp + "input_layernorm")
        norm(lp + "post_attention_layernorm")
        if arch == "qwen3":
            for qk in ("q_norm", "k_norm"):
                w[lp + f"self_attn.{qk}.weight"] = 1.0 + 0.2 * torch.randn(hd, generator=g)
    norm("model.norm")
    w["model.norm.weight"] *= 4.0
    if not cfg["tie_word_embeddings"]:
        normal("lm_head.weight", v, h, std=0.5)
    return w


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def make_tiny_model(
    path: str | os.PathLike[str],
    arch: str = "llama",
    seed: int = 0,
    *,
    vocab_size: int | None = None,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    max_position_embeddings: int | None = None,
    tie_word_embeddings: bool | None = None,
    head_dim: int | None = None,
) -> str:
    """Write a randomly initialised ``arch`` model (``llama``, ``qwen2``, ``qwen3`` or ``opt``)
    to ``path``.

    Defaults: vocab 512, hidden 64, 2 layers, 4 heads (2 KV heads for llama/qwen2/qwen3: GQA),
    intermediate 128, 1024 positions; qwen2 and qwen3 tie their embeddings, llama and opt do not
    unless asked (real OPT checkpoints tie; ``tie_word_embeddings=True`` reproduces that).
    qwen3 has per-head Q/K RMSNorms and an explicit ``head_dim`` (default 32, so
    ``heads * head_dim`` differs from ``hidden``, as in Qwen3-0.6B). Returns ``path``.
    """
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; "
                         f"choose from {sorted(_ARCHITECTURES)}")
    sizes = {"vocab_size": vocab_size, "hidden_size": hidden_size,
             "intermediate_size": intermediate_size, "num_layers": num_layers,
             "num_heads": num_heads, "num_kv_heads": num_kv_heads,
             "max_position_embeddings": max_position_embeddings, "head_dim": head_dim}
    for name, v in sizes.items():  # a size of 0 is refused, not taken for the default
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    vocab = 512 if vocab_size is None else vocab_size
    hidden = 64 if hidden_size is None else hidden_size
    heads = 4 if num_heads is None else num_heads
    kv_heads = heads if arch == "opt" else (num_kv_heads or max(1, heads // 2))
    if arch == "opt" and num_kv_heads not in (None, heads):
        raise ValueError("OPT has no grouped-query attention: num_kv_heads must equal num_heads")
    if head_dim is not None and arch != "qwen3":
        raise ValueError("an explicit head_dim is only written for qwen3")
    hd = head_dim or 32
    if hidden % heads and arch != "qwen3":
        raise ValueError(f"hidden_size={hidden} is not divisible by num_heads={heads}")
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} is not a multiple of num_kv_heads={kv_heads}")
    if vocab < 300:
        raise ValueError(f"vocab_size={vocab} is too small for a byte-level tokenizer (>= 300)")
    tie = (arch in ("qwen2", "qwen3")) if tie_word_embeddings is None else tie_word_embeddings
    cfg = _hf_config(arch, vocab, hidden, intermediate_size or 2 * hidden, num_layers or 2,
                     heads, kv_heads, max_position_embeddings or 1024, tie, hd)

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    _write_json(os.path.join(path, "config.json"), cfg)
    _write_json(os.path.join(path, "generation_config.json"), {
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "do_sample": False,
    })
    weights = _random_weights(arch, cfg, seed)
    save_file({k: t.contiguous() for k, t in sorted(weights.items())},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    tok = _train_tokenizer(vocab, add_bos=arch not in ("qwen2", "qwen3"))
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(tok.to_str(pretty=True))
    _write_json(os.path.join(path, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": arch not in ("qwen2", "qwen3"),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(os.path.join(path, "special_tokens_map.json"), {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
    })
    return path


def default_model_dir() -> str:
    """Directory of the default tiny llama, created on first use under ``$PDSERVE_CACHE`` (or
    ``~/.cache/pdserve``) as ``tiny-llama``."""
    return build_once(os.path.join(cache_root(), "tiny-llama"),
                      lambda tmp: make_tiny_model(tmp, "llama"))
