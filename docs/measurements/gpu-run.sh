#!/usr/bin/env bash
# What ran on the lent GPU machine for docs/measurements/ (issue 15), in one call of at most 10 minutes:
# three streams side by side, each cut off at a shared deadline, then everything packed into one file.
#   A  every `gpu` test of tests/, tests_memory/, tests_grad/ (pytest -m gpu --vram-require-gpu, xdist)
#   B  the GPU benchmark matrix into a results store (--vram-store), the JSON that `vramguard compare` reads
#   C  `vramguard audit --device cuda` on each tiny preset
#   F  `vramguard audit --device cuda` on the 1B shape and the 8B shape (random weights)
#   G  `vramguard audit --device cuda` through transformers' Trainer and TRL's SFTTrainer
#   H  `vramguard audit --device cuda` on the paths the first estimate validation left out: checkpointing,
#      LoRA dropout, eager attention (Gemma 2), a sliding-window mask (Gemma 3 beyond its window)
#   P  docs/measurements/gpu-peak.py: what is live at the peak (checkpointing, eager attention)
#   D  docs/measurements/gpu-diagnose.py: the sdpa kernel torch picks and what a step leaves allocated
#   E  the `gpu` tests of tests_grad/ alone
#   O  activation offloading through Trainer (save_on_cpu) and SFTTrainer (TRL's OffloadActivations), with and
#      without, on the tiny Llama and the 1B shape: host copies per step next to the device's peaks
# STORE (default RESULTS_DIR/store) is the results store B adds its run to; with two runs in it, B also
# writes `vramguard compare STORE@previous STORE@latest`.
# usage, on the GPU machine from the project root with .whl/ (../shared/tools/gpu-wheels.sh, plus
# `pip wheel --no-deps -w .whl .` for the pytest entry points) carried:
#   bash docs/measurements/gpu-run.sh RESULTS_DIR [STREAMS, default "A B C F"]
set -u
res=${1:?usage: gpu-run.sh RESULTS_DIR [STREAMS]}; streams=${2:-A B C F}
end=$((SECONDS + ${BUDGET_S:-520}))
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit
export PYTHONPATH=$PWD/src:$PWD/.site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
store=${STORE:-$res/store}; mkdir -p "$res" "$store"
left() { echo $((end - SECONDS > 5 ? end - SECONDS : 5)); }
{
  nvidia-smi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 - <<'PY'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for p in ("bitsandbytes", "transformers", "peft", "accelerate", "trl", "pytest", "pytest-benchmark",
          "pytest-xdist", "hypothesis", "nvidia-ml-py", "vramguard"):
    try: print(p, md.version(p))
    except md.PackageNotFoundError: print(p, "missing")
import bitsandbytes, vramguard
print("bitsandbytes from", bitsandbytes.__file__, "vramguard from", vramguard.__file__)
PY
} > "$res/env.txt" 2>&1
stream_A() {
  timeout "$(left)" python3 -m pytest -m gpu --vram-require-gpu -n "${XDIST:-6}" -p no:cacheprovider -q -rA \
    --junitxml="$res/gpu-tests.xml" tests tests_memory tests_grad > "$res/gpu-tests.log" 2>&1
  echo "A rc=$? at ${SECONDS}s"
}
stream_B() {
  timeout "$(left)" python3 -m pytest benchmarks -m "gpu and benchmark" --vram-require-gpu -p no:cacheprovider -q -rA \
    --benchmark-json="$res/gpu-bench.json" --vram-store="$store" > "$res/gpu-bench.log" 2>&1
  echo "B rc=$? at ${SECONDS}s"
  python3 -m vramguard compare "$store@previous" "$store@latest" --json "$res/compare.json" \
    > "$res/compare.txt" 2>&1
  echo "B compare rc=$?"
  cp -r "$store" "$res/store-after"
}
audit() {  # name, then vramguard audit options
  local name=$1; shift
  timeout "$(left)" python3 -m vramguard audit --device cuda --json "$res/audit-$name.json" "$@" \
    > "$res/audit-$name.txt" 2>&1
  echo "C audit $name rc=$? at ${SECONDS}s"
}
stream_C() {
  for p in tiny-llama tiny-llama-hf tiny-mistral tiny-qwen2 tiny-qwen3 tiny-phi3 tiny-gemma2 tiny-gemma3; do
    audit "$p" --model "$p"
  done
}
stream_F() {
  audit llama-1b-s1024-b2 --model llama-1b-shape --seq-len 1024 --batch 2 --steps 2
  audit llama-8b-s1024-b1 --model llama-3.1-8b --seq-len 1024 --batch 1 --steps 2
}
stream_D() {
  timeout "$(left)" python3 docs/measurements/gpu-diagnose.py > "$res/diagnose.txt" 2>&1
  echo "D rc=$? at ${SECONDS}s"
}
stream_E() {
  timeout "$(left)" python3 -m pytest -m gpu --vram-require-gpu -n 4 -p no:cacheprovider -q -rA tests_grad \
    > "$res/gpu-grad-tests.log" 2>&1
  echo "E rc=$? at ${SECONDS}s"
}
stream_G() {
  audit trainer-tiny-llama --model tiny-llama --trainer trainer
  audit sft-tiny-llama --model tiny-llama --trainer sft
}
stream_H() {
  audit llama-1b-s1024-b2-ckpt --model llama-1b-shape --seq-len 1024 --batch 2 --steps 2 --gradient-checkpointing
  audit llama-1b-s1024-b2-dropout --model llama-1b-shape --seq-len 1024 --batch 2 --steps 2 --lora-dropout 0.1
  audit tiny-gemma2-s640 --model tiny-gemma2 --seq-len 640 --batch 2 --steps 2
  audit tiny-gemma3-s640 --model tiny-gemma3 --seq-len 640 --batch 2 --steps 2
}
stream_P() {  # what is live at the peak where the estimate's peak fell short (checkpointing, eager)
  timeout "$(left)" python3 docs/measurements/gpu-peak.py llama-1b-shape 1024 2 --gradient-checkpointing \
    > "$res/peak-llama-1b-ckpt.txt" 2>&1
  timeout "$(left)" python3 docs/measurements/gpu-peak.py tiny-gemma2 640 2 > "$res/peak-tiny-gemma2.txt" 2>&1
  echo "P rc=$? at ${SECONDS}s"
}
stream_O() {
  for t in trainer sft; do
    audit "$t-tiny-llama" --model tiny-llama --trainer "$t"
    audit "$t-tiny-llama-offload" --model tiny-llama --trainer "$t" --offload-activations
    audit "$t-llama-1b-s1024-b2" --model llama-1b-shape --seq-len 1024 --batch 2 --steps 2 --trainer "$t"
    audit "$t-llama-1b-s1024-b2-offload" --model llama-1b-shape --seq-len 1024 --batch 2 --steps 2 \
      --trainer "$t" --offload-activations
  done
  timeout "$(left)" python3 -m pytest -m gpu --vram-require-gpu -p no:cacheprovider -q -rA \
    --junitxml="$res/gpu-offload-tests.xml" tests/test_integrations.py > "$res/gpu-offload-tests.log" 2>&1
  echo "O tests rc=$? at ${SECONDS}s"
}
for s in $streams; do "stream_$s" & done
wait
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$res/env.txt" 2>&1
echo "done at ${SECONDS}s"
