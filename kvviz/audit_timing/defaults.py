"""The timing audit's defaults, one set for `kvviz audit-timing`, its --help and the Audit page, so
that the command line and the app run the same audit unless told otherwise. No imports: --help
reads them without loading the audit."""

ROUNDS = 40  # each times a same-user hit, a cross-user hit, a miss, a null and a floor; the published protocol: 250
# Words of one token each (SmolLM2). 512, not 256: a hit shows only in the cache pages its prompt fills, and
# transformers serve's default page is 256 tokens, so a 256-token prompt fills none (docs/engines.md).
PROMPT_WORDS = 512
# max_tokens of every untimed primer: a server may cache nothing of a request that ends in its prefill
# step (transformers serve does not), which a primer of 1 token is.
PRIMER_TOKENS = 2
ALPHA = 1e-8
CHANNELS = ("time", "order")  # what the audit reads: time to first token, or the order replies finish in
DUMMIES = 8  # order channel: fresh prompts sent just before each probe, so that the server queues
STAGGER = 0.05  # order channel: seconds between the dummies and the probe, so that it arrives last
