"""Soak test: hundreds of agent turns on the default model under a memory cap, checking the Session contract.

Each turn does one of: a tool output (real files and test logs of the sample project) followed by a
reply, a user question and a reply, a stream abandoned after a few pieces, an asyncio task cancelled
mid-reply, a fork that answers on its own and is closed, or a bad call (which must change nothing).
After every turn it checks that the cap held, that every text appended or received is still in the
transcript in order, and that the transcript covers the session contiguously; it records the process's
resident memory, the KV bytes and the slots. Writes ``results/soak.json`` and ``results/soak.png``.

    python -m benchmarks.soak [--turns 200] [--cap 1024] [--seed 0] [--method snapkv]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

from benchmarks.agent_session import policy_with
from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from kvmemory import AsyncSession, Engine, KVMemoryError
from kvmemory.agents.coding_agent.sample_project import create_sample_project
from kvmemory.agents.coding_agent.workspace import Workspace
from kvmemory.memory import MemoryManager

QUESTIONS = [
    "What does the failing test check?",
    "Which file defines the database port?",
    "Summarise the last output.",
    "What should we try next?",
    "Is the ledger consistent?",
]
COMMANDS = [
    "pytest -q",
    "pytest -q tests/test_ledger.py",
    "ls -R",
    "cat README.md",
    "cat inventory/settings.py",
    "grep -rn def inventory",
    'python -c "import inventory; print(inventory.__file__)"',
]


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Soak:
    def __init__(self, engine: Engine, cap: int, seed: int, workspace: Workspace, method: str | None = None):
        self.engine, self.cap, self.rng, self.workspace = engine, cap, random.Random(seed), workspace
        self.session = engine.session(memory=MemoryManager(policy_with(method, cap)))
        self.expected: list[str] = []
        self.violations: list[str] = []
        self.tool_calls = 0

    # ---- turns ---------------------------------------------------------------------------------
    def tool_turn(self) -> None:
        command = self.rng.choice(COMMANDS)
        output = self.workspace.run_command(command)[:1500]
        self.tool_calls += 1
        call = {
            "id": f"c{self.tool_calls}",
            "type": "function",
            "function": {"name": "run_command", "arguments": {"command": command}},
        }
        self.session.append_messages(
            [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": output, "tool_call_id": f"c{self.tool_calls}"},
            ],
            add_generation_prompt=True,
        )
        self.expected.append(output)
        self.reply()

    def user_turn(self) -> None:
        question = self.rng.choice(QUESTIONS)
        self.session.append_messages([{"role": "user", "content": question}], add_generation_prompt=True)
        self.expected.append(question)
        self.reply()

    def reply(self) -> None:
        text = self.session.generate(
            max_new_tokens=self.rng.randint(4, 24), temperature=0.7, seed=self.rng.randint(0, 999)
        ).text
        if text:
            self.expected.append(text)

    def abandoned_stream(self) -> None:
        self.session.append_messages(
            [{"role": "user", "content": self.rng.choice(QUESTIONS)}], add_generation_prompt=True
        )
        self.expected.append(self.session.messages[-1]["content"])
        pieces, keep = [], self.rng.randint(0, 6)
        for piece in self.session.stream(max_new_tokens=40):
            pieces.append(piece)
            if len(pieces) >= keep:
                break
        if "".join(pieces):
            self.expected.append("".join(pieces))

    def cancelled_task(self) -> None:
        self.session.append_messages(
            [{"role": "user", "content": self.rng.choice(QUESTIONS)}], add_generation_prompt=True
        )
        self.expected.append(self.session.messages[-1]["content"])
        received: list[str] = []
        wanted = self.rng.randint(1, 5)

        async def run():
            wrapper = AsyncSession(self.session)

            async def consume():
                async for piece in wrapper.stream(max_new_tokens=60):
                    received.append(piece)

            task = asyncio.create_task(consume())
            while len(received) < wanted and not task.done():
                await asyncio.sleep(0.005)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

        asyncio.run(run())
        if "".join(received):
            self.expected.append("".join(received))

    def fork_turn(self) -> None:
        child = self.session.fork(with_memory=True)
        child.append_messages(
            [{"role": "user", "content": "(fork) " + self.rng.choice(QUESTIONS)}], add_generation_prompt=True
        )
        child.generate(max_new_tokens=8)
        if child.cache.slots_per_head > self.cap:
            self.violations.append(f"fork passed the cap: {child.cache.slots_per_head}")
        child.close()

    def bad_call(self) -> None:
        before = self.fingerprint()
        bad = self.rng.choice(
            [
                lambda: self.session.append_messages([{"role": "robot", "content": "x"}]),
                lambda: self.session.append_tokens([self.engine.vocab_size + 5]),
                lambda: self.session.generate(temperature=-1.0),
                lambda: self.session.append_messages([{"role": "tool", "content": "orphan output"}]),
                lambda: self.session.compact("snapkv", slots=0),
                lambda: self.session.recall(10**9),
            ]
        )
        try:
            bad()
            self.violations.append("a bad call was accepted")
        except KVMemoryError:
            pass
        if self.fingerprint() != before:
            self.violations.append("a failed call changed the session")

    # ---- checks --------------------------------------------------------------------------------
    def fingerprint(self):
        s = self.session
        return (
            list(s.tokens),
            [(g.id, g.start, g.end, g.text) for g in s.segments],
            s.messages,
            [layer.length for layer in s.cache.layers],
            s.cache.compactions,
            s.memory.state(),
        )

    def check(self) -> None:
        s = self.session
        if s.cache.slots_per_head > self.cap or s.memory.peak_slots > self.cap:
            self.violations.append(f"cap passed: {s.cache.slots_per_head} slots, peak {s.memory.peak_slots}")
        text = "".join(seg["text"] for seg in s.transcript())
        position = 0
        for item in self.expected:
            found = text.find(item, position)
            if found < 0:
                self.violations.append(f"lost: {item[:60]!r}")
                break
            position = found + len(item)
        end = 0
        for seg in s.segments:
            if seg.start != end:
                self.violations.append(f"transcript gap before segment {seg.id}")
            end = seg.end
        if end != len(s.tokens):
            self.violations.append("transcript does not cover the session")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--cap", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--method", default=None, help="switch every compacted rule of the default policy to this method"
    )
    args = parser.parse_args(argv)

    engine = Engine.from_pretrained(BENCH_MODEL)
    workspace = Workspace(create_sample_project(tempfile.mkdtemp(prefix="kvmemory-soak-")))
    soak = Soak(engine, args.cap, args.seed, workspace, args.method)
    soak.session.append_messages(
        [
            {"role": "system", "content": "You are a coding agent working on an inventory project."},
            {"role": "user", "content": "Find out why the tests fail and fix it."},
        ]
    )
    kinds = {
        "tool": soak.tool_turn,
        "user": soak.user_turn,
        "stream": soak.abandoned_stream,
        "cancel": soak.cancelled_task,
        "fork": soak.fork_turn,
        "bad": soak.bad_call,
    }
    weights = {"tool": 5, "user": 2, "stream": 1, "cancel": 1, "fork": 1, "bad": 1}
    timeline, counts, started = [], dict.fromkeys(kinds, 0), time.time()
    for turn in range(1, args.turns + 1):
        kind = soak.rng.choices(list(weights), list(weights.values()))[0]
        try:
            kinds[kind]()
        except KVMemoryError as err:  # a valid call that fails breaks the contract too; record it and go on
            soak.violations.append(f"turn {turn} ({kind}) failed: {err}")
        counts[kind] += 1
        soak.check()
        stats = soak.session.stats()
        timeline.append(
            {
                "turn": turn,
                "kind": kind,
                "logical_tokens": stats.logical_tokens,
                "slots": soak.session.cache.slots_per_head,
                "kv_bytes": stats.kv_bytes,
                "allocated_bytes": stats.allocated_bytes,
                "rss_bytes": resident_bytes(),
                "seconds": time.time() - started,
                "violations": len(soak.violations),
            }
        )
        if turn % 10 == 0 or turn == 1:
            row = timeline[-1]
            print(
                f"turn {turn:4d}  tokens {row['logical_tokens']:7d}  slots {row['slots']:5d}  KV "
                f"{row['kv_bytes'] / 2**20:6.1f} MiB"
                f"  RSS {row['rss_bytes'] / 2**20:7.1f} MiB  violations {row['violations']}  {row['seconds']:.0f} s",
                flush=True,
            )

    warm = timeline[min(len(timeline) - 1, max(0, args.turns // 6))]
    cap_bytes = args.cap * engine.kv_bytes_per_token
    summary = {
        "turns": args.turns,
        "cap_slots": args.cap,
        "method": args.method or "default policy",
        "cap_kv_bytes": cap_bytes,
        "turn_kinds": counts,
        "logical_tokens": timeline[-1]["logical_tokens"],
        "compactions": soak.session.cache.compactions,
        "max_slots": max(r["slots"] for r in timeline),
        "peak_slots": soak.session.memory.peak_slots,
        "max_kv_bytes": max(r["kv_bytes"] for r in timeline),
        "rss_after_warmup_bytes": warm["rss_bytes"],
        "rss_end_bytes": timeline[-1]["rss_bytes"],
        "rss_growth_after_warmup_bytes": timeline[-1]["rss_bytes"] - warm["rss_bytes"],
        "violations": len(soak.violations),
        "violation_examples": soak.violations[:10],
        "seconds": timeline[-1]["seconds"],
    }
    print()
    print(
        table(
            [summary], ["turns", "logical_tokens", "compactions", "max_slots", "peak_slots", "cap_slots", "violations"]
        )
    )
    print(
        f"RSS after warm-up (turn {warm['turn']}) {warm['rss_bytes'] / 2**20:.1f} MiB, at the end "
        f"{timeline[-1]['rss_bytes'] / 2**20:.1f} MiB (growth "
        f"{summary['rss_growth_after_warmup_bytes'] / 2**20:+.1f} MiB; "
        f"the cap's KV bytes are {cap_bytes / 2**20:.1f} MiB)"
    )
    save("soak", {"summary": summary, "timeline": timeline})
    plot(timeline, args.cap, RESULTS / "soak.png")


def plot(timeline: list[dict], cap: int, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in timeline]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(turns, [r["rss_bytes"] / 2**20 for r in timeline], label="process RSS")
    top.plot(turns, [r["kv_bytes"] / 2**20 for r in timeline], label="KV bytes")
    top.set_ylabel("MiB")
    top.legend()
    bottom.plot(turns, [r["slots"] for r in timeline], label="slots")
    bottom.axhline(cap, color="red", linestyle="--", label="cap")
    bottom.plot(turns, [r["logical_tokens"] / 10 for r in timeline], label="logical tokens / 10")
    bottom.set_xlabel("turn")
    bottom.legend()
    fig.suptitle("soak: resident memory and cache under the cap")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
