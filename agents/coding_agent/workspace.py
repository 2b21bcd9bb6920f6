"""The coding agent's workspace: file tools confined to one directory, commands behind an OS-level boundary.

File tools resolve every path (symlinks included) and refuse anything outside the workspace; they never
follow a link out, and binary files get a clear message. Commands come from an allow-list, run without a
shell inside a bubblewrap sandbox (``kvmemory.agents.coding_agent.sandbox``: only the workspace visible and
writable, no network, CPU/memory/output limits, the whole process tree killed at the time-out). The
text search runs there too, with its own time limit.
"""

from __future__ import annotations

import os
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Annotated

from langchain_core.tools import StructuredTool
from pydantic import Field

from kvmemory.agents.coding_agent.sandbox import Limits, Sandbox, SandboxError, SandboxUnavailableError

ALLOWED_PROGRAMS = {
    "python",
    "python3",
    "pytest",
    "ls",
    "cat",
    "head",
    "tail",
    "grep",
    "wc",
    "find",
    "diff",
    "echo",
    "sort",
}
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".venv", "node_modules"}
GREP_SECONDS = 10.0

__all__ = ["SandboxError", "SandboxUnavailableError", "Workspace"]


MAX_ARGUMENT_CHARS = 200  # a command or a pattern: a small model's otherwise runs on to the reply's token limit
MAX_PATCH_CHARS = 600  # a patch's old or new text: a few lines
MAX_PATH_CHOICES = 64  # a workspace with more files than this names them in no schema (the prompt would swell)
MAX_LINE_CHOICES = 400  # the lines patch_file's old text is chosen from, where the files read have no more


