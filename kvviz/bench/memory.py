"""`python -m kvviz bench --memory`: how much of the allocated KV memory holds tokens, for the paged
pool as it runs and for a contiguous allocator replayed on the same requests (the seed's section 3.3:
about 60% contiguous, over 90% paged). The paged count is the pool's own after every step.

Two mixed workloads, arriving a few per step into one pool:
- chat: real instructions in the model's chat template, answers capped at 256 tokens and stopping at
  EOS, as a server sees them: a contiguous allocator must reserve the cap;
- exact: prompts of 32-256 random tokens, each generating a known 16-128 tokens (EOS ignored), so the
  reservation is exact and contiguous loses only to growth and fragmentation: its kindest case.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from ..analysis.memory import ARTICLE, ContiguousReplay, Usage, contiguous_replay, overall, spans
from ..engine import Engine, EngineConfig, StepRecord
from ..engine.workload import RequestSpec, Workload
from ..models import LoadedModel

CHAT_CAP = 256
INSTRUCTIONS = (
    "Name a colour.", "What is the capital of France?", "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.", "List three fruits.", "Say hello in Spanish.",
    "Write a short story about a robot who learns to paint.", "What is 12 times 12?",
    "Describe the water cycle.", "Give me a name for a cat.", "Why is the sky blue?",
    "Write a limerick about a programmer.", "Translate 'thank you' into German.",
    "Summarise the plot of Romeo and Juliet.", "What does a CPU do?", "Suggest a weekend activity.",
    "Write a polite email declining a meeting.", "How many legs does a spider have?",
    "Explain photosynthesis to a child.", "What is the opposite of cold?", "Write two lines of a poem about rain.",
    "Give three tips for learning a language.", "What is the boiling point of water?",
    "Describe your ideal breakfast.", "Write a recipe for a simple salad.", "Who wrote Hamlet?",
    "Explain what an operating system is.", "Name a planet.", "What is a prime number?",
    "Write a motivational sentence.", "Describe a sunset in one paragraph.", "What is the largest ocean?",
)


@dataclass
class MemoryResult:
    case: str
    requests: int
    capacity: int  # slots, for both allocators
    paged: list[Usage]
    contiguous: ContiguousReplay
    generated: int

    @property
    def paged_utilisation(self) -> float | None:
        return overall(self.paged)

    @property
    def contiguous_utilisation(self) -> float | None:
        return overall(self.contiguous.usage)


def chat_workload(model: LoadedModel, n: int, rng: random.Random) -> list[RequestSpec]:
    tok = model.tokenizer
    out = []
    for i in range(n):
        text = INSTRUCTIONS[i % len(INSTRUCTIONS)]
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
        else:  # a tiny test model has no template: the instruction alone
            ids = tok(text).input_ids
        out.append(RequestSpec(f"chat{i}", prompt_ids=list(ids), max_new_tokens=CHAT_CAP, arrival_step=i // 2 * 3))
    return out


def exact_workload(vocab: int, n: int, rng: random.Random) -> list[RequestSpec]:
    return [RequestSpec(f"exact{i}", prompt_ids=[rng.randrange(100, vocab) for _ in range(rng.randrange(32, 257))],
                        max_new_tokens=rng.randrange(16, 129), ignore_eos=True, arrival_step=i // 2 * 3)
            for i in range(n)]


def measure(model: LoadedModel, name: str, reqs: list[RequestSpec], block_size: int = 16) -> MemoryResult:
    """Run the requests on a pool sized for about half of them at their longest, and replay them
    contiguously in the same number of slots."""
    longest = [len(r.prompt_ids) + r.max_new_tokens for r in reqs]
    num_blocks = max(-(-max(longest) // block_size), -(-sum(longest) // (2 * block_size)))
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_batch_tokens=512, compute="fast")
    paged: list[Usage] = []
    work: list[tuple[int, str, int]] = []

    def on_step(rec: StepRecord) -> None:
        snap = rec.snapshot
        paged.append(Usage(rec.step, snap.live_slots(), (len(snap.refcounts) - len(snap.free_queue)) * block_size))
        work.extend((rec.step, req, start + n) for req, (start, n) in rec.work.items())

    res = Engine(model, cfg).run(Workload(reqs, cfg), on_step=on_step)
    capacity = num_blocks * block_size
    given = {r.id: r for r in reqs}
    replay = contiguous_replay(spans(((r.id, r.arrival_step, len(r.prompt_ids) + given[r.id].max_new_tokens)
                                      for r in res.requests), work), capacity)
    return MemoryResult(name, len(reqs), capacity, paged, replay, res.stats.generated_tokens)


def run_memory_bench(model: LoadedModel, sizes: list[int], progress: Callable[[str], None] = print,
                     seed: int = 0) -> list[MemoryResult]:
    out = []
    for n in sizes:
        rng = random.Random(seed)
        for name, reqs in ((f"chat-{n}", chat_workload(model, n, rng)),
                           (f"exact-{n}", exact_workload(model.config.vocab_size, n, rng))):
            out.append(measure(model, name, reqs))
            r = out[-1]
            progress(f"{name:>10}  paged {_pct(r.paged_utilisation)}  contiguous {_pct(r.contiguous_utilisation)}")
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def memory_report(model: LoadedModel, results: list[MemoryResult]) -> str:
    lines = [f"Model `{model.name}`, device {model.device}. Memory utilisation: allocated KV slots holding a token, "
             "summed over every step; both allocators in the same slots. chat-N: N instructions in the chat "
             f"template, answers capped at {CHAT_CAP} tokens, stopping at EOS; exact-N: N random prompts of 32-256 "
             "tokens generating a known 16-128 tokens each (a contiguous reservation is exact).", "",
             "| case | requests | slots | paged | contiguous | article (paged / contiguous) | steps paged | "
             "steps contiguous | fragmented steps | tokens generated |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r.case} | {r.requests} | {r.capacity} | {_pct(r.paged_utilisation)} | "
                     f"{_pct(r.contiguous_utilisation)} | >{ARTICLE['paged']:.0%} / ~{ARTICLE['contiguous']:.0%} | "
                     f"{len(r.paged)} | {len(r.contiguous.usage)} | {r.contiguous.fragmented_steps} | "
                     f"{r.generated} |")
    lines.append("\nContiguous: each request reserves prompt + max_new_tokens on arrival, first fit; it advances "
                 "as it did in the paged run once placed. Fragmented steps: the first waiting request found no "
                 "region although enough slots were free in total.")
    return "\n".join(lines) + "\n"
