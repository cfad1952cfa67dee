"""Attention routed per call, so that no run ever changes the model object other runs share.

A loaded model's attention implementation is set once, at load, to a dispatcher named after the
model's own implementation ("kvviz+sdpa", "kvviz+eager", ...). A forward that carries a step callable
in its kwargs (`kvviz_step=...`, what the engine passes) attends through it; any other forward (the
reference oracle, `generate`, a user's own call) runs the stock attention, with the stock masks,
exactly as before loading. Several threads can therefore run the same model at once, each with its
own step or none, and none can see another's.
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX = "kvviz+"
STEP_KWARG = "kvviz_step"
_REGISTER = threading.Lock()
# transformers passes a 4D mask through untouched: a step forward, which builds its own masks, gets this
# one so that no causal mask is made for it (packed positions would otherwise build a T x T mask).
_UNREAD_MASK = torch.ones(1, 1, 0, 0, dtype=torch.bool)


def step_kwargs(step: Callable) -> dict:
    """The forward kwargs that send every layer's attention of one forward to `step`."""
    return {STEP_KWARG: step, "attention_mask": _UNREAD_MASK}


def _stock(fallback: str, module: torch.nn.Module) -> Callable:
    """The attention the model would run without kvviz: a registered one, or its own module's eager."""
    if fallback in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[fallback]
    return sys.modules[type(module).__module__].eager_attention_forward


def _dispatcher(fallback: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        step = kwargs.pop(STEP_KWARG, None)
        if step is not None:
            return step(module, query, key, value, kwargs.get("scaling"))
        return _stock(fallback, module)(module, query, key, value, attention_mask, **kwargs)

    return attention


def stock_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy that runs the model's own attention, for code that switches the implementation itself
    (transformers' generate_batch): the shared model is never switched. The copy shares the weights
    (parameters and buffers are the same tensors), so it costs modules and a config, not memory."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    clone = copy.deepcopy(model, memo=shared)
    clone.set_attn_implementation(clone.config._attn_implementation.removeprefix(PREFIX))
    return clone


def route_attention(model: torch.nn.Module) -> str:
    """Install the per-call dispatcher on a freshly loaded model (idempotent); returns its name."""
    current = model.config._attn_implementation or "eager"
    if current.startswith(PREFIX):
        return current
    name = PREFIX + current
    with _REGISTER:
        if name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(name, _dispatcher(current))
            mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(current)
            if mask is not None:  # the stock path keeps its masks (padding in `generate`, say)
                ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)
    model.set_attn_implementation(name)
    return name
