"""The controller's record of one request (:class:`ClusterRequest`): what the routers read
when they choose an instance, in a module of its own so that routers import it without
importing the controller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.request import Prompt, SamplingParams, Timeline


@dataclass
class ClusterRequest:
    request_id: str
    prompt_token_ids: Prompt  # (a list is made one)
    params: SamplingParams
    timeline: Timeline
    output_token_ids: list[int] = field(default_factory=list)
    stage: str = "new"  # queued | prefill | transfer | decode | done
    instance: str | None = None  # the instance whose tokens we accept now
    prefill_instance: str | None = None
    decode_instance: str | None = None
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    num_dispatches: int = 0
    # instances the request lives on -> KV tokens promised there and not yet reserved
    placed: dict[str, int] = field(default_factory=dict)
    predicted: Any = None  # LengthPrediction of the output (TetriInfer §3.3.2)
    counted_on: str | None = None  # the decode instance whose heavy/light counts include it

    def __post_init__(self) -> None:
        # the prompt carries its block hashes, computed once for the router and the engines
        if not isinstance(self.prompt_token_ids, Prompt):
            self.prompt_token_ids = Prompt(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def arrival(self) -> float:
        assert self.timeline.arrival is not None
        return self.timeline.arrival
