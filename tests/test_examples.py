"""The examples and both command lines, run as a user runs them (``python -m ...`` in a fresh process, short
settings), so the README's commands and snippets cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from kvmemory.runtime.named_models import SMALL_MODEL
from tests.conftest import wait_until

ROOT = Path(__file__).parents[1]
SMALL = {**os.environ, "KVMEMORY_DEFAULT_MODEL": SMALL_MODEL}  # "default" names the small model: quick runs


def run(*argv: str, timeout: float = 600, env: dict | None = SMALL) -> str:
    """Run a command from the repository root (on the small model unless ``env`` says otherwise); its output
    (stdout and stderr), failing on a non-zero exit."""
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


@pytest.mark.small_model
@pytest.mark.parametrize(
    "example, argv, expected",
    [
        ("async_api", [], r"second turn prefilled \d+ new tokens of \d+"),
        ("custom_policy", [], r"rule test-logs .* slots"),
        ("create_agent_middleware", [], r"kvmemory: \{'logical_tokens': \d+"),
        ("stategraph_compaction", [], r"kvmemory: \{'logical_tokens': \d+"),
        ("demo", ["--steps", "2", "--cap", "512", "--reply-tokens", "4", "--map", "{tmp}/map.png"], r"peak KV bytes"),
    ],
)
def test_an_example_runs_to_the_end(example, argv, expected, tmp_path):
    output = run(sys.executable, "-m", f"examples.{example}", *[a.format(tmp=tmp_path) for a in argv])
    assert re.search(expected, output), output[-3000:]


@pytest.mark.coder_model
def test_the_demo_runs_on_the_default_coder_model(tmp_path):
    """The README's demo command on the model it names (a short session: the full one takes minutes)."""
    argv = ["--steps", "3", "--cap", "1024", "--reply-tokens", "8", "--map", f"{tmp_path}/map.png"]
    output = run(sys.executable, "-m", "examples.demo", *argv, "--results", f"{tmp_path}/demo.json", env=None)
    assert "model: Qwen2.5-Coder-0.5B-Instruct" in output and "peak KV bytes" in output, output[-3000:]
    assert '"questions": 5' in (tmp_path / "demo.json").read_text()


@pytest.mark.coder_model
@pytest.mark.sandbox
def test_the_agent_calls_a_workspace_tool_in_the_coder_models_own_format():
    output = run("kvmemory-agent", "--sample", "--max-steps", "1", "--max-new-tokens", "64", env=None)
    assert re.search(r"→ (list_files|read_file|grep|run_command)\(", output), output[-3000:]


@pytest.mark.small_model
@pytest.mark.sandbox
def test_the_agent_command_line_and_its_example_run_on_the_sample_project(tmp_path):
    import json

    short = ["--max-steps", "1", "--max-new-tokens", "8"]
    output = run("kvmemory-agent", "--sample", *short, "--record", f"{tmp_path}/run.json")
    assert "workspace:" in output and "after the agent, pytest -q:" in output
    recorded = json.loads((tmp_path / "run.json").read_text())
    assert recorded["model"] == "SmolLM2-135M-Instruct" and recorded["tests_pass"] is False and recorded["steps"]
    assert recorded["model_calls"] == 1  # --max-steps counts model calls (the graph's nodes are more)
    assert "workspace:" in run(sys.executable, "-m", "examples.coding_agent_under_cap", *short)


@pytest.mark.small_model
def test_the_server_command_line_serves_the_openai_client_example():
    server = subprocess.Popen(
        ["kvmemory", "serve", "--port", "0"], cwd=ROOT, stderr=subprocess.PIPE, text=True, env=SMALL
    )
    try:
        url = read_server_url(server)
        wait_until(lambda: answers(f"{url}/v1/models"), timeout=300, what="the server to load its model")
        output = run(sys.executable, "-m", "examples.chat_openai_client", "--base-url", f"{url}/v1")
        assert re.search(r"\(\d+ of \d+ prompt tokens were cached\)", output), output
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.parametrize(
    ("example", "argv", "says"),
    [
        (
            "chat_openai_client",
            ["--base-url", "http://127.0.0.1:9/v1"],
            "no server at http://127.0.0.1:9/v1: start one",
        ),
        ("claude_code", ["--bin-dir", "/nonexistent/node_modules/.bin"], "npm install --prefix /nonexistent"),
    ],
)
def test_an_example_that_needs_something_missing_says_what_in_one_line(example, argv, says):
    done = subprocess.run(
        [sys.executable, "-m", f"examples.{example}", *argv], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode != 0 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status == 200
    except OSError:  # refused, or 503 while the model loads
        return False


def read_server_url(server: subprocess.Popen, timeout: float = 300) -> str:
    """The address uvicorn says it serves on, read from its log (a port of the kernel's choosing)."""
    found, said = [], threading.Event()

    def scan():  # reads to the end, so the server never blocks on a full pipe
        for line in server.stderr:
            if not found and (match := re.search(r"running on (http://\S+)", line)):
                found.append(match.group(1))
                said.set()
        said.set()  # the server exited

    threading.Thread(target=scan, daemon=True).start()
    assert said.wait(timeout) and found, f"the server did not start (exit code {server.poll()})"
    return found[0]


def test_the_command_lines_help_loads_no_model_code_and_the_server_no_langchain():
    check = (
        "import sys; import kvmemory.integrations.cli; assert 'torch' not in sys.modules, 'the CLI imported torch'; "
        "import kvmemory.integrations.server; "
        "langchain = [m for m in sys.modules if m.startswith(('langchain', 'langgraph'))]; "
        "assert not langchain, 'the server imported LangChain'"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "serve" in run("kvmemory", "--help")
