#!/usr/bin/env bash
# Tiny Mistral 3 audited and estimated at two image sizes (run from the repository root, in a venv with
# torchvision: README.md here says how it was made). Writes the JSON and text output beside this file.
set -euo pipefail
out=docs/measurements/2026-11-29-mistral3
model=fixtures/configs/vlm/tiny-mistral3.json
for size in 56x56 112x112; do
    flags=(--model "$model" --image-size "$size" --seq-len 128 --batch 2 --steps 2)
    vramguard audit "${flags[@]}" --device cpu --json "$out/audit-$size.json" > "$out/audit-$size.txt" 2>&1
    vramguard estimate "${flags[@]}" --trainer loop --target cpu --json "$out/estimate-$size.json" \
        > "$out/estimate-$size.txt" 2>&1
done
# --fit-dim image: the largest image whose step fits 814.5 MiB (the tiny step plus the CUDA context the estimate adds)
vramguard estimate --model "$model" --image-size 112x112 --seq-len 128 --batch 2 --trainer loop --fit 814.5MiB \
    --fit-dim image --json "$out/fit-image-814.5MiB.json" > "$out/fit-image-814.5MiB.txt" 2>&1 || [ $? -eq 1 ]  # 1: the requested shape does not fit
PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}src:tests" python "$out/check.py"
PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}src" python "$out/choices.py" > "$out/choices.txt"
