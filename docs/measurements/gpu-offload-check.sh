python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit
export PYTHONPATH=$PWD/src:$PWD/.site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p $OUT/r
python3 -m pytest -m gpu --vram-require-gpu -p no:cacheprovider -q -rA tests/test_integrations.py tests/test_tracker.py tests/test_ledger.py > $OUT/r/gpu-offload-tests.log 2>&1; echo tests rc=$?
tail -5 $OUT/r/gpu-offload-tests.log
python3 - > $OUT/r/trl-stash.txt 2>&1 <<'PY'
import sys, tempfile, pathlib, torch
sys.path.insert(0, "tests")
import dataclasses
from test_integrations import _sft, CONFIG
from vramguard.workload.models import build_qlora
from vramguard.integrations.transformers import VramGuardCallback
from vramguard.measure.ledger import SavedTensorLedger
tmp = pathlib.Path(tempfile.mkdtemp())
for model, seq, batch in (("tiny-llama", 128, 2), ("llama-1b-shape", 1024, 2)):
    cfg = dataclasses.replace(CONFIG, device="cuda", model=model, seq_len=seq, batch=batch)
    cb = VramGuardCallback(table=False)
    tr = _sft(build_qlora(cfg), cb, tmp, steps=2, use_cpu=False, activation_offloading=True, max_length=seq, per_device_train_batch_size=batch)
    tr.train()
    stash = tr.maybe_activation_offload_context.fwd_stash
    print(model, seq, batch, "retained", [s.retained_bytes for s in cb.report.steps], "host", [s.host_peak_bytes for s in cb.report.steps])
    for tid, (t, ev) in stash.items():
        print("  fwd_stash", tid, tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), "B", t.grad_fn)
PY
echo stash rc=$?
cat $OUT/r/trl-stash.txt | grep -v Warn | tail -20
