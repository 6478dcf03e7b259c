"""pdserve: goodput-optimised LLM serving (colocated, disaggregated, partially disaggregated)."""

import os

# OpenMP threads that wait for work sleep instead of spinning (GNU and LLVM OpenMP read this
# when torch loads them, so it must be set before torch is imported; pdserve imports torch
# lazily). Spinning threads fight any other busy process for the cores, which costs a loaded
# CPU host most of its throughput (docs/benchmarks.md, "Threads under contention"). Set
# OMP_WAIT_POLICY to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pdserve.request import RequestOutput, SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing pdserve must not import torch
        from pdserve.llm import LLM  # lazy: torch

        return LLM
    raise AttributeError(name)
