"""`tokenmill serve [MODEL]`: load a model and serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import logging
import os
import socket
import sys

from tokenmill.commands.common import DEFAULT_MODEL, add_engine_args, engine_kwargs

logger = logging.getLogger("tokenmill.server")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"model path or name (default: {DEFAULT_MODEL})")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    g.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes "
                                     "(default: $TOKENMILL_API_KEY)")
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests allowed to wait for a batch slot; more get HTTP 429 (256)")
    g.add_argument("--max-stop", type=int, default=64,
                   help="stop strings one request may give; more get HTTP 400 (64)")
    g.add_argument("--max-stop-token-ids", type=int, default=1024,
                   help="stop_token_ids one request may give; more get HTTP 400 (1024)")
    g.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="parse special-token text in chat messages (<|im_end|>) as control "
                        "tokens; by default it is encoded as plain text")
    g.add_argument("--max-prompts-per-request", type=int, default=128,
                   help="prompts in one /v1/completions request; more get HTTP 400 (128)")
    g.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                   help="largest request body accepted; larger ones get HTTP 413 (16 MiB)")
    g.add_argument("--served-model-name", nargs="+",
                   help="model name(s) clients use; the first one is reported")
    g.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds a connection may take to send a request's headers, and the "
                        "longest gap allowed in its body; stalled connections are closed (30)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds requests in flight may take to finish before "
                        "they end with an error event (30)")
    g.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    p.set_defaults(run=run)


def bind(host: str, port: int) -> socket.socket:
    """Bind before uvicorn starts, so that the printed address is final (even with --port 0)
    and clients connecting right away wait in the listen backlog instead of failing."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e


def run(args) -> int:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.app import create_app
    from tokenmill.server.connections import server_config
    from tokenmill.server.serving import RequestLimits
    from tokenmill.server.shutdown import DrainingServer

    api_key = args.api_key or os.environ.get("TOKENMILL_API_KEY")
    for flag in ("max_queued_requests", "max_stop", "max_stop_token_ids",
                 "max_prompts_per_request"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
    engine_config = EngineConfig(model=args.model, **engine_kwargs(args))
    if engine_config.node_rank > 0:  # a worker node: its ranks, no HTTP
        from tokenmill.distributed.executor import serve_node

        parallel = engine_config.parallel
        print(f"tokenmill serve: node {parallel.node_rank} of {parallel.nnodes}, ranks "
              f"{list(parallel.node_ranks)}, joining {parallel.master_addr}:"
              f"{parallel.master_port}", file=sys.stderr, flush=True)
        serve_node(engine_config, parallel)
        return 0
    names = args.served_model_name or [args.model]

    def build_engine() -> LLMEngine:  # on the engine's step thread (see AsyncEngine): one
        engine = LLMEngine(engine_config)  # OpenMP team in the process
        print(f"tokenmill serve: {engine.memory.describe()}", file=sys.stderr, flush=True)
        return engine

    app = create_app(build_engine, names, api_key, args.max_queued_requests,
                     args.max_request_bytes, RequestLimits(
                         args.max_stop, args.max_stop_token_ids, args.max_prompts_per_request,
                         args.allow_special_tokens_in_content))
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    if not api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s without --api-key: anyone who can reach it can use it",
                       args.host)
    shown = f"[{host}]" if ":" in host else host
    print(f"tokenmill serve: {names[0]!r} on http://{shown}:{port}/v1", flush=True)
    config = server_config(app, args.request_timeout, log_level=args.log_level,
                           timeout_graceful_shutdown=5)
    DrainingServer(config, app.state.async_engine, args.shutdown_timeout).run(sockets=[sock])
    return 0
