"""Typed model-loading errors: each message says what was asked for and what to do instead."""

from ..errors import ModelError

__all__ = ["ModelError", "ModelFetchError", "ModelNotFound", "UnsupportedModel"]


class ModelNotFound(ModelError):
    """No built-in model of that name and no such path."""


class UnsupportedModel(ModelError):
    """The model exists but is not a decoder architecture kvviz can drive."""


class ModelFetchError(ModelError):
    """Downloading or unpacking the default model failed."""
