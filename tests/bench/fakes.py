"""Test doubles: a fake OpenAI-compatible streaming server with known token delays, and an
in-process FIFO-queue target whose SLO attainment falls as the rate rises."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import WorkloadRequest
from pdserve.request import Timeline

TTFT_DELAY = 0.10  # seconds before the first token
TPOT_DELAY = 0.02  # seconds between tokens
MAX_MODEL_LEN = 4096
VOCAB_SIZE = 97  # what /v1/models reports; token ids at or above it get a 400


SEPARATORS = "\u2028\u0085\u2029"  # line ends to str.splitlines, not to SSE


def _chunk(text: str, finish: str | None = None, **extra: Any) -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "model": "fake",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}], **extra}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


def _usage(n: int) -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "model": "fake", "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
    return f"data: {json.dumps(body)}\n\n".encode()


def make_app(bodies: list[dict[str, Any]]) -> FastAPI:
    """Behaviour by prompt text: ``BAD`` → 400; ``DROP`` → connection dropped after 2 tokens;
    ``STREAMERR`` → an error chunk after 2 tokens; ``COALESCE`` → 2 tokens per chunk;
    ``SLOW`` → 5 s of silence; ``FINISHCHUNK`` → an extra empty chunk carrying the finish
    reason; ``SEPS`` → each token is a character of :data:`SEPARATORS`, written raw inside the
    JSON (as JSON allows), lines ended by CRLF. Anything else (token ids too) streams
    ``max_tokens`` tokens with the fixed delays."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "object": "model",
                                            "max_model_len": MAX_MODEL_LEN,
                                            "vocab_size": VOCAB_SIZE}]}

    @app.get("/metrics")
    async def metrics() -> Any:  # a vLLM-style exposition: requests received so far
        from fastapi.responses import PlainTextResponse

        return PlainTextResponse("# TYPE vllm:num_requests_running gauge\n"
                                 "vllm:num_requests_running 0.0\n"
                                 "# TYPE vllm:request_success counter\n"
                                 f"vllm:request_success_total {float(len(bodies))}\n")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        bodies.append(body)
        prompt = body["prompt"] if isinstance(body["prompt"], str) else ""
        n = int(body["max_tokens"])
        if prompt.startswith("BAD"):
            return JSONResponse({"error": {"message": "prompt is not allowed", "code": 400}},
                                status_code=400)
        bad = [t for t in body["prompt"] if isinstance(t, int) and not 0 <= t < VOCAB_SIZE] \
            if isinstance(body["prompt"], list) else []
        if bad:
            msg = f"prompt token id {bad[0]} is outside the vocabulary [0, {VOCAB_SIZE})"
            return JSONResponse({"error": {"message": msg, "code": 400}}, status_code=400)
        arrived = time.monotonic()

        async def stream() -> AsyncIterator[bytes]:
            await asyncio.sleep(TTFT_DELAY)
            if prompt.startswith("SLOW"):
                await asyncio.sleep(5)
            times = []
            step = 2 if prompt.startswith("COALESCE") else 1
            for i in range(0, n, step):
                if i:
                    await asyncio.sleep(TPOT_DELAY * step)
                if i >= 2 and prompt.startswith("DROP"):
                    raise RuntimeError("simulated crash")
                if i >= 2 and prompt.startswith("STREAMERR"):
                    yield f"data: {json.dumps({'error': {'message': 'engine died'}})}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                    return
                k = min(step, n - i)
                times += [time.monotonic()] * k
                last = i + k >= n
                extra = {}
                if last and body.get("return_timeline"):
                    tl = Timeline(arrival=arrived, prefill_queued=arrived,
                                  prefill_start=arrived + 0.01, prefill_end=times[0],
                                  token_times=times, finish=times[-1])
                    extra["timeline"] = tl.to_dict()
                finish = "length" if last and not prompt.startswith("FINISHCHUNK") else None
                if prompt.startswith("SEPS"):
                    seps = "".join(SEPARATORS[j % len(SEPARATORS)] for j in range(i, i + k))
                    yield _chunk(seps, finish, **extra).replace(b"\n", b"\r\n")
                else:
                    yield _chunk("x" * k, finish, **extra)
            if prompt.startswith("FINISHCHUNK"):
                yield _chunk("", "length")
            yield _usage(n)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


class FakeServer:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(make_app(self.bodies), host="127.0.0.1",
                                                    port=self.port, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


class QueueTarget:
    """A single FIFO server: each request takes ``1 / capacity`` seconds to its first token,
    then ``tpot`` per token. Runs on a virtual clock, instantly."""

    def __init__(self, capacity: float, num_gpus: int = 1, tpot: float = 0.01,
                 name: str = "queue") -> None:
        self.capacity, self.num_gpus, self.tpot, self.name = capacity, num_gpus, tpot, name
        self.calls = 0

    async def run(self, requests: list[WorkloadRequest]) -> list[RequestRecord]:
        self.calls += 1
        free, out = 0.0, []
        for r in sorted(requests, key=lambda r: r.arrival_time):
            start = max(r.arrival_time, free)
            first = free = start + 1.0 / self.capacity
            tl = Timeline(arrival=r.arrival_time, prefill_start=start, prefill_end=first,
                          token_times=[first + i * self.tpot for i in range(r.output_len)])
            tl.finish = tl.token_times[-1]
            out.append(RequestRecord(r.request_id, r.prompt_len, r.output_len, tl))
        order = {r.request_id: i for i, r in enumerate(requests)}
        return sorted(out, key=lambda rec: order[rec.request_id])
