#!/usr/bin/env bash
# What ran on the lent GPU machine for docs/measurements/2026-11-25-h100/ (issue 26), in one call of at most
# 10 minutes: streams side by side, each cut off at a shared deadline, then everything packed into one file.
#   A  every `gpu` test of tests/, tests_memory/, tests_grad/ (pytest -m gpu --vram-require-gpu, xdist)
#   P  docs/measurements/gpu-op-temporaries.py: the op at each step's highest point and what it allocated
#      inside itself (the checkpointing and eager-attention gaps of 2026-11-22)
#   R  docs/measurements/gpu-fake-ranks.py: rank 0 of FSDP2 / FSDP1 at N = 2, 4, 8 on real CUDA tensors under
#      torch's fake process group (8B shape; 7B shape at N = 2)
#   T  `vramguard audit --device cuda --config` of the configured runs (configs in the results' configs/):
#      packing + padding-free (sdpa), Liger, DoRA, paged 8-bit AdamW, three tiny MoEs, the OLMoE-1B-7B shape
#   S  docs/measurements/gpu-snapshot-pair.py: `vramguard audit --device cuda --snapshot` next to PyTorch's own
#      snapshot of the same steps
#   M  (second call) the MoE audits again with lora_dropout 0 (PEFT refuses dropout on the experts' ParamWrapper)
#   V  (second call) audits the kernel-temporaries rule was not derived from: checkpointing at seq 2048, eager
#      attention on tiny Llama, the math attention without checkpointing at batch 4
#   Q  (second call) rank 0 of the 7B shape at N = 4, 8 (FSDP2) and N = 2 (FSDP1)
# usage, on the GPU machine from the project root with .whl/ (../shared/tools/gpu-wheels.sh, plus
# `pip wheel --no-deps -w .whl .` for the pytest entry points) carried:
#   bash docs/measurements/gpu-run2.sh RESULTS_DIR [STREAMS, default "A P R T S"]
set -u
res=${1:?usage: gpu-run2.sh RESULTS_DIR [STREAMS]}; streams=${2:-A P R T S}
end=$((SECONDS + ${BUDGET_S:-530}))
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit
export PYTHONPATH=$PWD/src:$PWD/.site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=2
cfg=docs/measurements/2026-11-25-h100/configs
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
stream_P() {
  local py=docs/measurements/gpu-op-temporaries.py
  timeout "$(left)" python3 $py llama-1b-shape 1024 2 --gradient-checkpointing > "$res/ops-llama-1b-s1024-b2-ckpt.txt" 2>&1
  timeout "$(left)" python3 $py tiny-gemma2 640 2 > "$res/ops-tiny-gemma2-s640-b2.txt" 2>&1
  timeout "$(left)" python3 $py tiny-gemma3 640 2 > "$res/ops-tiny-gemma3-s640-b2.txt" 2>&1
  timeout "$(left)" python3 $py llama-1b-shape 1024 1 > "$res/ops-llama-1b-s1024-b1.txt" 2>&1
  echo "P rc=$? at ${SECONDS}s"
}
rank() {  # model n engine
  timeout "$(left)" python3 docs/measurements/gpu-fake-ranks.py "$res/rank-$1-$3-n$2.json" "$1" "$2" "$3" \
    > "$res/rank-$1-$3-n$2.txt" 2>&1
  echo "R $1 $3 n$2 rc=$? at ${SECONDS}s"
}
stream_R() {
  { rank llama-3.1-8b 2 fsdp2; rank llama-3.1-8b 8 fsdp2; rank llama-3.1-8b 4 fsdp1; rank mistral-7b-v0.3 2 fsdp2; } &
  { rank llama-3.1-8b 4 fsdp2; rank llama-3.1-8b 2 fsdp1; rank llama-3.1-8b 8 fsdp1; } &
  wait
}
audit() {  # name, then vramguard audit options
  local name=$1; shift
  timeout "$(left)" python3 -m vramguard audit --device cuda --steps 3 --json "$res/audit-$name.json" "$@" \
    > "$res/audit-$name.txt" 2>&1
  echo "T audit $name rc=$? at ${SECONDS}s"
}
stream_T() {
  for m in tiny-mixtral tiny-qwen3-moe tiny-olmoe; do audit "moe-$m" --config "$cfg/moe-$m.yaml"; done
  for c in plain-1b packing-padding-free-1b liger-1b dora-1b paged-adamw-8bit-1b; do audit "$c" --config "$cfg/$c.yaml"; done
  audit olmoe-1b-7b-shape-s1024-b1 --config "$cfg/plain-1b.yaml" --model "$cfg/olmoe-1b-7b-shape.json" --batch 1
}
stream_S() {
  local py=docs/measurements/gpu-snapshot-pair.py
  timeout "$(left)" python3 $py "$res/snapshots" tiny-llama 128 2 > "$res/snapshot-tiny-llama.txt" 2>&1
  timeout "$(left)" python3 $py "$res/snapshots" llama-1b-shape 512 2 --gradient-checkpointing \
    > "$res/snapshot-llama-1b.txt" 2>&1
  echo "S rc=$? at ${SECONDS}s"
}
stream_M() {
  for m in tiny-mixtral tiny-qwen3-moe tiny-olmoe; do audit "moe-$m" --config "$cfg/moe-$m.yaml"; done
  audit olmoe-1b-7b-shape-s1024-b1 --config "$cfg/moe-tiny-olmoe.yaml" --model "$cfg/olmoe-1b-7b-shape.json" \
    --seq-len 1024 --batch 1
}
stream_V() {
  audit llama-1b-s2048-b1-ckpt --model llama-1b-shape --seq-len 2048 --batch 1 --gradient-checkpointing --steps 2
  audit tiny-llama-eager-s512-b2 --model tiny-llama --attn-implementation eager --seq-len 512 --batch 2 --steps 2
  audit tiny-qwen3-s512-b4 --model tiny-qwen3 --seq-len 512 --batch 4 --steps 2
  audit tiny-gemma2-s1024-b1-ckpt --model tiny-gemma2 --seq-len 1024 --batch 1 --gradient-checkpointing --steps 2
}
stream_Q() {
  rank mistral-7b-v0.3 4 fsdp2; rank mistral-7b-v0.3 8 fsdp2; rank mistral-7b-v0.3 2 fsdp1
}
for s in $streams; do "stream_$s" & done
wait
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$res/env.txt" 2>&1
echo "done at ${SECONDS}s"
