"""The choices of one API request (prompts × ``n`` samples) as engine requests, merged into
one stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from pdserve.request import RequestOutput, SamplingParams
from pdserve.server.formats import ResponseFormat
from pdserve.server.metrics import ServerMetrics


async def _close(outputs: AsyncIterator[RequestOutput]) -> None:
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


class Fanout:
    """The choices of one API request, each an engine request, merged into one stream of
    ``(choice index, output)``.

    The first sample of each prompt is submitted at once (so that a bad prompt or a full queue
    fails the API request before anything is sent); its other samples are submitted when it
    produces its first token, when its prompt's full KV blocks are in the prefix cache, so
    that they reuse them instead of computing the prompt again. Iteration ends when every
    choice has finished; the first exception of any choice is raised. :meth:`aclose` aborts
    whatever is still running."""

    def __init__(self, runtime: Any, metrics: ServerMetrics, fmt: ResponseFormat,
                 jobs: list[tuple[list[int], SamplingParams]],
                 on_finish: Callable[[list[int], RequestOutput], None] | None = None) -> None:
        self.runtime = runtime
        self.on_finish = on_finish  # called with (prompt ids, final output) of each choice
        self.metrics = metrics
        self.fmt = fmt
        self.jobs = jobs
        self.queue: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = (
            asyncio.Queue())
        self.iters: dict[int, AsyncIterator[RequestOutput]] = {}
        self.tasks: list[asyncio.Future[None]] = []
        self.finished = 0
        self.done: set[int] = set()  # choices whose final output was read

    def request_id(self, index: int) -> str:
        return self.fmt.id if self.fmt.num_choices == 1 else f"{self.fmt.id}-{index}"

    def _submit(self, index: int) -> AsyncIterator[RequestOutput]:
        ids, params = self.jobs[index]
        if index % self.fmt.n:  # a later sample: the request was admitted with all of them
            it = self.runtime.generate(self.request_id(index), ids, params, admitted=True)
        else:
            it = self.runtime.generate(self.request_id(index), ids, params)
        self.iters[index] = it
        return it

    async def start(self) -> None:
        """Submit each prompt's first sample; on an error abort those submitted and raise."""
        try:
            for i in range(0, len(self.jobs), self.fmt.n):
                self._submit(i)
        except Exception:
            await self.aclose()
            raise
        if len(self.jobs) > 1:
            for i in list(self.iters):
                self._pump(i)

    def _pump(self, index: int) -> None:
        self.tasks.append(asyncio.ensure_future(self._run(index)))

    async def _run(self, index: int) -> None:
        tracker = self.metrics.tracker(len(self.jobs[index][0]))
        leader = index % self.fmt.n == 0 and self.fmt.n > 1
        try:
            async for out in self.iters[index]:
                tracker.observe(out)
                if leader:
                    leader = False
                    for j in range(index + 1, index + self.fmt.n):
                        self._submit(j)
                        self._pump(j)
                self.queue.put_nowait((index, out, None))
                if out.finished:
                    self._finished(index, out)
                    return
            raise RuntimeError("the runtime ended the output stream without a final output")
        except Exception as e:
            tracker.close("error")
            self.queue.put_nowait((index, None, e))
        finally:
            tracker.close()

    def _finished(self, index: int, out: RequestOutput) -> None:
        if self.on_finish is not None and out.finish_reason in ("stop", "length"):
            self.on_finish(self.jobs[index][0], out)

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.jobs) == 1:  # one choice: its iterator directly, no task or queue hop
            tracker = self.metrics.tracker(len(self.jobs[0][0]))
            try:
                async for out in self.iters[0]:
                    tracker.observe(out)
                    if out.finished:
                        self.finished = 1
                        self.done.add(0)
                        self._finished(0, out)
                    yield 0, out
                    if out.finished:
                        return
                raise RuntimeError("the runtime ended the output stream without a final "
                                   "output")
            except Exception:
                tracker.close("error")
                raise
            finally:
                tracker.close()
        while self.finished < len(self.jobs):
            index, out, exc = await self.queue.get()
            if exc is not None:
                raise exc
            assert out is not None
            if out.finished:
                self.finished += 1
                self.done.add(index)
            yield index, out

    async def aclose(self) -> None:
        """Stop every choice; abort those that have not finished (an output iterator that was
        never iterated does not abort its request when closed)."""
        with anyio.CancelScope(shield=True):
            for t in self.tasks:
                t.cancel()
            if self.tasks:
                await asyncio.wait(self.tasks)
            for index, it in self.iters.items():
                await _close(it)
                if index not in self.done:
                    await self.runtime.abort(self.request_id(index))
