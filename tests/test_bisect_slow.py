"""Real releases: bisect bitsandbytes on CPU for the first release whose 4-bit fp4 matmul trains on CPU.

Slow (downloads up to ~7 wheels of 30-100 MB into the overlay cache, then reuses them), so marked
``slow`` and not in the default run: ``pytest -m slow tests/test_bisect_slow.py``. Uses the user's
overlay cache (``$VRAMGUARD_CACHE`` or ``~/.cache/vramguard/overlays``) so a rerun downloads nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from vramguard.bisect.search import probe_bound
from vramguard.cli import main

PROBE = Path(__file__).parent / "probes" / "bnb_fp4_cpu_grad.py"


@pytest.mark.slow
def test_bitsandbytes_first_release_with_fp4_training_on_cpu(capsys, tmp_path: Path) -> None:
    log = tmp_path / "bnb.json"
    code = main(
        [
            "bisect",
            "bitsandbytes",
            "--bad",
            "0.44.0",
            "--good",
            "0.50.2",
            "--find-fix",
            "--timeout",
            "600",
            "--log",
            str(log),
            "--",
            sys.executable,
            str(PROBE),
            "fp4",
        ]
    )
    out, err = capsys.readouterr()
    if code == 2 and "cannot reach the package index" in err:
        pytest.skip(err.strip())
    assert code == 0, err
    data = json.loads(log.read_text())
    # 0.46 added CPU 4-bit for nf4 only ("quant_type must be nf4 on CPU"); 0.47.0 added fp4 on CPU.
    assert data["result"]["first_fixed"] == "0.47.0", data["result"]
    assert data["result"]["last_bad"] == "0.46.1"
    n_skips = len(data["result"]["skipped"])
    assert data["probe_count"] <= probe_bound(len(data["candidates"])) + n_skips
    for probe in data["probes"]:  # every verdict came from the overlay version, not the installed one
        if probe["verdict"] != "skip":
            assert probe["output_tail"][-1].startswith(f"bitsandbytes {probe['version']}: "), probe
    print(out)
