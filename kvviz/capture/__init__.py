"""Production captures: vLLM/SGLang KV-cache events over ZMQ, recorded to a file and imported as runs."""
