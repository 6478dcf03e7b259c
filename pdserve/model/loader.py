"""Load a Hugging Face checkpoint directory into our paged-attention modules.

Reads ``config.json`` (via :meth:`pdserve.config.ModelConfig.from_dir`) and the weights from
``model.safetensors``, a sharded ``model.safetensors.index.json``, or (fallback)
``pytorch_model.bin`` / ``pytorch_model.bin.index.json``. Every checkpoint tensor must map to a
parameter (through the model's ``hf_weight_spec``) or be known-ignorable; every parameter must be
filled. Anything else is a ``ValueError`` that names the tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from torch import nn

from pdserve.checkpoints import resolve_model
from pdserve.config import ModelConfig
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.opt import OPTForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "opt": OPTForCausalLM,
}


def weight_files(model_dir: str) -> list[str]:
    """The checkpoint files of ``model_dir`` (safetensors preferred)."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if os.path.isfile(os.path.join(model_dir, single)):
            return [os.path.join(model_dir, single)]
        index_path = os.path.join(model_dir, index)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index_path} has no weight_map")
            files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
            missing = [p for p in files if not os.path.isfile(p)]
            if missing:
                raise ValueError(f"{index_path} lists shard(s) that do not exist: {missing}")
            return files
    raise ValueError(f"model directory {model_dir!r} has no model.safetensors, "
                     "model.safetensors.index.json or pytorch_model.bin")


def iter_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, CPU tensor)`` for every tensor of the checkpoint files."""
    for path in files:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            yield from state.items()


def build_model(cfg: ModelConfig, dtype: str = "float32", device: str = "cpu") -> nn.Module:
    """A model of ``cfg``'s family allocated directly on ``device`` in ``dtype``, its weights
    uninitialised until :func:`load_weights` fills them."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    cls = MODEL_CLASSES.get(cfg.family)
    if cls is None:
        raise ValueError(f"unsupported model family {cfg.family!r}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into ``model`` (a family module with ``hf_weight_spec``).

    Raises ``ValueError`` naming unexpected tensors, missing tensors or shape mismatches."""
    spec: dict[str, tuple[str, int]] = model.hf_weight_spec()  # type: ignore[operator]
    params = dict(model.named_parameters())
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        key = name if name in spec else f"model.{name}"  # some OPT files drop "model."
        if key not in spec:
            if not model.ignored_hf_weight(name):  # type: ignore[operator]
                unexpected.append(name)
            continue
        pname, row = spec[key]
        param = params[pname]
        rows = tensor.shape[0] if tensor.dim() else 1
        target = param[row : row + rows]
        if tensor.shape[1:] != param.shape[1:] or target.shape[0] != rows:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, which does not "
                             f"fit parameter {pname!r} of shape {tuple(param.shape)} at row {row}")
        target.copy_(tensor)
        seen.add(key)
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensor(s): "
                         f"{sorted(unexpected)[:10]}")
    missing = sorted(set(spec) - seen)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {missing[:10]}")


def load_model(model_dir: str, dtype: str = "float32",
               device: str = "cpu") -> tuple[nn.Module, ModelConfig]:
    """Build the model described by ``model_dir/config.json`` and load its weights.

    ``model_dir`` may also be a ``.gguf`` file or a built-in model name
    (:func:`pdserve.checkpoints.resolve_model`).

    ``dtype``: ``float32``, ``bfloat16`` or ``float16``; ``device``: ``cpu`` or ``cuda[:N]``.
    Returns ``(model, config)``; the model is in eval mode without gradients.
    """
    model_dir = resolve_model(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    files = weight_files(model_dir)
    model = build_model(cfg, dtype, device)
    load_weights(model, iter_weights(files))
    return model, cfg
