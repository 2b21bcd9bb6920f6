"""Real text of several kinds for the benchmarks, frozen under ``benchmarks/data`` so that no result changes
with installed package versions or with this project's own later edits.

* source: this project's own Python source (``kvmemory/``), as of the freeze;
* logs: genuine pytest output (verbose, long tracebacks, captured logging) of a suite of varied failures;
* prose: this project's own documentation (README and docstrings);
* reasoning: worked multi-step arithmetic solutions whose every number is computed (generated, deterministic).
The ``make_*`` functions are how the frozen files were made: ``python -m benchmarks.texts`` writes them anew.
Facts can be planted at chosen depths to probe retrieval after compaction.
"""

from __future__ import annotations

import ast
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"


def make_source_text() -> str:
    """This project's own Python source (the ``kvmemory`` package), file by file."""
    paths = sorted((REPO / "kvmemory").rglob("*.py"))
    return "\n".join(f"# file: {p.relative_to(REPO).as_posix()}\n{p.read_text()}" for p in paths)


def make_prose_text() -> str:
    """This project's own prose: the README, then the docstrings of its modules, classes and functions, each
    paragraph once (a paragraph repeated verbatim would turn the continuation into a copy task)."""
    parts, seen = [], set()
    sources = [("README", (REPO / "README.md").read_text())]
    for path in sorted(REPO.glob("*/**/*.py")):
        if path.relative_to(REPO).parts[0] in ("kvmemory", "integrations", "agents", "examples", "benchmarks"):
            tree = ast.parse(path.read_text())
            docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, DOCUMENTED))
            sources.append((path.name, "\n\n".join(d for d in docs if d)))
    for _, text in sources:
        for paragraph in text.split("\n\n"):
            key = " ".join(paragraph.split())
            if len(key) > 80 and key not in seen:
                seen.add(key)
                parts.append(paragraph.strip("\n"))
    return "\n\n".join(parts)


DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


DIAGNOSTICS_TESTS = """
import base64, configparser, csv, datetime, decimal, fractions, io, ipaddress, json, logging, pathlib, re
import shlex, sqlite3, statistics, struct, subprocess, sys, tarfile, uuid, zipfile
import pytest

log = logging.getLogger("diagnostics")


def load_settings(text):
    log.info("parsing %d bytes of settings", len(text))
    return json.loads(text)


def test_settings_json():
    assert load_settings('{"retries": 3, "hosts": ["a", "b"],}')["retries"] == 3


@pytest.mark.parametrize("raw", ["12", "0x1f", "7.5", "-3", "1_000"])
def test_parse_quantity(raw):
    log.debug("quantity %r", raw)
    assert int(raw) >= 0


def test_release_date():
    stamp = datetime.datetime.strptime("2026-13-02 10:00", "%Y-%m-%d %H:%M")
    assert stamp.year == 2026


def test_invoice_rounding():
    total = sum(decimal.Decimal(p) for p in ("19.99", "5.01", "0.333"))
    assert total.quantize(decimal.Decimal("0.01")) == decimal.Decimal("25.32")


def test_ratio():
    assert fractions.Fraction(3, 0) < 1


def test_version_pattern():
    assert re.compile(r"v(\\d+)\\.(\\d+")


def test_read_manifest(tmp_path):
    log.warning("manifest missing under %s", tmp_path.name)
    assert pathlib.Path(tmp_path, "MANIFEST.in").read_text()


def test_subprocess_exit_code():
    subprocess.run([sys.executable, "-c", "import sys; print('building wheel'); sys.exit(3)"], check=True,
                   capture_output=True)


def test_inventory_csv():
    rows = list(csv.DictReader(io.StringIO("sku,qty\\nWX-1,4\\nBT-9,x\\n")))
    assert sum(int(r["qty"]) for r in rows) == 4


def test_config_section():
    parser = configparser.ConfigParser()
    parser.read_string("[server]\\nport = 8080\\n")
    assert parser.getint("database", "port") == 5432


@pytest.mark.parametrize("address", ["10.0.0.256", "192.168.1.10", "fe80::1::2"])
def test_allowed_address(address):
    assert ipaddress.ip_address(address).is_private


def test_token_decoding():
    assert base64.b64decode("c2VjcmV0LXRva2Vu=", validate=True) == b"secret-token"


def test_archive_listing(tmp_path):
    broken = tmp_path / "build.zip"
    broken.write_bytes(b"PK\\x03\\x04 not really a zip")
    assert zipfile.ZipFile(broken).namelist()


def test_tarball(tmp_path):
    path = tmp_path / "release.tar.gz"
    path.write_bytes(b"\\x1f\\x8b garbage")
    with tarfile.open(path) as tar:
        assert tar.getnames()


def test_header_unpack():
    magic, version = struct.unpack("<IH", b"\\x7fELF\\x02")
    assert version == 2


def test_command_line_split():
    assert shlex.split("deploy --tag 'release 4.2") == ["deploy", "--tag", "release 4.2"]


def test_latency_stats():
    samples = [s for s in (12.5, 40.1, 9.8) if s > 100]
    assert statistics.mean(samples) < 50


def test_migration_query():
    db = sqlite3.connect(":memory:")
    db.execute("create table orders (id integer primary key, sku text, qty integer)")
    db.execute("insert into orders (sku, qty, price) values ('WX-1', 2, 9.5)")


def test_request_id():
    assert uuid.UUID("7d444840-9dc0-11d1-b245-5ffdce74fad2x").version == 1


def test_utf8_upload():
    assert b"caf\\xe9 r\\xe9sum\\xe9".decode("utf-8") == "café résumé"


def test_report_totals():
    expected = {"widgets": 120, "bolts": 75, "nuts": 300, "washers": 40, "status": "complete"}
    actual = {"widgets": 120, "bolts": 57, "nuts": 300, "washers": 44, "status": "partial"}
    assert actual == expected


def test_sorted_skus():
    assert sorted(["BT-0090", "WX-4471", "AA-0001", "ZZ-9999"]) == ["AA-0001", "BT-0090", "ZZ-9999", "WX-4471"]


def test_banner():
    assert "Inventory service v4.2 (build 1187) ready on port 8080" == "Inventory service v4.2 (build 1178) ready on port 8000"


def test_retry_budget():
    log.error("upstream timed out after %d attempts", 5)
    attempts = {"east": 3, "west": 5}
    assert attempts["north"] <= 5


def test_missing_attribute():
    class Client:
        base_url = "https://api.internal"

    assert Client().timeout_seconds == 30


def test_merge_type():
    assert sum([[1, 2], [3]], 0) == [1, 2, 3]
"""


