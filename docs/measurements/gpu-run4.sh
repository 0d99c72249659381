#!/usr/bin/env bash
# What ran on the lent GPU machine for docs/measurements/2026-11-27-h200-blog13b/ (issue 23): the Hugging Face
# 4-bit blog's LLaMA-13B rows (fixtures/published/configs/hf-4bit-blog-llama-13b.yaml, each row's changes as
# flags) run for real with today's libraries, `vramguard audit --device cuda --config`, to tell an estimating
# error from what the 2023 stack and the gist's settings did differently. One call of at most 10 minutes, two
# streams side by side (the 13B checkpoint each audit writes is 26 GB: one stream writes it to disk, the other
# to /dev/shm when there is room), each cut off at a shared deadline.
#   S1  GC, NF4, fp16 compute, seq 1024 (the row that disagrees): PEFT-default targets (q_proj, v_proj), then
#       all-linear with nested quantization, then TRL's SFTTrainer on the first
#   S2  the same row with all-linear, then with nested quantization (q_proj, v_proj), then seq 512 (fits)
# usage, on the GPU machine from the project root with .whl/ (../shared/tools/gpu-wheels.sh) carried:
#   bash docs/measurements/gpu-run4.sh RESULTS_DIR [NAMES: only these audits, e.g. "gc-s1024-qv gc-s512-qv"]
# (a device call returns at most 8 files: tar RESULTS_DIR into $OUT)
set -u
res=${1:?usage: gpu-run4.sh RESULTS_DIR [NAMES]}; only=${2:-}
end=$((SECONDS + ${BUDGET_S:-480}))
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit
export PYTHONPATH=$PWD/src:$PWD/.site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=4
cfg=fixtures/published/configs/hf-4bit-blog-llama-13b.yaml
row=(--quant-type nf4 --compute-dtype fp16 --gradient-checkpointing --seq-len 1024 --steps 2)
mkdir -p "$res"
left() { echo $((end - SECONDS > 5 ? end - SECONDS : 5)); }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  df -h /tmp /dev/shm
  python3 - <<'PY'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for p in ("bitsandbytes", "transformers", "peft", "accelerate", "trl", "datasets", "vramguard"):
    try: print(p, md.version(p))
    except md.PackageNotFoundError: print(p, "missing")
PY
} > "$res/env.txt" 2>&1
audit() {  # name, then vramguard audit options
  local name=$1; shift
  [ -z "$only" ] || [[ " $only " == *" $name "* ]] || return 0
  timeout "$(left)" python3 -m vramguard audit --device cuda --config "$cfg" --json "$res/audit-$name.json" "$@" \
    > "$res/audit-$name.txt" 2>&1
  echo "audit $name rc=$? at ${SECONDS}s"
}
stream_S1() {
  audit gc-s1024-qv "${row[@]}"
  audit gc-s1024-nq-all-linear "${row[@]}" --double-quant --target-modules all-linear
  audit gc-s1024-qv-sft "${row[@]}" --trainer sft
}
stream_S2() {
  audit gc-s1024-all-linear "${row[@]}" --target-modules all-linear
  audit gc-s1024-nq-qv "${row[@]}" --double-quant
  audit gc-s512-qv --quant-type nf4 --compute-dtype fp16 --gradient-checkpointing --seq-len 512 --steps 2
}
shm=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
{
  stream_S1 &
  if [ "${shm:-0}" -ge 40 ]; then TMPDIR=/dev/shm stream_S2 & else wait; stream_S2; fi
  wait
} 2>&1 | tee "$res/summary.log"
