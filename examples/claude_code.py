"""Claude Code (or Codex) against `kvmemory serve`: two turns of a real session on the local model.

    npm install --prefix ~/.cache/claude @anthropic-ai/claude-code @openai/codex
    python -m examples.claude_code [--agent claude|codex] [--bin-dir ~/.cache/claude/node_modules/.bin]

It starts `kvmemory serve` (the Anthropic Messages API, an API key, `examples/claude_code_policy.yaml`,
replies bounded by `--max-new-tokens`), runs `claude -p` once and then again with `--continue` (Claude Code
resends the whole conversation), and prints each turn's usage as Claude Code reports it: the second turn's
`cache_read_input_tokens` is the conversation the session kept resident. With ``--agent codex`` it runs
`codex exec` and `codex exec resume --last` over the Responses API instead (Codex reports its thread's
totals). Slow on a CPU (Claude Code's
prompt is about 21,000 tokens) and the 135M default model is no coding agent: the point is the protocol and
the cache reuse across turns. Not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

KEY = "sk-local-example"


def wait_for(base: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("kvmemory serve did not start")


def claude_turn(claude: str, base: str, prompt: str, workdir: str, again: bool) -> dict:
    env = {
        **os.environ,
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": KEY,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
    }
    command = [claude, "-p", prompt, "--max-turns", "1", "--output-format", "json"] + (["--continue"] if again else [])
    started = time.monotonic()
    done = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=1800)
    result = json.loads(done.stdout or "{}")
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def codex_turn(codex: str, base: str, prompt: str, workdir: str, again: bool) -> dict:
    """One `codex exec` turn (``again``: resuming the last thread), with a provider pointed at the server."""
    home = os.path.join(workdir, ".codex")
    os.makedirs(home, exist_ok=True)
    with open(os.path.join(home, "config.toml"), "w") as config:
        config.write(
            'model = "default"\nmodel_provider = "kvmemory"\n[model_providers.kvmemory]\nname = "kvmemory"\n'
            f'base_url = "{base}/v1"\nenv_key = "KVMEMORY_KEY"\nwire_api = "responses"\n'
        )
    command = [codex, "exec", "--skip-git-repo-check", "--json"] + (["resume", "--last"] if again else []) + [prompt]
    env = {**os.environ, "CODEX_HOME": home, "KVMEMORY_KEY": KEY}
    started = time.monotonic()
    done = subprocess.run(
        command, env=env, cwd=workdir, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    usage = next((e["usage"] for e in events if e.get("type") == "turn.completed"), {})
    reply = next((e["item"]["text"] for e in events if e.get("item", {}).get("type") == "agent_message"), None)
    cached = usage.get("cached_input_tokens", 0)
    totals = {"cache_read_input_tokens": cached, "input_tokens": usage.get("input_tokens", 0) - cached}
    return {"usage": totals, "result": reply, "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", choices=("claude", "codex"), default="claude")
    parser.add_argument("--bin-dir", default=os.path.expanduser("~/.cache/claude/node_modules/.bin"))
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    program = os.path.join(args.bin_dir, args.agent)
    if not os.access(program, os.X_OK):
        package = "@anthropic-ai/claude-code" if args.agent == "claude" else "@openai/codex"
        prefix = os.path.dirname(os.path.dirname(args.bin_dir))  # (<prefix>/node_modules/.bin)
        raise SystemExit(
            f"{program} not found: install it with `npm install --prefix {prefix} {package}` (or give --bin-dir)"
        )
    base = f"http://127.0.0.1:{args.port}"
    policy = os.path.join(os.path.dirname(__file__), "claude_code_policy.yaml")
    turn_of = claude_turn if args.agent == "claude" else codex_turn
    with tempfile.TemporaryDirectory() as workdir:
        serve = [sys.executable, "-m", "kvmemory.integrations.cli", "serve", "--port", str(args.port), "--api-key", KEY]
        serve += ["--model-alias", "*", "--policy", policy, "--max-new-tokens", str(args.max_new_tokens)]
        server = subprocess.Popen(serve, env={**os.environ, "KVMEMORY_QUIET": "1"})
        try:
            wait_for(base, server)
            for turn, prompt in enumerate(["What is 2+2? Answer briefly.", "And 3+3?"]):
                result = turn_of(program, base, prompt, workdir, turn > 0)
                usage = result.get("usage", {})
                read, fresh = usage.get("cache_read_input_tokens", 0), usage.get("input_tokens", 0)
                share = read / (read + fresh) if read + fresh else 0.0
                print(
                    f"turn {turn + 1}: {result['seconds']} s, input {fresh:,} new + {read:,} from the cache "
                    f"({share:.0%}), reply {str(result.get('result'))[:80]!r}"
                )
        finally:
            server.terminate()
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
