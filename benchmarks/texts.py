"""Real text of several kinds for the quality benchmarks, made on this machine at run time.

* source: the installed transformers package's Python files;
* logs: genuine pytest output (verbose, long tracebacks) from running the sample project's failing tests;
* prose: Python standard-library module documentation;
* reasoning: worked multi-step arithmetic solutions whose every number is computed.
Facts can be planted at chosen depths to probe retrieval after compaction.
"""

from __future__ import annotations

import importlib
import inspect
import random
import subprocess
import sys
import tempfile

from agents.coding_agent.sample_project import create_sample_project
from benchmarks.common import source_text

PROSE_MODULES = (
    "json", "re", "os", "pathlib", "argparse", "subprocess", "logging", "collections", "typing", "asyncio",
    "functools", "itertools", "dataclasses", "contextlib", "unittest", "email", "http.client", "sqlite3",
    "threading", "socket", "csv", "zipfile", "tarfile", "shutil", "tempfile", "textwrap", "string", "decimal",
)


def prose_text(min_chars: int) -> str:
    parts, total = [], 0
    for name in PROSE_MODULES:
        mod = importlib.import_module(name)
        for obj in [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")][:40]:
            doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj) else None
            if doc and len(doc) > 200:
                parts.append(doc)
                total += len(doc)
        if total >= min_chars:
            break
    return "\n\n".join(parts)


def log_text(min_chars: int) -> str:
    """Output of real pytest runs over the sample project (failing tests with tracebacks)."""
    runs = [["-v", "--tb=long"], ["-vv", "--tb=long", "-rA"], ["--tb=short", "-rA"], ["-v", "--tb=native"], ["-q", "--tb=line"]]
    parts, total = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        root = create_sample_project(tmp)
        i = 0
        while total < min_chars:
            args = runs[i % len(runs)]
            out = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider"], cwd=root,
                                 capture_output=True, text=True, timeout=120).stdout
            out = out.replace(str(root), "/workspace")
            parts.append(f"$ python -m pytest {' '.join(args)}\n{out}")
            total += len(out)
            i += 1
    return "\n".join(parts)


def reasoning_text(min_chars: int, seed: int = 0) -> str:
    """Step-by-step solutions of generated word problems; each step's result is computed, not invented."""
    rng = random.Random(seed)
    parts, total, n = [], 0, 0
    while total < min_chars:
        n += 1
        crates, per, broken, price = rng.randint(12, 90), rng.randint(6, 48), rng.randint(3, 40), rng.randint(2, 19)
        shipped = crates * per
        good = shipped - broken
        revenue = good * price
        fee = revenue // 10
        text = (
            f"Problem {n}. A warehouse receives {crates} crates with {per} jars each. {broken} jars arrive broken. "
            f"Each intact jar sells for {price} euros and the platform keeps 10% (rounded down).\n\n"
            f"Let me think step by step. First the total number of jars: {crates} × {per} = {shipped}.\n\n"
            f"Next remove the broken ones: {shipped} − {broken} = {good} intact jars.\n\n"
            f"Revenue before fees: {good} × {price} = {revenue} euros.\n\n"
            f"Wait, the fee is 10% rounded down, so the fee is {revenue} // 10 = {fee} euros.\n\n"
            f"So the warehouse keeps {revenue} − {fee} = {revenue - fee} euros. The answer is {revenue - fee}.\n\n"
        )
        parts.append(text)
        total += len(text)
    return "".join(parts)


TEXT_KINDS = {"source": source_text, "logs": log_text, "prose": prose_text, "reasoning": reasoning_text}


def plant_facts(text: str, facts: list[str], seed: int = 0) -> str:
    """Insert each fact as its own line at spread-out depths (between existing lines)."""
    lines = text.split("\n")
    rng = random.Random(seed)
    depths = sorted(rng.uniform(0.1, 0.8) for _ in facts)
    for offset, (depth, fact) in enumerate(zip(depths, facts)):
        lines.insert(int(depth * len(lines)) + offset, fact)
    return "\n".join(lines)

