"""What the controller asks its driver to do (:class:`pdserve.cluster.controller.Controller`
returns these): :class:`Send` a command to an instance, :class:`Transfer` KV between two
instances, :class:`Fail` a request. Small plain values, in their own module so that the
controller's helpers (the flip watcher) return them without importing the controller."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.worker import Command
from pdserve.request import Timeline


@dataclass(slots=True)
class Send:
    instance_id: str
    command: Command


@dataclass(slots=True)
class Transfer:
    """Move the KV of ``request_id`` from block ``first_block`` on, ``src`` → ``dst``."""

    request_id: str
    src: str
    dst: str
    first_block: int
    num_tokens: int  # tokens whose KV moves (for link-time accounting)


@dataclass(slots=True)
class Fail:
    request_id: str
    message: str
    timeline: Timeline


Action = Send | Transfer | Fail
