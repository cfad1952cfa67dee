#!/usr/bin/env bash
# The GPU checks, as one script for a lent CUDA machine: the packed-vs-generate equality tests on
# CUDA (float32), the transformers backend's tests (issue 27) on CUDA, and the bench. Figures go to
# $OUT (default ./artifacts).
#
# That machine fetches nothing: it has torch and transformers, and the packages it lacks travel as
# wheels in .whl (carry it; the device tool's README says how to download them here), installed
# below into /tmp/site. The SmolLM2 weights (270 MB as GGUF) exceed the 64 MiB a call carries, so
# unless they are in the model cache there, the equality tests run on the tiny models only and the
# bench runs on tiny-llama (which measures the engine's overhead per step rather than the model).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-artifacts}"
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
model=tiny-llama
select=(-m "not slow")
if timeout 60 python3 -m kvviz fetch-model smollm2 >/dev/null 2>&1; then model=smollm2; select=(); fi
KVVIZ_TEST_DEVICE=cuda python3 -m pytest -q "${select[@]}" tests/test_engine_equivalence.py 2>&1 | tee "$out/equivalence-cuda.txt"
# transformers' continuous batching on CUDA under the oracle: equality with generate_batch, clean runs,
# the injected transformers bugs caught, and sdpa_paged's output checked against the recomputed weights
KVVIZ_TEST_DEVICE=cuda python3 -m pytest -q -m "not slow" tests/test_hf_backend.py 2>&1 | tee "$out/hf-backend-cuda.txt"
python3 -m kvviz bench --device cuda --model "$model" --sizes 8,32 --new-tokens 64 --out "$out/bench-cuda.md"
