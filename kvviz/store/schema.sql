-- kvviz run store, schema version 2 (2 added token_text; a version 1 file is upgraded in place). One DuckDB file holds every run; the table of runs is `runs`.
-- Keys: run_id everywhere; step numbers start at 0; positions and blocks are 0-based.

CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR);

CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR PRIMARY KEY,
    created_at TIMESTAMP,
    status VARCHAR,            -- running | complete | failed
    error VARCHAR,             -- why a failed run failed
    model VARCHAR,
    model_fingerprint VARCHAR, -- sha256 of the weights' source
    scenario VARCHAR,
    fault VARCHAR,
    fault_scope JSON,          -- where the fault was confined ({"steps", "requests", "layers", "every"}), or null
    seed BIGINT,
    engine JSON,               -- EngineConfig
    workload JSON,             -- the workload as given, enough to re-run it
    kvviz_version VARCHAR,
    steps INTEGER,
    seconds DOUBLE,
    generated_tokens INTEGER,
    max_foreign_mass DOUBLE,
    leak_rate DOUBLE,
    findings INTEGER
);

CREATE TABLE IF NOT EXISTS requests (
    run_id VARCHAR, request_id VARCHAR, tenant VARCHAR, parent VARCHAR,
    prompt_ids INTEGER[], output_ids INTEGER[], text VARCHAR,
    arrival_step INTEGER, first_token_step INTEGER, finish_step INTEGER, finish_reason VARCHAR,
    cached_tokens INTEGER
);

-- The text of each token id the run's requests hold, so that views can label tokens without the tokenizer.
CREATE TABLE IF NOT EXISTS token_text (run_id VARCHAR, token_id INTEGER, text VARCHAR);

-- What each step computed: request_id computed positions [start, start + tokens).
CREATE TABLE IF NOT EXISTS step_work (
    run_id VARCHAR, step INTEGER, request_id VARCHAR, start INTEGER, tokens INTEGER,
    admitted BOOLEAN, preempted BOOLEAN, sampled_token INTEGER, finished BOOLEAN
);

-- Slot provenance as a log: where each step wrote each request's K/V (the slot, the block's
-- lifetime then). Replaying it up to step s, with the `cow` block_events (whole blocks copied
-- before the step's writes), gives every slot's writer, position and token.
CREATE TABLE IF NOT EXISTS slot_writes (
    run_id VARCHAR, step INTEGER, request_id VARCHAR, position INTEGER, token INTEGER, slot INTEGER,
    block INTEGER, lifetime INTEGER
);

CREATE TABLE IF NOT EXISTS steps (run_id VARCHAR, step INTEGER, seconds DOUBLE, free_blocks INTEGER);

-- Page tables after each step.
CREATE TABLE IF NOT EXISTS page_tables (
    run_id VARCHAR, step INTEGER, request_id VARCHAR, logical_block INTEGER, physical_block INTEGER
);

-- Every block after each step. state: free | cached (free, hash kept) | used.
CREATE TABLE IF NOT EXISTS blocks (
    run_id VARCHAR, step INTEGER, block INTEGER, refcount INTEGER, hash UBIGINT, lifetime INTEGER, state VARCHAR
);

-- Every change to a block, in order within the step. kind: allocate | hit | share | free | preempt
-- | cow (block is the copy of source) | cache | evict.
CREATE TABLE IF NOT EXISTS block_events (
    run_id VARCHAR, step INTEGER, seq INTEGER, kind VARCHAR, block INTEGER, request_id VARCHAR,
    refcount INTEGER, source INTEGER
);

-- The provenance oracle per (step, request, layer, head), reduced over the request's queries.
CREATE TABLE IF NOT EXISTS leak_metrics (
    run_id VARCHAR, step INTEGER, request_id VARCHAR, layer INTEGER, head INTEGER,
    max_foreign DOUBLE, sum_foreign DOUBLE, leak_rows INTEGER, rows INTEGER, sum_entropy DOUBLE
);

-- Attention rows: the key slots one query read, their weights and each key's class
-- (0 own, 1 foreign, 2 stale). head = -1 is the mean over heads. Keys with no weight that the
-- query could not see are not stored.
CREATE TABLE IF NOT EXISTS attention (
    run_id VARCHAR, step INTEGER, layer INTEGER, head INTEGER, request_id VARCHAR, position INTEGER,
    key_slots INTEGER[], weights FLOAT[], key_classes UTINYINT[]
);

-- KV-cache events imported from a vLLM/SGLang capture: one row per block hash. The prefix tree is
-- block_hash -> parent_hash; there are no physical block ids in these events.
CREATE TABLE IF NOT EXISTS kv_events (
    run_id VARCHAR, step INTEGER, seq BIGINT, ts DOUBLE, rank INTEGER,
    kind VARCHAR,              -- BlockStored | BlockRemoved | AllBlocksCleared
    block_hash UBIGINT, parent_hash UBIGINT, block_index INTEGER, token_ids INTEGER[], block_size INTEGER,
    lora_name VARCHAR, medium VARCHAR, salt VARCHAR
);

CREATE TABLE IF NOT EXISTS findings (
    run_id VARCHAR, kind VARCHAR, request_id VARCHAR, step INTEGER, layer INTEGER, head INTEGER,
    position INTEGER, source_request VARCHAR, mass DOUBLE
);

CREATE TABLE IF NOT EXISTS divergence (
    run_id VARCHAR, request_id VARCHAR, first_divergent_step INTEGER, max_logit_diff DOUBLE, max_kl DOUBLE,
    classification VARCHAR
);

CREATE OR REPLACE VIEW leak_rate_per_step AS
SELECT run_id, step, request_id, sum(leak_rows) / sum(rows) AS leak_rate, max(max_foreign) AS max_foreign_mass
FROM leak_metrics GROUP BY run_id, step, request_id;

CREATE OR REPLACE VIEW top_leaking_heads AS
SELECT run_id, layer, head, max(max_foreign) AS max_foreign_mass, sum(leak_rows) AS leak_rows
FROM leak_metrics GROUP BY run_id, layer, head;

-- Blocks cached after each captured message: stored minus removed, back to zero at AllBlocksCleared
-- (a message that clears counts all it stores and removes as after the clear).
CREATE OR REPLACE VIEW kv_cache_blocks AS
WITH per_step AS (
    SELECT run_id, step, count(*) FILTER (kind = 'BlockStored') AS stored,
           count(*) FILTER (kind = 'BlockRemoved') AS removed, count(*) FILTER (kind = 'AllBlocksCleared') AS cleared
    FROM kv_events GROUP BY run_id, step),
epochs AS (SELECT *, sum(cleared) OVER (PARTITION BY run_id ORDER BY step) AS epoch FROM per_step)
SELECT run_id, step, sum(stored - removed) OVER (PARTITION BY run_id, epoch ORDER BY step) AS cached_blocks,
       stored, removed
FROM epochs;

CREATE OR REPLACE VIEW block_occupancy AS
SELECT run_id, step, count(*) FILTER (state = 'used') AS used, count(*) FILTER (state = 'cached') AS cached,
       count(*) FILTER (state = 'free') AS free
FROM blocks GROUP BY run_id, step;
