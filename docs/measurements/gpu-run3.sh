#!/usr/bin/env bash
# What ran on the lent GPU machine for docs/measurements/2026-11-27-h200/ (issue 26, round three), in one call of
# at most 10 minutes: streams side by side, each cut off at a shared deadline.
#   A  every `gpu` test of tests/, tests_memory/, tests_grad/ (pytest -m gpu --vram-require-gpu, xdist) on a GPU
#      kind the suite had not met (H200), at a main with gradient accumulation
#   G  gradient accumulation on CUDA: `vramguard audit --device cuda --config` of the 1B shape with 1, 2 and 4
#      micro-batches (4: with packing + padding-free and paged 8-bit AdamW), and transformers' Trainer on tiny
#      Llama with 1 and 2 micro-batches (the rise: the gradients plus the later micro-batch's rows)
#   H  the headline shapes again on this GPU: the 1B shape (batch 2 x 1,024) and the 8B shape (batch 1 x 1,024),
#      the 1B one with --html and --snapshot (the picture of the step drawn from a CUDA run)
#   R  docs/measurements/gpu-fake-ranks.py: rank 0 of FSDP2 / FSDP1 (8B shape, N = 2) with 2 micro-batches
#      under no_sync, and FSDP2 with 1 as this GPU's baseline
# usage, on the GPU machine from the project root with .whl/ (../shared/tools/gpu-wheels.sh, plus
# `pip wheel --no-deps -w .whl .` for the pytest entry points) carried:
#   bash docs/measurements/gpu-run3.sh RESULTS_DIR [STREAMS, default "A G H R"]
set -u
res=${1:?usage: gpu-run3.sh RESULTS_DIR [STREAMS]}; streams=${2:-A G H R}
end=$((SECONDS + ${BUDGET_S:-450}))
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit
export PYTHONPATH=$PWD/src:$PWD/.site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=2
cfg=docs/measurements/2026-11-27-h200/configs
old=docs/measurements/2026-11-25-h100/configs
mkdir -p "$res"
left() { echo $((end - SECONDS > 5 ? end - SECONDS : 5)); }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 - <<'PY'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for p in ("bitsandbytes", "transformers", "peft", "accelerate", "trl", "datasets", "liger-kernel", "triton",
          "pytest", "pytest-xdist", "hypothesis", "nvidia-ml-py", "vramguard"):
    try: print(p, md.version(p))
    except md.PackageNotFoundError: print(p, "missing")
PY
  git log -1 --format='commit %H' 2>/dev/null || true
} > "$res/env.txt" 2>&1
stream_A() {
  timeout "$(left)" python3 -m pytest -m gpu --vram-require-gpu -n "${XDIST:-6}" -p no:cacheprovider -q -rA \
    --junitxml="$res/gpu-tests.xml" tests tests_memory tests_grad > "$res/gpu-tests.log" 2>&1
  echo "A rc=$? at ${SECONDS}s"
}
audit() {  # name, then vramguard audit options
  local name=$1; shift
  timeout "$(left)" python3 -m vramguard audit --device cuda --json "$res/audit-$name.json" "$@" \
    > "$res/audit-$name.txt" 2>&1
  echo "audit $name rc=$? at ${SECONDS}s"
}
stream_G() {
  audit trainer-tiny-llama-ga1 --model tiny-llama --trainer trainer --steps 2
  audit trainer-tiny-llama-ga2 --model tiny-llama --trainer trainer --steps 2 --gradient-accumulation-steps 2
  audit plain-1b --config "$old/plain-1b.yaml" --steps 3
  audit accum-1b --config "$cfg/accum-1b.yaml" --steps 3
  audit accum-packing-paged-1b --config "$cfg/accum-packing-paged-1b.yaml" --steps 3
}
stream_H() {
  audit llama-1b-s1024-b2 --model llama-1b-shape --seq-len 1024 --batch 2 --steps 2 \
    --html "$res/llama-1b-s1024-b2.html" --snapshot "$res/llama-1b-s1024-b2.pickle"
  audit llama-3.1-8b-s1024-b1 --model llama-3.1-8b --seq-len 1024 --batch 1 --steps 2
}
rank() {  # model n engine micro-batches
  timeout "$(left)" python3 docs/measurements/gpu-fake-ranks.py "$res/rank-$1-$3-n$2-ga$4.json" "$1" "$2" "$3" \
    --gradient-accumulation-steps "$4" > "$res/rank-$1-$3-n$2-ga$4.txt" 2>&1
  echo "R $1 $3 n$2 ga$4 rc=$? at ${SECONDS}s"
}
stream_R() {
  { rank llama-3.1-8b 2 fsdp2 2; rank llama-3.1-8b 2 fsdp2 1; } &
  { rank llama-3.1-8b 2 fsdp1 2; } &
  wait
}
for s in $streams; do "stream_$s" & done
wait
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$res/env.txt" 2>&1
echo "done at ${SECONDS}s"
