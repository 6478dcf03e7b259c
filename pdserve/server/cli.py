"""``pdserve serve``: start a cluster runtime and the OpenAI-compatible API in front of it.

The deployment flags are :mod:`pdserve.flags`' (the same as ``pdserve simulate``'s, so a
``--config`` file runs live or simulated as it is).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from pdserve.checkpoints import BUILTIN_MODELS, resolve_model
from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig, ModelConfig, check_pool_holds_a_request
from pdserve.engine.logfile import check_log_path
from pdserve.engine.pipeline import lane_blocks
from pdserve.flags import (
    add_deployment_flags,
    deployment_from_args,
    guarded,
    one_line_errors,
    positive,
    positive_int,
)
from pdserve.planner.replan import add_replan_flags, replanner_from_args
from pdserve.predict.data import PairLog
from pdserve.server.compile_pool import DEFAULT_TIMEOUT_S, DEFAULT_WORKERS
from pdserve.server.errors import DEFAULT_MAX_REQUEST_BYTES
from pdserve.server.http import DEFAULT_HEADER_TIMEOUT_S, timed_h11
from pdserve.sim.model_catalogue import canonical_model_name


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand; it sets ``func`` (``args.func(args)`` → exit code)."""
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Start model instances (colocated or prefill/decode disaggregated) and an "
                    "OpenAI-compatible API server in front of them.")
    m = p.add_argument_group("server")
    m.add_argument("--demo", action="store_true",
                   help="serve the default tiny random model (created on first use)")
    m.add_argument("--served-model-name", help="model name clients use (default: --model)")
    m.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    m.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    m.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint "
                                     "but /health, /ping and /version (visible in `ps`: "
                                     "prefer --api-key-file or $PDSERVE_API_KEY) "
                                     "(default: none)")
    m.add_argument("--api-key-file", metavar="FILE",
                   help="read the API key from FILE (its first line) (default: none)")
    m.add_argument("--enable-admin", action="store_true",
                   help="serve /admin/instances (live scaling), behind the API key if one is "
                        "set (default: off)")
    m.add_argument("--admin-key-file", metavar="FILE",
                   help="serve /admin/instances behind this separate key (its first line; "
                        "also $PDSERVE_ADMIN_KEY) (default: none)")
    m.add_argument("--grammar-timeout", type=positive, default=DEFAULT_TIMEOUT_S,
                   help="an output constraint (guided_regex, guided_json, response_format) "
                        "that takes longer to compile is refused with HTTP 400 "
                        "(default: %(default)s s)")
    m.add_argument("--grammar-workers", type=positive_int, default=DEFAULT_WORKERS,
                   help="processes compiling output constraints (default: %(default)s)")
    m.add_argument("--header-timeout", type=positive, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="close a connection that has not sent its request headers within this "
                        "many seconds (slow clients) (default: %(default)s)")
    m.add_argument("--max-instances", type=positive_int,
                   help="the most instances /admin/instances may run at once (default: twice "
                        "the deployment's)")
    m.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get HTTP 413 (default: %(default)s)")
    m.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    m.add_argument("--log-length-pairs", metavar="FILE.jsonl",
                   help="append each finished request's (prompt_token_ids, output_len) to FILE, "
                        "training data for `pdserve predictor train` (TetriInfer section "
                        "3.3.2) (default: off)")
    add_deployment_flags(p, model_help="Hugging Face model directory")
    add_replan_flags(p)
    one_line_errors(p)
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The deployment the flags (and ``--config``) describe. Raises ``ValueError``/``TypeError``
    on bad values."""
    if args.demo and args.model:
        raise ValueError("give either --model or --demo, not both")
    if args.demo:
        from pdserve.model.tiny import default_model_dir  # lazy: torch

        args.model = default_model_dir()
    config = deployment_from_args(args)
    if not config.model:
        raise ValueError("give --model DIR (or --demo for a tiny random model, or a --config "
                         "file with a model)")
    from dataclasses import replace

    _refuse_catalogue_name(config.model)
    path = resolve_model(config.model)  # a .gguf file or a built-in name → an HF directory
    if path != config.model:
        if not args.served_model_name:
            args.served_model_name = config.model  # clients use the name the user gave
        config = replace(config, model=path)

    # resolve the engine against the model now: a bad max_model_len fails before any load
    max_len = ModelConfig.from_dir(config.model).max_position_embeddings
    config.engine_config(model_max_len=max_len)

    specs = config.instance_specs(max_len)
    for path in sorted({s.engine.step_log for s in specs if s.engine.step_log}):
        check_log_path(path, "step log")  # a step must never fail on its log
    nodes = len({s.node for s in specs})
    if nodes > 1:  # on one node the layout and inter_node_link say nothing a live run ignores
        simulated = ([f"inter_node_link={config.inter_node_link}"] if config.inter_node_link
                     else [])
        simulated.append(f"gpus_per_node={config.gpus_per_node} (instances on {nodes} nodes)")
        warnings.warn(f"{' and '.join(simulated)} in the spec are simulated only: live, Ray "
                      f"places the instances and KV moves between them at the transport's "
                      f"speed (kv_link alone is emulated)", stacklevel=2)
    return config


def _refuse_catalogue_name(model: str) -> None:
    """A spec written by ``pdserve plan`` names a simulator catalogue model (``opt-13b``):
    shapes, no weights. Say how to serve it rather than that it does not exist."""
    from pathlib import Path

    if Path(model).exists() or model in BUILTIN_MODELS or not canonical_model_name(model):
        return
    raise ValueError(f"model {model!r} is a simulator catalogue entry (shapes, no weights): "
                     "give --model DIR, a checkpoint of it, to serve this deployment live "
                     "(--model overrides the spec's model)")


async def serve(config: ClusterConfig, host: str = "127.0.0.1", port: int = 8000,
                served_model_name: str | None = None, api_key: str | None = None,
                log_level: str = "info",
                max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                pair_log: PairLog | None = None,
                replan: Callable[[Any], Any] | None = None,
                app_options: dict[str, Any] | None = None,
                header_timeout: float = DEFAULT_HEADER_TIMEOUT_S) -> None:
    """Build and start the runtime, serve HTTP until SIGINT/SIGTERM, then shut down. With
    ``pair_log``, every finished request is logged as a (prompt, output length) pair; with
    ``replan`` (:func:`pdserve.planner.replan.replanner_from_args`), a live replanner watches the
    runtime; ``app_options`` are more keyword arguments of
    :func:`~pdserve.server.app.build_app` (admin API, grammar compilation). A connection
    that has not sent its request headers within ``header_timeout`` seconds is closed."""
    import uvicorn

    from pdserve.server.app import build_app, default_served_model_name  # lazy: fastapi

    n = sum(r.count for r in config.roles)
    where = (f"Ray at {config.ray_address}" if config.ray_address else "a local Ray instance") \
        if config.backend == "ray" else "this process"
    print(f"pdserve: loading {config.model!r} on {n} instance(s) in {where}...",
          file=sys.stderr, flush=True)
    runtime = await build_runtime(config)
    try:  # a pool that cannot hold one request of max_model_len: refused, as vLLM does
        for st in runtime.instance_status():
            spec = config.role(st.role)
            if st.num_kv_blocks is None or spec is None:
                continue
            lanes = lane_blocks(st.num_kv_blocks, spec.pp)
            check_pool_holds_a_request(
                min(n for _, n in lanes), config.engine_config(spec).cache.block_size,
                runtime.max_model_len, f"instance {st.instance_id}'s KV pool"
                + (" (per pipeline lane)" if len(lanes) > 1 else ""))
    except ValueError:
        await runtime.shutdown()
        raise
    if replan is not None:
        replan(runtime)
    loop = asyncio.get_running_loop()
    main_thread = threading.current_thread() is threading.main_thread()
    handled = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
    try:
        app = build_app(runtime, served_model_name, api_key, max_request_bytes, pair_log,
                        **(app_options or {}))
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                               timeout_graceful_shutdown=5,
                                               http=timed_h11(header_timeout)))
        # uvicorn re-raises the signal it caught once it has stopped; route it to a no-op so
        # that it does not cancel this task before the runtime is shut down below.
        for sig in handled:
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            name = served_model_name or default_served_model_name(runtime.model_name)
            print(f"pdserve: serving {name!r} on http://{host}:{port}/v1 "
                  f"({config.strategy}, {n} instance(s), {config.num_gpus} rank(s))",
                  flush=True)

        announcer = asyncio.create_task(announce())
        try:
            await server.serve()
        finally:
            announcer.cancel()
    finally:
        await runtime.shutdown()
        for sig in handled:
            loop.remove_signal_handler(sig)


def _key_from(flag: str | None, file: str | None, env: str, what: str) -> str | None:
    """A key from its flag, its file's first line or the environment variable ``env`` (one
    of them at most). ``ValueError`` names the flag or file that is wrong."""
    given = [name for name, v in ((f"--{what}", flag), (f"--{what}-file", file)) if v]
    if len(given) > 1:
        raise ValueError(f"give one of {' and '.join(given)}, not both")
    if file:
        try:
            with open(file, encoding="utf-8") as f:
                flag = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--{what}-file {file!r} cannot be read: {e}") from None
        if not flag:
            raise ValueError(f"--{what}-file {file!r} is empty")
    elif flag is None:
        flag = os.environ.get(env) or None
    if flag is not None and (not flag.isprintable() or not flag.isascii() or " " in flag):
        raise ValueError(f"the {what.replace('-', ' ')} must be printable ASCII without "
                         f"spaces (an HTTP header carries it)")
    return flag


def keys_from_args(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(api key, admin key)`` from the flags, files and ``$PDSERVE_API_KEY`` /
    ``$PDSERVE_ADMIN_KEY``."""
    return (_key_from(args.api_key, args.api_key_file, "PDSERVE_API_KEY", "api-key"),
            _key_from(None, args.admin_key_file, "PDSERVE_ADMIN_KEY", "admin-key"))


