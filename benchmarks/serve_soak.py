"""Soak of ``kvmemory serve`` as users run it: clients on several API keys for minutes, each holding a
conversation in one of the three dialects, with clients that go away mid-turn, bodies over the size limit and
fuzzed requests mixed in. Records every answer's status, requests that hang, sessions lost or corrupted (a
continuing conversation that no longer finds its prefix cached, or a session that shrank), and the server's
resident memory, its sessions' KV bytes and its disk bytes over time. Writes ``results/serve_soak.json`` and
``results/serve_soak.png``.

    python -m benchmarks.serve_soak [--minutes 10] [--clients 8] [--keys 3] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import BENCH_MODEL, RESULTS, save

HANG_S = 120.0  # a request unanswered this long is hung
ACTIONS = {"turn": 0.55, "abandon-stream": 0.1, "abandon-plain": 0.1, "oversize": 0.05, "fuzz": 0.2}
WORDS = ["user", "tool", None, 3, -1, 2**70, "", [], {}, "<|im_end|>\n<|im_start|>system\n", 1e308, True, "\ud800"]


def turn_body(dialect: str, history: list[dict], stream: bool) -> tuple[str, dict]:
    """The route and body that continue ``history`` (alternating user and assistant texts) in ``dialect``."""
    if dialect == "chat":
        return "/v1/chat/completions", {"model": "default", "messages": history, "max_tokens": 16, "stream": stream}
    if dialect == "responses":
        return "/v1/responses", {
            "model": "default",
            "input": history,
            "max_output_tokens": 16,
            "stream": stream,
            "store": False,
        }
    return "/v1/messages", {"model": "default", "messages": history, "max_tokens": 16, "stream": stream}


def fuzzed(body: dict, rng: random.Random) -> dict:
    """``body`` with one to three fields replaced by values of the wrong kind (or dropped)."""
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        target = body
        path = []
        while isinstance(target, (dict, list)) and target and rng.random() < 0.7:
            key = rng.choice(list(target)) if isinstance(target, dict) else rng.randrange(len(target))
            path.append((target, key))
            target = target[key]
        if path:
            parent, key = path[-1]
            if isinstance(parent, dict) and rng.random() < 0.2:
                parent.pop(key)
            else:
                parent[key] = rng.choice(WORDS)
    return body


class Server:
    """``kvmemory serve`` in a process of its own, on keys ``keys``, its sessions in a temporary directory."""

    def __init__(self, model: str, keys: list[str], max_sessions: int):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.sessions = Path(tempfile.mkdtemp(prefix="kvmemory-soak-"))
        command = [
            sys.executable,
            "-m",
            "kvmemory.integrations.cli",
            "serve",
            "--model",
            model,
            "--port",
            str(self.port),
        ]
        command += ["--sessions", str(self.sessions), "--max-sessions", str(max_sessions), "--max-request-mb", "1"]
        command += ["--save-after-turn", "--max-new-tokens", "32"]
        for key in keys:
            command += ["--api-key", key]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"kvmemory serve exited: {self.process.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{self.base}/health").status_code == 200 and self.ready(keys[0]):
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise SystemExit("kvmemory serve did not load its model in 10 minutes")

    def ready(self, key: str) -> bool:
        return httpx.get(f"{self.base}/v1/models", headers={"x-api-key": key}).status_code == 200

    def resident_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.sessions.rglob("*") if p.is_file())

    def stop(self) -> float:
        started = time.monotonic()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return float("inf")
        return time.monotonic() - started


class Client(threading.Thread):
    """One agent: a conversation on its own session, continued turn by turn, with misbehaviour mixed in."""

    def __init__(self, server: Server, key: str, index: int, until: float, seed: int, tally):
        super().__init__(daemon=True)
        self.server, self.key, self.until, self.rng, self.tally = server, key, until, random.Random(seed), tally
        self.dialect = ("chat", "responses", "messages")[index % 3]
        self.name = f"soak-{index}"
        self.session = f"{self.name}-0"
        self.history: list[dict] = []
        self.held = 0  # the session's tokens after this client's last successful turn

    def headers(self) -> dict:
        return {"x-api-key": self.key, "x-session-id": self.session}

    def run(self) -> None:
        while time.monotonic() < self.until:
            action = self.rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
            try:
                getattr(self, action.replace("-", "_"))()
            except httpx.TimeoutException:
                self.tally("hung", action)
            except httpx.TransportError as err:
                self.tally("transport_error", f"{action}: {type(err).__name__}")

    def post(self, route: str, body, timeout: float = HANG_S, **kwargs) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**self.headers(), "content-type": "application/json"}
        return httpx.post(self.server.base + route, content=content, headers=headers, timeout=timeout, **kwargs)

    def turn(self) -> None:
        question = {"role": "user", "content": f"Step {len(self.history) // 2}: what next? {self.rng.random():.6f}"}
        route, body = turn_body(self.dialect, self.history + [question], stream=False)
        answer = self.post(route, body)
        self.tally(answer.status_code, "turn")
        if answer.status_code == 429:
            return  # the key's share is full: this conversation waits
        if answer.status_code != 200:
            return
        reply = answer.json()
        usage = reply["usage"]
        cached = usage.get("prompt_tokens_details", usage.get("input_tokens_details", {})) or {}
        reused = cached.get("cached_tokens", usage.get("cache_read_input_tokens", 0)) or 0
        if self.history and reused == 0:
            self.tally("lost_session", self.dialect)  # a continuing conversation found nothing of its prefix
        text = reply_text(self.dialect, reply)
        self.history += [question, {"role": "assistant", "content": text or "ok"}]
        stats = httpx.get(f"{self.server.base}/v1/sessions/{self.session}", headers=self.headers(), timeout=HANG_S)
        if stats.status_code != 200 or stats.json()["logical_tokens"] < self.held:
            self.tally("corrupted_session", self.dialect)
        else:
            self.held = stats.json()["logical_tokens"]
        if len(self.history) > 40:  # a long conversation ends; the next one starts on a fresh session
            self.new_conversation()

    def abandon_stream(self) -> None:
        question = {"role": "user", "content": "Tell me a long story."}
        route, body = turn_body(self.dialect, self.history + [question], stream=True)
        with httpx.stream("POST", self.server.base + route, json=body, headers=self.headers(), timeout=HANG_S) as r:
            self.tally(r.status_code, "abandon-stream")
            for _ in r.iter_bytes():
                break  # the client goes away after its first bytes
        self.new_conversation()  # the session kept what was sent, which this client never read: start afresh

    def new_conversation(self) -> None:
        """Delete this client's session (as a client that cleans up does) and start on a fresh one."""
        for _ in range(3):  # a turn just abandoned frees its session at its next token
            gone = httpx.delete(f"{self.server.base}/v1/sessions/{self.session}", headers=self.headers(), timeout=60)
            if gone.status_code != 409:
                break
            time.sleep(0.5)
        self.history, self.held = [], 0
        self.session = f"{self.name}-{self.rng.randrange(10**6)}"

    def abandon_plain(self) -> None:
        route, body = turn_body(self.dialect, self.history + [{"role": "user", "content": "Think hard."}], False)
        try:
            self.tally(self.post(route, body, timeout=0.3).status_code, "abandon-plain")
        except httpx.TimeoutException:
            self.tally("abandoned", "abandon-plain")

    def oversize(self) -> None:
        route, body = turn_body(self.dialect, [{"role": "user", "content": "x" * 1_100_000}], False)
        self.tally(self.post(route, body).status_code, "oversize")

    def fuzz(self) -> None:
        route, body = turn_body(self.dialect, self.history + [{"role": "user", "content": "hi"}], False)
        answer = self.post(route, fuzzed(body, self.rng))
        self.tally(answer.status_code, "fuzz")
        if answer.status_code == 200:  # the server took the fuzzed history as the client's own edit of it
            self.new_conversation()


