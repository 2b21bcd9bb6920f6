"""What every section of the generated READMEs shares: reading a results file, Markdown tables, the machine."""

from __future__ import annotations

import json

from benchmarks.common import RESULTS


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def md(rows: list[list], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def on_cpu(d: dict) -> str:
    """ ", on <CPU> (<its vector extensions>)" when the file names them."""
    m = d.get("machine", {})
    if not m.get("cpu_model"):
        return ""
    return f", on {m['threads']} threads of an {m['cpu_model']} ({', '.join(m['cpu_flags'])})"


def formats_of(d: dict) -> str:
    """ ", <weights> weights, <dtype> cache" when the file records them (runs before they were recorded: fp32)."""
    return f", {d['weights']} weights, {d['kv_dtype']} cache" if "kv_dtype" in d else ""


NLL_COLUMN = "max Δ NLL (full cache)"


def beside_fp32(row: dict) -> list[str]:
    """A weight or cache format's NLL change and method order cells (``benchmarks.quality.beside_the_first``)."""
    return [f"{row['max_full_nll_change']:.4f}", "yes" if row["same_method_order"] else "no"]
