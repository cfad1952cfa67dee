"""How far llama.cpp's batched runs are from each request run alone: the figure the llama.cpp backend's
reference tolerance (kvviz.llama_backend.TOLERANCE) is set from, and docs/engines.md's table.

    python scripts/llama_variance.py [--model smollm2] [--new 16] [--streams]

Runs the catalogue's clean workloads (and the passphrase requests) through llama.cpp with both attention
kernels, every request judged by both oracles, and prints per workload: the foreign mass (0 on a clean
run), the findings (a kernel_mismatch says flash attention's tolerance is too tight), how many requests
came out different from themselves run alone (a near tie flipped), and the largest logit difference.
With --streams it compares instead llama.cpp's unified cache (isolation 'masked') with a stream per
sequence (isolation 'streams', kv_unified off) on the same workloads: what each computes and shares.
Timing does not matter here: it runs under any load.
"""

from __future__ import annotations

import argparse

import torch

from kvviz.catalogue.scenarios import SCENARIOS
from kvviz.engine.workload import Workload
from kvviz.llama_backend import TOLERANCE, alone
from kvviz.models import load_model
from kvviz.runners.checked import run_checked

NAMES = ("passphrase", "control_shared_system_prompt", "control_tenants", "control_forks")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--new", type=int, default=16, help="tokens each request generates")
    ap.add_argument("--streams", action="store_true", help="compare the unified cache with a stream per sequence")
    args = ap.parse_args()
    model = load_model(args.model, device="cpu")
    if args.streams:
        return compare_streams(model, args.new)
    print(f"| workload | kernel | requests | foreign mass | findings | outputs differ from alone | greedy flips "
          f"| largest logit difference (tolerance {TOLERANCE}) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in NAMES:
        wl = SCENARIOS[name].build(model.tokenizer)
        for r in wl["requests"]:
            r["max_new_tokens"] = args.new
        for kernel in ("eager_paged", "flash_attn"):
            wl["engine"] = {"backend": "llama.cpp", "block_size": 16, "num_blocks": 64, "kernel": kernel}
            workload = Workload.from_dict(wl)
            run = run_checked(model, workload)
            rerun = alone(workload)
            flips = sum(bool((rerun(model, r.prompt_ids, r.output_ids).argmax(-1) != torch.tensor(r.output_ids)).any())
                        for r in run.result.requests)
            differ = sum(d.max_logit_diff > 0 for d in run.divergences)
            print(f"| {name} | {kernel} | {len(run.result.requests)} | {run.summary()['leak']['max_foreign_mass']} "
                  f"| {len(run.findings)} | {differ} | {flips} | "
                  f"{max(d.max_logit_diff for d in run.divergences):.3f} |")


def compare_streams(model, new: int) -> None:
    print("| workload | isolation | prompt tokens | computed | served from cells | foreign mass | findings "
          "| largest logit difference from alone |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in NAMES:
        wl = SCENARIOS[name].build(model.tokenizer)
        for r in wl["requests"]:
            r["max_new_tokens"] = new
        for isolation in ("masked", "streams"):
            wl["engine"] = {"backend": "llama.cpp", "block_size": 16, "num_blocks": 64, "isolation": isolation}
            run = run_checked(model, Workload.from_dict(wl))
            st = run.result.stats
            print(f"| {name} | {isolation} | {st.prompt_tokens} | {st.prefill_tokens_computed} | {st.cached_tokens} "
                  f"| {run.summary()['leak']['max_foreign_mass']} | {len(run.findings)} "
                  f"| {max(d.max_logit_diff for d in run.divergences):.3f} |")


if __name__ == "__main__":
    main()