class Workspace:
    def __init__(self, root: str | Path, command_timeout: float = 60.0, max_output_chars: int = 12_000):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise SandboxError(f"workspace {self.root} is not a directory")
        self.command_timeout = command_timeout
        self.max_output_chars = max_output_chars
        self.sandbox = Sandbox(
            self.root, Limits(wall_seconds=command_timeout, cpu_seconds=max(1, int(command_timeout)))
        )
        self._grep_sandbox = Sandbox(self.root, Limits(wall_seconds=GREP_SECONDS, cpu_seconds=int(GREP_SECONDS)))

    # ---- guards ----------------------------------------------------------------------------------
    def resolve(self, path: str) -> Path:
        target = (self.root / path).resolve()
        if target != self.root and self.root not in target.parents:
            raise SandboxError(f"path {path!r} is outside the workspace{self.path_hint()}")
        return target

    def files(self) -> list[str]:
        """Every file of the workspace, relative to its root (the skipped directories left out)."""
        return self.list_files().splitlines() if self.root.is_dir() else []

    def directories(self) -> list[str]:
        return sorted({"."} | {str(Path(f).parent) for f in self.files() if Path(f).parent != Path(".")})

    def path_hint(self) -> str:
        """What a wrong path's error adds: the real paths, which a small model copies where it would invent one."""
        files = self.files()
        shown = ", ".join(files[:20]) + (
            f" and {len(files) - 20} more (list_files shows them)" if len(files) > 20 else ""
        )
        return f" (paths are relative to the workspace root; its files: {shown})"

    def _cap(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        half = self.max_output_chars // 2
        return f"{text[:half]}\n... [{len(text) - self.max_output_chars} characters cut] ...\n{text[-half:]}"

    def _read_text(self, path: str) -> str:
        target = self.resolve(path)
        if not target.is_file():
            raise SandboxError(f"no such file: {path}{self.path_hint()}")
        data = target.read_bytes()
        try:
            if b"\0" in data[:8192]:
                raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise SandboxError(f"{path} is a binary file ({len(data)} bytes), not text") from None

    # ---- tools -----------------------------------------------------------------------------------
    def list_files(self, path: str = ".") -> str:
        """List the files under a directory of the workspace, recursively."""
        base = self.resolve(path)
        if not base.is_dir():
            raise SandboxError(f"no such directory: {path}{self.path_hint()}")
        files = []
        for dirpath, dirnames, filenames in os.walk(base):  # never descends into linked directories
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(filenames):
                files.append(str((Path(dirpath) / name).relative_to(self.root)))
        return "\n".join(files) or "(no files)"

    def read_file(self, path: str, start_line: int = 1, max_lines: int = 400) -> str:
        """Read a text file of the workspace, with line numbers."""
        lines = self._read_text(path).splitlines()
        chunk = lines[start_line - 1 : start_line - 1 + max_lines]
        body = "\n".join(f"{i:4d}  {line}" for i, line in enumerate(chunk, start_line))
        more = (
            f"\n... ({len(lines) - start_line + 1 - len(chunk)} more lines)"
            if len(lines) >= start_line + max_lines
            else ""
        )
        return self._cap(f"{path}:\n{body}{more}")

    def grep(self, pattern: Annotated[str, Field(max_length=MAX_ARGUMENT_CHARS)], path: str = ".") -> str:
        """Search the workspace's text files for a (Perl-style) regular expression; returns file:line: text."""
        base = self.resolve(path)
        excludes = [f"--exclude-dir={d}" for d in sorted(SKIP_DIRS)]
        # -r follows no symbolic links, -I skips binary files; the sandbox bounds time and output
        done = self._grep_sandbox.run(["grep", "-rnIP", *excludes, "--", pattern, str(base.relative_to(self.root))])
        if done.timed_out:
            raise SandboxError(f"grep stopped after {GREP_SECONDS:.0f} s: simplify the pattern {pattern!r}")
        if done.returncode == 2:
            raise SandboxError(f"grep failed: {done.output.strip()[:300]}")
        hits = [line.removeprefix("./") for line in done.output.splitlines()]
        hits = [f"{f}:{n}: {text.strip()}" for f, n, text in (h.split(":", 2) for h in hits if h.count(":") >= 2)]
        return self._cap("\n".join(hits) or "no matches")

    def write_file(self, path: Annotated[str, Field(max_length=MAX_ARGUMENT_CHARS)], content: str) -> str:
        """Create or overwrite a file of the workspace."""
        target = self.resolve(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        return f"wrote {len(content)} characters to {path}"

    def patch_file(
        self,
        path: str,
        old: Annotated[str, Field(max_length=MAX_PATCH_CHARS)],
        new: Annotated[str, Field(max_length=MAX_PATCH_CHARS)],
    ) -> str:
        """Replace one exact occurrence of ``old`` with ``new`` in a file. Where ``old`` is one whole line without
        its indentation, ``new`` takes that line's indentation (each of its lines, if several)."""
        text = self._read_text(path)
        count = text.count(old)
        if count != 1:
            elsewhere = [f for f in self.files()[:MAX_PATH_CHOICES] if f != path and old in self._text_or_empty(f)]
            hint = f"; the old text is in {', '.join(elsewhere)}: patch that file" if elsewhere and not count else ""
            raise SandboxError(f"expected exactly one occurrence of the old text in {path}, found {count}{hint}")
        line = next((line for line in text.splitlines() if line.strip() == old and old), None)
        if line is not None:
            indent = line[: len(line) - len(line.lstrip())]
            new = textwrap.indent(textwrap.dedent(new.strip("\n")), indent).removeprefix(indent)
        self.resolve(path).write_text(text.replace(old, new, 1))
        return f"patched {path}"

    def _text_or_empty(self, path: str) -> str:
        try:
            return self._read_text(path)
        except SandboxError:  # (a binary file)
            return ""

    def patchable_lines(self, paths) -> list[str]:
        """The lines of ``paths`` that ``patch_file`` can take as its ``old`` text, without their indentation:
        those that occur once in their file (a line that recurs would be refused)."""
        lines: dict[str, None] = {}
        for path in paths:
            text = self._text_or_empty(path)
            for line in text.splitlines():
                stripped = line.strip()
                if stripped and len(stripped) <= MAX_PATCH_CHARS and text.count(stripped) == 1:
                    lines[stripped] = None
        return list(lines)

    def run_command(self, command: Annotated[str, Field(max_length=MAX_ARGUMENT_CHARS)]) -> str:
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
        if program in ("python", "python3"):
            argv[0] = sys.executable
        elif program == "pytest":
            argv = [sys.executable, "-m", "pytest", *argv[1:]]
        done = self.sandbox.run(argv)
        output = done.output.replace(str(self.root), ".")
        if done.timed_out:
            return self._cap(
                f"$ {command}\n[timed out after {self.command_timeout:.0f} s; every process it started was "
                f"killed]\n{output}"
            )
        cut = "\n[output cut]" if done.truncated else ""
        return self._cap(f"$ {command}\n[exit code {done.returncode}]\n{output}{cut}")

    # ---- LangChain tools -------------------------------------------------------------------------
    POLICIES = {  # each tool's kvmemory policy: how far its outputs may be compacted
        "list_files": {"ratio": 6},
        "read_file": {"ratio": 4},
        "grep": {"ratio": 6},
        "write_file": {"ratio": 2},
        "patch_file": {"ratio": 2},
        "run_command": {"ratio": 12},
    }
    EXISTING = {"read_file": "files", "patch_file": "files", "list_files": "directories", "grep": "directories"}

    def tools(self, paths_as_choices: bool = False, seen: dict[str, set[str]] | None = None) -> list[StructuredTool]:
        """The workspace operations as LangChain tools, each with the kvmemory policy its output deserves.
        ``paths_as_choices``: the tools that read an existing path name the workspace's paths in their schema
        (an enum, while there are at most ``MAX_PATH_CHOICES``), so that a model whose arguments are held to
        the schema picks a real path instead of inventing one; ``seen``: per tool, paths left out of its
        choices (those whose output the model has already, unless that leaves none); and ``patch_file`` is
        offered the files read but tests (``seen["read_file"]``, ``is_test_path``): a file is patched as it was read,
        its ``old`` text one of their lines (``patchable_lines``); ``read_file`` then reads whole files."""
        from kvmemory.integrations.middleware import kv_policy

        out = []
        for name, rule in self.POLICIES.items():
            fn = getattr(self, name)
            tool = StructuredTool.from_function(fn, name=name, description=fn.__doc__, handle_tool_error=_tool_error)
            if paths_as_choices and name in self.EXISTING:
                choices = getattr(self, self.EXISTING[name])()
                if name == "patch_file":
                    read = (seen or {}).get("read_file", ())
                    choices = [c for c in choices if c in read and not is_test_path(c)] or choices
                else:
                    choices = [c for c in choices if c not in (seen or {}).get(name, ())] or choices
                if len(choices) <= MAX_PATH_CHOICES:
                    schema = tool.tool_call_schema.model_json_schema()
                    schema["properties"]["path"] = {**schema["properties"]["path"], "enum": choices}
                    if name == "read_file":  # whole files: a model given start_line starts at the failing line
                        schema["properties"] = {"path": schema["properties"]["path"]}  # and misses the code above
                    lines = self.patchable_lines(choices) if name == "patch_file" else []
                    if 0 < len(lines) <= MAX_LINE_CHOICES:  # a line copied, where a small model invents one
                        schema["properties"]["old"] = {**schema["properties"]["old"], "enum": lines}
                    tool = StructuredTool.from_function(
                        fn, name=name, description=fn.__doc__, args_schema=schema, handle_tool_error=_tool_error
                    )
            out.append(kv_policy(**rule)(tool))
        return out


def is_test_path(path: str) -> bool:
    """A test file (pytest's naming, or anything under a tests directory): what a fix must pass, not change."""
    parts = Path(path).parts
    name = parts[-1] if parts else ""
    return any(p in ("tests", "test") for p in parts[:-1]) or name.startswith("test_") or name.endswith("_test.py")


def _tool_error(err: Exception) -> str:
    return f"error: {err}"
