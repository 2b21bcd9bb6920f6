"""Memory maps: slots per segment over a session's life, as a stacked-area PNG."""

from __future__ import annotations

from pathlib import Path

from kvmemory.extras import require

KIND_COLORS = {
    "system": "#4c72b0",
    "user": "#55a868",
    "assistant": "#8172b2",
    "reasoning": "#ccb974",
    "tool_call": "#64b5cd",
    "tool_output": "#c44e52",
    "tool_schema": "#4c72b0",
    "recall": "#da8bc3",
    "text": "#8c8c8c",
}


def plot_memory_map(timeline: list[dict], segments, path, cap: int | None = None, title: str = "KV memory map"):
    """Stacked slots per segment (coloured by kind) at every recorded event; the cap as a line. ``path``: a
    file path (its folder is created) or a binary file object; the PNG is written there and ``path`` returned."""
    require("plot", "a memory map picture")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = {s.id: s.kind for s in segments}
    ids = sorted({i for entry in timeline for i in entry["segments"]})
    x = [entry["logical"] for entry in timeline]
    ys = [[entry["segments"].get(i, 0.0) for entry in timeline] for i in ids]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.stackplot(
        x, ys, colors=[KIND_COLORS.get(kinds.get(i, "text"), "#8c8c8c") for i in ids], linewidth=0.2, edgecolor="white"
    )
    ax.plot(x, x, color="gray", linestyle=":", linewidth=1, label="uncompacted (one slot per token)")
    if cap:
        ax.axhline(cap, color="black", linestyle="--", linewidth=1, label=f"cap ({cap} slots)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in KIND_COLORS.items() if k in set(kinds.values())]
    labels = [k for k in KIND_COLORS if k in set(kinds.values())]
    line_handles, line_labels = ax.get_legend_handles_labels()
    ax.legend(handles + line_handles, labels + line_labels, fontsize=8, loc="upper left")
    ax.set_xlabel("tokens seen (logical length)")
    ax.set_ylabel("slots per head")
    ax.set_ylim(0, max(max(e["physical"] for e in timeline) * 1.3, cap or 0) if timeline else 1)
    ax.set_title(title)
    fig.tight_layout()
    if isinstance(path, (str, Path)):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path
