"""`load_model`: one entry point for the default model, local folders and files, and tiny models."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from . import gguf, gguf_export, smollm2, tiny
from .cache import cache_dir
from .errors import ModelError, ModelNotFound, UnsupportedModel
from .queue import ModelQueue
from .routing import route_attention

DEFAULT_MODEL = "smollm2"
BUILTIN = ("smollm2", *tiny.TINY_CONFIGS)
# Decoders whose attention goes through transformers' AttentionInterface with per-token positions.
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready for the engine, with what a run record needs to reproduce it."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    fingerprint: str  # sha256 of the weights' source: a run is only replayable on the same weights
    queue: ModelQueue = field(default_factory=ModelQueue, repr=False, compare=False)  # runs take turns on it
    source_gguf: Path | None = None  # the GGUF file the weights came from, if they did

    @property
    def config(self):
        return self.model.config

    def gguf(self) -> Path:
        """A GGUF file of these weights, for engines that load GGUF (llama.cpp): the file they came from,
        or, for the tiny Llama, the weights written as one."""
        if self.source_gguf is not None:
            return self.source_gguf
        if self.model.config.model_type == "llama" and self.name in tiny.TINY_CONFIGS:
            return gguf_export.llama_gguf(self.model, self.fingerprint)
        raise ModelNotFound(f"model: {self.name} has no GGUF file; llama.cpp loads GGUF only (give a .gguf path, "
                            "smollm2 or tiny-llama, or convert the model with llama.cpp's convert_hf_to_gguf.py)")


def stderr_progress(message: str) -> None:
    print(f"kvviz: {message}", file=sys.stderr, flush=True)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ModelError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} asked for, but CUDA is not available here: use cpu or auto")
    if dev.type not in ("cpu", "cuda"):
        raise ModelError(f"device {device!r} is not supported: use auto, cpu, cuda or cuda:N")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        out = dtype
    elif dtype == "auto":
        out = torch.float32
    elif dtype in DTYPES:
        out = DTYPES[dtype]
    else:
        raise ModelError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    if out != torch.float32 and device.type != "cuda":
        raise ModelError(f"{out} is only allowed on CUDA; on {device.type} kvviz computes in float32")
    return out


def load_model(name_or_path: str = DEFAULT_MODEL, device: str = "auto", dtype: str | torch.dtype = "auto",
               progress: Callable[[str], None] = stderr_progress) -> LoadedModel:
    """Load a decoder by built-in name (smollm2, tiny-llama, tiny-gpt2), HF folder or .gguf path."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    source = None
    if name_or_path in tiny.TINY_CONFIGS:
        model, tokenizer = tiny.tiny_model(name_or_path), tiny.byte_tokenizer()
        fingerprint = _tensor_fingerprint(model)
    else:
        folder, fingerprint, source = _local_folder(name_or_path, progress)
        model, tokenizer = _from_folder(folder)
    model = model.to(device=dev, dtype=dt).eval().requires_grad_(False)
    route_attention(model)  # once, here: no run ever changes the model again
    line = cache_dir() / "queue" / f"{fingerprint[:16]}-{dev.type}{dev.index if dev.index is not None else ''}"
    return LoadedModel(name_or_path, model, tokenizer, dev, dt, fingerprint, ModelQueue(line), source)


def _local_folder(name_or_path: str, progress: Callable[[str], None]) -> tuple[Path, str, Path | None]:
    """A Hugging Face folder for the request (converting GGUF files), its weights' fingerprint and the
    GGUF file it came from, if it did."""
    if name_or_path == "smollm2":
        source = smollm2.gguf_path(progress)
        folder = gguf.convert_gguf(source, progress)
        return folder, gguf.source_sha256(folder), source
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelNotFound(f"no model {name_or_path!r}: not a built-in ({', '.join(BUILTIN)}) "
                            "and no such file or folder")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(f"{path} is a file but not a .gguf: give a .gguf file or a Hugging Face folder")
        folder = gguf.convert_gguf(path, progress)
        return folder, gguf.source_sha256(folder), path.resolve()
    if not (path / "config.json").exists():
        raise ModelNotFound(f"{path} has no config.json: not a Hugging Face model folder")
    _check_architecture(path)
    return path, _files_fingerprint(path), None


def _check_architecture(folder: Path) -> None:
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedModel(f"{folder}/config.json is not valid JSON: {e}") from e
    if model_type not in SUPPORTED_TYPES:
        raise UnsupportedModel(f"{folder}: model_type {model_type!r} is not supported; kvviz drives "
                               f"decoder models of type {', '.join(SUPPORTED_TYPES)}")


def _from_folder(folder: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    _check_architecture(folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(f"could not load the model in {folder}: {e}") from e
    return model, tokenizer


def _files_fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".json") and f.is_file():
            h.update(f.name.encode())
            with open(f, "rb") as src:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


def _tensor_fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
