#!/usr/bin/env bash
# Video frames (issue 45 item 2), run where torchvision imports (torch 2.14.1, torchvision 0.29.1: transformers'
# video processors require it): from the repository root, PY=/path/to/that/venv/bin/python (default: python)
# PYTHONPATH=src docs/measurements/2026-11-29-video/run.sh. The tiny Qwen2.5-VL's audit and estimate at 3 and 8
# frames (about 15 s each on 2 cores), then full-size estimates at seq 4096 (about 30 s each).
set -euo pipefail
PY=${PY:-python}
here=docs/measurements/2026-11-29-video
tiny=(--model fixtures/configs/vlm/tiny-qwen2.5-vl.json --video-size 56x84 --seq-len 640 --batch 1 --steps 2)
for n in 3 8; do
    "$PY" -m vramguard audit "${tiny[@]}" --video-frames "$n" --device cpu --json "$here/audit-$n-frames.json" \
        > "$here/audit-$n-frames.txt"
    "$PY" -m vramguard estimate "${tiny[@]}" --video-frames "$n" --trainer loop --target cpu \
        --json "$here/estimate-$n-frames.json" > "$here/estimate-$n-frames.txt"
done
full=(--seq-len 4096 --batch 1 --target-modules all-linear)
for model in qwen2.5-vl-7b qwen3-vl-8b; do
    "$PY" -m vramguard estimate --model "$model" --video-frames 8 --video-size 448x448 "${full[@]}" \
        --json "$here/$model-video-8x448x448-4096.json" > "$here/$model-video-8x448x448-4096.txt"
done
"$PY" -m vramguard estimate --model qwen2.5-vl-7b --image-size 448x448 "${full[@]}" \
    --json "$here/qwen2.5-vl-7b-image-448x448-4096.json" > "$here/qwen2.5-vl-7b-image-448x448-4096.txt"
