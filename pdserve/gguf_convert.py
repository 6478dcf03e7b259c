"""Convert a GGUF checkpoint (llama.cpp's format) into a Hugging Face directory, once.

:func:`gguf_model_dir` turns ``model.gguf`` into a cached directory in the layout the loader,
tokenizer and chat-template code already read:

- ``config.json`` / ``generation_config.json`` from the GGUF metadata (``{arch}.*`` keys; a
  ``rope_freqs`` tensor becomes Llama 3 ``rope_scaling`` when it matches it exactly);
- ``model.safetensors``: every tensor dequantized to float32 with the ``gguf`` package and renamed
  to its Hugging Face name. llama.cpp stores Llama's Q and K projections with the rows of each
  head interleaved (``[x0, x_{d/2}, x1, x_{d/2+1}, ...]``, the rotate-every-two layout of its RoPE
  kernel); they are put back into the rotate-half order Hugging Face's Llama expects (Qwen2 is
  stored unpermuted);
- ``tokenizer.json`` + ``tokenizer_config.json`` with the chat template, converted from the
  ``tokenizer.ggml.*`` metadata by transformers' GGUF tokenizer conversion (plus the
  digit-by-digit split of SmolLM's pre-tokenizer, which that conversion lacks).

The cache lives under ``$PDSERVE_CACHE`` (or ``~/.cache/pdserve``) in ``gguf/<key>/<name>``, the
key a hash of the file's absolute path, size and modification time (and the versions of this
converter and of transformers), so a changed file is converted again. No torch here: numpy and
safetensors' numpy API. The conversion takes a minute or two on a small CPU (SmolLM2-135M: read
the file, dequantize 272 tensors, write them, build the tokenizer); :class:`Progress` reports
each step on stderr, with a bar per tensor on a terminal and plain lines otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from typing import Any

import numpy as np

from pdserve.cache import build_once, cache_root

# Bump when the converted layout changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1

# GGUF architecture -> (Hugging Face architecture, model_type). Mistral GGUFs say "llama".
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
# Architectures whose Q/K rows llama.cpp's converter permuted for its rotate-every-two RoPE.
_PERMUTED_QK = {"llama"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# llama.cpp pre-tokenizers that split every digit on its own before the GPT-2 regex (SmolLM's
# and StarCoder's vocabularies); transformers' conversion keeps the plain GPT-2 split for them.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}


class Progress:
    """Steps and a per-tensor count on stderr: a tqdm bar on a terminal, else a plain line per
    step and per tenth of the tensors. ``enabled=False`` prints nothing."""

    def __init__(self, enabled: bool = True, stream: Any = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self._bar: Any = None
        self._total = 0
        self._done = 0
        self._quiet = threading.Event()  # set: the current step's heartbeat stops
        self._lock = threading.Lock()  # a heartbeat line never follows the next step's

    def _say(self, text: str) -> None:
        if self.enabled:
            print(f"pdserve: [{time.monotonic() - self.t0:5.1f} s] {text}", file=self.stream,
                  flush=True)

    def step(self, text: str, heartbeat_s: float = 10.0) -> None:
        """Start a step; until the next one, a line every ``heartbeat_s`` seconds says it is
        still running (steps inside other libraries report nothing themselves)."""
        self.close()
        self._say(text)
        if not self.enabled or heartbeat_s <= 0:
            return
        quiet = self._quiet = threading.Event()

        def beat() -> None:
            start = time.monotonic()
            while not quiet.wait(heartbeat_s):
                with self._lock:
                    if quiet.is_set():
                        break
                    self._say(f"... still {text} ({time.monotonic() - start:.0f} s)")

        threading.Thread(target=beat, daemon=True, name="gguf-progress").start()

    def done(self, text: str) -> None:
        self.close()
        self._say(text)

    def close(self) -> None:
        """Stop the heartbeat and the bar."""
        with self._lock:
            self._quiet.set()
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def tensors(self, total: int) -> None:
        self.close()
        self._total, self._done = total, 0
        if self.enabled and self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="pdserve: dequantizing", unit="tensor",
                             file=self.stream, leave=False)
        else:
            self._say(f"dequantizing {total} tensors")

    def tensor_done(self, name: str) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(name, refresh=False)
            self._bar.update(1)
            if self._done == self._total:
                self._bar.close()
                self._bar = None
                self._say(f"dequantized {self._total} tensors")
        elif self._total and (self._done * 10 // self._total
                              > (self._done - 1) * 10 // self._total):
            self._say(f"dequantized {self._done}/{self._total} tensors ({name})")


def _reader(path: str) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a GGUF file we can read"
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader: Any, path: str = "") -> dict[str, Any]:
    """``config.json`` for the GGUF file read by ``reader``; ``ValueError`` names an unsupported
    architecture or feature."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF file {path!r} has architecture {arch!r}; supported: "
                         f"{sorted(ARCHITECTURES)}")
    hf_arch, model_type = ARCHITECTURES[arch]
    tensors = {t.name for t in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF file {path!r} lacks the metadata key {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dims = int(key("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"GGUF file {path!r}: partial rotary embeddings (rope.dimension_count "
                         f"{rope_dims} != head dim {head_dim}) are not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(key("vocab_size", len(tokens) or None)),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"GGUF file {path!r}: rope scaling {scaling!r} is not supported "
                             "(supported: linear)")
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(key("rope.scaling.factor"))}
    if "rope_freqs.weight" in tensors:
        cfg["rope_scaling"] = _llama3_scaling(reader, path, head_dim, cfg)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    # End of a chat turn (llama 3's <|eot_id|>) stops generation too.
    stops = [int(t) for t in (eos, _field(reader, "tokenizer.ggml.eot_token_id"),
                              _field(reader, "tokenizer.ggml.eom_token_id")) if t is not None]
    stops = list(dict.fromkeys(stops))
    if stops:
        cfg["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return cfg


def _llama3_scaling(reader: Any, path: str, head_dim: int,
                    cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp bakes Llama 3.1's RoPE scaling into per-frequency factors (``rope_freqs``).
    Recover the ``llama3`` parameters and check they reproduce the factors exactly."""
    from gguf import dequantize

    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    old = scaling["original_max_position_embeddings"]
    smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
    expect = np.where(wavelen < old / 4.0, 1.0,
                      np.where(wavelen > old, scaling["factor"],
                               1.0 / ((1 - smooth) / scaling["factor"] + smooth)))
    if factors.shape != expect.shape or not np.allclose(factors, expect, rtol=1e-3):
        raise ValueError(f"GGUF file {path!r}: rope_freqs.weight does not match Llama 3 RoPE "
                         "scaling with the usual parameters; not supported")
    return scaling


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of Q/K rows (works for weights and biases)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_weights(reader: Any, cfg: dict[str, Any], path: str = "",
               progress: Progress | None = None) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its Hugging Face name."""
    from gguf import dequantize

    progress = progress or Progress(enabled=False)
    permute = cfg["model_type"] in _PERMUTED_QK
    out: dict[str, np.ndarray] = {}
    progress.tensors(len(reader.tensors))
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # folded into config.json's rope_scaling
            progress.tensor_done(t.name)
            continue
        m = _LAYER_RE.fullmatch(t.name)
        if m and m.group(2) in _LAYER_TENSORS:
            layer, kind, suffix = m.groups()
            name = f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
        else:
            base, _, suffix = t.name.rpartition(".")
            if base not in _GLOBAL_TENSORS:
                raise ValueError(f"GGUF file {path!r} has a tensor {t.name!r} that a "
                                 f"{cfg['model_type']} checkpoint does not have")
            name, kind = f"{_GLOBAL_TENSORS[base]}.{suffix}", base
        try:
            w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as e:
            raise ValueError(f"GGUF file {path!r}: tensor {t.name!r} is stored as "
                             f"{t.tensor_type.name}, which the gguf package cannot "
                             "dequantize") from e
        if permute and kind == "attn_q":
            w = _unpermute(w, cfg["num_attention_heads"])
        elif permute and kind == "attn_k":
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
        progress.tensor_done(t.name)
    return out


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def write_tokenizer(reader: Any, gguf_path: str, out_dir: str, max_len: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) from the
    ``tokenizer.ggml.*`` metadata."""
    if _field(reader, "tokenizer.ggml.tokens") is None:
        raise ValueError(f"GGUF file {gguf_path!r} has no tokenizer (tokenizer.ggml.tokens)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                        gguf_file=os.path.basename(gguf_path))
    if _field(reader, "tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        from tokenizers import pre_tokenizers

        backend = tok.backend_tokenizer
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.save_pretrained(out_dir)
    template_file = os.path.join(out_dir, "chat_template.jinja")
    if os.path.isfile(template_file):  # one place for the template, read by every version
        os.remove(template_file)
    with open(os.path.join(out_dir, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    for k in ("is_local", "local_files_only"):
        tcfg.pop(k, None)
    tcfg["model_max_length"] = max_len
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tcfg["chat_template"] = template
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tcfg)


def convert_gguf(gguf_path: str, out_dir: str, progress: Progress | None = None) -> str:
    """Write the Hugging Face layout of ``gguf_path`` into ``out_dir``; returns ``out_dir``.
    ``progress`` reports each step (default: silent)."""
    from safetensors.numpy import save_file

    progress = progress or Progress(enabled=False)
    try:
        return _convert(gguf_path, out_dir, progress, save_file)
    finally:
        progress.close()


def _convert(gguf_path: str, out_dir: str, progress: Progress, save_file: Any) -> str:
    progress.step(f"reading {os.path.basename(gguf_path)}")
    reader = _reader(gguf_path)
    cfg = hf_config(reader, gguf_path)
    weights = hf_weights(reader, cfg, gguf_path, progress)
    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    _write_json(os.path.join(out_dir, "generation_config.json"), gen)
    size = sum(w.nbytes for w in weights.values())
    progress.step(f"writing model.safetensors ({size / 2**20:,.0f} MiB of float32)")
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del weights
    progress.step("building the tokenizer from the GGUF vocabulary (transformers)")
    write_tokenizer(reader, gguf_path, out_dir, cfg["max_position_embeddings"])
    progress.done("converted")
    return out_dir


def gguf_model_dir(gguf_path: str, name: str | None = None) -> str:
    """The cached Hugging Face directory of ``gguf_path``, converted on first use.

    ``name`` is the directory's base name (what servers report as the model name); default: the
    file name without ``.gguf``."""
    if not os.path.isfile(gguf_path):
        raise ValueError(f"GGUF file {gguf_path!r} does not exist")
    from importlib.metadata import version

    st = os.stat(gguf_path)
    # transformers writes the tokenizer files, in its version's format
    ident = (f"{os.path.abspath(gguf_path)}\0{st.st_size}\0{st.st_mtime_ns}\0"
             f"{CONVERTER_VERSION}\0{version('transformers')}")
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    name = name or os.path.basename(gguf_path).removesuffix(".gguf")
    path = os.path.join(cache_root(), "gguf", key, name)
    if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        return path
    print(f"pdserve: converting {gguf_path} into {path} (once; a minute or two)",
          file=sys.stderr, flush=True)
    return build_once(path, lambda tmp: convert_gguf(gguf_path, tmp, Progress()))
