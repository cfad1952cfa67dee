"""Judging an attention kernel that returns no weights (transformers' `sdpa_paged`, llama.cpp's flash
attention).

kvviz recomputes every head's weights in float32 from the queries and the gathered keys the kernel
was given, over the keys the kernel was told each query may see (transformers' mask), and compares
the kernel's output with the output those weights give. Within the tolerance, the recomputed weights
are the ones the kernel used, and the oracle judges them as it judges `eager_paged`'s; past it, the
kernel computed something else (a key dropped or added inside it, an output written wrong), which is
a `kernel_mismatch`.

Why under the kernel's mask and not under the visibility provenance says is right: weights recomputed
over each query's own keys alone would be own by construction, so the oracle could never report a
foreign or stale read in an sdpa_paged run, and a wrong mask or block table (transformers' bug, not
the kernel's) would surface only as an unattributed mismatch. Recomputed under the mask, a faithful
kernel's weights are judged exactly as eager_paged's are (the same findings, naming the same
requests and sources), and a mismatch means the kernel itself.

The tolerance. Each output element is a softmax-weighted sum over the L keys a query sees,
o = sum_i p_i v_i with sum_i p_i = 1, so every rounding error in it is bounded by the largest |v_i|
the query sees (`scale`), and two computations of it in one dtype (SDPA's fused kernel against
kvviz's matmuls, summing in different orders) differ by a few units of that dtype's epsilon times
scale, growing with L as blocked and pairwise sums do, like log2 L (the worst case, L eps, is never
approached). The check allows

    |o_kernel - o_recomputed| <= MARGIN * eps(dtype) * log2(2L) * scale

per query, head and output element, with eps of the dtype the kernel computed in (float32: 2^-23).
Measured on clean runs (`python scripts/kernel_tolerance.py`: tiny-llama, tiny-gpt2 and SmolLM2 in
float32 on CPU, L from 1 to 1502, chunked prefill and decode), the largest difference was
MEASURED_MAX in those units (SmolLM2; the tiny random models 0.51), flat across L. MARGIN is 16,
about fifteen times that, because the difference doubled from the tiny random models to SmolLM2,
whose scores run larger, and a model with larger scores still must not have its clean runs
reported. In float32 the tolerance is then about 2e-6 log2(2L) scale, while a key k of weight p
dropped or added inside the kernel moves the output by about p |v_k - o|, of the order of p scale:
one key of average weight (p = 1/L) is caught up to L of about 30 000. bfloat16 kernels (CUDA) are
not measured yet; the same formula there (eps 2^-7) would allow about 0.13 log2(2L) scale and catch
gross errors only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MEASURED_MAX = 1.05  # the largest difference of clean runs, in eps * log2(2L) * scale (see above)
MARGIN = 16.0  # the tolerance, in eps * log2(2L) * scale


@dataclass
class KernelCheck:
    """One layer of one batch: the weights kvviz recomputed and how far the kernel's output is from theirs."""

    weights: torch.Tensor  # [H, T, K] float32: every head's attention of every packed query over the key axis
    excess: torch.Tensor  # [H, T] the largest |kernel - recomputed| of the query's output, in tolerances
    error: torch.Tensor  # [H, T] the same difference, in eps * log2(2L) * scale (what MARGIN is measured in)


def check(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    scaling: float | None,
    output: torch.Tensor,
    eps: float | None = None,
) -> KernelCheck:
    """query [H, T, D], key and value [KVH, K, D] (the kernel's inputs, gathered), visible [T, K] (what
    the kernel was told each query sees), output [T, H, D] (what it returned); eps: the epsilon of the
    dtype the kernel computed in, by default its output's."""
    H, T, D = query.shape
    groups = H // key.shape[0]
    # a query told to see nothing: the kernels' finite fill spreads its weight over every key, so here too
    visible = visible | ~visible.any(-1, keepdim=True)
    k = key.float().repeat_interleave(groups, 0)
    v = value.float().repeat_interleave(groups, 0)
    scores = torch.matmul(query.float(), k.transpose(1, 2)) * (D**-0.5 if scaling is None else scaling)
    weights = torch.softmax(scores.masked_fill(~visible, torch.finfo(torch.float32).min), dim=-1)
    ours = torch.matmul(weights, v)  # [H, T, D]
    diff = (output.transpose(0, 1).float() - ours).abs().amax(-1)  # [H, T]
    scale = torch.where(visible, v.abs().amax(-1)[:, None, :], 0.0).amax(-1)  # [H, T] largest |v| a query sees
    unit = (eps or torch.finfo(output.dtype).eps) * torch.log2(2 * visible.sum(-1)) * scale
    error = diff / unit.clamp(min=torch.finfo(torch.float32).tiny)
    return KernelCheck(weights, error / MARGIN, error)
