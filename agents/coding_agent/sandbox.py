"""An OS-level boundary for the coding agent's commands, built with bubblewrap (Debian package ``bubblewrap``).

Each command runs in fresh user, mount, PID, network, IPC and UTS namespaces: the workspace is the only
writable directory and the only user data visible (the system's programs and libraries and the Python
installation are mounted read-only, ``/tmp`` is an empty tmpfs, there is no network). The whole
process tree is killed on time-out (bubblewrap is PID 1 of the namespace and dies with its parent; the
caller also kills its process group). CPU seconds, address space, file size and the number of open
files are limited with rlimits; output is read up to a cap. Where the boundary cannot be created the
workspace refuses to run commands (``SandboxUnavailableError``): there is no silent fall-back.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from langchain_core.tools import ToolException

# read-only system locations a command may need; each is mounted only if it exists
SYSTEM_PATHS = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/ssl/certs",
)


class SandboxError(ToolException):
    """A tool call that would leave the workspace or break its limits."""


class SandboxUnavailableError(SandboxError):
    """The OS-level boundary cannot be created here (bubblewrap missing or namespaces not permitted)."""


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 60.0
    cpu_seconds: int = 60
    memory_bytes: int = 2 << 30
    file_bytes: int = 256 << 20  # largest file a command may write (its captured output included)
    open_files: int = 256
    output_bytes: int = 1 << 20  # output read back; the rest is dropped


@dataclass
class CommandResult:
    returncode: int | None  # None when the command was killed at the wall-clock limit
    output: str
    timed_out: bool
    truncated: bool


class Sandbox:
    """Runs argv lists inside ``root`` behind the boundary described in the module docstring."""

    def __init__(self, root: Path, limits: Limits = Limits()):
        self.root = Path(root).resolve()
        self.limits = limits
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxUnavailableError(
                "bubblewrap (bwrap) is not installed: commands cannot be confined to the workspace. "
                "Install it (apt-get install bubblewrap) or run the agent without command tools."
            )
        probe = subprocess.run([*self._prefix(), "true"], capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            raise SandboxUnavailableError(
                f"bubblewrap cannot create the sandbox here (namespaces not permitted?): {probe.stderr.strip()[:300]}"
            )

    def _prefix(self) -> list[str]:
        python_prefixes = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}
        argv = [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
        ]
        for path in SYSTEM_PATHS:
            if Path(path).is_symlink():
                argv += ["--symlink", os.readlink(path), path]
            elif Path(path).exists():
                argv += ["--ro-bind", path, path]
        for prefix in sorted(python_prefixes):
            if not any(str(prefix).startswith(p + "/") for p in SYSTEM_PATHS):
                argv += ["--ro-bind", str(prefix), str(prefix)]
        python_bin = str(Path(sys.executable).parent)
        env = {
            "PATH": f"{python_bin}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.root),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "TMPDIR": "/tmp",
        }
        argv += ["--bind", str(self.root), str(self.root), "--chdir", str(self.root), "--clearenv"]
        for key, value in env.items():
            argv += ["--setenv", key, value]
        return argv + ["--"]

    def _set_limits(self) -> None:  # runs in the child before exec (bubblewrap and all it starts inherit)
        lim = self.limits
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_seconds, lim.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_bytes, lim.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_bytes, lim.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim.open_files, lim.open_files))

    def run(self, argv: list[str]) -> CommandResult:
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(
                [*self._prefix(), *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self._set_limits,
            )
            timed_out = False
            try:
                proc.wait(timeout=self.limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole tree, whether it ended or not
                proc.wait()
            size = out.seek(0, os.SEEK_END)
            out.seek(0)
            data = out.read(self.limits.output_bytes)
        return CommandResult(
            None if timed_out else proc.returncode,
            data.decode("utf-8", errors="replace"),
            timed_out,
            size > self.limits.output_bytes,
        )