def check_port(host: str, port: int) -> None:
    """Fail now, before any model loads or Ray starts, when ``host:port`` cannot be served:
    a port outside 1-65535, a host that does not resolve, or an address already in use (bound
    and released at once, with the ``SO_REUSEADDR`` uvicorn sets). Raises ``ValueError``."""
    import socket

    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port} is outside 1-65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} does not resolve: {e}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else \
                f"cannot be bound: {e.strerror or e}"
            raise ValueError(f"{host}:{port} {why} (choose another --port or --host)") from None


def _serve(args: argparse.Namespace) -> int:
    check_port(args.host, args.port)  # before the model loads and Ray starts
    config = config_from_args(args)
    api_key, admin_key = keys_from_args(args)
    if args.max_instances is not None and not (args.enable_admin or admin_key):
        raise ValueError("--max-instances caps /admin/instances, which is off: add "
                         "--enable-admin or --admin-key-file")
    if args.max_instances is not None and args.max_instances < sum(r.count for r in
                                                                   config.roles):
        raise ValueError(f"--max-instances {args.max_instances} is below the deployment's "
                         f"{sum(r.count for r in config.roles)} instances")
    replan = replanner_from_args(args, config)  # bad replanning settings fail before the load
    pair_log = None
    if args.log_length_pairs:
        pair_log = PairLog(args.log_length_pairs)  # a bad path fails before the model loads
    try:
        with contextlib.suppress(KeyboardInterrupt):
            extra: dict[str, Any] = {"replan": replan} if replan is not None else {}
            extra["app_options"] = {"enable_admin": args.enable_admin, "admin_key": admin_key,
                                    "max_instances": args.max_instances,
                                    "grammar_timeout": args.grammar_timeout,
                                    "grammar_workers": args.grammar_workers}
            extra["header_timeout"] = args.header_timeout
            asyncio.run(serve(config, args.host, args.port, args.served_model_name,
                              api_key, args.log_level, args.max_request_bytes, pair_log,
                              **extra))
    finally:
        if pair_log is not None:
            pair_log.close()
    return 0


run = guarded("serve", _serve)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m pdserve.server.cli serve ...``."""
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
