"""The bench's baseline: a workload through llama.cpp's C API with nothing of kvviz in the loop, as a
llama-cpp-python program would run it: every prompt in its own sequence, prefilled in batches of
`n_batch` tokens, then one batch a step holding every sequence's next token, greedy, no observer."""

from __future__ import annotations

from pathlib import Path

from .adapter import LlamaContext
from .facts import BatchToken
from .run import CELL_ROUND


def run_plain(gguf: Path, prompts: list[list[int]], new_tokens: int, n_batch: int) -> list[list[int]]:
    """Each prompt's `new_tokens` greedy tokens (EOS not checked: every request does the same work)."""
    cells = sum(len(p) + new_tokens for p in prompts)
    ctx = LlamaContext(gguf, n_ctx=-(-cells // CELL_ROUND) * CELL_ROUND, n_batch=n_batch,
                       n_seq_max=len(prompts), unified=True, flash_attn=False, listener=None)
    try:
        todo = [BatchToken(token=t, pos=i, seqs=(s,), logits=i == len(p) - 1)
                for s, p in enumerate(prompts) for i, t in enumerate(p)]
        last: dict[int, int] = {}
        for start in range(0, len(todo), n_batch):
            chunk = todo[start:start + n_batch]
            for row, i in zip(ctx.decode(chunk), [k for k, t in enumerate(chunk) if t.logits], strict=True):
                last[chunk[i].seqs[0]] = int(ctx.logits(row).argmax())
        out = [[last[s]] for s in range(len(prompts))]
        for step in range(1, new_tokens):
            batch = [BatchToken(token=out[s][-1], pos=len(p) + step - 1, seqs=(s,), logits=True)
                     for s, p in enumerate(prompts)]
            for s, row in enumerate(ctx.decode(batch)):
                out[s].append(int(ctx.logits(row).argmax()))
        return out
    finally:
        ctx.close()
