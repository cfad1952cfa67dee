"""What runs things: a workload under the oracles (checked), recorded into the store, a live run for
the app, a replay that verifies a stored run, the detection matrix, imports of uploaded files and
background explain jobs. Everything below (engine, oracle, store, analysis) only computes or stores."""
