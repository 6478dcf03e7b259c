"""``pdserve serve``: start a cluster runtime and the OpenAI-compatible API in front of it.

:func:`add_engine_args` / :func:`engine_kwargs_from_args` generate the engine flags from
``EngineConfig.KWARGS`` and the config dataclasses' fields, for every CLI that builds engines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import threading
import types
import typing
from collections.abc import Iterable
from dataclasses import MISSING, fields
from typing import Any

from pdserve.cluster.routing import ROUTERS
from pdserve.config import (
    BACKENDS,
    DTYPES,
    STRATEGIES,
    CacheConfig,
    ClusterConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)

_ENGINE_HELP = {
    "device": "'cpu' or 'cuda[:N]'",
    "dtype": "weight and KV dtype",
    "seed": "random seed of the model's sampler",
    "block_size": "tokens per KV cache block",
    "num_kv_blocks": "KV cache blocks per instance (default: size from available memory)",
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes",
    "memory_utilization": "share of free GPU memory for weights + KV cache",
    "cpu_kv_gib": "KV cache size on CPU, in GiB",
    "max_num_batched_tokens": "token budget of one step (default: 2048 with chunked prefill, "
                              "else max(2048, max_model_len))",
    "max_num_seqs": "most requests in one step",
    "max_model_len": "longest prompt + output (default: the model's max_position_embeddings)",
    "enable_chunked_prefill": "split long prompts over several steps",
    "role": "instance role",
    "prefill_token_target": "DistServe's L_m: prefill batches grow to this many tokens",
    "policy": "local prefill ordering policy",
}
_CHOICES: dict[str, Iterable[str]] = {"dtype": DTYPES}
_FIELDS = {f.name: (cls, f) for cls in (EngineConfig, CacheConfig, SchedulerConfig)
           for f in fields(cls)}


def _flag_type(hint: Any) -> tuple[Any, list[str] | None]:
    """``(argparse type, choices)`` of a field's type hint (``int | None`` → ``int``)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return str, [str(a) for a in args]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    return hint, None


