"""Model loading: the default SmolLM2 (from a PyPI-shipped GGUF), local folders and .gguf files,
and tiny random models for tests."""

from .errors import ModelError, ModelFetchError, ModelNotFound, UnsupportedModel
from .loader import BUILTIN, DEFAULT_MODEL, SUPPORTED_TYPES, LoadedModel, load_model

__all__ = [
    "BUILTIN", "DEFAULT_MODEL", "SUPPORTED_TYPES", "LoadedModel", "ModelError", "ModelFetchError",
    "ModelNotFound", "UnsupportedModel", "load_model",
]
