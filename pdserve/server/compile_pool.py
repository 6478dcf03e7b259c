"""Structured-output compilation in worker processes, with a time and a size limit.

Compiling a regular expression into a token automaton (outlines-core) can take exponential
time: ``[ab]*a[ab]{18}`` (46 bytes) takes seconds to minutes. The server checks every output
constraint by compiling it here before the request is admitted: in one of ``workers``
processes, each holding the tokenizer's vocabulary, so that a pathological expression occupies
one worker while the others serve the trivial ones beside it. A compilation that runs past
``timeout`` seconds, or whose worker runs out of its ``memory_bytes`` address space, is a
``ValueError`` (HTTP 400); one whose client left is cancelled. Either way its worker process is
killed and replaced. Results (success or the error) are cached per expression.

A JSON schema (or choice list) is converted to its regular expression in the worker too, under
the same limits. The instance that serves the request compiles the (admitted) expression again
for its own masks; an expression that passed here compiles there within the same limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing as mp
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

from pdserve import grammar

log = logging.getLogger("pdserve.server")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_WORKERS = 2
DEFAULT_MEMORY_BYTES = 4 << 30  # address space per worker process
CACHE_SIZE = 256


def _worker(conn: Connection, eos_token_id: int, by_bytes: dict[bytes, list[int]],
            memory_bytes: int) -> None:
    """A compile worker: build the vocabulary once, say ``ready``, then compile each regular
    expression it receives and answer ``None`` or the error message."""
    import resource

    with contextlib.suppress(ValueError, OSError):  # a lower hard limit: keep it
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    from outlines_core import Index, Vocabulary

    vocab = Vocabulary(eos_token_id, by_bytes)
    conn.send("ready")
    while True:
        try:
            kind, spec = conn.recv()
        except EOFError:
            return
        try:
            regex = to_regex(kind, spec)
            grammar.check_regex(regex)
        except ValueError as e:
            conn.send((None, str(e)))
            continue
        except MemoryError:
            conn.send((None, f"the output constraint needs more than {memory_bytes >> 20} MiB "
                             f"to convert"))
            continue
        try:
            Index(regex, vocab)
            conn.send((regex, None))
        except MemoryError:
            conn.send((None, f"the output constraint needs more than {memory_bytes >> 20} MiB "
                             f"to compile"))
        except Exception as e:  # the Rust side raises its own error types
            conn.send((None, f"cannot compile the output constraint: {e}"))


def to_regex(kind: str, spec: Any) -> str:
    """The regular expression of a structured-output request: ``kind`` ``json_object``,
    ``json`` (a schema), ``choice`` (strings) or ``regex``. ``ValueError`` when unsupported."""
    if kind == "json_object":
        return grammar.json_object_regex()
    if kind == "json":
        return grammar.regex_for_schema(spec)
    if kind == "choice":
        return grammar.regex_for_choice(spec)
    if kind == "regex":
        return str(spec)
    raise ValueError(f"unknown output constraint kind {kind!r}")


class _Worker:
    def __init__(self, ctx: Any, args: tuple[Any, ...]) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, *args), daemon=True,
                                name="pdserve-grammar")
        self.proc.start()
        child.close()
        self.ready = False

    async def recv(self) -> Any:
        """The worker's next message, without blocking the loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        fd = self.conn.fileno()

        def readable() -> None:
            if fut.done():
                return
            try:
                fut.set_result(self.conn.recv())
            except (EOFError, OSError) as e:
                fut.set_exception(e)

        loop.add_reader(fd, readable)
        try:
            return await fut
        finally:
            loop.remove_reader(fd)

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.conn.close()
        self.proc.join(timeout=5)


class CompilePool:
    """Compiles regular expressions over one tokenizer's vocabulary in worker processes (started
    at the first use, spawned: no state of the server is forked)."""

    def __init__(self, tokenizer: Any, eos_token_id: int, workers: int = DEFAULT_WORKERS,
                 timeout: float = DEFAULT_TIMEOUT_S,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        if workers < 1:
            raise ValueError(f"grammar workers must be >= 1, got {workers}")
        if not timeout > 0:
            raise ValueError(f"grammar timeout must be > 0, got {timeout}")
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.workers = workers
        self.timeout = timeout
        self.memory_bytes = memory_bytes
        self.killed = 0  # workers killed (timeouts, cancellations, crashes)
        self.busy: list[_Worker] = []  # compiling now
        self._args: tuple[Any, ...] | None = None
        self._idle: list[_Worker] = []
        self._slots: asyncio.Semaphore | None = None
        # verdicts per constraint: (regex, None) or (None, error)
        self._cache: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()
        self._ctx = mp.get_context("spawn")

    def _vocabulary_args(self) -> tuple[Any, ...]:
        if self._args is None:
            by_bytes: dict[bytes, list[int]] = {}
            for i, b in grammar.token_bytes(self.tokenizer).items():
                if i != self.eos_token_id and b:
                    by_bytes.setdefault(b, []).append(i)
            self._args = (self.eos_token_id, by_bytes, self.memory_bytes)
        return self._args

    async def check(self, regex: str) -> None:
        """Compile ``regex``; ``ValueError`` when it is invalid, unsupported, or over the time
        or memory limit. Cancelling the call (the client left) kills its worker."""
        await self.compile("regex", regex)

    async def compile(self, kind: str, spec: Any) -> str:
        """The regular expression of a structured-output request (:func:`to_regex`), converted
        and compiled in a worker, both under the limits; ``ValueError`` as :meth:`check`."""
        if kind == "regex":
            grammar.check_regex(str(spec))  # size: characters and counted repetitions, at once
        key = f"{kind}\0{spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)}"
        if key in self._cache:
            self._cache.move_to_end(key)
            regex, error = self._cache[key]
        else:
            regex, error = await self._compile((kind, spec))
            self._cache[key] = (regex, error)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        if error is not None:
            raise ValueError(error)
        assert regex is not None
        return regex

    async def _compile(self, job: tuple[str, Any]) -> tuple[str | None, str | None]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            worker = self._idle.pop() if self._idle else None
            if worker is None:
                loop = asyncio.get_running_loop()
                args = await loop.run_in_executor(None, self._vocabulary_args)
                worker = _Worker(self._ctx, args)
            ok = False
            try:
                if not worker.ready:  # starting the worker is not the expression's time
                    if await worker.recv() != "ready":
                        raise RuntimeError("the grammar worker did not start")
                    worker.ready = True
                worker.conn.send(job)
                self.busy.append(worker)
                try:
                    result = await asyncio.wait_for(worker.recv(), self.timeout)
                except asyncio.TimeoutError:
                    log.warning("compiling a %s output constraint took over %.1f s; refused",
                                job[0], self.timeout)
                    return None, (f"the output constraint takes longer than "
                                  f"{self.timeout:g} s to compile; simplify it")
                except (EOFError, OSError):  # the worker died (out of memory, killed)
                    return None, (f"the output constraint could not be compiled within "
                                  f"{self.memory_bytes >> 20} MiB")
                ok = True
                return result[0], result[1]
            finally:
                if worker in self.busy:
                    self.busy.remove(worker)
                if ok:
                    self._idle.append(worker)
                else:  # timed out, cancelled or dead: the process may be mid-compile
                    self.killed += 1
                    worker.kill()

    def close(self) -> None:
        for w in self._idle:
            w.kill()
        self._idle.clear()
