"""Model loading: named models (``named_models``: GGUF files pulled from the package registry), GGUF files
(``gguf_files``: their blocks kept or dequantized), local directories and HF hub ids."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kvmemory.errors import ModelLoadError, UnsupportedArchitectureError
from kvmemory.runtime import gguf_files
from kvmemory.runtime.named_models import model_file, named_model

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


def is_gguf_source(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a GGUF file (a named model or a ``.gguf`` path), without fetching it."""
    return named_model(str(name_or_path)) is not None or str(name_or_path).endswith(".gguf")


def gguf_source(name_or_path: str) -> Path | None:
    """The GGUF file ``name_or_path`` names (a named model's, pulled if missing, or a ``.gguf`` path); None for a
    checkpoint directory or hub id."""
    if named_model(str(name_or_path)) is not None:
        return model_file(str(name_or_path))
    if str(name_or_path).endswith(".gguf"):
        if not Path(name_or_path).is_file():
            raise ModelLoadError(f"GGUF file not found: {name_or_path}")
        return Path(name_or_path)
    return None


def load_model_and_tokenizer(name_or_path: str, device, dtype, attn_implementation: str, keep_blocks: bool = False):
    """The model, its tokenizer and the sha256 of the file it was read from (None for a checkpoint). A GGUF
    file's weights stay in their blocks where ``keep_blocks`` (``gguf_files``), else are dequantized."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_source(name_or_path)
    source = Path(name_or_path) if gguf is None else gguf_files.prepared(gguf)
    try:
        config = AutoConfig.from_pretrained(str(source))
    except ValueError as err:  # transformers' message for an unknown config architecture
        raise UnsupportedArchitectureError(f"cannot load {name_or_path!r}: {err}") from err
    except OSError as err:
        raise ModelLoadError(
            f"model {name_or_path!r} not found: not a local directory, GGUF file or reachable hub id ({err})"
        ) from err
    check_architecture(config)
    keep_every_token(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source))
        if gguf is not None:
            model = gguf_files.gguf_model(gguf, source, config, dtype, keep_blocks, attn_implementation)
            return model.to(device), tokenizer, gguf_files.source_digest(source)
        with quiet_progress_bars():  # a checkpoint loads in a second or two: not worth a bar
            model = AutoModelForCausalLM.from_pretrained(
                str(source), config=config, dtype=dtype, attn_implementation=attn_implementation
            )
    except OSError as err:
        raise ModelLoadError(f"could not load the weights of {name_or_path!r}: {err}") from err
    return model.to(device).eval(), tokenizer, None
