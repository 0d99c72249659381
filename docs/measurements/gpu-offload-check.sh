#!/usr/bin/env bash
# Activation offloading on the GPU (issue 13): the offloading tests of tests/test_integrations.py (and the
# tracker/ledger gpu tests), then docs/measurements/gpu-retained-diff.py, which names the device blocks a
# step leaves with offloading and not without. Results under $OUT/r. Run from the project root with .whl/.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit
export PYTHONPATH=$PWD/src:$PWD/.site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT/r"
python3 -m pytest -m gpu --vram-require-gpu -p no:cacheprovider -q -rA tests/test_integrations.py tests/test_tracker.py \
  tests/test_ledger.py > "$OUT/r/gpu-offload-tests.log" 2>&1
echo "tests rc=$?"
tail -4 "$OUT/r/gpu-offload-tests.log"
python3 docs/measurements/gpu-retained-diff.py > "$OUT/r/retained-diff.txt" 2>&1
echo "retained-diff rc=$?"
grep -E "^==|^  " "$OUT/r/retained-diff.txt" | head -80
