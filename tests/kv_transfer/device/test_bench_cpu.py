"""The device bench's CPU rehearsal, small: both processes start, every arm runs, the checksums
match on every path, the GPU-only thresholds say why they are skipped, and the RESULT line is last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_rehearsal_runs_every_arm_and_reports_json(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    cmd = [
        sys.executable,
        str(ROOT / "infra/device/kv_cuda_bench.py"),
        "--device",
        "cpu",
        "--tokens",
        "64",
        "--shapes",
        "smollm",
        "--repeats",
        "1",
        "--fixed-repeats",
        "1",
        "--port",
        "28710",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT device=cpu rehearsal=true ") and "checksums_equal=true" in last
    result = json.loads(out.read_text())
    shape = result["shapes"]["SmolLM2-135M"]
    assert shape["shape"]["layers"] == 30 and shape["blocks"] == 4
    assert shape["bytes"] == 64 * 30 * 2 * 3 * 64 * 2
    assert shape["checksums_equal"] == {"ipc": True, "shm": True, "tcp": True, "layerwise": True}
    for arm in ("d2h", "h2d", "ipc"):
        assert shape["verdicts"][arm].startswith("skipped: needs a GPU")
    assert shape["verdicts"]["checksums"] == "pass"
    for t in ("shm", "tcp"):
        assert shape["pulls"][t]["gbps"] > 0 and shape["pulls"][t]["fixed_ms"] > 0
    assert shape["layerwise"]["whole_exposed_ms"] > 0
