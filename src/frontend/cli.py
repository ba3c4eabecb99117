"""`triode`: the command line. Engine flags are generated from EngineArgs (one set of
defaults shared with the Python API and the TRIODE_* variables)."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from triode.bench.commands import add_bench_commands, missing_bench_extra
from triode.bench.serve import add_bench_serve
from triode.engine.errors import TriodeError
from triode.frontend.engine_flags import add_engine_flags, engine_args_from, size_argument
from triode.frontend.openai.tool_parsers import TOOL_PARSERS
from triode.scenarios.command import add_scenario_commands


def _serve(namespace: argparse.Namespace) -> int:
    from triode.frontend.server import serve
    from triode.frontend.server.factory import create_app
    from triode.frontend.server.settings import ServerSettings

    model = namespace.model_positional or namespace.model
    args = engine_args_from(namespace, **({"model": model} if model else {}))
    settings = ServerSettings.from_env(
        api_keys=namespace.api_key, max_body_bytes=namespace.max_body_size,
        trust_request_chat_template=namespace.trust_request_chat_template,
        chat_template=namespace.chat_template, tool_call_parser=namespace.tool_call_parser,
        enable_auto_tool_choice=namespace.enable_auto_tool_choice,
        responses_store_size=namespace.responses_store_size,
        responses_store_max_age=namespace.responses_store_max_age,
        lora_modules=namespace.lora_modules,
        allow_runtime_lora_updating=namespace.allow_runtime_lora_updating,
        server_dev_mode=namespace.server_dev_mode,
    )
    return serve.run(create_app(args, settings), host=namespace.host, port=namespace.port)


def _port(text: str) -> int:
    port = int(text)  # argparse reports a ValueError as "invalid _port value"
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triode", description="trio-native LLM inference and serving")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model_positional", nargs="?", metavar="MODEL", help="model to serve")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000, help="0 picks a free port (printed)")
    serve.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on /v1/* (repeat for several keys; "
                            "default: $TRIODE_API_KEY, comma-separated)")
    serve.add_argument("--max-body-size", type=size_argument, default=None, metavar="SIZE",
                       help="largest request body, e.g. 8MiB (default: $TRIODE_MAX_BODY_SIZE or 8MiB)")
    serve.add_argument("--trust-request-chat-template", action="store_true", default=None,
                       help="let requests bring their own chat_template (a Jinja program run for every "
                            "such request; default: $TRIODE_TRUST_REQUEST_CHAT_TEMPLATE or no)")
    serve.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="the chat template for requests without their own: a file or the Jinja "
                            "text (default: $TRIODE_CHAT_TEMPLATE, else the model's)")
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how tool calls are found in the model's output, for tool_choice auto "
                            "(default: $TRIODE_TOOL_CALL_PARSER)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                       help='let the model decide when to call tools (tool_choice "auto"); needs '
                            "--tool-call-parser (default: $TRIODE_ENABLE_AUTO_TOOL_CHOICE or no)")
    serve.add_argument("--responses-store-size", type=int, default=None, metavar="N",
                       help="responses kept for previous_response_id and GET /v1/responses/{id}, the "
                            "oldest dropped first; 0 keeps none (default: $TRIODE_RESPONSES_STORE_SIZE or "
                            "1000)")
    serve.add_argument("--responses-store-max-age", type=float, default=None, metavar="SECONDS",
                       help="how long a stored response is kept (default: $TRIODE_RESPONSES_STORE_MAX_AGE "
                            "or 3600)")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters served under these names (a request's model selects one), "
                            "name=path or a JSON object with name, path and base_model_name; needs "
                            "--enable-lora (default: $TRIODE_LORA_MODULES)")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true", default=None,
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default: "
                            "$TRIODE_ALLOW_RUNTIME_LORA_UPDATING or $VLLM_ALLOW_RUNTIME_LORA_UPDATING, else no)")
    serve.add_argument("--server-dev-mode", action="store_true", default=None,
                       help="serve the development endpoint POST /reset_prefix_cache (default: "
                            "$TRIODE_SERVER_DEV_MODE or $VLLM_SERVER_DEV_MODE, else no)")
    add_engine_flags(serve)
    # once a flag; now refused with where it belongs rather than as an unknown argument
    serve.add_argument("--fault-plan", help=argparse.SUPPRESS, default=None)
    serve.set_defaults(handler=_serve)

    bench = commands.add_parser("bench", help="benchmarks against a baseline measured in the same run")
    benches = bench.add_subparsers(dest="bench", required=True)
    add_bench_commands(benches)
    add_bench_serve(benches)
    add_scenario_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    namespace = parser.parse_args(argv)
    if getattr(namespace, "fault_plan", None) is not None:
        parser.error("--fault-plan is not a serving option: fault injection is a test facility, which "
                     "`triode scenario run` drives (it sets TRIODE_FAULT_PLAN for the servers it starts; "
                     "scenarios/README.md)")
    if namespace.command == "bench" and (missing := missing_bench_extra()):
        parser.error(f"triode bench needs {', '.join(missing)}: pip install 'triode[bench]'")
    if getattr(namespace, "json", None) is not None and Path(namespace.json).is_dir():
        parser.error(f"--json {namespace.json}: is a folder; name the file to write")
    for option, directory in _output_folders(namespace):
        try:  # before minutes of measuring, not after
            directory.mkdir(parents=True, exist_ok=True)
            if not os.access(directory, os.W_OK):
                raise PermissionError(errno.EACCES, "not writable")
        except OSError as e:
            parser.error(f"{option} {directory}: {e.strerror or e}")
    try:
        return namespace.handler(namespace)
    except TriodeError as e:
        print(f"triode: error: {e}", file=sys.stderr)
        return 2
    except BaseException as e:
        if not _interrupted(e):
            raise
        print("triode: interrupted", file=sys.stderr)
        return 130


def _output_folders(namespace: argparse.Namespace) -> list[tuple[str, Path]]:
    """The folders a command writes its results into: --output-dir, --json's folder."""
    folders = []
    if (output_dir := getattr(namespace, "output_dir", None)) is not None:
        folders.append(("--output-dir", Path(output_dir)))
    if (results := getattr(namespace, "json", None)) is not None:
        folders.append(("--json", Path(results).parent))
    return folders


def _interrupted(error: BaseException) -> bool:
    """A Ctrl-C, alone or as every exception of a group (trio's, with strict groups)."""
    if isinstance(error, BaseExceptionGroup):
        return all(_interrupted(inner) for inner in error.exceptions)
    return isinstance(error, KeyboardInterrupt)


if __name__ == "__main__":
    sys.exit(main())
