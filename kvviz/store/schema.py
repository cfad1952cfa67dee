"""The run store's schema, declared once: the DDL, the Arrow types the recorder and the capture import
build, and the kvviz trace's tables all come from here, so the public trace format cannot drift from
the database.

Version 2 added token_text, version 3 the positional_entropy view, version 4 steps.live_slots, the
kv_slot_utilisation view, the timing audits, cache_lookups and the cache detail of block_events, version
5 replicas, tiers and KV groups of captures (and datasets registered in place), version 6 each capture
block's lifetime, idle time and reuse gap, version 7 the host tier of offloading (block_events.medium,
host_blocks), adapters and disaggregated prefill (kv_transfers), version 8 what each transfer moved
(kv_transfers.from_blocks, to_blocks, kv_of, intact), version 9 the explanations `kvviz explain` keeps
(lookup_explanations, runs.explained_at), version 10 whether a capture's store names its own salt
(kv_event_rows.salt_named) and the block and step range of a cross-tenant read (findings.block,
last_step), version 11 the timing audits' verdicts and controls, version 12 the engine that ran each run
(runs.backend: kvviz's own or transformers' continuous batching; older engine runs are kvviz's) and
block_lifetimes per block of an engine run (two blocks can hold one hash) ended by a reset
(block_events kind clear), version 13 the keys each recorded query could see written once
(attention_keys) instead of in each of its rows (attention_rows; `attention` is the view that joins
them back), version 14 attention rows a recorder writes as Parquet parts beside the store
(attention_parts: the `attention` view reads them where they lie), version 15 what a run's engine said of it
(runs.notes), version 16 its replays under other caches (whatif_points), version 17 the paired timing audit (same-user
and cross-user hits in one schedule: the control's test, the primers' max_tokens, the server's own cached-token
counts and any contradiction between them and timing), version 18 the KV-event contract's breaches of each capture
(capture_breaches) and the evidence the linter reads in its rows (kv_event_rows.tokens_given, parent_cached), and
the timing audit's order channel (timing_audits.channel and dummies, timing_samples.rank), version 19 the blocks
a capture keeps salted in one tier and unsalted in another (cross_tier_salts); older files are upgraded in place
by the idempotent DDL.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

SCHEMA_VERSION = "19"
# Versions whose files the idempotent DDL brings up to date.
UPGRADABLE = {"1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16", "17", "18"}

_ARROW = {"VARCHAR": pa.string(), "JSON": pa.string(), "TIMESTAMP": pa.timestamp("us"), "BIGINT": pa.int64(),
          "INTEGER": pa.int32(), "DOUBLE": pa.float64(), "FLOAT": pa.float32(), "BOOLEAN": pa.bool_(),
          "UBIGINT": pa.uint64(), "UTINYINT": pa.uint8()}


@dataclass(frozen=True)
class Column:
    name: str
    sql: str  # DuckDB type; "X[]" is a list of X
    note: str = ""
    in_trace: bool = True  # part of the kvviz trace format (run_id never is: the manifest holds it)
    added_in: str | None = None  # the schema version that added it to an existing table: older files and
    # traces lack it (upgraded files hold null there; a trace without it imports with null)

    @property
    def arrow(self) -> pa.DataType:
        if self.sql.endswith("[]"):
            return pa.list_(_ARROW[self.sql[:-2]])
        return _ARROW[self.sql]


@dataclass(frozen=True)
class Table:
    name: str
    note: str
    columns: tuple[Column, ...]
    in_trace: bool = True  # exported and imported with a run as a kvviz trace
    key: str | None = None  # a primary key column
    stored_as: str | None = None  # the base table holding its rows, when `name` is a view over it

    @property
    def base(self) -> str:
        """Where inserts go."""
        return self.stored_as or self.name

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)

    def ddl(self) -> str:
        """CREATE TABLE, and the notes as comments in the file (the SQL page's schema shows them)."""
        cols = ",\n".join(f"    {c.name} {c.sql}{' PRIMARY KEY' if c.name == self.key else ''}" for c in self.columns)
        comments = [f"COMMENT ON TABLE {self.base} IS {_quote(self.note)};"]
        comments += [f"COMMENT ON COLUMN {self.base}.{c.name} IS {_quote(c.note)};" for c in self.columns if c.note]
        added = [f"ALTER TABLE {self.base} ADD COLUMN IF NOT EXISTS {c.name} {c.sql};" for c in self.columns
                 if c.added_in]
        return f"CREATE TABLE IF NOT EXISTS {self.base} (\n{cols}\n);\n" + "\n".join(added + comments)

    def required_in_trace(self) -> list[str]:
        """Trace columns a trace must hold: every one but those added after traces were first written."""
        return [c for c in self.trace_columns() if not self.column(c).added_in]

    def trace_columns(self) -> list[str]:
        return [c.name for c in self.columns if c.in_trace and c.name != "run_id"]


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _cols(spec: str) -> tuple[Column, ...]:
    """'name TYPE, name TYPE' -> columns (every table of a run starts with run_id)."""
    return tuple(Column(*part.split()) for part in spec.split(","))


RUN_ID = "run_id VARCHAR, "
TABLES: dict[str, Table] = {t.name: t for t in (
    Table("meta", "The schema version and other facts about the file.", _cols("key VARCHAR, value VARCHAR"),
          in_trace=False, key="key"),
    Table("runs", "One row per run: how it was made and its leak summary.", (
        Column("run_id", "VARCHAR"), Column("created_at", "TIMESTAMP"),
        Column("status", "VARCHAR", "running | complete | failed"),
        Column("error", "VARCHAR", "why a failed run failed", in_trace=False),
        Column("model", "VARCHAR"), Column("model_fingerprint", "VARCHAR", "sha256 of the weights' source"),
        Column("scenario", "VARCHAR"), Column("fault", "VARCHAR"),
        Column("fault_scope", "JSON", "where the fault was confined, or null"), Column("seed", "BIGINT"),
        Column("engine", "JSON", "EngineConfig"), Column("workload", "JSON", "the workload as given"),
        Column("kvviz_version", "VARCHAR"), Column("steps", "INTEGER"), Column("seconds", "DOUBLE"),
        Column("generated_tokens", "INTEGER"), Column("max_foreign_mass", "DOUBLE"), Column("leak_rate", "DOUBLE"),
        Column("findings", "INTEGER"),
        Column("explained_at", "TIMESTAMP", "when its lookups were explained and kept in lookup_explanations",
               in_trace=False, added_in="9"),
        Column("backend", "VARCHAR", "the engine that ran it: kvviz (kvviz's own) | transformers (Hugging Face "
               "transformers' continuous batching, observed) | llama.cpp (observed); null for a capture",
               added_in="12"),
        Column("notes", "VARCHAR[]", "what the run's engine ran with a stated consequence (a salt it has not) and "
               "said once it ran (a misuse that never struck)", in_trace=False, added_in="15")), key="run_id"),
    Table("requests", "Each request of a run and what it generated.", _cols(
        RUN_ID + "request_id VARCHAR, tenant VARCHAR, parent VARCHAR, prompt_ids INTEGER[], output_ids INTEGER[], "
        "text VARCHAR, arrival_step INTEGER, first_token_step INTEGER, finish_step INTEGER, finish_reason VARCHAR, "
        "cached_tokens INTEGER")),
    Table("token_text", "The text of each token id the run's requests hold (labels without the tokenizer).",
          _cols(RUN_ID + "token_id INTEGER, text VARCHAR")),
    Table("steps", "One row per scheduler step.", (
        *_cols(RUN_ID + "step INTEGER, seconds DOUBLE, free_blocks INTEGER"),
        Column("live_slots", "INTEGER", "slots holding a computed token of a request still holding the block (a "
               "shared block counts once); allocated slots are (num_blocks - free_blocks) x block_size",
               added_in="4"))),
    Table("slot_writes", "Slot provenance as a log: where each step wrote each request's K/V (replayed with the "
          "cow block_events it gives every slot's writer, position and token).", _cols(
              RUN_ID + "step INTEGER, request_id VARCHAR, position INTEGER, token INTEGER, slot INTEGER, "
              "block INTEGER, lifetime INTEGER")),
    Table("step_work", "What each step computed: request_id computed positions [start, start + tokens).", _cols(
        RUN_ID + "step INTEGER, request_id VARCHAR, start INTEGER, tokens INTEGER, admitted BOOLEAN, "
        "preempted BOOLEAN, sampled_token INTEGER, finished BOOLEAN")),
    Table("page_tables", "Page tables after each step.", _cols(
        RUN_ID + "step INTEGER, request_id VARCHAR, logical_block INTEGER, physical_block INTEGER")),
    Table("blocks", "Every block after each step. state: free | cached (free, hash kept) | used | reserved "
          "(no request's: transformers' trash blocks, last).", _cols(
        RUN_ID + "step INTEGER, block INTEGER, refcount INTEGER, hash UBIGINT, lifetime INTEGER, state VARCHAR")),
    Table("kv_transfers", "Disaggregated prefill: each request handed from the prefill instance to the decode "
          "instance, with the blocks and bytes of K/V sent and the status the transfer reported.", (
              *_cols(RUN_ID + "step INTEGER, request_id VARCHAR, blocks INTEGER, bytes BIGINT, status VARCHAR"),
              Column("from_blocks", "INTEGER[]", "the prefill instance's blocks sent", added_in="8"),
              Column("to_blocks", "INTEGER[]", "the decode instance's blocks that received them", added_in="8"),
              Column("kv_of", "VARCHAR[]", "who wrote the K/V the received slots hold after the transfer, by "
                     "slot provenance (the request, a request it hit or forked from; unwritten: slots the transfer "
                     "never wrote)", added_in="8"),
              Column("intact", "BOOLEAN", "every received slot holds the K/V of this request's own tokens at its "
                     "position (the provenance rule for own)", added_in="8"))),
    Table("host_blocks", "The host tier of an offloading run after each step: each host block's hash, if it holds "
          "an offloaded block (state cached) or not (free).", _cols(
              RUN_ID + "step INTEGER, block INTEGER, hash UBIGINT, state VARCHAR")),
    Table("block_events", "Every change to a block, in order within the step. kind: allocate | hit | share | free "
          "| preempt | cow (block is the copy of source) | cache | evict | clear (a reset of the prefix cache took its "
          "hash); with a host tier also offload (block's "
          "content copied to host block source) | restore (host block source copied into block) | host_evict "
          "(host block lost its hash); disaggregated also transfer (block received the K/V of the prefill instance's "
          "block source: the copy made, which a faulty transfer may make from the wrong block or not at all).", (
              *_cols(RUN_ID + "step INTEGER, seq INTEGER, kind VARCHAR, block INTEGER, request_id VARCHAR, "
                     "refcount INTEGER, source INTEGER"),
              Column("hash", "UBIGINT", "cache: the hash given; evict, clear: the hash taken away", added_in="4"),
              Column("parent_hash", "UBIGINT", "cache: the hash of the block before it in its chain", added_in="4"),
              Column("token_ids", "INTEGER[]", "cache: the block's tokens", added_in="4"),
              Column("salt", "VARCHAR", "cache: the salt of the request that cached it", added_in="4"),
              Column("adapter", "VARCHAR", "cache: the adapter of the request that cached it", added_in="7"),
              Column("medium", "VARCHAR", "the tier block is on: GPU (the device pool) or CPU (the host tier)",
                     added_in="7"))),
    Table("cache_lookups", "Each prefix-cache lookup at a request's admission (a re-admission after preemption "
          "too): the prompt tokens looked up and the tokens the cache served.", _cols(
              RUN_ID + "step INTEGER, request_id VARCHAR, salt VARCHAR, tokens INTEGER, hit_tokens INTEGER")),
    Table("leak_metrics", "The provenance oracle per (step, request, layer, head), reduced over the queries.", _cols(
        RUN_ID + "step INTEGER, request_id VARCHAR, layer INTEGER, head INTEGER, max_foreign DOUBLE, "
        "sum_foreign DOUBLE, leak_rows INTEGER, rows INTEGER, sum_entropy DOUBLE")),
    Table("attention", "Attention rows: the key slots one query read, their weights and classes (0 own, 1 foreign, "
          "2 stale); head -1 is the mean over heads. Stored in attention_rows, whose key lists are null where the "
          "row read its query's keys (attention_keys); this view joins them back.", _cols(
              RUN_ID + "step INTEGER, layer INTEGER, head INTEGER, request_id VARCHAR, position INTEGER, "
              "key_slots INTEGER[], weights FLOAT[], key_classes UTINYINT[]"), stored_as="attention_rows"),
    Table("attention_keys", "The key slots a recorded query could see at a step and their classes, once for all "
          "of its attention rows (every layer and head).", _cols(
              RUN_ID + "step INTEGER, request_id VARCHAR, position INTEGER, key_slots INTEGER[], "
              "key_classes UTINYINT[]"), in_trace=False),
    Table("attention_parts", "Runs whose recorded attention rows are Parquet parts beside the store "
          "(STORE_FOLDER/attention/RUN_ID/*.parquet, each a complete file): the view `attention` reads them with "
          "attention_rows.", _cols("run_id VARCHAR"), in_trace=False),
    Table("kv_event_rows", "KV-cache events imported (copied) from a vLLM/SGLang capture, one row per block of each "
          "event (the prefix tree is block_hash -> parent_hash within a replica and KV group; no physical block "
          "ids). Query the view kv_events: these rows and every capture dataset registered in place.", (
              *_cols(RUN_ID + "step INTEGER, seq BIGINT, ts DOUBLE, rank INTEGER, kind VARCHAR, block_hash UBIGINT, "
                     "parent_hash UBIGINT, block_index INTEGER, token_ids INTEGER[], block_size INTEGER, "
                     "lora_name VARCHAR, medium VARCHAR, salt VARCHAR"),
              Column("replica", "VARCHAR", "the publisher it came from (capture-vllm --endpoint NAME=...)",
                     added_in="5"),
              Column("restart", "INTEGER", "how many times the replica's publisher had restarted before it",
                     added_in="5"),
              Column("received", "DOUBLE", "when the capture received it (seconds since the epoch)", added_in="5"),
              Column("event_index", "INTEGER", "the event's place in its batch", added_in="5"),
              Column("lora_id", "BIGINT", added_in="5"),
              Column("group_idx", "INTEGER", "the KV-cache group: the same hash in two groups is two blocks",
                     added_in="5"),
              Column("spec_kind", "VARCHAR", "kv_cache_spec_kind, e.g. full_attention", added_in="5"),
              Column("sliding_window", "INTEGER", "kv_cache_spec_sliding_window", added_in="5"),
              Column("locality", "VARCHAR", "LOCAL | REMOTE", added_in="5"),
              Column("session_id", "VARCHAR", added_in="5"),
              Column("lookahead_token_ids", "INTEGER[]", "tokens past the block that entered its hash",
                     added_in="5"),
              Column("repeat", "BOOLEAN", "changes nothing in the cache as tracked on this replica, group and medium: "
                     "a BlockStored of a cached hash (a hit reported by kv_cache_report_mode=full) or a BlockRemoved "
                     "of one not cached", added_in="5"),
              Column("lifetime_s", "DOUBLE", "a removal's: seconds (publisher clock) since the store that cached the "
                     "block", added_in="6"),
              Column("idle_s", "DOUBLE", "a removal's: seconds since the block was last stored or hit", added_in="6"),
              Column("reuse_gap_s", "DOUBLE", "a hit's (a repeated store): seconds since the block's previous store "
                     "or hit", added_in="6"),
              Column("salt_named", "BOOLEAN", "a store's: its own event names its salt (false: the salt is the "
                     "chain's it continues, or the cached block's it hits; vLLM names it in a chain's first block "
                     "only, so which tenant stored the block cannot be told)", added_in="10"),
              Column("tokens_given", "INTEGER", "a store whose token_ids do not hold block_size tokens per block (a "
                     "breach of the KV-event contract): how many it gave, on each of its rows (their token_ids are "
                     "null); null otherwise", added_in="18"),
              Column("parent_cached", "BOOLEAN", "the first block an event stores new: whether the block before it "
                     "(the event's parent_hash, or a hit reported ahead of it) was cached on this replica, KV group "
                     "and medium then; null on other rows and for a chain's first block", added_in="18")),
          in_trace=False),
    Table("capture_breaches", "What a capture's KV-event stream contradicts of the contract a consumer (llm-d's "
          "indexer, Dynamo's router, kvviz's own views) trusts, found on import (`kvviz lint`): one row per kind "
          "and replica, docs/capture-format.md says what each distorts.", (
              Column("run_id", "VARCHAR"),
              Column("kind", "VARCHAR", "token_count | remove_unstored | stored_twice | parent_after_child | "
                     "seq_gap | seq_back | never_removes | salt_mixed | medium_removed_only"),
              Column("replica", "VARCHAR"),
              Column("count", "BIGINT", "how many: events (token_count), blocks (remove_unstored, stored_twice, "
                     "parent_after_child, medium_removed_only), messages lost (seq_gap) or gone back (seq_back), "
                     "stored blocks (never_removes), chains begun without a salt (salt_mixed)"),
              Column("first_step", "INTEGER", "the message of the first occurrence (the capture's arrival order)"),
              Column("first_seq", "BIGINT", "that message's sequence number"),
              Column("first_ts", "DOUBLE", "that message's time on the publisher's clock"),
              Column("detail", "VARCHAR", "the first occurrence in words: the block, the sequence numbers, the "
                     "medium")), in_trace=False),
    Table("cross_tier_salts", "cross_tier_salt findings of a capture, found on import: block hashes one replica "
          "stored salted in one medium (tier) and unsalted in another, so that tier serves them to any tenant; one "
          "row per replica, KV group, pair of media and salt (docs/capture-format.md).", (
              Column("run_id", "VARCHAR"),
              Column("replica", "VARCHAR"),
              Column("group_idx", "INTEGER", "the KV-cache group (null: the capture names none)"),
              Column("salted_medium", "VARCHAR", "the medium whose copies carry the salt (GPU, ...)"),
              Column("unsalted_medium", "VARCHAR", "the medium whose copies of the same hashes carry none"),
              Column("salt", "VARCHAR", "the salt the salted copies carry (their chain's)"),
              Column("blocks", "BIGINT", "how many block hashes"),
              Column("block_hashes", "UBIGINT[]", "the block hashes, in the order both copies first existed"),
              Column("hits", "BIGINT", "hits (repeated stores) of the unsalted copies"),
              Column("served", "VARCHAR[]", "the tenants those hits' events name (a hit naming none is in hits only)"),
              Column("first_step", "INTEGER", "the message where a hash first had both copies")), in_trace=False),
    Table("capture_sources", "Capture datasets registered in place (import --in-place): the view kv_events reads "
          "their Parquet files where they lie.", _cols(RUN_ID + "path VARCHAR, files INTEGER"), in_trace=False),
    Table("findings", "What the oracles found: the worst query of one kind of anomaly per request, step and "
          "source; a cross_tenant finding is one block another tenant wrote that a request read (own by content: "
          "no attention leak, a trust boundary crossed), for every layer, at steps step..last_step.", (
              *_cols(RUN_ID + "kind VARCHAR, request_id VARCHAR, step INTEGER"),
              Column("layer", "INTEGER", "null: every layer (a cross_tenant read: the block holds every layer's K/V)"),
              Column("head", "INTEGER", "null: no one head (cross_tenant, a capture's findings)"),
              Column("position", "INTEGER", "the query's position (cross_tenant: the first that read the block; "
                     "telemetry_mismatch: where the request's first forward started, the tokens it was served)"),
              Column("source_request", "VARCHAR", "who wrote the keys (cross_tenant: the writer of the first slot "
                     "read); a capture's: the salt that stored the block first"),
              Column("mass", "DOUBLE", "the query's attention on such keys at that layer and head (duplicate and "
                     "non_finite: 1; normalisation: how far the weights are from 1; kernel_mismatch: how far the "
                     "kernel's output is from the recomputed one, in tolerances; telemetry_mismatch: the cached "
                     "tokens the reply reported); null for cross_tenant, which is no attention figure"),
              Column("block", "INTEGER", "cross_tenant: the physical block read", added_in="10"),
              Column("last_step", "INTEGER", "the last step the finding spans: a cross_tenant read goes on at every "
                     "step from step to last_step; the others are of one step (null in files before version 10)",
                     added_in="10"))),
    Table("lookup_explanations", "Why each prefix-cache lookup of a run (each stored chain of a capture) stopped "
          "where it did, as `kvviz explain` says; kept the first time a complete run is explained (a capture's "
          "explain takes about 5 s per million events).", (
              *_cols(RUN_ID + "request VARCHAR, step INTEGER"),
              Column("ts", "DOUBLE", "a capture's: its message's time on the publisher's clock"),
              *_cols("hit_tokens INTEGER, stop_block INTEGER, stop_token INTEGER"),
              Column("reason", "VARCHAR", "cold | evicted | capacity | namespace | diverged | partial_block | "
                     "preempted | unexplained"),
              Column("evidence", "JSON", "what shows the reason, e.g. when the block was stored and evicted")),
          in_trace=False),
    Table("whatif_points", "The run replayed under other prefix caches (`kvviz whatif`, the inspector's What if "
          "view): per eviction policy and capacity, the share of prompt tokens a cache that size would have served "
          "(a capture's capacity is per replica, the hits of its replicas summed).", (
              *_cols(RUN_ID + "policy VARCHAR"),
              Column("keying", "VARCHAR", "shared | tenant | conversation: how blocks were keyed (salted)"),
              Column("capacity", "BIGINT", "blocks; the run's distinct blocks is the unbounded cache"),
              Column("hits", "BIGINT", "full-block lookups served from the cache"),
              Column("lookups", "BIGINT", "full-block lookups"),
              Column("tokens_saved", "BIGINT", "prefill tokens served: hits x block size"),
              Column("prompt_tokens", "BIGINT"), Column("hit_rate", "DOUBLE", "tokens_saved / prompt_tokens")),
          in_trace=False),
    Table("timing_audits", "Timing audits of a server's prompt cache (kvviz audit-timing), one row per audit: "
          "one-sided KS tests that hits reach their first token sooner than misses. The hit columns are the tested "
          "hits: cross-user ones in a paired audit (level paired), the level's before version 17.", (
              Column("audit_id", "VARCHAR"), Column("created_at", "TIMESTAMP"), Column("base_url", "VARCHAR"),
              Column("target", "VARCHAR", "what was audited, in words (a server the app started: model, policy)",
                     added_in="4"),  # files from before it was added to version 4 lack it too
              Column("model", "VARCHAR"),
              Column("level", "VARCHAR", "paired (same-user and cross-user hits each round, version 17 on) | global "
                     "(another user and key sent each hit's prompt first) | per-user (the prober itself did)"),
              Column("endpoint", "VARCHAR", "completions | chat"), Column("samples", "INTEGER", "per side"),
              Column("prompt_tokens", "INTEGER"), Column("alpha", "DOUBLE"), Column("ks_statistic", "DOUBLE"),
              Column("p_value", "DOUBLE"), Column("median_hit_ms", "DOUBLE"), Column("median_miss_ms", "DOUBLE"),
              Column("hit_faster_than_all_misses", "BOOLEAN"),
              Column("detected", "BOOLEAN", "the tested hits came sooner: the server shares its cache across users "
                     "(paired, global) or within a user (per-user)"),
              Column("verdict", "VARCHAR", "paired: isolated | shared across users | no caching seen | inconclusive "
                     "(the null control rejects, or cross-user hits sit between same-user hits and misses) | no "
                     "verdict (too few samples, unequal prompts, too fast to time); before version 17 detected | not "
                     "detected | inconclusive | no verdict; null before version 11", added_in="11"),
              Column("reason", "VARCHAR", "the verdict in one sentence (before version 17: why, when not plain), and "
                     "why the audit stopped early", added_in="11"),
              Column("null_ks_statistic", "DOUBLE", "the null control against misses, the same test (paired: a miss "
                     "primed by the prober itself; before: a second miss)", added_in="11"),
              Column("null_p_value", "DOUBLE", added_in="11"), Column("median_null_ms", "DOUBLE", added_in="11"),
              Column("median_floor_ms", "DOUBLE", "a one-word prompt's: the server's time for no prompt work",
                     added_in="11"),
              Column("counted_prompt_tokens", "INTEGER", "the median timed prompt as the server counted it "
                     "(usage.prompt_tokens), when it reports usage", added_in="11"),
              Column("reported_cached_hits", "INTEGER", "tested hits the server itself reported serving from its "
                     "cache (more cached_tokens than a miss), when it reports them", added_in="11"),
              Column("primer_tokens", "INTEGER", "max_tokens of each untimed primer (timed requests ask for 1); null "
                     "before version 17 (1)", added_in="17"),
              Column("same_ks_statistic", "DOUBLE", "same-user hits against misses: the positive control",
                     added_in="17"),
              Column("same_p_value", "DOUBLE", added_in="17"), Column("median_same_ms", "DOUBLE", added_in="17"),
              Column("apart_ks_statistic", "DOUBLE", "same-user hits against cross-user hits: what isolation must "
                     "show", added_in="17"),
              Column("apart_p_value", "DOUBLE", added_in="17"),
              Column("reported_hits_of", "INTEGER", "tested hits whose reply said how many tokens were cached",
                     added_in="17"),
              Column("reported_cached_same", "INTEGER", "same-user hits the server reported serving from its cache",
                     added_in="17"),
              Column("reported_same_of", "INTEGER", added_in="17"),
              Column("telemetry", "VARCHAR", "what the server's own cached-token counts say, in the verdicts' words; "
                     "null where the channel could not be used", added_in="17"),
              Column("telemetry_note", "VARCHAR", "why the cached-tokens channel could not be used, or which replies "
                     "said nothing", added_in="17"),
              Column("contradiction", "VARCHAR", "where timing and the server's counts disagree, the finding in one "
                     "sentence", added_in="17"),
              Column("channel", "VARCHAR", "what the audit read: time (time to first token; null before version 18) | "
                     "order (each probe's finishing rank among dummies sent just before it: the p-values are exact "
                     "permutation tests of the mean rank, the KS columns its shift in places)",
                     added_in="18"),
              Column("dummies", "INTEGER", "order channel: fresh prompts sent just before each probe", added_in="18")),
          in_trace=False, key="audit_id"),
    Table("timing_samples", "Each timed request of a timing audit: time to first token in milliseconds.", (
        *_cols("audit_id VARCHAR"),
        Column("kind", "VARCHAR", "same (a same-user hit) | cross (a cross-user hit) | miss | null (the control) | "
               "floor (a one-word prompt); hit in audits before version 17"),
        Column("sample", "INTEGER", "the round"), *_cols("ttft_ms DOUBLE, cached_tokens INTEGER"),
        Column("prompt_tokens", "INTEGER", "the timed prompt as the server counted it", added_in="11"),
        Column("primer_tokens", "INTEGER", "the prompt sent just before it, as the server counted it",
               added_in="11"),
        Column("rank", "INTEGER", "order channel: how many of the round's dummies finished before the probe (then "
               "kind is same, cross or null: a fresh probe)", added_in="18")), in_trace=False),
    Table("divergence", "Each request against itself run alone (the reference oracle).", _cols(
        RUN_ID + "request_id VARCHAR, first_divergent_step INTEGER, max_logit_diff DOUBLE, max_kl DOUBLE, "
        "classification VARCHAR")),
)}

VIEWS = """
-- Until capture datasets are registered in place (refresh_file_views), the copied rows alone.
CREATE OR REPLACE VIEW kv_events AS SELECT * FROM kv_event_rows;

CREATE OR REPLACE VIEW leak_rate_per_step AS
SELECT run_id, step, request_id, sum(leak_rows) / sum(rows) AS leak_rate, max(max_foreign) AS max_foreign_mass
FROM leak_metrics GROUP BY run_id, step, request_id;

CREATE OR REPLACE VIEW top_leaking_heads AS
SELECT run_id, layer, head, max(max_foreign) AS max_foreign_mass, sum(leak_rows) AS leak_rows
FROM leak_metrics GROUP BY run_id, layer, head;

-- Blocks cached on each replica after each captured message that touched it: stored minus removed,
-- back to zero at the replica's AllBlocksCleared or publisher restart; a repeated store is a hit, not a
-- block, and a removal of a block not cached (again, or cached before the capture began) removes nothing.
CREATE OR REPLACE VIEW kv_cache_blocks AS
WITH per_step AS (
    SELECT run_id, coalesce(replica, 'replica-0') AS replica, step, any_value(coalesce(restart, 0)) AS restart,
           count(*) FILTER (kind = 'BlockStored' AND NOT coalesce(repeat, false)) AS stored,
           count(*) FILTER (kind = 'BlockStored' AND repeat) AS repeated,
           count(*) FILTER (kind = 'BlockRemoved' AND NOT coalesce(repeat, false)) AS removed,
           count(*) FILTER (kind = 'AllBlocksCleared') AS cleared
    FROM kv_events WHERE kind IS NOT NULL GROUP BY ALL),
epochs AS (SELECT *, sum(cleared) OVER (PARTITION BY run_id, replica, restart ORDER BY step) AS epoch FROM per_step)
SELECT run_id, replica, restart, step,
       sum(stored - removed) OVER (PARTITION BY run_id, replica, restart, epoch ORDER BY step) AS cached_blocks,
       stored, removed, repeated
FROM epochs;

-- Blocks cached per replica, KV group and medium (tier) after each message that changed them: a block moved
-- to another tier is stored there and removed here (an offload, not a loss); an AllBlocksCleared empties
-- every group and tier of its replica, a restart starts the count again.
CREATE OR REPLACE VIEW kv_cache_occupancy AS
WITH ev AS (
    SELECT run_id, coalesce(replica, 'replica-0') AS replica, coalesce(restart, 0) AS restart, group_idx, medium,
           step, kind, coalesce(repeat, false) AS rep
    FROM kv_events WHERE kind IS NOT NULL),
parts AS (SELECT DISTINCT run_id, replica, restart, group_idx, medium FROM ev
          WHERE kind IN ('BlockStored', 'BlockRemoved')),
clears AS (
    SELECT *, row_number() OVER (PARTITION BY run_id, replica, restart ORDER BY step) AS epoch
    FROM (SELECT DISTINCT run_id, replica, restart, step FROM ev WHERE kind = 'AllBlocksCleared')),
changes AS (
    SELECT run_id, replica, restart, group_idx, medium, step,
           count(*) FILTER (kind = 'BlockStored' AND NOT rep) AS stored,
           count(*) FILTER (kind = 'BlockRemoved' AND NOT rep) AS removed
    FROM ev WHERE kind IN ('BlockStored', 'BlockRemoved') GROUP BY ALL
    UNION ALL  -- a clear is a change of every part of its replica, down to nothing
    SELECT p.run_id, p.replica, p.restart, p.group_idx, p.medium, c.step, 0, 0
    FROM parts p JOIN clears c USING (run_id, replica, restart)),
merged AS (SELECT run_id, replica, restart, group_idx, medium, step, sum(stored) AS stored,
                  sum(removed) AS removed FROM changes GROUP BY ALL),
epoched AS (
    SELECT m.*, coalesce(c.epoch, 0) AS epoch FROM merged m ASOF LEFT JOIN clears c
        ON m.run_id = c.run_id AND m.replica = c.replica AND m.restart = c.restart AND c.step <= m.step)
SELECT run_id, replica, group_idx, medium, restart, step, stored, removed,
       sum(stored - removed) OVER (PARTITION BY run_id, replica, restart, group_idx, medium, epoch
                                   ORDER BY step) AS cached_blocks
FROM epoched;

-- The seed's positional entropy (nats) of each request's queries per step, layer and head: the mean over
-- the step's queries, placed at their mean position (exact for decode steps, which have one query).
CREATE OR REPLACE VIEW positional_entropy AS
SELECT m.run_id, m.request_id, m.step, w.start + (w.tokens - 1) / 2.0 AS position, m.layer, m.head,
       m.sum_entropy / m.rows AS entropy, m.rows AS queries, m.leak_rows / m.rows AS leak_rate
FROM leak_metrics m JOIN step_work w ON w.run_id = m.run_id AND w.step = m.step AND w.request_id = m.request_id
WHERE m.rows > 0;

-- The seed's memory utilisation, paged: the share of allocated KV slots (blocks with a reference) that
-- hold a computed token after each step; null for steps recorded before schema 4. A disaggregated run's
-- arena is both instances' pools.
CREATE OR REPLACE VIEW kv_slot_utilisation AS
SELECT s.run_id, s.step, s.live_slots,
       (CAST(r.engine->>'num_blocks' AS INTEGER) * (CASE WHEN r.engine->>'disaggregated' = 'true' THEN 2 ELSE 1 END)
        - s.free_blocks) * CAST(r.engine->>'block_size' AS INTEGER) AS allocated_slots,
       s.live_slots / nullif(allocated_slots, 0) AS utilisation
FROM steps s JOIN runs r ON r.run_id = s.run_id;

-- Each life of a cached block, from the store that cached it to the removal (or reset) that ended it:
-- captures per replica, KV group and medium (ts in the publisher's seconds; hits are the stores
-- kv_cache_report_mode=full repeats), engine runs per block hash and block (two blocks can hold one hash at
-- once; steps; hits are the prefix hits on the block). idle: from the last hit (or the store) to the end;
-- null ends are still cached.
CREATE OR REPLACE VIEW block_lifetimes AS
WITH ev AS (
    SELECT run_id, coalesce(replica, 'replica-0') AS replica, coalesce(restart, 0) AS restart, group_idx, medium,
           block_hash, kind, step, ts, coalesce(repeat, false) AS rep,
           sum(CASE WHEN kind = 'BlockStored' AND NOT coalesce(repeat, false) THEN 1 ELSE 0 END) OVER (
               PARTITION BY run_id, replica, restart, group_idx, medium, block_hash
               ORDER BY step, coalesce(event_index, 0), block_index) AS life
    FROM kv_events WHERE kind IN ('BlockStored', 'BlockRemoved')),
lives AS (
    SELECT run_id, replica, restart, group_idx, medium, block_hash, life,
           min(step) FILTER (kind = 'BlockStored' AND NOT rep) AS stored_step,
           min(ts) FILTER (kind = 'BlockStored' AND NOT rep) AS stored_ts,
           min(step) FILTER (kind = 'BlockRemoved' AND NOT rep) AS removed_step,
           min(ts) FILTER (kind = 'BlockRemoved' AND NOT rep) AS removed_ts,
           count(*) FILTER (kind = 'BlockStored' AND rep) AS hits,
           max(step) FILTER (kind = 'BlockStored' AND rep) AS last_hit_step,
           max(ts) FILTER (kind = 'BlockStored' AND rep) AS last_hit_ts
    FROM ev WHERE life > 0 GROUP BY ALL),
clears AS (
    SELECT run_id, coalesce(replica, 'replica-0') AS replica, coalesce(restart, 0) AS restart, step, ts
    FROM kv_events WHERE kind = 'AllBlocksCleared'),
capture AS (
    SELECT l.* EXCLUDE (removed_step, removed_ts, restart),
           CASE WHEN c.step IS NOT NULL AND (l.removed_step IS NULL OR c.step < l.removed_step) THEN c.step
                ELSE l.removed_step END AS removed_step,
           CASE WHEN c.step IS NOT NULL AND (l.removed_step IS NULL OR c.step < l.removed_step) THEN c.ts
                ELSE l.removed_ts END AS removed_ts
    FROM lives l ASOF LEFT JOIN clears c
      ON l.run_id = c.run_id AND l.replica = c.replica AND l.restart = c.restart AND c.step >= l.stored_step),
engine_lives AS (
    SELECT run_id, hash AS block_hash, block, step AS stored_step,
           lead(step) OVER (PARTITION BY run_id, hash, block ORDER BY step, seq) AS next_step,
           lead(kind) OVER (PARTITION BY run_id, hash, block ORDER BY step, seq) AS next_kind, kind
    FROM block_events WHERE (kind IN ('cache', 'evict') OR kind = 'clear' AND medium = 'GPU') AND hash IS NOT NULL),
engine AS (
    SELECT l.run_id, NULL AS replica, NULL AS group_idx, NULL AS medium, l.block_hash,
           row_number() OVER (PARTITION BY l.run_id, l.block_hash ORDER BY l.stored_step, l.block) AS life,
           l.stored_step, NULL AS stored_ts, count(h.step) AS hits, max(h.step) AS last_hit_step,
           NULL AS last_hit_ts,
           CASE WHEN l.next_kind IN ('evict', 'clear') THEN l.next_step END AS removed_step, NULL AS removed_ts
    FROM engine_lives l
    LEFT JOIN block_events h ON h.run_id = l.run_id AND h.kind = 'hit' AND h.block = l.block
         AND h.step >= l.stored_step AND (l.next_kind IS NULL OR h.step < l.next_step)
    WHERE l.kind = 'cache'
    GROUP BY l.run_id, l.block_hash, l.block, l.stored_step, l.next_kind, l.next_step)
SELECT run_id, replica, group_idx, medium, block_hash, life, stored_step, removed_step,
       removed_step - stored_step AS lifetime_steps, removed_ts - stored_ts AS lifetime_s, hits, last_hit_step,
       removed_step - coalesce(last_hit_step, stored_step) AS idle_steps,
       removed_ts - coalesce(last_hit_ts, stored_ts) AS idle_s
FROM (SELECT run_id, replica, group_idx, medium, block_hash, life, stored_step, stored_ts, removed_step,
             removed_ts, hits, last_hit_step, last_hit_ts FROM capture
      UNION ALL BY NAME
      SELECT * FROM engine);

-- Prefix-cache hits per interval: engine runs per step from their lookups (prompt tokens looked up,
-- tokens the cache served); captures per replica and minute of the publisher's clock from their stores
-- (a store that repeats a cached block is a hit, reported only under kv_cache_report_mode=full).
CREATE OR REPLACE VIEW hit_rate_per_interval AS
SELECT run_id, NULL AS replica, 'step' AS unit, step AS interval_start, count(*) AS lookups,
       sum(tokens) AS tokens, sum(hit_tokens) AS hit_tokens, sum(hit_tokens) / nullif(sum(tokens), 0) AS hit_rate
FROM cache_lookups GROUP BY run_id, step
UNION ALL
SELECT run_id, coalesce(replica, 'replica-0'), 'minute', floor(ts / 60) * 60, NULL,
       sum(block_size), coalesce(sum(block_size) FILTER (repeat), 0),
       coalesce(sum(block_size) FILTER (repeat), 0) / nullif(sum(block_size), 0)
FROM kv_events WHERE kind = 'BlockStored' GROUP BY ALL;

CREATE OR REPLACE VIEW block_occupancy AS
SELECT run_id, step, count(*) FILTER (state = 'used') AS used, count(*) FILTER (state = 'cached') AS cached,
       count(*) FILTER (state = 'free') AS free
FROM blocks GROUP BY run_id, step;
"""

# Tables an upgrade renames (old name -> new), before the DDL runs.
RENAMED = {"kv_events": "kv_event_rows", "attention": "attention_rows"}
DATASET_COLUMNS = [c.name for c in TABLES["kv_event_rows"].columns if c.name != "run_id"]


def rename_old_tables(con) -> None:
    """Views that were tables: version 4 kept captures in kv_events (now over kv_event_rows and datasets),
    version 12 attention rows whole in attention (now over attention_rows and attention_keys)."""
    for old, new in RENAMED.items():
        if con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ? AND table_type = "
                       "'BASE TABLE'", [old]).fetchone()[0]:
            con.execute(f"ALTER TABLE {old} RENAME TO {new}")


