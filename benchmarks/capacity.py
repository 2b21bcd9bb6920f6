"""How many agent sessions one machine holds, and how fast they decode: kvmemory against llama.cpp.

llama.cpp is the engine a CPU user would otherwise run. It is measured here on the same GGUF file (``--model``:
the small default benchmark model, or a coder model) and the same threads, with its own parallel-decoding tool
(``llama-batched-bench``), built from the llama.cpp tree that the ``llama-cpp-python`` source distribution
vendors (``build_llama_cpp``: a benchmark's tool, not a dependency; cached under ``~/.cache/kvmemory``).

**Parallel decode** (part ``parallel``). S sessions (S = 1, 4, 8, 16), each holding a 2k-token context of its
own, decode ``--tokens`` tokens each at once: aggregate decode tokens/s, and its ratio to one session.
llama.cpp: ``llama-batched-bench -npp 2048 -ntg T -npl 1,4,8,16`` (S_TG, its aggregate decode speed; each
sequence has its own prompt and cells), once per ``--llama-settings`` entry (flash attention on or off, f16 or
q8_0 KV), so that the report can give it its best per row. kvmemory: S sessions on agent-trace contexts of
about 2k tokens (``benchmarks/concurrency.py``), uncompacted and each under a 1/8 cap (256 slots per head),
their decode phases taking turns, ``--rounds`` rounds (medians).

**Capacity under a KV budget** (part ``budget``). For each budget (``--budgets-gib``), how many long agent
sessions fit, what they decode together, and what each remembers. The session is the long-session benchmark's
(``benchmarks/long_session.py``): the six agent tasks in turn, about 30k tokens of file reads, test runs and logs.

* llama.cpp holds a session's context in its cache, its KV in ``--llama-kv`` (q8_0: 34 bytes per 32 values,
  with flash attention, which a quantized V needs; or f16). A session costs the cells of its context: the
  whole session and the reply where the model's trained context holds them, else that context, and then it
  must drop what is oldest. Sessions held = budget / that; their aggregate decode is measured with that many
  sequences of (context − T) prompt tokens.
* kvmemory holds each session under the default policy capped at 1/N of its tokens (``--caps``). The session
  is replayed step by step under that cap, as the long-session benchmark replays it; its bytes (KV storage as
  allocated, plus the queries it records for compaction) set how many fit the budget, and that many copies of
  it (``Session.fork``, each with its own cache) are held at once and decode together. Then each appends a
  tool output (its first task's, asked again) and starts a reply, all at once: time to first token, median
  and worst, and the turn's prefill tokens/s.

What each session remembers: each of the session's facts asked at its end, answered by greedy generation
(``facts_answered``, exact match, as ``benchmarks.agent_memory`` asks) from the capped session (kvmemory) and
from what llama.cpp's context holds, on the same weights in kvmemory's engine (the long-session benchmark's
``context-window`` condition). For the default benchmark model, which answers nothing, also ``fact_gain_kept``
from ``benchmarks/results/long_session.json`` (run that benchmark first, at the same caps): the share of the
log-probability gain each fact's freshly read task gives, kept by that cap or by the context window.

Writes ``capacity.json`` and ``capacity.png`` (``capacity_<model>.*`` for another model); running one part
keeps the other's rows of an earlier run.

    python -m benchmarks.capacity [--model NAME] [--parts parallel budget] [--sessions 1 4 8 16] [--tokens 32]
        [--budgets-gib 1 4] [--caps 16 32] [--llama-kv q8_0] [--llama-settings "fa on, q8_0 KV" ...]
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

from benchmarks import concurrency, llama_bench
from benchmarks.agent_memory import ask, setup, step_through
from benchmarks.agent_traces import TRACE_SETS, load_traces
from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from benchmarks.long_session import CONTEXT_WINDOW, context_window, with_call_ids
from benchmarks.long_session import long_session as long_session_of
from kvmemory import Engine, run_on_compute
from kvmemory.memory import MemoryBudget, MemoryManager, MemoryPolicy
from kvmemory.runtime.loading import gguf_source

# a llama.cpp tree with build/bin/llama-batched-bench (KVMEMORY_LLAMA_CPP), else one built here once
CACHE = Path(os.environ.get("KVMEMORY_CACHE", Path.home() / ".cache" / "kvmemory"))
LLAMA_CPP_HOME = Path(os.environ.get("KVMEMORY_LLAMA_CPP", CACHE / "llama.cpp"))
LLAMA_TOOL = "llama-batched-bench"
KV_BYTES_PER_VALUE = {"f16": 2.0, "q8_0": 34 / 32}  # q8_0: 32 int8 values and an fp16 scale a block
KV_FLAGS = {"f16": llama_bench.SETTINGS["fa off, f16 KV"], "q8_0": llama_bench.SETTINGS["fa on, q8_0 KV"]}
PARTS = ("parallel", "budget")


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


def llama_batched(
    tool: Path, gguf: Path, prompt: int, tokens: int, counts: list[int], threads: int, flags: list[str],
    shared: bool = True,
) -> dict:  # fmt: skip
    """llama.cpp's speeds for each count of parallel sequences, each with a ``prompt``-token context in its own
    cache stream (``-no-kvu``): aggregate decode tokens/s (``S_TG``), and prefill tokens/s (``S_PP``). ``flags``:
    its attention and KV settings (``llama_bench.SETTINGS``).

    ``shared``: the prompt is computed once and copied into every sequence's stream (``-pps``); decode then
    reads each sequence's own cache exactly as with separate prompts (``prompt_check`` measures both), and the
    run does not spend minutes prefilling the same tokens again."""
    context = max(counts) * (prompt + tokens)
    command = [
        str(tool), "-m", str(gguf), "-c", str(context), "-b", "2048", "-ub", "512", "-no-kvu",
        "-npp", str(prompt), "-ntg", str(tokens), "-npl", ",".join(map(str, counts)),
        "-t", str(threads), "--output-format", "jsonl", *flags, *(["-pps"] if shared else []),
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
    capped at ``cap`` tokens' bytes: exactly the session that benchmark asks its facts of at that cap. Returns
    the session and the view of the history it was shown (for asking it questions)."""
    _, view, memory, _ = setup(engine, "kvmemory-default", cap)
    session = engine.session(memory=memory)
    step_through(session, view, messages, scored=0)
    session.set_messages(view.show(messages))
    return session, view


