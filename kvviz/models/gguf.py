"""GGUF files become ordinary float weights once, then load from the cache in about a second.

transformers de-quantises a GGUF on every load (~20 s for SmolLM2); the result is saved as a
safetensors folder keyed by the file's path, size and mtime, with the file's sha256 alongside.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .cache import cache_dir, publish_dir, sha256_file
from .errors import ModelError, UnsupportedModel

META = "kvviz-meta.json"


def converted_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: Path, progress: Callable[[str], None]) -> Path:
    """The converted folder for `gguf_path`, converting it first if this is the first use."""
    target = converted_dir(gguf_path)
    if (target / META).exists():
        return target
    progress(f"converting {gguf_path.name} to float weights (once; about 20 s for SmolLM2)")
    where = dict(gguf_file=gguf_path.name, local_files_only=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **where)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **where)
    except Exception as e:  # the GGUF parser raises anything from struct.error to KeyError on bad files
        kind = UnsupportedModel if "architecture" in str(e).lower() else ModelError
        raise kind(f"{gguf_path}: transformers cannot load this GGUF file ({type(e).__name__}: {e})") from e
    # The de-quantised weights are plain floats: drop the GGUF quantizer so they can be saved.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    with publish_dir(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / META).write_text(json.dumps({"source": str(gguf_path), "sha256": sha256_file(gguf_path)}))
    progress(f"cached converted weights in {target}")
    return target


def source_sha256(converted: Path) -> str:
    return json.loads((converted / META).read_text())["sha256"]