def attention_view(parts: list[tuple[str, Path]]) -> str:
    """Attention rows with their keys: their own, or (null in the rows) their query's; the rows are the
    file's and those of the Parquet parts of each (run, folder) in `parts` (each holding at least one).
    A run's parts are read by a branch of their own whose run_id is a constant, so a query of one run
    reads no other run's files."""
    rows = "attention_rows"
    if parts:
        rows = "(" + "\nUNION ALL BY NAME ".join(
            ["SELECT * FROM attention_rows"] + [f"SELECT * REPLACE ({_quote(run)} AS run_id) FROM read_parquet("
                                               f"{_quote(str(folder / '*.parquet'))})" for run, folder in parts]) + ")"
    return f"""CREATE OR REPLACE VIEW attention AS
SELECT a.run_id, a.step, a.layer, a.head, a.request_id, a.position, coalesce(a.key_slots, k.key_slots) AS key_slots,
       a.weights, coalesce(a.key_classes, k.key_classes) AS key_classes
FROM {rows} a LEFT JOIN attention_keys k
  ON k.run_id = a.run_id AND k.step = a.step AND k.request_id = a.request_id AND k.position = a.position;
"""


def refresh_file_views(con, attention_root: Path) -> None:
    """The views over files beside the store: kv_events (the copied rows and every capture dataset
    registered in place that is still there; a run whose dataset has gone is marked failed, saying where
    it was) and attention (the file's rows and the attention parts under attention_root that are there;
    a run whose parts have gone says so in its error)."""
    for run, folder in _attention_parts(con, attention_root):
        if not has_parts(folder):
            con.execute("UPDATE runs SET error = ? WHERE run_id = ?",
                        [f"its attention rows are no longer at {folder}", run])
            con.execute("DELETE FROM attention_parts WHERE run_id = ?", [run])
    con.execute(attention_view(_attention_parts(con, attention_root)))
    sources = con.execute("SELECT run_id, path FROM capture_sources ORDER BY run_id").fetchall()
    for run, path in sources:
        if not Path(path).is_dir():
            con.execute("UPDATE runs SET status = 'failed', error = ? WHERE run_id = ?",
                        [f"its capture dataset is no longer at {path} (import it again)", run])
            con.execute("DELETE FROM capture_sources WHERE run_id = ?", [run])
    parts = ["SELECT * FROM kv_event_rows"] + [dataset_query(run, path) for run, path in sources if Path(path).is_dir()]
    con.execute("CREATE OR REPLACE VIEW kv_events AS " + "\nUNION ALL BY NAME\n".join(parts))


