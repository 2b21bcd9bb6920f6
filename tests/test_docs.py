"""The docs a user reads stay true: the README's code runs, its test command is CI's, and the generated
benchmarks/README.md is what the results files generate."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def test_the_benchmarks_readme_is_what_the_results_generate():
    assert (ROOT / "benchmarks" / "README.md").read_text() == report.render(), (
        "benchmarks/README.md is stale: run python -m benchmarks.report --write"
    )


def test_the_readme_is_short_and_no_doc_cites_a_commit():
    assert len(README.splitlines()) <= 300
    for path in [ROOT / "README.md", *ROOT.glob("docs/*.md"), ROOT / "benchmarks" / "README.md"]:
        assert not re.search(r"\bcommits? [0-9a-f]{7,40}\b", path.read_text()), path


def test_ci_runs_the_readmes_test_command():
    shown = README.split("<!-- test-command -->\n```bash\n", 1)[1].split("\n", 1)[0]
    extracted = subprocess.run(
        ["awk", "/<!-- test-command -->/{getline; getline; print; exit}", "README.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert extracted == shown and "pytest" in shown


@pytest.mark.coder_model  # the snippets load "default": the coder model
@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", README))))
def test_a_python_snippet_of_the_readme_runs(index):
    code = re.findall(r"```python\n(.*?)```", README, flags=re.S)[index]
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def test_the_readmes_results_table_is_what_the_results_generate():
    from benchmarks.report.readme import with_results

    assert README == with_results(README), "README.md's results table is stale: run python -m benchmarks.report --write"