def answered(asked: list[dict]) -> dict:
    """How many of the facts asked were answered (the answer in the greedy reply), and of how many."""
    return {"facts_answered": sum(a["exact"] for a in asked), "facts_asked": len(asked)}


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


def fact_gain_kept(model: str, label: str) -> tuple[float | None, str | None]:
    """The share of the fact gain the long-session benchmark measured for ``label`` (``kvmemory-default 1/16``,
    ``context-window``) over all its facts, with its 95% interval; None where it has not run, or ran on another
    model (it runs on the default benchmark model)."""
    path = RESULTS / "long_session.json"
    rows = json.loads(path.read_text())["summary"] if path.is_file() and model == BENCH_MODEL else []
    row = next((r for r in rows if r.get("label") == label and r["ages"] == "all"), None)
    return (row["fact_gain_kept"], row["gain_ci"]) if row else (None, None)


def results_name(model: str) -> str:
    return "capacity" if model == BENCH_MODEL else f"capacity_{model}"


# ---- the run ----------------------------------------------------------------------------------------------
def parallel_part(engine: Engine, tool: Path, gguf: Path, args, threads: int) -> tuple[list[dict], dict]:
    """Aggregate decode of 1..16 sessions on 2k-token contexts: llama.cpp under each setting, kvmemory
    uncompacted and capped at 1/8. Returns the rows and llama.cpp's check that a copied prompt decodes as
    separate ones do."""
    started = time.perf_counter()
    check_flags = llama_bench.SETTINGS[args.llama_settings[0]]
    separate = llama_batched(tool, gguf, args.context, args.tokens, [4], threads, check_flags, shared=False)[4]
    copied = llama_batched(tool, gguf, args.context, args.tokens, [4], threads, check_flags)[4]
    prompt_check = {"settings": args.llama_settings[0], "separate_prompts": separate, "shared_prompt_copied": copied}
    print(f"llama.cpp, 4 sequences of {args.context} tokens: {prompt_check}", flush=True)
    measured = []
    for name in args.llama_settings:
        speeds = llama_batched(
            tool, gguf, args.context, args.tokens, args.sessions, threads, llama_bench.SETTINGS[name]
        )
        measured.append(("llama.cpp", name, None, {n: v["decode"] for n, v in speeds.items()}))
    for cap in (None, args.context // 8):
        speeds = kvmemory_parallel(engine, args.sessions, args.context, args.tokens, cap, args.rounds)
        measured.append(("kvmemory", None, cap, speeds))
    rows = [
        {
            "part": "parallel",
            "engine": engine_name,
            "model": args.model,
            "settings": settings,
            "cap_slots": cap,
            "sessions": n,
            "context_tokens": args.context,
            "aggregate_decode_tps": speeds[n],
            "ratio_to_one": speeds[n] / speeds[min(args.sessions)],
        }
        for engine_name, settings, cap, speeds in measured
        for n in args.sessions
    ]
    print(table(rows, list(rows[0])), flush=True)
    print(f"parallel part: {time.perf_counter() - started:.0f} s", flush=True)
    return rows, prompt_check


def budget_part(engine: Engine, tool: Path, gguf: Path, args, threads: int) -> tuple[list[dict], list[dict]]:
    """Long sessions held under each KV budget: llama.cpp at its context in ``--llama-kv``, kvmemory at each
    cap; what they decode together and the facts each remembers. Returns the rows and the replays' times."""
    traces = [t for name in TRACE_SETS for t in load_traces(trace_set=name)]
    long = long_session_of(traces)[0]
    messages = long["messages"]
    tokens = len(engine.session().renderer.render(messages))  # as the long-session benchmark counts them
    turn = next_turn(messages)
    rows = []

    trained = llama_context(gguf)
    context = min(trained, tokens + args.tokens)  # llama.cpp's cells for one session
    values = engine.num_layers * engine.num_kv_heads * engine.head_dim * 2  # keys and values of one position
    cell_bytes = round(values * KV_BYTES_PER_VALUE[args.llama_kv])
    started = time.perf_counter()
    window = context_window(engine, long)  # what llama.cpp's context holds, asked on the same weights
    remembered = answered(window["facts"])
    print(
        f"what {context:,} cells hold ({window['messages_kept']} of {len(messages)} messages):"
        f" {remembered['facts_answered']}/{remembered['facts_asked']} facts answered,"
        f" {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    window_gain, window_ci = fact_gain_kept(args.model, CONTEXT_WINDOW)
    for gib in args.budgets_gib:
        budget = int(gib * 2**30)
        count = budget // (context * cell_bytes)
        started = time.perf_counter()
        flags = KV_FLAGS[args.llama_kv]
        theirs = {}
        if count:
            theirs = llama_batched(tool, gguf, context - args.tokens, args.tokens, [count], threads, flags)[count]
        print(f"llama.cpp, {count} sequences of {context:,} cells: {theirs}, {time.perf_counter() - started:.0f} s")
        rows.append(
            {
                "part": "budget",
                "engine": "llama.cpp",
                "model": args.model,
                "kv_type": args.llama_kv,
                "settings": " ".join(flags),
                "kv_budget_bytes": budget,
                "context_tokens": context,
                "session_tokens": tokens,
                "session_bytes": context * cell_bytes,
                "sessions": count,
                "sessions_held": count,
                "aggregate_decode_tps": theirs.get("decode", 0.0),
                "prefill_tps": theirs.get("prefill", 0.0),
                **remembered,
                "fact_gain_kept": window_gain,
                "fact_gain_ci": window_ci,
            }
        )
    replays = []
    for divisor in args.caps:
        cap = tokens // divisor
        started = time.perf_counter()
        session, view = held_session(engine, messages, cap)
        replays.append({"cap": f"1/{divisor}", "tokens": len(session.tokens), "seconds": time.perf_counter() - started})
        stats = session.stats()
        one = session_bytes(session)
        remembered = answered(ask(session, view, messages, long["facts"], engine.tokenizer))
        print(
            f"kvmemory replayed {len(session.tokens)} tokens under a {cap}-slot cap in {replays[-1]['seconds']:.0f} s:"
            f" {one / 2**20:.1f} MiB a session (KV {stats.kv_bytes / 2**20:.1f}, allocated"
            f" {stats.allocated_bytes / 2**20:.1f}, recorded queries {stats.query_bytes / 2**20:.1f});"
            f" {remembered['facts_answered']}/{remembered['facts_asked']} facts answered",
            flush=True,
        )
        gain, ci = fact_gain_kept(args.model, f"kvmemory-default 1/{divisor}")
        for gib in args.budgets_gib:
            budget = int(gib * 2**30)
            ours = kvmemory_capacity(engine, session, turn, budget, args.tokens)
            rows.append(
                {
                    "part": "budget",
                    "engine": "kvmemory",
                    "model": args.model,
                    "kv_type": str(engine.kv_dtype).removeprefix("torch."),
                    "kv_budget_bytes": budget,
                    "context_tokens": len(session.tokens),
                    "session_tokens": tokens,
                    "cap": f"1/{divisor}",
                    "cap_slots": cap,
                    "session_bytes": one,
                    "session_kv_bytes": stats.kv_bytes,
                    "session_query_bytes": stats.query_bytes,
                    "sessions": ours["sessions_held"],
                    **ours,
                    **remembered,
                    "fact_gain_kept": gain,
                    "fact_gain_ci": ci,
                }
            )
            print(table([r for r in rows if r["part"] == "budget"], list(rows[-1])), flush=True)
        session.close()
    return rows, replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=BENCH_MODEL, help="a named model or GGUF path (the same file for both)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per session in each phase")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budgets-gib", type=float, nargs="+", default=[1, 4])
    parser.add_argument(
        "--caps", type=int, nargs="+", default=[16, 32], help="each long session's cap: 1/N of its tokens"
    )
    parser.add_argument("--llama-kv", default="q8_0", choices=KV_FLAGS, help="llama.cpp's KV in the budget part")
    parser.add_argument(
        "--llama-settings",
        nargs="+",
        default=["fa on, q8_0 KV", "fa off, f16 KV"],
        choices=llama_bench.SETTINGS,
        help="llama.cpp's settings in the parallel part (each run; the report gives it its best per row)",
    )
    args = parser.parse_args()
    engine = Engine.from_pretrained(args.model)
    gguf = gguf_source(args.model)
    threads = run_on_compute(torch.get_num_threads)  # what kvmemory's passes run on; llama.cpp gets the same
    tool = build_llama_cpp()
    name = results_name(args.model)
    earlier = json.loads((RESULTS / f"{name}.json").read_text()) if (RESULTS / f"{name}.json").is_file() else {}
    kept = [r for r in earlier.get("rows", []) if r["part"] not in args.parts]  # the parts not run now
    payload = {"model": args.model, "prompt_check": earlier.get("prompt_check"), "replays": earlier.get("replays")}
    settings = {**earlier.get("settings", {}), **vars(args), "threads": threads}
    settings["llama_cpp"] = "llama-cpp-python sdist's vendored llama.cpp"

    def store(rows: list[dict], partial: bool = False) -> None:  # after each part: an hour-long part loses no other
        rows = sorted(rows, key=lambda r: PARTS.index(r["part"]))
        save(name, {**payload, "settings": settings, "rows": rows, **({"partial": True} if partial else {})})
        plot(rows, RESULTS / f"{name}.png")
        print(f"saved {RESULTS / name}.json", flush=True)

    rows = kept
    if "parallel" in args.parts:
        parallel, payload["prompt_check"] = parallel_part(engine, tool, gguf, args, threads)
        rows = rows + parallel
        store(rows, partial="budget" in args.parts)  # the report waits for the budget part
    if "budget" in args.parts:
        budget, payload["replays"] = budget_part(engine, tool, gguf, args, threads)
        store(rows + budget)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    parallel = [r for r in rows if r["part"] == "parallel"]
    for label in dict.fromkeys((r["engine"], r.get("settings"), r.get("cap_slots")) for r in parallel):
        mine = [r for r in parallel if (r["engine"], r.get("settings"), r.get("cap_slots")) == label]
        engine, settings, cap = label
        name = engine + (f" ({settings})" if settings else "")
        name += f", each under {cap} slots" if cap else ", uncompacted"
        left.plot([r["sessions"] for r in mine], [r["aggregate_decode_tps"] for r in mine], "o-", label=name)
    left.set_xlabel("sessions decoding at once (2k-token contexts)")
    left.set_ylabel("aggregate decode tokens/s")
    left.legend(fontsize=8)
    budget = [r for r in rows if r["part"] == "budget"]
    for key in dict.fromkeys((r["engine"], r.get("cap")) for r in budget):
        mine = [r for r in budget if (r["engine"], r.get("cap")) == key]
        first = mine[0]
        if key[1] is None:
            name = f"llama.cpp, {first['context_tokens']:,} cells of {first.get('kv_type', 'f16')} KV"
        else:
            name = f"kvmemory, cap {key[1]}"
        if first.get("facts_asked"):
            name += f" ({first['facts_answered']}/{first['facts_asked']} facts answered)"
        elif first.get("fact_gain_kept") is not None:
            name += f" (fact gain kept {first['fact_gain_kept']:.2f})"
        marker = "s" if key[1] is None else "o"
        right.plot([r["sessions_held"] for r in mine], [r["aggregate_decode_tps"] for r in mine], marker, label=name)
        for r in mine:
            right.annotate(f"{r['kv_budget_bytes'] / 2**30:g} GiB", (r["sessions_held"], r["aggregate_decode_tps"]))
    right.set_xscale("log")
    right.legend(fontsize=8)
    tokens = budget[-1].get("session_tokens", budget[-1]["context_tokens"]) if budget else 0
    right.set_xlabel(f"{tokens:,}-token agent sessions held under the KV budget (log scale)")
    right.set_ylabel("their aggregate decode tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
