"""Sections of ``benchmarks/README.md`` on serving: saved sessions, the server and its soak run."""

from __future__ import annotations

from benchmarks.report.tables import formats_of, md, on_cpu


def persistence_section(d: dict) -> str:
    rows = [
        [
            f"{r['logical_tokens']:,}",
            r["slots"],
            f"{r['file_mb']:.0f}",
            f"{r['save_s']:.2f}",
            f"{r['load_s']:.2f}",
            f"{r['rebuild_s']:.1f}",
            f"{r['load_vs_rebuild']:.0f}×",
            "yes" if r["identical_logits"] else "no",
        ]
        for r in d["rows"]
    ]
    columns = ["logical tokens", "slots", "file MB", "save s", "load s", "re-prefill s", "load speed-up", "same logits"]
    return (
        f"**Saved sessions** (`python -m benchmarks.persistence`{formats_of(d)}{on_cpu(d)}): a session under a "
        f"{d['cap']}-slot cap, saved with `session.save`, loaded with `engine.load_session` (medians of 3), "
        "against rebuilding it by re-prefilling its transcript under the same policy.\n\n" + md(rows, columns)
    )


def serve_section(d: dict) -> str:
    rows = [
        [r["mode"], r["turns"], f"{r['prefilled_tokens']:,}", f"{r['median_turn_s']:.2f}", f"{r['total_s']:.1f}"]
        for r in d["summary"]
    ]
    restore = d["restore"]
    return (
        f"**Serving** (`python -m benchmarks.serve`): the `{d['trace']}` agent trace sent turn by turn to a live "
        "`kvmemory serve` through the `openai` client, with an `x-session-id` (the cache stays resident) and "
        "without (every turn re-prefills the history, as a server without session affinity does).\n\n"
        + md(rows, ["mode", "turns", "prefilled tokens", "median turn s", "total s"])
        + f"\n\nRestoring the finished session ({restore['logical_tokens']:,} tokens) from its file over HTTP: "
        f"{restore['restore_s']:.2f} s, against {restore['reprefill_s']:.1f} s to re-prefill it "
        f"({restore['speedup']:.0f}×)."
    )


def serve_soak_section(d: dict) -> str:
    s, settings = d["summary"], d["settings"]
    return (
        f"**Soak of `kvmemory serve`** (`python -m benchmarks.serve_soak`{on_cpu(d)}): {settings['clients']} "
        f"clients on {settings['keys']} API keys for {settings['minutes']:g} minutes on `{d['model']}`, each "
        "continuing a conversation in one of the three dialects, with clients that go away mid-stream and "
        "mid-turn, bodies over the size limit and fuzzed requests mixed in: "
        f"{s['requests']:,} answered requests, {s['status_5xx']} with a 5xx, {s['hung']} hung, "
        f"{s['lost_sessions']} continuing conversations that lost their session, {s['corrupted_sessions']} "
        f"sessions that shrank; peak server memory {s['peak_rss_bytes'] / 2**20:.0f} MiB, peak disk "
        f"{s['peak_disk_bytes'] / 2**20:.0f} MiB; SIGTERM stopped it in {s['sigterm_stop_s']:.1f} s. "
        "![soak](results/serve_soak.png)"
    )


def context_management_section(d: dict) -> str:
    columns = [
        "condition",
        "facts answered after",
        "compaction turn s",
        "of a full re-prefill",
        "tokens prefilled",
        "slots held",
    ]
    rows = [
        [
            s["condition"],
            f"{s['facts_answered']} of {s['facts']}",
            f"{s['compaction_s']:.1f}",
            f"{s['cost_vs_reprefill']:.1%}",
            s["compaction_prefill"],
            s["held_slots"],
        ]
        for s in d["summary"]
    ]
    refused = sorted({r["trace"] for r in d["rows"] if "refused" in r})
    note = (
        f" At the summary's bytes the protected prompt did not fit for {', '.join(refused)} (refused with a 400)."
        if refused
        else ""
    )
    return (
        f"**A client's compaction** (`python -m benchmarks.context_management`, {d['model']}{on_cpu(d)}): agent "
        "traces sent to `kvmemory serve` through the `openai` client, then compacted: `POST /v1/responses/compact` "
        "on the resident session (latent; its compaction item sent back in place of the history), or the history "
        f"with a summarise prompt and a new conversation from the summary (up to {d['summary_tokens']} tokens), as "
        "Codex and Claude Code do; then every fact the trace read once, early, asked (greedy, exact match). The "
        "compaction turn is timed against re-prefilling the whole history in a fresh session."
        + note
        + "\n\n"
        + md(rows, columns)
    )