def dataset_query(run_id: str, path: str | Path) -> str:
    """A dataset registered in place as kv_events rows of its run: what the store's view reads, and what
    explain reads on a connection of its own (not holding the store while it works)."""
    cols = ", ".join(_quote(c) for c in DATASET_COLUMNS)  # those a dataset has: an older one's missing ones are null
    return (f"SELECT {_quote(run_id)} AS run_id, COLUMNS(lambda c: list_contains([{cols}], c)) FROM read_parquet("
            f"{_quote(str(Path(path) / 'replica=*/*.parquet'))}, hive_partitioning = true, "
            "hive_types = {'replica': VARCHAR}, union_by_name = true) WHERE kind IS NOT NULL")


def datasets_gone(con, attention_root: Path) -> bool:
    """Has a dataset registered in place or a run's attention parts been moved or deleted, or the store
    with its parts (the views would fail to read them, or read them where they were)?"""
    parts = _attention_parts(con, attention_root)
    return (any(not Path(d).is_dir() for d in capture_dirs(con))
            or any(not has_parts(folder) for _, folder in parts)
            or bool(parts) and _quote(f"{attention_root}/")[:-1] not in _view_sql(con, "attention"))  # moved


def _view_sql(con, name: str) -> str:
    return con.execute("SELECT sql FROM duckdb_views() WHERE view_name = ?", [name]).fetchone()[0]


