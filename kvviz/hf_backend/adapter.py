"""The one module of kvviz that reads Hugging Face transformers' continuous batching from inside.

kvviz runs transformers' own ContinuousBatchingManager (its scheduler, paged cache, block ledger and
paged attention: what `generate_batch` runs) on a copy of the model that shares its weights, one
batch at a time (the manager's own loop body, called from this thread instead of its background
thread), and only observes. The attention function registered under transformers' own name for the
kernel chosen (`paged|eager` for eager_paged, `sdpa` for sdpa_paged, which continuous batching runs
over its paged cache) calls transformers' function as transformers' module holds it and returns its
result unchanged; what it saw (the packed batch, its write and read indices, and the weights:
eager_paged's as returned, sdpa_paged's recomputed by kvviz.engine.kernel_check and checked
against the kernel's output) goes to a listener, and the allocator's block tables, ledger reference
counts and hashes are read between batches. No file of transformers is patched; for any model kvviz
does not observe the function is transformers' own.

These are private parts of transformers that change between releases: the adapter names the
versions it understands and refuses the others.
"""

# transformers' internals are imported below check_version(): another release is refused before they are read
# ruff: noqa: E402
from __future__ import annotations

import threading
from collections import Counter

import torch
import transformers

from ..errors import WorkloadError

SUPPORTED = "5.24"  # the transformers releases (major.minor) whose internals this module reads
# engine.kernel -> the attention implementation transformers' continuous batching runs it under
IMPLEMENTATIONS = {"eager_paged": "paged|eager", "sdpa_paged": "sdpa"}


class BackendError(WorkloadError):
    """transformers' continuous batching cannot run this here (version, model, cache size)."""


def check_version(version: str | None = None) -> None:
    """Refuse a transformers release whose internals this adapter was not written against."""
    v = version or transformers.__version__
    if v.split(".")[:2] != SUPPORTED.split("."):
        raise BackendError(
            f"transformers {v} is installed; kvviz's transformers backend reads the continuous "
            f"batching internals of transformers {SUPPORTED}.x only (pip install "
            f"'transformers=={SUPPORTED}.*')"
        )


check_version()

from transformers import AttentionInterface, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.integrations import eager_paged, sdpa_attention
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..engine import kernel_check
from ..models.routing import stock_copy
from .facts import Batch, CacheView, Listener, Outcome

_OBSERVED: dict[int, ContinuousBatching] = {}  # id of an attention module -> the run observing it
_REGISTER = threading.Lock()


def _observed_eager(module, query, key, value, attention_mask, **kwargs):
    """transformers' paged eager attention, unchanged; a module kvviz observes also reports its weights."""
    run = _OBSERVED.get(id(module))
    if run is not None:
        run._begin(attention_mask, kwargs)
    out, weights = eager_paged.eager_paged_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if run is not None:
        run.listener.on_layer(module.layer_idx, weights[0])
    return out, weights


def _observed_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention (paged inside continuous batching), unchanged; for a module kvviz
    observes, the weights are recomputed from the same inputs and the output checked against the kernel's."""
    run = _OBSERVED.get(id(module))
    if run is not None:
        run._begin(attention_mask, kwargs)
    out, weights = sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if run is not None:
        run._check(module.layer_idx, query, key, value, kwargs.get("scaling"), out)
    return out, weights


_WRAPPERS = {"paged|eager": _observed_eager, "sdpa": _observed_sdpa}


def _register(implementation: str) -> None:
    with _REGISTER:
        if ALL_ATTENTION_FUNCTIONS.get(implementation) is not _WRAPPERS[implementation]:
            AttentionInterface.register(implementation, _WRAPPERS[implementation])


