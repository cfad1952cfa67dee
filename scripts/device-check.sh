#!/usr/bin/env bash
# The GPU checks of issue #3, as one script for a lent CUDA machine: the packed-vs-generate
# equality tests on CUDA (float32) and the bench. Figures go to $OUT (default ./artifacts).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-artifacts}"
mkdir -p "$out"
python -m pip install --disable-pip-version-check -q -r requirements.txt
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
KVVIZ_TEST_DEVICE=cuda python -m pytest -q tests/test_engine_equivalence.py 2>&1 | tee "$out/equivalence-cuda.txt"
python -m kvviz bench --device cuda --sizes 8,32 --new-tokens 64 --out "$out/bench-cuda.md"
