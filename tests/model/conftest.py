"""Fixtures: tiny models of each architecture (built once per session) and their
transformers twins."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.tiny import make_tiny_model

ARCHS = ("llama", "qwen2", "qwen3", "opt")

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(str(root / arch), arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def hf_models(tiny_dirs):
    from transformers import AutoModelForCausalLM

    cache: dict[str, torch.nn.Module] = {}

    def get(arch: str) -> torch.nn.Module:
        if arch not in cache:
            cache[arch] = AutoModelForCausalLM.from_pretrained(
                tiny_dirs[arch], dtype=torch.float32).eval()
        return cache[arch]

    return get
