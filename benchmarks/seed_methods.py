"""The seed methods where agents need them: counter-causal surprise, Attention Matching and TAM, each composed
with what made the default win, measured on agent traces at several caps.

Each seed method ranks the span's positions its own way (``CompactionMethod.position_scores``): counter-causal
by how little the later context predicts a token, Attention Matching by the heads' consensus on recent
attention, TAM by that attention spread over thought segments by its budget rule. The compositions
(``benchmarks/agent_memory.KV_METHODS``):

* ``<seed>-lines``: ``REAL(inner=Lines(<seed>))``: the ranking by whole lines, tokens under 1 nat of
  surprisal first to go, one selection for every head and segment, REAL's head budgets, gaps closed;
* ``<seed>-lines-fit``: the same with Attention Matching's β and value fit on the kept slots
  (``REAL(inner=Fitted(Lines(<seed>)))``);

against the default policy, ``uniform-lines`` (the default's ranking with every head keeping the same count),
counter-causal alone (per token and head, gaps kept) and dropping the oldest messages, all on the default
16-bit cache, so equal slots are equal bytes. Two trace sets: ``tuning`` (``benchmarks/agent_traces.SPECS``,
the traces the default was chosen on) and ``held-out`` (``HELD_OUT``: written and frozen before any of this was
measured), reported apart. Metrics as in ``benchmarks/agent_memory.py`` (fact gain kept with 95% bootstrap
intervals over facts, last-turn ΔNLL with intervals over traces, degenerate free replies) plus each
session's compaction pauses: the median and the worst, and seconds per 2,048 slots compacted.

    python -m benchmarks.seed_methods [--caps 8 16 4] [--sets tuning held-out] [--conditions ...] [--replies 1]
    python -m benchmarks.seed_methods --update --caps 16 4 --sets held-out   # add runs to the saved ones
    python -m benchmarks.seed_methods --from-saved   # tables and picture from the saved rows
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.agent_memory import interval, no_trace_logprobs, replay, summarise
from benchmarks.agent_traces import TRACE_SETS, load_traces
from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from kvmemory import Engine

SEEDS = ["cc", "am", "tam"]
MEASURED = ["uncompacted", "drop-oldest", "kvmemory-default", "uniform-lines", "counter-causal"]
MEASURED += [f"{seed}-lines" for seed in SEEDS]
# Attention Matching's fit on a line choice: 4-19 s a compaction (``--conditions`` runs them)
FITTED = [*[f"{seed}-lines-fit" for seed in SEEDS], "am-fit-default", "am-mass-default"]
POOLS = ["default-pool50", "default-pool25"]  # candidates for a default between the default and uniform-lines
BASELINES = ("drop-oldest", "kvmemory-default", "uniform-lines")


def pauses(rows: list[dict]) -> dict:
    """The median over sessions of each session's median compaction pause, and the worst pause of any."""
    per_session = [r["pauses_s"] for r in rows if r["pauses_s"]]
    if not per_session:
        return {"pause_median_s": 0.0, "pause_worst_s": 0.0}
    return {
        "pause_median_s": statistics.median(statistics.median(p) for p in per_session),
        "pause_worst_s": max(max(p) for p in per_session),
    }


def summary_of(rows: list[dict], none: dict, caps: list[int]) -> list[dict]:
    out = []
    for trace_set in dict.fromkeys(r["set"] for r in rows):
        mine = [r for r in rows if r["set"] == trace_set]
        full = [r for r in mine if r["condition"] == "uncompacted"]
        for divisor in caps:
            capped = [r for r in mine if r["divisor"] == divisor and r["condition"] != "uncompacted"]
            ran = {(r["trace"], r["condition"]) for r in capped}
            traces = {t for t, _ in ran if all((t, c) in ran for _, c in ran)}  # those every condition ran on
            capped = [r for r in capped if r["trace"] in traces]
            if not capped:
                continue
            for s in summarise(full + capped, none, divisor):
                if s["condition"] == "uncompacted":
                    continue
                cell = [r for r in capped if r["condition"] == s["condition"]]
                keep = ("fact_gain_kept", "gain_ci", "answers_held", "delta_nll_last_turn", "nll_ci")
                keep += ("degenerate_replies",)
                row = {"set": trace_set, "cap": s["cap"], "condition": s["condition"], "traces": sorted(traces)}
                row.update({k: s[k] for k in keep})
                out.append({**row, "pause_s_per_2048_slots": s["pause_s_per_2048_slots"], **pauses(cell)})
    return out