def has_parts(folder: Path) -> bool:
    return next(folder.glob("*.parquet"), None) is not None


def _attention_parts(con, root: Path) -> list[tuple[str, Path]]:
    """Each run with attention parts and their folder (under the store's, wherever it now lies)."""
    try:
        runs = con.execute("SELECT run_id FROM attention_parts ORDER BY run_id").fetchall()
    except duckdb.CatalogException:  # a file from before attention parts
        return []
    return [(run, root / run) for (run,) in runs]


def capture_dirs(con) -> list[str]:
    """The folders readers may read: the datasets registered in place (nothing else)."""
    try:
        rows = con.execute("SELECT path FROM capture_sources").fetchall()
    except duckdb.CatalogException:  # a file from before capture datasets
        return []
    return [str(Path(p)) + "/" for (p,) in rows]


TRACE_TABLES: dict[str, list[str]] = {t.name: t.trace_columns() for t in TABLES.values() if t.in_trace}


# Rows from before a column existed, given what it means for them (run on upgrade; idempotent).
BACKFILL = """
UPDATE kv_event_rows SET replica = 'replica-0', restart = 0 WHERE replica IS NULL;
UPDATE runs SET backend = coalesce(engine->>'backend', 'kvviz') WHERE backend IS NULL AND engine <> '{}';
"""


def ddl() -> str:
    """The whole schema as one idempotent script: creating a new file or upgrading an old one."""
    return "\n\n".join(t.ddl() for t in TABLES.values()) + "\n" + BACKFILL + VIEWS + attention_view([])


def conform(table: str, rows: pa.Table) -> pa.Table:
    """Rows cast to the declared types of their columns; ValueError names a column that is not
    declared or a value that does not fit (what every insert goes through)."""
    t = TABLES[table]
    declared = {c.name: c for c in t.columns}
    out = []
    for name, col in zip(rows.column_names, rows.columns, strict=True):
        if name not in declared:
            raise ValueError(f"table {table!r} has no column {name!r}")
        want = declared[name].arrow
        try:
            out.append(col if col.type == want else col.cast(want))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise ValueError(f"{table}.{name}: {col.type} values do not fit {declared[name].sql} "
                             f"({str(e).splitlines()[0]})") from None
    return pa.table(out, names=rows.column_names)


def arrow_table(table: str, columns: dict[str, list]) -> pa.Table:
    """Buffered column lists as an Arrow table of the declared types (hashes above 2^63 included)."""
    t = TABLES[table]
    return pa.table({name: pa.array(values, type=t.column(name).arrow) for name, values in columns.items()})
