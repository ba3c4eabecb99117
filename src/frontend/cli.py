"""`triode`: the command line. Engine flags are generated from EngineArgs (one set of
defaults shared with the Python API and the TRIODE_* variables)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from engine.bench.commands import add_bench_commands
from engine.errors import TriodeError
from frontend.engine_flags import add_engine_flags, engine_args_from


def _serve(namespace: argparse.Namespace) -> int:
    from engine.worker.loading import resolve_model
    from engine.worker.runner import ModelRunner

    args = engine_args_from(namespace, model=namespace.model_positional or namespace.model)
    resolved = resolve_model(args.model, cache_dir=args.resolved_cache_dir())
    runner = ModelRunner(args, resolved.path)
    print(
        f"triode: loaded {resolved.source} from {resolved.path} "
        f"({runner.config.architecture}, {runner.dtype}, {runner.num_blocks} KV blocks of "
        f"{runner.block_size} tokens, max_model_len {runner.max_model_len})."
    )
    print("triode: the HTTP server arrives with the frontend (issue 4); nothing is served yet.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triode", description="trio-native LLM inference and serving")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model_positional", nargs="?", metavar="MODEL", help="model to serve")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    add_engine_flags(serve)
    serve.set_defaults(handler=_serve)

    bench = commands.add_parser("bench", help="benchmarks against a baseline measured in the same run")
    benches = bench.add_subparsers(dest="bench", required=True)
    add_bench_commands(benches)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    namespace = build_parser().parse_args(argv)
    try:
        return namespace.handler(namespace)
    except TriodeError as e:
        print(f"triode: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
