"""Model loading: named models (``named_models``: GGUF files pulled from the package registry), GGUF files, local
directories and HF hub ids. A GGUF file is converted once into a cached transformers checkpoint
(``converted_gguf``) whose linear weights are stored in fp16, as the engine runs them."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kvmemory.errors import ModelLoadError, UnsupportedArchitectureError
from kvmemory.notices import one_time_work, warn
from kvmemory.runtime.named_models import CACHE_DIR, model_file, named_model

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def pick_device_and_dtype(device: str | torch.device | None, dtype: torch.dtype | str | None):
    """cuda + bf16 when a GPU is present, cpu + fp32 otherwise; explicit arguments win."""
    device = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype


def check_architecture(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        archs = getattr(config, "architectures", None) or [model_type]
        raise UnsupportedArchitectureError(
            f"architecture {archs[0]!r} (model_type {model_type!r}) is not supported; "
            f"kvmemory runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def keep_every_token(config) -> None:
    """A Mistral sliding window would make attention skip old tokens; kvmemory keeps and attends all of them."""
    if getattr(config, "sliding_window", None) is not None:
        logger.info(
            "sliding_window=%s disabled: kvmemory keeps every token and compacts instead", config.sliding_window
        )
        config.sliding_window = None
    if hasattr(config, "use_sliding_window"):
        config.use_sliding_window = False


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' progress bars off for the block (its settings' bars, and the GGUF converter's own tqdm,
    which no setting reaches), as they were afterwards."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    shown, bar = hf_logging.is_progress_bar_enabled(), getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = lambda items, *args, **kwargs: items
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if shown:
            hf_logging.enable_progress_bar()


def load_model_and_tokenizer(name_or_path: str, device, dtype, attn_implementation: str):
    """The model, its tokenizer and the sha256 of the file it was prepared from where one is kept (a named
    model's pin, a GGUF file's digest taken at its conversion; None for a checkpoint)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    digest = None
    if (named := named_model(str(name_or_path))) is not None:
        source, digest = converted_gguf(model_file(str(name_or_path))), named.sha256
    elif str(name_or_path).endswith(".gguf"):
        if not Path(name_or_path).is_file():
            raise ModelLoadError(f"GGUF file not found: {name_or_path}")
        source = converted_gguf(Path(name_or_path))
        digest = source_digest(source)
    else:
        source = Path(name_or_path)
    gguf_file = None
    if source.suffix == ".gguf":  # no conversion could be cached: read the GGUF file itself
        source, gguf_file = source.parent, source.name

    try:
        config = AutoConfig.from_pretrained(str(source), gguf_file=gguf_file)
    except ValueError as err:  # transformers' message for an unknown GGUF/config architecture
        raise UnsupportedArchitectureError(f"cannot load {name_or_path!r}: {err}") from err
    except OSError as err:
        raise ModelLoadError(
            f"model {name_or_path!r} not found: not a local directory, GGUF file or reachable hub id ({err})"
        ) from err
    check_architecture(config)
    keep_every_token(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), gguf_file=gguf_file)
        with quiet_progress_bars():  # a checkpoint loads in a second or two: not worth a bar
            model = AutoModelForCausalLM.from_pretrained(
                str(source), gguf_file=gguf_file, config=config, dtype=dtype, attn_implementation=attn_implementation
            )
    except OSError as err:
        raise ModelLoadError(f"could not load the weights of {name_or_path!r}: {err}") from err
    return model.to(device).eval(), tokenizer, digest


CONVERSION_FORMAT = "linear-fp16"  # in the cache key: a checkpoint of another layout is converted again
SOURCE_DIGEST = "source.sha256"  # in a converted checkpoint: the sha256 of the GGUF file it was made from


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def source_digest(converted: Path) -> str | None:
    """The sha256 of the GGUF file a conversion was made from (taken once, at the conversion); None where the
    GGUF file is read directly (no conversion could be cached) and the engine hashes the weights instead."""
    path = converted / SOURCE_DIGEST
    return path.read_text().strip() if path.is_file() else None


def converted_gguf(gguf: Path) -> Path:
    """A transformers checkpoint of ``gguf``, made once and kept under ``CACHE_DIR``; the GGUF file itself where
    the cache cannot be written.

    transformers reads a GGUF file's metadata field by field, three times a load (config, tokenizer, weights),
    and dequantizes every block in numpy: a minute for Qwen2.5-Coder-0.5B on 2 cores, where the checkpoint
    loads in seconds. The linear layers' weights are stored in fp16, the format the engine runs them in on a
    CPU (``runtime/weights.py``), so the file is half of fp32's and loading rounds nothing again; embeddings,
    norms and biases keep the file's precision. The cache key holds the file's path, size and modification
    time, the transformers version that converts and ``CONVERSION_FORMAT``; a conversion of the same file under
    another key is removed once the new one is in place."""
    import transformers

    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{CONVERSION_FORMAT}"
    target = CACHE_DIR / "models" / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (target / "config.json").is_file():
        if not (target / SOURCE_DIGEST).is_file():  # converted by an earlier kvmemory: digest it once now
            with contextlib.suppress(OSError):
                (target / SOURCE_DIGEST).write_text(file_sha256(gguf))
        return target
    expected = f"{max(30, round(stat.st_size / 2**30 * 120, -1)):.0f} s"  # 61 s for the 0.47 GiB default
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with one_time_work(f"converting {gguf.name} to a transformers checkpoint in {target.parent}", expected):
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            try:
                _convert(gguf, staging)
                (staging / SOURCE_DIGEST).write_text(file_sha256(gguf))  # the model's identity, hashed once
                os.replace(staging, target)  # whole or not at all: a second process may have won the race
            except OSError:
                if not (target / "config.json").is_file():
                    raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except OSError as err:
        warn("cannot cache a converted %s (%s): reading the GGUF file on every load", gguf.name, err)
        return gguf
    for stale in target.parent.glob(f"{gguf.stem}-*"):  # an earlier conversion of this file: same stem, other key
        if stale != target and len(stale.name) == len(target.name) and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return target


def _convert(gguf: Path, into: Path) -> None:
    """Write ``gguf`` as a transformers checkpoint into ``into``, linear weights in fp16. transformers marks a
    model read from GGUF as quantized and will not save it, so its (dequantized) weights and config are written
    here. A tied output head is the embedding, and keeps its precision."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    AutoTokenizer.from_pretrained(**source).save_pretrained(into)
    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    embedding = model.get_input_embeddings().weight
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight is not embedding:
                module.weight.data = module.weight.data.to(torch.float16)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(into)
    model.generation_config.save_pretrained(into)
    save_model(model, str(into / "model.safetensors"), metadata={"format": "pt"})
