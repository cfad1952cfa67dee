"""The timing audit (`kvviz audit-timing`): does a server's time to first token reveal that another
tenant's prompt is cached? Paired with the same user's own hits as the control, so that "nothing
found" tells isolation from no cache. defaults holds the one set of settings the CLI and the page
share, client sends one user's requests, probe runs the schedule, verdict judges the timings,
telemetry reads what the server itself said of its cache, recorded keeps audits in the store for the
app."""
