"""The models the engine benchmarks run, by name: ``llama56m`` (a seeded random tiny llama,
56.4M parameters, written once) and ``smollm2`` (SmolLM2-135M-Instruct from its GGUF); and the
competing process of their ``busy`` conditions."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

from pdserve.checkpoints import resolve_model

BUSY_CODE = "while 1: pass"  # ``python -c BUSY_CODE``: one core's worth of competing work

# the random llama of benchmarks/offline_throughput.py (its flags' defaults)
LLAMA56M = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408, "num_layers": 8,
            "num_heads": 8, "num_kv_heads": 4, "max_position_embeddings": 1024}


def bench_llama_dir(seed: int = 0, vocab_size: int = 32000, hidden_size: int = 512,
                    intermediate_size: int = 1408, num_layers: int = 8, num_heads: int = 8,
                    num_kv_heads: int = 4, max_position_embeddings: int = 1024) -> str:
    """The directory of a random tiny llama of these sizes, written on first use under
    ``$PDSERVE_CACHE`` (else the temporary folder's ``pdserve``)."""
    name = (f"bench-llama-v{vocab_size}-h{hidden_size}-i{intermediate_size}"
            f"-l{num_layers}-a{num_heads}-kv{num_kv_heads}")
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(tempfile.gettempdir(), "pdserve")
    path = os.path.join(root, name)
    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        from pdserve.model.tiny import make_tiny_model  # lazy: torch

        make_tiny_model(path, "llama", seed=seed, vocab_size=vocab_size,
                        hidden_size=hidden_size, intermediate_size=intermediate_size,
                        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        max_position_embeddings=max_position_embeddings)
    return path


def resolve_models(names: Sequence[str], seed: int = 0) -> dict[str, str]:
    """Model directories by benchmark name: ``llama56m``, ``smollm2``, or a directory."""
    paths = {}
    for name in names:
        if name == "llama56m":
            paths[name] = bench_llama_dir(seed, **LLAMA56M)
        elif name == "smollm2":
            paths[name] = resolve_model("smollm2-135m-instruct")
        else:
            paths[name] = name  # a Hugging Face directory
    return paths
