"""What ``pip install kvmemory`` puts in site-packages: everything under ``kvmemory`` (the repository's
``integrations/`` and ``agents/`` become ``kvmemory.integrations`` and ``kvmemory.agents``, so the OpenAI Agents
SDK keeps its ``agents``), a core of the engine and the memory, and each optional part refused in one line
naming its extra when that extra is not installed."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def installed_name(folder: Path) -> str:
    """The import name a package folder of the repository installs as (pyproject's package-dir)."""
    relative = folder.relative_to(ROOT).as_posix()
    for name, source in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        if relative == source or relative.startswith(source + "/"):
            return name + relative[len(source) :].replace("/", ".")
    return relative.replace("/", ".")


def test_the_package_list_names_every_package_folder():
    folders = [
        init.parent for top in ("kvmemory", "integrations", "agents") for init in (ROOT / top).rglob("__init__.py")
    ]
    assert sorted(PYPROJECT["tool"]["setuptools"]["packages"]) == sorted(installed_name(f) for f in folders)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
        str(ROOT),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return next(out.glob("kvmemory-*.whl"))


def test_the_wheel_installs_only_under_kvmemory_with_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"kvmemory", wheel.name.split("-py")[0] + ".dist-info"}
    for needed in ("runtime/head_profiles/Qwen2.5-Coder-0.5B-Instruct.json", "kernels/simd.h"):
        assert f"kvmemory/{needed}" in names
    assert "kvmemory/agents/coding_agent/recorded_tool_outputs.json" in names
    assert not any(name.startswith(("kvmemory/examples", "kvmemory/benchmarks", "kvmemory/tests")) for name in names)


def test_the_core_requires_neither_test_tools_nor_plotting_nor_langchain(wheel):
    metadata = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-py')[0]}.dist-info/METADATA").decode()
    core = [
        line.split()[1] for line in metadata.splitlines() if line.startswith("Requires-Dist") and "extra ==" not in line
    ]
    assert "torch>=2.4" in core
    for optional in ("pytest", "matplotlib", "langchain", "langgraph", "fastapi", "uvicorn", "ray"):
        assert not any(requirement.startswith(optional) for requirement in core), optional


def test_a_bare_install_names_the_extra_each_command_needs(wheel, tmp_path):
    """The wheel alone, in a venv without site-packages: the commands answer ``--help`` (no torch needed) and
    refuse what needs an extra in one line, exit code 2."""
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    bin_ = tmp_path / "venv" / "bin"
    install = [str(bin_ / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, capture_output=True)

    def command(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_ / argv[0]), *argv[1:]], capture_output=True, text=True, cwd=tmp_path)

    assert "serve" in command("kvmemory", "--help").stdout
    assert "--sample" in command("kvmemory-agent", "--help").stdout
    for argv, message in [
        (("kvmemory", "serve", "--model", "x"), "kvmemory serve needs fastapi, uvicorn: pip install 'kvmemory[serve]'"),
        (("kvmemory", "serve", "--ray", "--model", "x"), "pip install 'kvmemory[ray]'"),
        (("kvmemory-agent", "--sample"), "pip install 'kvmemory[agent]'"),
    ]:
        done = command(*argv)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    done = command("python", "-c", "from kvmemory.integrations import ChatKVMemory")
    assert "ChatKVMemory needs langchain_core, langchain, langgraph: pip install 'kvmemory[langchain]'" in done.stderr
