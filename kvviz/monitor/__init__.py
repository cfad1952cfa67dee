"""`kvviz monitor`: a fleet's KV-event stream watched live, its state kept from the events alone in
bounded memory and exposed to Prometheus (docs/monitoring.md)."""