def add_engine_args(parser: argparse.ArgumentParser,
                    exclude: Iterable[str] = ()) -> argparse._ArgumentGroup:
    """Add one flag per name in ``EngineConfig.KWARGS`` (minus ``exclude``): ``--block-size N``
    and so on; booleans get ``--x/--no-x``. Every default is ``None`` (= the config's own)."""
    group = parser.add_argument_group("engine (one model instance)")
    skip = set(exclude)
    for name in EngineConfig.KWARGS:
        if name in skip:
            continue
        cls, f = _FIELDS[name]
        hint = typing.get_type_hints(cls)[name]
        kind, choices = _flag_type(hint)
        default = f.default if f.default is not MISSING else None
        help_ = f"{_ENGINE_HELP.get(name, name)}"
        if name not in ("num_kv_blocks", "max_num_batched_tokens", "max_model_len"):
            help_ += f" (default: {default})"
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_)
        else:
            group.add_argument(flag, dest=name, type=kind, default=None,
                               choices=list(_CHOICES.get(name, choices or [])) or None,
                               help=help_)
    return group


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keyword arguments the user set (for ``EngineConfig.from_kwargs``)."""
    return {k: getattr(args, k) for k in EngineConfig.KWARGS
            if getattr(args, k, None) is not None}


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand; it sets ``func`` (``args.func(args)`` → exit code)."""
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Start model instances (colocated or prefill/decode disaggregated) and an "
                    "OpenAI-compatible API server in front of them.")
    m = p.add_argument_group("model and server")
    m.add_argument("--model", metavar="DIR", help="Hugging Face model directory")
    m.add_argument("--demo", action="store_true",
                   help="serve the default tiny random model (created on first use)")
    m.add_argument("--served-model-name", help="model name clients use (default: --model)")
    m.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    m.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    m.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    m.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    c = p.add_argument_group("cluster")
    c.add_argument("--strategy", choices=STRATEGIES, default="colocated")
    c.add_argument("--num-instances", type=int, default=1,
                   help="colocated instances (default: %(default)s)")
    c.add_argument("--num-prefill", type=int, default=1,
                   help="prefill instances when disaggregated (default: %(default)s)")
    c.add_argument("--num-decode", type=int, default=1,
                   help="decode instances when disaggregated (default: %(default)s)")
    c.add_argument("--prefill-token-target", type=int,
                   help="DistServe's L_m: tokens per prefill batch (default: the token budget)")
    c.add_argument("--prefill-router", choices=sorted(ROUTERS), default="shortest_queue",
                   help="picks the prefill (or colocated) instance (default: %(default)s)")
    c.add_argument("--decode-router", choices=sorted(ROUTERS), default="least_load",
                   help="picks the decode instance (default: %(default)s)")
    c.add_argument("--backend", choices=BACKENDS, default="ray",
                   help="run instances as Ray actors or in this process (default: %(default)s)")
    c.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    c.add_argument("--link-bandwidth", type=float, metavar="GBps",
                   help="emulated KV link bandwidth in GB/s (default: unlimited)")
    c.add_argument("--link-latency", type=float, default=0.0, metavar="ms",
                   help="emulated KV link latency in ms (default: %(default)s)")
    c.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="waiting requests beyond this get HTTP 429 (default: %(default)s)")
    add_engine_args(p, exclude=("role", "prefill_token_target"))
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The deployment the flags describe. Raises ``ValueError``/``TypeError`` on bad flags."""
    if args.demo and args.model:
        raise ValueError("give either --model or --demo, not both")
    if args.demo:
        from pdserve.model.tiny import default_model_dir

        model = default_model_dir()
    elif args.model:
        model = args.model
    else:
        raise ValueError("give --model DIR (or --demo for a tiny random model)")
    model_config = ModelConfig.from_dir(model)
    engine = EngineConfig.from_kwargs(model, model_max_len=model_config.max_position_embeddings,
                                      **engine_kwargs_from_args(args))
    return ClusterConfig(
        engine=engine, strategy=args.strategy, num_instances=args.num_instances,
        num_prefill=args.num_prefill, num_decode=args.num_decode,
        prefill_router=args.prefill_router, decode_router=args.decode_router,
        prefill_token_target=args.prefill_token_target, backend=args.backend,
        ray_address=args.ray_address, link_bandwidth_gbps=args.link_bandwidth,
        link_latency_ms=args.link_latency, max_waiting_requests=args.max_waiting_requests)


async def serve(config: ClusterConfig, host: str = "127.0.0.1", port: int = 8000,
                served_model_name: str | None = None, api_key: str | None = None,
                log_level: str = "info") -> None:
    """Build and start the runtime, serve HTTP until SIGINT/SIGTERM, then shut down."""
    import uvicorn

    from pdserve.cluster.runtime import build_runtime
    from pdserve.server.app import build_app

    runtime = await build_runtime(config)
    loop = asyncio.get_running_loop()
    main_thread = threading.current_thread() is threading.main_thread()
    handled = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
    try:
        app = build_app(runtime, served_model_name, api_key)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                               timeout_graceful_shutdown=5))
        # uvicorn re-raises the signal it caught once it has stopped; route it to a no-op so
        # that it does not cancel this task before the runtime is shut down below.
        for sig in handled:
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            name = served_model_name or runtime.model_name
            print(f"pdserve: serving {name!r} on http://{host}:{port}/v1 "
                  f"({config.strategy}, {config.num_gpus} instance(s))", flush=True)

        announcer = asyncio.create_task(announce())
        try:
            await server.serve()
        finally:
            announcer.cancel()
    finally:
        await runtime.shutdown()
        for sig in handled:
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    """Run ``serve`` from parsed flags; bad flags print ``error: ...`` and return 2."""
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config, args.host, args.port, args.served_model_name, args.api_key,
                          args.log_level))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m pdserve.server.cli serve ...``."""
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