class ContinuousBatching:
    """transformers' manager over a paged cache of a size given (never sized from free memory), driven
    one batch at a time. Blocks are numbered as kvviz's pool is: transformers' first blocks are trash
    sectors no request is given (padding writes there), so its block `b` is kvviz's `b - trash`, and
    the trash blocks come last (`num_blocks` .. `num_blocks + trash - 1`), read by nothing legitimate."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        page_size: int,
        num_blocks: int,
        max_batch_tokens: int,
        block_sharing: bool,
        temperature: float,
        top_p: float,
        eos_ids: list[int],
        seed: int,
        kernel: str = "eager_paged",
    ):
        check_version()
        if page_size < 4:
            raise BackendError(f"engine.block_size: transformers' pages hold at least 4 tokens, got {page_size}")
        self.listener: Listener | None = None  # set before the first step
        self.model = stock_copy(model)  # shares the weights; its attention setting is its own
        groups = group_layers_by_attn_type(self.model.config.get_text_config())
        if set(groups) != {FULL_ATTENTION}:
            raise BackendError(
                f"model: its layers are {', '.join(sorted(groups))}; kvviz's transformers backend "
                "observes caches of full-attention layers only"
            )
        self.implementation = IMPLEMENTATIONS[kernel]
        try:
            self.model.set_attn_implementation(self.implementation)
        except (ValueError, ImportError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise BackendError(
                f"engine.kernel: transformers cannot run {type(self.model).__name__} with {kernel} "
                f"({first.rstrip('.')})"
            ) from None
        gen = GenerationConfig(
            do_sample=temperature > 0, temperature=temperature or 1.0, top_p=top_p, eos_token_id=eos_ids or -1
        )
        cb = ContinuousBatchingConfig(
            page_size=page_size,
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            allow_block_sharing=block_sharing,
            seed=seed,
            use_cuda_graph=False,
            use_async_batching=False,
            auto_switch_to_flash=False,
            cpu_offload_space=0.0,
        )
        self.manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        try:
            self.bp = self.manager._create_batch_processor()
        except MemoryError as e:
            raise BackendError(
                f"engine.num_blocks: transformers could not make a paged cache of {num_blocks} "
                f"blocks x {page_size} tokens here ({e})"
            ) from None
        self.manager.batch_processor, self.manager.current_batch = self.bp, 0
        (self.allocator,) = self.bp.cache.cache_allocators.values()
        a = self.allocator
        self.block_size, self.num_blocks = a.tokens_per_page, a.num_blocks
        self.trash = self.bp.cache.pool.num_reserved_sectors * a.blocks_per_sector
        self.total_blocks = self.num_blocks + self.trash
        if self.num_blocks != num_blocks:  # sectors hold whole blocks: the cache is rounded to them
            raise BackendError(
                f"engine.num_blocks: transformers' cache for this model holds blocks in sectors of "
                f"{a.blocks_per_sector}; use a multiple of {a.blocks_per_sector} (got {num_blocks})"
            )
        self._batch: Batch | None = None
        self._logits_rows: torch.Tensor | None = None
        self._futures: list = []
        _register(self.implementation)
        self._modules = [id(mod) for mod in self.model.modules()]
        for i in self._modules:
            _OBSERVED[i] = self
        self._hook = self.model.get_output_embeddings().register_forward_hook(self._logits)

    # -- numbering -----------------------------------------------------------------------------
    def block(self, b: int) -> int:
        """kvviz's number of transformers' block b."""
        return (b - self.trash) % self.total_blocks

    def _slots(self, raw: torch.Tensor) -> torch.Tensor:
        """transformers' cache indices (block * stride + offset, the same in every layer) as kvviz slots;
        an index past a block's first page (no token's key) reads as the read trash."""
        stride, page = self.allocator.block_physical_stride, self.block_size
        block, offset = raw // stride, raw % stride
        slots = ((block - self.trash) % self.total_blocks) * page + offset
        return torch.where(offset < page, slots, self.block(0) * page)

    # -- requests and batches ------------------------------------------------------------------
    def add(self, request_id: str, token_ids: list[int], max_new_tokens: int, eos_ids: list[int]) -> None:
        """Queue a request; it joins the next batch transformers' scheduler makes room for."""
        self.manager.add_request(
            input_ids=token_ids, request_id=request_id, max_new_tokens=max_new_tokens, eos_token_id=eos_ids
        )

    def step(self) -> Outcome | None:
        """One iteration of transformers' own loop body: schedule, forward, sample, update; None when it
        ran no batch."""
        before, self._batch = self.manager.current_batch, None
        self.manager._generation_loop_body(self.bp, bootstrapping=False)
        if self.manager.current_batch == before:
            return None
        if self._batch is None:
            raise BackendError(
                f"model: a batch ran without going through transformers' {self.implementation} "
                "attention, so kvviz saw nothing of it"
            )
        sampled = {f.state.request_id: f.state.generated_tokens[-1] for f in self._futures if f.has_new_token}
        finished = [f.state.request_id for f in self._futures if f.state.status == RequestStatus.FINISHED]
        return Outcome(sampled, finished)

    def cancel(self, request_id: str) -> None:
        """transformers' own cancellation: the next iteration drops the request and frees its blocks."""
        self.manager.cancel_request(request_id)

    def failures(self) -> list[tuple[str, str]]:
        """(request, error) of every request transformers failed, from its output queue."""
        out = []
        q = self.manager.output_router.output_queue
        while not q.empty():
            o = q.get_nowait()
            if o.error is not None:
                out.append((o.request_id, o.error))
        return out

    def cache_view(self) -> CacheView:
        a, ledger, B = self.allocator, self.allocator.ledger, self.block
        tables = {rid: [B(b) for b in blocks] for rid, blocks in a.block_table.items()}
        held = Counter(b for t in tables.values() for b in t)
        refcounts = [1 if held[i] else 0 for i in range(self.total_blocks)]
        for b, n in ledger.shared_ref_counts.items():
            refcounts[B(b)] = n
        hashes: list[int | None] = [None] * self.total_blocks
        for b, h in ledger.block_to_hash.items():
            hashes[B(b)] = h
        computed = {rid: s.position_offset for rid, s in self.bp.scheduler.active_requests.items()}
        return CacheView(tables, refcounts, hashes, [B(b) for b in ledger.cached_blocks], computed)

    def _begin(self, mask: torch.Tensor | None, kwargs: dict) -> None:
        """A layer is about to attend: the first of a batch reads the batch, before any kernel runs."""
        if self._batch is None:
            self._batch = self._read_batch(mask, kwargs)
            self.listener.on_batch(self._batch)

    def _check(self, layer: int, query, key, value, scaling: float | None, out: torch.Tensor) -> None:
        """A kernel that returns no weights: kvviz's recomputed weights to the oracle, with how far the
        kernel's output is from theirs."""
        c = kernel_check.check(query[0], key[0], value[0], self._batch.visible, scaling, out[0])
        self.listener.on_layer(layer, c.weights)
        self.listener.on_kernel(layer, c.excess)

    def _read_batch(self, mask: torch.Tensor | None, kwargs: dict) -> Batch:
        futures = self._futures = list(self.bp.inputs_and_outputs.requests_in_batch)
        i = self.allocator.index
        write, read = kwargs["write_index"][i], kwargs["read_index"][i]
        keys = read if read.numel() else write  # a batch with nothing cached attends to the new keys themselves
        if mask is None:
            raise BackendError(f"model: transformers' {self.implementation} attention got no mask")
        visible = mask[0, 0] > torch.finfo(mask.dtype).min / 2
        self._logits_rows = kwargs.get("logits_indices")
        states = [f.state for f in futures]
        return Batch(
            [s.request_id for s in states],
            [s.position_offset - f.query_length for s, f in zip(states, futures, strict=True)],
            [f.query_length for f in futures],
            [s.initial_tokens + s.generated_tokens for s in states],
            [f.has_new_token for f in futures],
            self._slots(write),
            self._slots(keys),
            visible,
            self.cache_view(),
        )

    def _logits(self, module, args, output: torch.Tensor) -> None:
        if self._batch is None:
            return
        n, kept = sum(self._batch.sampling), self._logits_rows
        # a model that keeps only the logits asked for (logits_to_keep) gives one row per request of the batch,
        # the sampling ones first; another gives every packed token's
        rows = output[0, :n] if output.shape[1] == len(kept) else output[0, kept[:n]]
        self.listener.on_logits(rows.float())

    def close(self) -> None:
        """Stop observing and let the cache go."""
        for i in self._modules:
            _OBSERVED.pop(i, None)
        self._hook.remove()
        self.manager.batch_processor = None
        self.bp = None
        self.manager.destroy()
