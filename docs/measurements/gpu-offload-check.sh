#!/usr/bin/env bash
# Activation offloading on the GPU (issue 13): the offloading tests of tests/test_integrations.py (and the
# tracker/ledger gpu tests), docs/measurements/gpu-retained-diff.py (the device blocks a step leaves with
# offloading and not without, by allocating frame) and gpu-trl-holder.py (who holds them). Results under
# $OUT/r. Run from the project root with .whl/ carried.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit
export PYTHONPATH=$PWD/src:$PWD/.site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT/r"
python3 -m pytest -m gpu --vram-require-gpu -p no:cacheprovider -q -rA tests/test_integrations.py tests/test_tracker.py \
  tests/test_ledger.py > "$OUT/r/gpu-offload-tests.log" 2>&1
echo "tests rc=$?"
tail -4 "$OUT/r/gpu-offload-tests.log"
for script in ${SCRIPTS:-gpu-retained-diff gpu-trl-holder}; do
  python3 "docs/measurements/$script.py" > "$OUT/r/$script.txt" 2>&1
  echo "$script rc=$?"
  grep -E "^==|^  " "$OUT/r/$script.txt" | head -60
done
