"""Torch models for serving: paged attention, Llama/Mistral/Qwen2 and OPT, loader, sampler and
random tiny models."""

from pdserve.model.layers import AttentionMetadata, build_attention_metadata, paged_attention
from pdserve.model.loader import load_model
from pdserve.model.sampler import Sampler, SampleRow
from pdserve.model.tiny import default_model_dir, make_tiny_model

__all__ = [
    "AttentionMetadata",
    "Sampler",
    "SampleRow",
    "build_attention_metadata",
    "default_model_dir",
    "load_model",
    "make_tiny_model",
    "paged_attention",
]
