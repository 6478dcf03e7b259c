"""pdserve: goodput-optimised LLM serving (colocated, disaggregated, partially disaggregated)."""

from pdserve.request import RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing pdserve must not import torch
        from pdserve.llm import LLM

        return LLM
    raise AttributeError(name)
