"""`kvviz serve`: the engine as an OpenAI-compatible server (app), its engine thread (worker), the
request bodies (protocol) and the Prometheus metrics. Importing this package loads none of them."""

SHARING = ("global", "per-user", "off")  # the prefix-cache policies `--cache-sharing` takes