def reply_text(dialect: str, reply: dict) -> str:
    if dialect == "chat":
        return reply["choices"][0]["message"]["content"] or ""
    if dialect == "responses":
        return "".join(c.get("text", "") for item in reply["output"] for c in item.get("content", []))
    return "".join(block.get("text", "") for block in reply["content"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--keys", type=int, default=3)
    parser.add_argument("--max-sessions", type=int, default=12, help="the server's bound (shared by the keys)")
    parser.add_argument("--model", default=BENCH_MODEL)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    keys = [f"soak-key-{i}" for i in range(args.keys)]
    server = Server(args.model, keys, args.max_sessions)
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def tally(outcome, action) -> None:
        with lock:
            counts[(str(outcome), action)] += 1

    started = time.monotonic()
    until = started + args.minutes * 60
    clients = [Client(server, keys[i % len(keys)], i, until, args.seed * 1000 + i, tally) for i in range(args.clients)]
    for client in clients:
        client.start()
    samples = []
    while any(c.is_alive() for c in clients):
        kv = 0
        for key in keys:
            listed = httpx.get(f"{server.base}/v1/sessions", headers={"x-api-key": key}, timeout=HANG_S).json()
            for entry in listed["data"]:
                stats = httpx.get(f"{server.base}/v1/sessions/{entry['id']}", headers={"x-api-key": key})
                kv += stats.json().get("kv_bytes", 0) if stats.status_code == 200 else 0
        samples.append(
            {
                "t": round(time.monotonic() - started, 1),
                "rss_bytes": server.resident_bytes(),
                "kv_bytes": kv,
                "disk_bytes": server.disk_bytes(),
            }
        )
        time.sleep(10)
    for client in clients:
        client.join(timeout=HANG_S)
    stop_s = server.stop()
    by_status = collections.Counter()
    for (outcome, _), n in counts.items():
        by_status[outcome] += n
    summary = {
        "requests": sum(n for (o, _), n in counts.items() if o.isdigit()),
        "status_5xx": sum(n for o, n in by_status.items() if o.isdigit() and int(o) >= 500),
        "hung": by_status["hung"],
        "lost_sessions": by_status["lost_session"],
        "corrupted_sessions": by_status["corrupted_session"],
        "transport_errors": by_status["transport_error"],
        "sigterm_stop_s": round(stop_s, 2),
        "peak_rss_bytes": max(s["rss_bytes"] for s in samples),
        "peak_disk_bytes": max(s["disk_bytes"] for s in samples),
    }
    outcomes = [{"outcome": o, "action": a, "count": n} for (o, a), n in sorted(counts.items())]
    path = save(
        "serve_soak",
        {"model": args.model, "settings": vars(args), "summary": summary, "outcomes": outcomes, "samples": samples},
    )
    plot(samples, RESULTS / "serve_soak.png", summary)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


def plot(samples: list[dict], path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    t = [s["t"] / 60 for s in samples]
    for field, label in (("rss_bytes", "server resident memory"), ("kv_bytes", "sessions' KV"), ("disk_bytes", "disk")):
        axis.plot(t, [s[field] / 2**20 for s in samples], label=label)
    axis.set_xlabel("minutes")
    axis.set_ylabel("MiB")
    axis.set_title(
        f"kvmemory serve soak: {summary['requests']} requests, {summary['status_5xx']} 5xx, {summary['hung']} hung, "
        f"{summary['lost_sessions']} lost sessions",
        fontsize=9,
    )
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
