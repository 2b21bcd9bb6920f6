"""A sandboxed workspace for the coding agent: file tools and commands confined to one directory.

Paths are resolved (symlinks included) and must stay inside the workspace. Commands run without a
shell, from an allow-list of programs, with a time-out, a minimal environment and an output cap; any
argument that names a path outside the workspace is refused. This guards against accidents and model
mistakes; it is not an OS-level security boundary (run untrusted agents in a container as well).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from langchain_core.tools import StructuredTool, ToolException

ALLOWED_PROGRAMS = {"python", "python3", "pytest", "ls", "cat", "head", "tail", "grep", "wc", "find", "diff", "echo", "sort"}
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".venv", "node_modules"}


class SandboxError(ToolException):
    """A tool call that would leave the workspace or break its limits."""


class Workspace:
    def __init__(self, root: str | Path, command_timeout: float = 60.0, max_output_chars: int = 12_000):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise SandboxError(f"workspace {self.root} is not a directory")
        self.command_timeout = command_timeout
        self.max_output_chars = max_output_chars

    # ---- guards ----------------------------------------------------------------------------------
    def resolve(self, path: str) -> Path:
        target = (self.root / path).resolve()
        if target != self.root and self.root not in target.parents:
            raise SandboxError(f"path {path!r} is outside the workspace")
        return target

    def _cap(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        half = self.max_output_chars // 2
        return f"{text[:half]}\n... [{len(text) - self.max_output_chars} characters cut] ...\n{text[-half:]}"

    # ---- tools -----------------------------------------------------------------------------------
    def list_files(self, path: str = ".") -> str:
        """List the files under a directory of the workspace, recursively."""
        base = self.resolve(path)
        files = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(filenames):
                files.append(str((Path(dirpath) / name).relative_to(self.root)))
        return "\n".join(files) or "(no files)"

    def read_file(self, path: str, start_line: int = 1, max_lines: int = 400) -> str:
        """Read a text file of the workspace, with line numbers."""
        target = self.resolve(path)
        if not target.is_file():
            raise SandboxError(f"no such file: {path}")
        lines = target.read_text(errors="replace").splitlines()
        chunk = lines[start_line - 1 : start_line - 1 + max_lines]
        body = "\n".join(f"{i:4d}  {line}" for i, line in enumerate(chunk, start_line))
        more = f"\n... ({len(lines) - start_line + 1 - len(chunk)} more lines)" if len(lines) >= start_line + max_lines else ""
        return self._cap(f"{path}:\n{body}{more}")

    def grep(self, pattern: str, path: str = ".") -> str:
        """Search the workspace's text files for a regular expression; returns file:line: text."""
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise SandboxError(f"invalid regular expression {pattern!r}: {err}") from err
        base = self.resolve(path)
        hits = []
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file() and not SKIP_DIRS & set(p.parts))
        for file in files:
            try:
                for n, line in enumerate(file.read_text().splitlines(), 1):
                    if regex.search(line):
                        hits.append(f"{file.relative_to(self.root)}:{n}: {line.strip()}")
            except UnicodeDecodeError:
                continue
        return self._cap("\n".join(hits) or "no matches")

    def write_file(self, path: str, content: str) -> str:
        """Create or overwrite a file of the workspace."""
        target = self.resolve(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        return f"wrote {len(content)} characters to {path}"

    def patch_file(self, path: str, old: str, new: str) -> str:
        """Replace one exact occurrence of ``old`` with ``new`` in a file."""
        target = self.resolve(path)
        if not target.is_file():
            raise SandboxError(f"no such file: {path}")
        text = target.read_text()
        count = text.count(old)
        if count != 1:
            raise SandboxError(f"expected exactly one occurrence of the old text in {path}, found {count}")
        target.write_text(text.replace(old, new, 1))
        return f"patched {path}"

    def run_command(self, command: str) -> str:
        """Run a command (no shell) in the workspace; returns exit code and output."""
        try:
            argv = shlex.split(command)
        except ValueError as err:
            raise SandboxError(f"cannot parse command: {err}") from err
        if not argv:
            raise SandboxError("empty command")
        program = Path(argv[0]).name
        if program not in ALLOWED_PROGRAMS:
            raise SandboxError(f"program {argv[0]!r} is not allowed; allowed: {', '.join(sorted(ALLOWED_PROGRAMS))}")
        if program.startswith("python") and any(a in ("-c", "-m") and i + 1 < len(argv) and argv[i + 1] not in ("pytest", "unittest") for i, a in enumerate(argv[1:], 1)):
            raise SandboxError("python may only run files of the workspace or -m pytest / -m unittest")
        for arg in argv[1:]:
            if arg.startswith("-"):
                continue
            if arg.startswith("/") or ".." in Path(arg).parts or arg.startswith("~"):
                self.resolve(arg)  # raises when the path leaves the workspace
        if program in ("python", "python3"):
            argv[0] = sys.executable
        elif program == "pytest":
            argv = [sys.executable, "-m", "pytest", *argv[1:]]
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.root), "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
        try:
            done = subprocess.run(argv, cwd=self.root, env=env, capture_output=True, text=True, timeout=self.command_timeout)
        except subprocess.TimeoutExpired:
            return f"$ {command}\n[timed out after {self.command_timeout:.0f} s]"
        output = (done.stdout + done.stderr).replace(str(self.root), ".")
        return self._cap(f"$ {command}\n[exit code {done.returncode}]\n{output}")

    # ---- LangChain tools -------------------------------------------------------------------------
    def tools(self) -> list[StructuredTool]:
        """The workspace operations as LangChain tools, each with the kvmemory policy its output deserves."""
        from integrations.middleware import kv_policy

        policies = {"list_files": {"ratio": 6}, "read_file": {"ratio": 4}, "grep": {"ratio": 6}, "write_file": {"ratio": 2},
                    "patch_file": {"ratio": 2}, "run_command": {"ratio": 12}}
        out = []
        for name, rule in policies.items():
            fn = getattr(self, name)
            tool = StructuredTool.from_function(fn, name=name, description=fn.__doc__, handle_tool_error=_tool_error)
            out.append(kv_policy(**rule)(tool))
        return out


def _tool_error(err: Exception) -> str:
    return f"error: {err}"