def make_log_text(min_chars: int = 200_000) -> str:
    """Genuine pytest output: a suite of varied failures through real standard-library code (JSON, dates,
    decimals, archives, SQL, subprocesses, assertion diffs, captured logging), with long tracebacks.
    Each run uses other flags, so the text reads like an agent's session rather than one log repeated."""
    runs = [
        ["-v", "--tb=long", "-rA", "--log-level=DEBUG"],
        ["-q", "--tb=short", "-rfE", "-p", "no:randomly"],
        ["-vv", "--tb=native"],
        ["-v", "--tb=auto", "-l"],
    ]
    parts, total = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "test_diagnostics.py").write_text(DIAGNOSTICS_TESTS)
        for args in runs:
            out = subprocess.run(
                [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "test_diagnostics.py"],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=300,
            ).stdout
            out = out.replace(tmp, "/workspace")
            parts.append(f"$ python -m pytest {' '.join(args)} test_diagnostics.py\n{out}")
            total += len(out)
            if total >= min_chars:
                break
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


def frozen_text(kind: str, min_chars: int) -> str:
    """The frozen text of ``kind`` (a file under ``benchmarks/data``), so results never depend on what is
    installed; refuses a request for more text than the file holds rather than measuring on less."""
    text = (DATA / f"{kind}.txt").read_text()
    if len(text) < min_chars:
        raise ValueError(f"benchmarks/data/{kind}.txt holds {len(text)} characters, {min_chars} were asked for")
    return text


def source_text(min_chars: int) -> str:
    return frozen_text("source", min_chars)


def log_text(min_chars: int) -> str:
    return frozen_text("logs", min_chars)


def prose_text(min_chars: int) -> str:
    return frozen_text("prose", min_chars)


TEXT_KINDS = {"source": source_text, "logs": log_text, "prose": prose_text, "reasoning": reasoning_text}


def plant_facts(text: str, facts: list[str], seed: int = 0) -> str:
    """Insert each fact as its own line at spread-out depths (between existing lines)."""
    lines = text.split("\n")
    rng = random.Random(seed)
    depths = sorted(rng.uniform(0.1, 0.8) for _ in facts)
    for offset, (depth, fact) in enumerate(zip(depths, facts)):
        lines.insert(int(depth * len(lines)) + offset, fact)
    return "\n".join(lines)


def freeze() -> None:
    """Write the frozen texts anew from this checkout and this machine (changes every benchmark number)."""
    DATA.mkdir(exist_ok=True)
    made = {"source": make_source_text(), "logs": make_log_text(), "prose": make_prose_text()}
    for kind, text in made.items():
        (DATA / f"{kind}.txt").write_text(text)
        print(f"benchmarks/data/{kind}.txt: {len(text):,} characters")


if __name__ == "__main__":
    freeze()
