"""The ``chunkserve`` command line.

Each subcommand is a pair: ``_add_<name>(subparsers)`` declares its arguments and sets
``handler`` to ``_run_<name>(args) -> int``. Handlers import what they need themselves,
so one subcommand never pays for another's imports.

Exit codes, each failure with a one-line message on stderr and no traceback: 0 success
(``serve``: stopped by SIGTERM or SIGHUP), 1 no Ray cluster answers where the config
points, 2 bad input (including a config the Ray cluster cannot place), 130 interrupted
by Ctrl-C (``serve`` and ``batch`` remove their workers first).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from modeltools.docqa_config import add_train_arguments, train_overrides

EXIT_OK = 0
EXIT_UNREACHABLE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse has already printed usage and the message
        return EXIT_OK if exit_.code is None else int(exit_.code)
    try:
        return args.handler(args)
    except ValueError as error:
        return _fail(args, f"error: {error}", EXIT_USAGE)
    except KeyboardInterrupt:
        return _fail(args, _INTERRUPTED.get(args.command, "interrupted"), EXIT_INTERRUPTED)
    except ConnectionError as error:
        from cluster.ops.ray_session import RayUnreachable

        if not isinstance(error, RayUnreachable):
            raise
        return _fail(args, f"error: {error}", EXIT_UNREACHABLE)


_INTERRUPTED = {
    "serve": "interrupted; the app and its workers are removed",
    "batch": "interrupted; the records written so far are kept (run it again with the same "
    "--output to resume)",
}


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    print(f"chunkserve {args.command}: {message}", file=sys.stderr, flush=True)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chunkserve",
        description="Serve LLMs on Ray, reusing the KV cache of prompt chunks.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_make_model(subparsers)
    _add_serve(subparsers)
    _add_batch(subparsers)
    _add_status(subparsers)
    _add_chat(subparsers)
    return parser


def _add_make_model(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-model",
        help="write a random-weight (or the trained doc-QA) checkpoint in the Hugging Face layout",
        description="Write a random-weight checkpoint (config, safetensors, tokenizer, "
        "chat template) that transformers and chunkserve both load. --preset docqa trains "
        "the small doc-QA model instead (on CUDA where present; see the training options).",
    )
    p.add_argument("dir", help="output directory (created; must be empty unless --overwrite)")
    p.add_argument("--preset", default="tiny", help="shapes, e.g. tiny, qwen3-0.6b or docqa")
    p.add_argument("--family", default="qwen3", help="qwen3 (ChatML) or llama (Llama 3)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        type=_parse_assignment,
        default=[],
        help="override a config field; VALUE is JSON where it parses, else a string "
        "(repeatable, e.g. --set num_hidden_layers=3 --set tie_word_embeddings=true)",
    )
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the preset's)")
    p.add_argument(
        "--shard-size-mb",
        type=float,
        help="largest safetensors file before the weights are sharded (default 2048)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty directory")
    p.add_argument(
        "--no-weights",
        action="store_true",
        help="write the config and tokenizer only: a model for engine.load_format dummy "
        "(random weights made in place at start), for shapes too large to write "
        "(e.g. --preset llama3-70b --family llama)",
    )
    add_train_arguments(p.add_argument_group("training (--preset docqa only)"))
    p.set_defaults(handler=_run_make_model)


def _parse_assignment(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _run_make_model(args: argparse.Namespace) -> int:
    from modeltools.make_model import make_model

    optional = {"dtype": args.dtype, "shard_size_mb": args.shard_size_mb}
    training = train_overrides(args)
    if args.preset == "docqa":
        from modeltools.docqa_train import make_docqa_model

        if args.no_weights:
            raise ValueError("--no-weights writes random-weight presets' configs, not docqa")
        if args.family != "qwen3":
            raise ValueError("preset 'docqa' exists for the qwen3 family only")
        out = make_docqa_model(
            args.dir,
            seed=args.seed,
            overrides=dict(args.overrides),
            dtype=args.dtype,
            overwrite=args.overwrite,
            **training,
        )
        print(f"wrote the trained docqa checkpoint (seed {args.seed}) to {out}:")
        for path in sorted(p for p in out.iterdir() if p.is_file()):
            print(f"  {path.name:<40} {path.stat().st_size:>14,} bytes")
        return EXIT_OK
    if training:
        raise ValueError(f"training options ({', '.join(sorted(training))}) need --preset docqa")
    out = make_model(
        args.dir,
        preset=args.preset,
        family=args.family,
        seed=args.seed,
        overrides=dict(args.overrides),
        overwrite=args.overwrite,
        weights=not args.no_weights,
        **{k: v for k, v in optional.items() if v is not None},
    )
    what = "config (no weights: engine.load_format dummy)" if args.no_weights else "checkpoint"
    print(f"wrote {args.preset} {args.family} {what} (seed {args.seed}) to {out}:")
    for path in sorted(p for p in out.iterdir() if p.is_file()):
        print(f"  {path.name:<40} {path.stat().st_size:>14,} bytes")
    return EXIT_OK


def _add_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="cluster config YAML, e.g. configs/local.yaml")
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a config field by its dotted path; VALUE is YAML "
        "(repeatable, e.g. --set workers.count=2 --set server.port=8080)",
    )


def _load_config(args: argparse.Namespace):
    from cluster.config import load_config

    return load_config(args.config, args.overrides)


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible API on Ray until Ctrl-C",
        description="Start (or join) Ray, the chunk directory, the workers and the HTTP app "
        "described by the config; print the URL; serve until Ctrl-C.",
    )
    _add_config_arguments(p)
    p.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from cluster.ops.serve import serve_until_stopped

    serve_until_stopped(_load_config(args), log=lambda line: print(line, flush=True))
    return EXIT_OK


def _add_batch(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "batch",
        help="run a JSONL file of OpenAI-style requests; resumable",
        description="Run every request line of INPUT (OpenAI Batch API lines, or bare "
        "request bodies with a custom_id) and write one response line per request to "
        "OUTPUT, in input order. A rerun skips ids already in OUTPUT. Works locally and "
        "under `ray job submit`.",
    )
    _add_config_arguments(p)
    p.add_argument("--input", required=True, type=Path, help="request lines (JSONL)")
    p.add_argument("--output", required=True, type=Path, help="response lines (appended)")
    p.add_argument(
        "--retry-errors",
        action="store_true",
        help="on a rerun, also run again the ids whose earlier record is an error (their "
        "error records are removed from OUTPUT first; each id keeps one record)",
    )
    p.set_defaults(handler=_run_batch)


def _run_batch(args: argparse.Namespace) -> int:
    from cluster.batch.job import run_batch

    summary = run_batch(_load_config(args), args.input, args.output, args.retry_errors)
    print(summary.describe(args.output), flush=True)
    return EXIT_OK


def _add_status(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status",
        help="show a running cluster's workers, chunks and cache hit rate",
        description="Connect to the running Ray cluster and report on the workers and "
        "chunk directory of the config's cluster (found by its name and ray.namespace). "
        "The Ray cluster is the config's ray.address, else RAY_ADDRESS, else the one "
        "started on this machine; the directory is the one the running cluster uses "
        "(the server's --sets included). Takes the same --set overrides as serve.",
    )
    _add_config_arguments(p)
    p.set_defaults(handler=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    from cluster.ops.status import cluster_status, format_status

    cfg = _load_config(args)
    print(format_status(cfg, cluster_status(cfg)), flush=True)
    return EXIT_OK


def _add_chat(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chat",
        help="chat in the terminal; shows reused vs computed prompt tokens per reply",
        description="An interactive chat against a running server (--url) or an in-process "
        "engine (--model DIR). After each reply it prints the prompt tokens reused from the "
        "KV cache, those computed, and the time to first token. Commands: /system TEXT, "
        "/register, /register-file PATH, /chunks, /reuse [exact|approximate], /quit.",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="the server's API base, e.g. http://127.0.0.1:8000/v1")
    target.add_argument("--model", help="a checkpoint directory to run in this process")
    p.add_argument("--api-key", default="none", help="API key for --url (default: none)")
    p.add_argument("--model-name", help="model id for --url (default: the server's first)")
    p.add_argument("--device", help="cuda or cpu, for --model (default: cuda if available)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (default 64)")
    p.add_argument(
        "--reuse",
        choices=("exact", "approximate"),
        default="exact",
        help="reuse mode of the turns (default exact; /reuse changes it)",
    )
    p.add_argument("--system", default="", help="the system prompt to start with (/system sets it)")
    p.set_defaults(handler=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    from cluster.ops.chat_backends import LocalBackend, RemoteBackend
    from cluster.ops.chat_cli import run_chat

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if args.url:
        backend = RemoteBackend(args.url, args.api_key, args.max_tokens, args.model_name)
    else:
        backend = LocalBackend(args.model, args.max_tokens, args.device)
    run_chat(backend, args.reuse, args.system)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