def plot(summary: list[dict], path) -> None:
    """Pareto pictures: fact gain kept against last-turn ΔNLL, a panel per trace set and cap, marker area by
    the median pause."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["set"] for r in summary))
    caps = list(dict.fromkeys(r["cap"] for r in summary))
    fig, axes = plt.subplots(len(sets), len(caps), figsize=(5.5 * len(caps), 4.8 * len(sets)), squeeze=False)
    colors = {"drop-oldest": "tab:gray", "kvmemory-default": "tab:blue", "uniform-lines": "tab:cyan"}
    seed_colors = {"cc": "tab:red", "am": "tab:green", "tam": "tab:purple", "counter": "tab:red", "default": "navy"}
    for i, trace_set in enumerate(sets):
        for j, cap in enumerate(caps):
            ax = axes[i][j]
            cell = [r for r in summary if r["set"] == trace_set and r["cap"] == cap]
            if not cell:
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"{trace_set} traces, cap {cap}: not measured", ha="center", fontsize=9)
                continue
            for r in cell:
                condition = r["condition"]
                color = colors.get(condition) or seed_colors[condition.split("-")[0]]
                marker = "s" if condition.endswith("-fit") else "^" if condition == "counter-causal" else "o"
                size = 30 + 400 * r["pause_median_s"]
                x, y = r["delta_nll_last_turn"], r["fact_gain_kept"]
                (x_low, x_high), (y_low, y_high) = interval(r["nll_ci"]), interval(r["gain_ci"])
                xerr, yerr = [[max(x - x_low, 0)], [max(x_high - x, 0)]], [[max(y - y_low, 0)], [max(y_high - y, 0)]]
                ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt="none", color=color, alpha=0.35, linewidth=1)
                ax.scatter(x, y, s=size, color=color, marker=marker, alpha=0.7)
                ax.annotate(
                    condition,
                    (r["delta_nll_last_turn"], r["fact_gain_kept"]),
                    fontsize=7,
                    xytext=(4, 3),
                    textcoords="offset points",
                )
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_xlabel("last-turn ΔNLL vs uncompacted (nats/token, lower is better)")
            ax.set_ylabel("share of the full trace's fact gain kept")
            ax.set_title(f"{trace_set} traces, cap {cap} (bars: 95% intervals; area: median pause)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def finish(rows: list[dict], none: dict, caps: list[int], replies: int) -> None:
    summary = summary_of(rows, none, caps)
    columns = list(summary[0])
    print(table(summary, columns), flush=True)
    plot(summary, RESULTS / "seed_methods.png")
    traces = {s: list(dict.fromkeys(r["trace"] for r in rows if r["set"] == s)) for s in TRACE_SETS}
    out = {"caps": caps, "replies": replies, "traces": traces, "summary": summary, "rows": rows}
    out["no_trace"] = [list(k) + [v] for k, v in none.items()]
    print(f"saved {save('seed_methods', out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--caps", type=int, nargs="+", default=[8, 16, 4], help="cap = trace tokens / N")
    parser.add_argument("--sets", nargs="+", default=list(TRACE_SETS), choices=list(TRACE_SETS))
    parser.add_argument("--conditions", nargs="+", default=MEASURED, choices=MEASURED + FITTED + POOLS)
    parser.add_argument("--replies", type=int, default=1, help="free replies per trace and condition")
    parser.add_argument("--from-saved", action="store_true", help="only summarise the saved rows")
    parser.add_argument(
        "--update", action="store_true", help="add to the saved rows (replacing the same runs) instead of starting anew"
    )
    args = parser.parse_args()
    rows, none, caps = [], {}, args.caps
    if args.from_saved or args.update:
        saved = json.loads((RESULTS / "seed_methods.json").read_text())
        none = {(t, q): lp for t, q, lp in saved["no_trace"]}
        if args.from_saved:
            finish(saved["rows"], none, saved["caps"], saved["replies"])
            return
        redo = {(s, c, d) for s in args.sets for c in args.conditions for d in args.caps}
        rows = [r for r in saved["rows"] if (r["set"], r["condition"], r["divisor"]) not in redo]
        caps = list(dict.fromkeys(saved["caps"] + args.caps))
    engine = Engine.from_pretrained(BENCH_MODEL)  # the default 16-bit cache: equal slots are equal bytes
    for divisor in args.caps:  # cap by cap: a stopped run still compares every condition at the caps it did
        for trace_set in args.sets:
            for trace in load_traces(trace_set=trace_set):
                name = trace["name"]
                if (name, trace["facts"][0][0]) not in none:
                    none.update({(name, q): lp for (q, _), lp in zip(trace["facts"], no_trace_logprobs(engine, trace))})
                length = len(engine.session().renderer.render(trace["messages"]))
                runs = [c for c in args.conditions if c != "uncompacted"]
                if not any(r["trace"] == name and r["condition"] == "uncompacted" for r in rows):
                    runs.insert(0, "uncompacted")
                for condition in runs:
                    divided = 1 if condition == "uncompacted" else divisor
                    row = replay(engine, trace, condition, length // divided, args.replies)
                    print(
                        f"{trace_set:<8} 1/{divisor:<3} {name:<10} {condition:<16} NLL {row['nll_last_turn']:.3f}  "
                        f"pause max {max(row['pauses_s'], default=0):.2f} s  {row['seconds']:.0f} s",
                        flush=True,
                    )
                    rows.append({**row, "set": trace_set, "divisor": divided})
                    partial = {"caps": caps, "replies": args.replies, "rows": rows, "partial": True}
                    save("seed_methods", {**partial, "no_trace": [list(k) + [v] for k, v in none.items()]})
        finish(rows, none, [d for d in caps if any(r["divisor"] == d for r in rows)], args.replies)


if __name__ == "__main__":
    main()
