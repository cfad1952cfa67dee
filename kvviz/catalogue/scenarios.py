"""Replayable scenarios: a workload, an optional fault, the finding expected, and why.

The seed's three leak patterns come first, then one scenario per catalogue fault, then the clean
controls. Every scenario with a fault has a control: the same workload with the correct defences,
which must stay exactly clean.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from ..errors import WorkloadError
from .faults import FAULTS

SYSTEM = "You are a helpful assistant. Answer in one short sentence."


def _req(rid: str, prompt: str, new: int = 6, **kw) -> dict:
    return {"id": rid, "prompt": prompt, "max_new_tokens": new, **kw}


def _engine(**kw) -> dict:
    return {"block_size": 4, "num_blocks": 128, "max_batch_tokens": 256, **kw}


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    explanation: str
    workload: dict
    fault: str | None = None
    tight_pool: bool = False  # size the pool to the largest request + 1 block, for any tokenizer
    host_share: float = 1.0  # a tight pool's host tier (offloading), as a share of the pool
    prefix_block: str | None = None  # the block size is this text's token count: a shared prefix of one block

    def build(self, tokenizer) -> dict:
        """The workload for a model, a copy the caller owns (sessions share the catalogue): a tight pool
        and a prefix-sized block are sized from this tokenizer's token counts."""
        wl = copy.deepcopy(self.workload)
        if self.prefix_block is not None:
            wl["engine"]["block_size"] = len(tokenizer(self.prefix_block).input_ids)
        if self.tight_pool:
            B = wl["engine"]["block_size"]
            longest = max(len(tokenizer(r["prompt"]).input_ids) + r["max_new_tokens"] for r in wl["requests"])
            wl["engine"]["num_blocks"] = -(-longest // B) + 1
            if wl["engine"].get("offload"):
                wl["engine"]["offload"] = {"cpu_blocks": max(1, int(wl["engine"]["num_blocks"] * self.host_share))}
        return wl

    @property
    def expected(self) -> tuple[str, ...]:
        """Finding kinds the provenance oracle must raise (any of them); () for a clean control."""
        return FAULTS[self.fault].expected if self.fault else ()


_TWO_MASKED = {"requests": [_req("A", "Passphrase: red orange yellow"), _req("B", "Password: green cyan blue")],
               "engine": _engine(isolation="masked")}
_THREE = {"requests": [_req("A", "The capital of France is"), _req("B", "Water boils at a temperature of", 8),
                       _req("C", "One, two, three, four,", 5, arrival_step=2)]}
_CHAT = {"requests": [_req(f"u{i}", f"{SYSTEM}\nUser: {q}\nAssistant:", 8, arrival_step=i)
                      for i, q in enumerate(["What colour is the sky?", "Name a prime number.",
                                             "What is the capital of Italy?", "How many legs has a spider?"])],
         "engine": _engine()}


def _two_tenants(a: dict, b: dict) -> dict:
    """The same system prompt from A and, two steps later, B, each with its namespaces."""
    return {"requests": [_req("A", SYSTEM + " Hi.", 4, **a), _req("B", SYSTEM + " Hello.", 4, arrival_step=2, **b)],
            "engine": _engine()}


_DISAGGREGATED = {"requests": [_req("A", "The capital of France is"), _req("B", "Water boils at a temperature of", 8,
                                                                           arrival_step=1)],
                  "engine": _engine(disaggregated=True)}


def _offload() -> dict:
    """A's system prompt is pushed out of a tight device pool by two other prompts, then sent again."""
    return {"requests": [_req("A", SYSTEM, 1), _req("B", "Unrelated filler text " * 6, 2, arrival_step=1),
                         _req("D", "Different words to push the filler out " * 3, 2, arrival_step=4),
                         _req("C", SYSTEM + " Again.", 6, arrival_step=7)],
            "engine": _engine(offload={"cpu_blocks": 1})}


def _salted_offload() -> dict:
    """The offload workload with A's prompt from one tenant and C's, the same words, from another."""
    wl = _offload()
    for r in wl["requests"]:
        r["cache_salt"] = "tenant-b" if r["id"] == "C" else "tenant-a"
    return wl


_CANCELLED_PREFILL = {"requests": [_req("A", SYSTEM + " Hi.", 4, cancel_step=1),
                                   _req("C", SYSTEM + " Again.", 6, arrival_step=2)],
                      "engine": _engine(max_batch_tokens=6)}


def _session(keep: int) -> dict:
    """A chat turn, then the same session resubmitted cut to its first `keep` tokens with a new question."""
    return {"requests": [_req("A", "User: Name three colours.\nAssistant:", 8),
                         _req("B", " Name three fruits instead.", 6, parent="A", truncate=keep, arrival_step=12)],
            "engine": _engine()}


def _three(isolation: str) -> dict:
    return {**_THREE, "engine": _engine(isolation=isolation)}


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("passphrase", "The seed's passphrase experiment",
             "Requests 红 橙 黄 and 绿 青 蓝 (and an English pair) share one key axis, isolated by the "
             "block-diagonal AND causal mask alone. Run it to see A's last prompt token attend only to its own "
             "slots; the boundary scenario (or any run with its fault set to boundary: --fault boundary) shows "
             "it reach into B's.",
             {"requests": [_req("A", "红 橙 黄"), _req("B", "绿 青 蓝"),
                           _req("C", "red orange yellow"), _req("D", "green cyan blue")],
              "engine": _engine(isolation="masked")}),
    Scenario("boundary", "Boundary leak",
             "Two requests sit next to each other in the shared buffer, A 'Passphrase: red orange yellow' and B "
             "'Password: green cyan blue'; a mask off by one at the edge lets A's last query see B's first slot "
             "('Password'): its last prompt token (yellow), then each token it generates. The weight is modest "
             "(the seed saw 0.20); on some models it is enough to change the continuation (the side-by-side "
             "says whether it did). The seed's own pair, 黄 attending 绿: the passphrase scenario with this "
             "fault.", _TWO_MASKED, "boundary"),
    Scenario("global", "Global leak",
             "The isolation mask is lost: every token of A sees every token of B, with foreign weight spread "
             "roughly as B's share of the buffer. The output is nonsense.", _TWO_MASKED, "global"),
    Scenario("positional", "Positional leak in a multi-turn chat",
             "Users share a system prompt through the prefix cache. On every other step the first block after "
             "the shared prefix resolves to the previous user's block: small, intermittent weight on another "
             "user's turn, and sometimes an answer to the wrong question.", _CHAT, "positional"),
    Scenario("padding_as_isolation", "Padding mask used as the isolation mask",
             "The mask separates real tokens from padding, not request from request: packed requests read "
             "each other's earlier tokens.", _three("masked"), "padding_as_isolation"),
    Scenario("softmax_then_mask", "Mask applied after softmax",
             "The normaliser already contains the masked logits: the kept weights sum to less than 1. No "
             "foreign weight survives, so only the normalisation check sees it.", _three("paged"),
             "softmax_then_mask"),
    Scenario("additive_mask_sum", "Masks summed instead of combined with AND",
             "0/1 isolation and causal planes are added: a key that passes either passes, so other requests' "
             "early positions become visible.", _three("masked"), "additive_mask_sum"),
    Scenario("low_precision_fill", "Finite fill under float16",
             "Masked logits are filled with -1e4 in float16; with logits as large as some models produce, the "
             "fill no longer hides masked keys, and a fully masked row would attend uniformly.",
             _three("masked"), "low_precision_fill"),
    Scenario("zero_block_table", "Page table of zeros",
             "Attention reads through a page table that points every logical block at physical block 0, "
             "which holds another request's keys.", _three("paged"), "zero_block_table"),
    Scenario("missing_cow", "Fork without copy-on-write",
             "A parallel-sampling fork shares its parent's partial last block; without copy-on-write both write "
             "their next tokens into it and each reads the other's.",
             {"requests": [_req("P", "List three fruits:", 10), _req("F", "", 8, parent="P", arrival_step=1),
                           _req("G", " and", 8, parent="P", arrival_step=2)],
              "engine": _engine(block_size=64, num_blocks=16)}, "missing_cow"),
    Scenario("early_free", "Shared block freed early (use after free)",
             "A fork shares its parent's blocks; when the parent finishes, its blocks are freed although the "
             "fork still reads them, and the next request's keys are written over them.",
             {"requests": [_req("P", SYSTEM, 2), _req("F", " Sure.", 16, parent="P", arrival_step=1),
                           _req("C", "Completely different words now fill the freed blocks", 8, arrival_step=3)],
              "engine": _engine(prefix_caching=False)}, "early_free"),
    Scenario("stale_hash", "Stale hash entry after eviction",
             "A cached prefix is evicted under pressure but its hash entry survives; a later request with the "
             "same prefix 'hits' a block that now holds someone else's keys.",
             {"requests": [_req("A", SYSTEM, 1), _req("B", "Unrelated filler text " * 6, 8, arrival_step=1),
                           _req("C", SYSTEM + " Again.", 6, arrival_step=3)],
              "engine": _engine()}, "stale_hash", tight_pool=True),
    Scenario("unsalted_prefix", "Prefix cache shared across tenants",
             "Two tenants send the same system prompt; without the salt their prefix blocks are shared. "
             "Attention is correct (the content is identical), yet a trust boundary is crossed: the timing side "
             "channel of prompt caching. Only the cross-tenant check sees it.",
             _two_tenants({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}), "unsalted_prefix"),
    Scenario("wrong_slot_mapping", "Slot mapping assumes contiguous slots",
             "Two requests finish and free their blocks; the next prompt gets those recycled blocks, which are "
             "not physically contiguous. Writes that assume contiguous slots land in the wrong blocks: the "
             "request reads holes where its keys should be.",
             {"requests": [_req("P", "First short prompt", 1), _req("Q", "Second short prompt", 1),
                           _req("B", "A longer prompt written into recycled, scattered blocks", 4, arrival_step=1)],
              "engine": _engine(block_size=2, prefix_caching=False)}, "wrong_slot_mapping"),
    Scenario("offload_wrong_block", "Offloaded block restored from the wrong host block",
             "A's system prompt is evicted from the device pool by B and kept on the host tier; C sends the same "
             "prompt and its blocks are restored, each from the host block next to the right one: C reads keys "
             "of other positions, or never written.", _offload(), "offload_wrong_block", tight_pool=True),
    Scenario("offload_stale_restore", "Host block overwritten after its hash was kept",
             "The host tier holds half the pool: offloading B's and D's blocks takes the host blocks that held A's "
             "prompt, but their hashes stay. When C sends A's prompt, it 'hits' on the host and restores others' "
             "keys.", _offload(), "offload_stale_restore", tight_pool=True, host_share=0.5),
    Scenario("transfer_wrong_request", "Disaggregated prefill: the wrong request's K/V",
             "A prefill instance computes each prompt and transfers its K/V to the decode instance. The transfer "
             "sends what the buffer held before: B decodes on A's prompt and answers A's question.",
             _DISAGGREGATED, "transfer_wrong_request"),
    Scenario("transfer_failed_silently", "Disaggregated prefill: a failed transfer that says ok",
             "The transfer fails but reports success: the decode instance's blocks were never written, and every "
             "request decodes on whatever they held, with a success status.", _DISAGGREGATED,
             "transfer_failed_silently"),
    Scenario("untagged_namespace", "A salt and an adapter of the same name",
             "Tenant A's requests carry the salt 'foo'; B runs under an adapter that is also called 'foo'. With "
             "namespaces hashed untagged both become the extra key 'foo': B reuses blocks whose keys and values the "
             "base model computed for A, though its adapter would have computed others. kvviz simulates adapters as "
             "namespaces only (no adapter weights), so B's output still matches B run alone: the reference oracle "
             "labels B a leak with no divergent step, and the provenance oracle shows the foreign reads.",
             _two_tenants({"cache_salt": "foo"}, {"adapter": "foo"}), "untagged_namespace"),
    Scenario("stale_hash_after_truncate", "Stale hashes after a session is truncated",
             "A chat turn finishes; the user edits it, and the session is resubmitted cut to its first 8 tokens "
             "with a new question. Keeping every old block hash makes the new question's blocks 'hit' the old "
             "turn's: the request reads the old tokens' keys where its new ones belong.", _session(8),
             "stale_hash_after_truncate"),
    Scenario("partial_hash_promoted", "A partial block's outdated hash promoted",
             "The session is cut inside a block (10 tokens, blocks of 4): the cut block keeps the hash it had when "
             "it was full of the old tokens, and when the new question fills it, that hash names it.",
             _session(10), "partial_hash_promoted"),
    Scenario("host_tier_unsalted", "A salted device cache over a host tier keyed by tokens",
             "Tenants a and b send the same system prompt, each with its salt. On the device their blocks never "
             "meet; but a's blocks were pushed out to the host tier, which keys blocks by their tokens alone, and "
             "b's lookup restores them from there. Attention is correct (the same words), a trust boundary is "
             "crossed: the cross-tenant check sees it.", _salted_offload(), "host_tier_unsalted", tight_pool=True),
    Scenario("hash_before_write", "A block's hash published before its K/V are written",
             "A's prompt is prefilled in chunks of 6 tokens with blocks of 4: the first chunk fills block 0 and half "
             "of block 1, and the engine registers block 1's hash already, for the tokens it will hold. The client "
             "goes away before the next chunk (cancel_step 1). C sends the same prompt and 'hits' block 1, whose "
             "last two slots nobody wrote.", _CANCELLED_PREFILL, "hash_before_write"),
    Scenario("offload_after_free", "An offload copy that runs after the block was given away",
             "B's prompt takes the device block that held A's system prompt; the copy of A's block to the host tier "
             "runs a step late, after B's forward wrote into it. The host keeps the mix under A's hash, and when C "
             "sends A's prompt it restores B's keys.", _offload(), "offload_after_free", tight_pool=True),
    Scenario("wrong_key_insert", "K/V computed from other inputs inserted under the plain key",
             "A runs under an adapter ('style'), so its K/V are not the base model's. The engine rightly skips the "
             "lookup for it, but inserts its blocks under the plain token key; B sends the same system prompt with "
             "no adapter and hits them. As with the adapters of untagged_namespace, kvviz runs no adapter weights: "
             "the provenance oracle sees the foreign reads, the reference oracle does not.",
             _two_tenants({"adapter": "style"}, {}), "wrong_key_insert"),
    Scenario("block_boundary", "A shared prefix that ends exactly on a block boundary",
             "The block size is the system prompt's length in tokens, so A's and B's shared prefix is exactly one "
             "block. B hits it and starts its own tokens on the boundary; an off-by-one writes B's first token into "
             "the last shared block: A, still decoding, reads B's key there, and B reads a hole where its own "
             "should be.",
             {"requests": [_req("A", SYSTEM + " Hi.", 8), _req("B", SYSTEM + "\nUser: Hello.", 4, arrival_step=2)],
              "engine": _engine()}, "block_boundary", prefix_block=SYSTEM),
    Scenario("uncounted_restore", "A reply that reports none of the tokens it was served",
             "C sends A's system prompt after it was pushed out to the host tier, and is served it from there. The "
             "engine counts only device hits in what it reports, so C's reply says 0 cached tokens while it decoded "
             "on A's K/V. No attention figure moves (the content is right): the telemetry check compares the "
             "reply with what the oracle saw.", _offload(), "uncounted_restore", tight_pool=True),
    Scenario("control_shared_system_prompt", "Control: a shared system prompt",
             "Users share a system prompt through the prefix cache with correct defences: zero foreign weight.",
             _CHAT),
    Scenario("control_tenants", "Control: many tenants with salts",
             "Six requests from three tenants with the same system prompt: salts keep each tenant's blocks apart.",
             {"requests": [_req(f"r{i}", f"{SYSTEM} Question {i}?", 4, cache_salt=f"tenant-{i % 3}", arrival_step=i)
                           for i in range(6)], "engine": _engine()}),
    Scenario("control_forks", "Control: forks with copy-on-write",
             "Parallel samples forked from one prompt share its blocks and copy the partial one on first write.",
             {"requests": [_req("P", "List three fruits:", 10), _req("F", "", 8, parent="P", arrival_step=1),
                           _req("G", " and", 8, parent="P", arrival_step=2)],
              "engine": _engine(block_size=64, num_blocks=16)}),
]}


class UnknownScenario(WorkloadError):
    pass


def scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise UnknownScenario(f"unknown scenario {name!r}; try: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]
