#!/usr/bin/env bash
# Video rows of the families after Qwen2-VL, Qwen2.5-VL and Qwen3-VL (issue 45 item 2), run where torchvision imports
# (torch 2.14.1, torchvision 0.29.1: transformers' video processors require it): from the repository root,
# PY=/path/to/that/venv/bin/python (default: python) PYTHONPATH=src docs/measurements/2026-11-29-video-families/run.sh.
# Each tiny fixture's audit and estimate (--trainer loop --target cpu) of a row with a video of 3 and of 8 frames of
# 56x84 at seq 640 (about 10 s each on 2 cores).
set -euo pipefail
PY=${PY:-python}
here=docs/measurements/2026-11-29-video-families
for family in qwen3-vl-moe qwen3.5 glm4v internvl smolvlm; do
    tiny=(--model "fixtures/configs/vlm/tiny-$family.json" --video-size 56x84 --seq-len 640 --batch 1 --steps 2 --quiet)
    for n in 3 8; do
        "$PY" -m vramguard audit "${tiny[@]}" --video-frames "$n" --device cpu --json "$here/$family-audit-$n.json"
        "$PY" -m vramguard estimate "${tiny[@]}" --video-frames "$n" --trainer loop --target cpu \
            --json "$here/$family-estimate-$n.json"
    done
done
