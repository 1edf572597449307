"""``warm_batches`` loads at startup what pyarrow loads on its first conversion of rows (it imports
pandas then: ~0.2 s of CPU that otherwise lands in a router's first requests). Checked in a fresh
interpreter, where nothing is loaded yet: after the warm-up, building every table's batch imports
nothing more."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys
from telemetry.batches import build_batch, warm_batches
from telemetry.schemas import SCHEMAS
cold = set(sys.modules)
warm_batches()
warmed = set(sys.modules)
for table in SCHEMAS:
    build_batch(table, [{"request_id": "r1", "tenant_id": "t"}, {}], [1.0, 2.0], "probe")
print(json.dumps({"loaded_by_warm": len(warmed - cold), "loaded_after": sorted(set(sys.modules) - warmed)}))
"""


def test_after_the_warm_up_building_batches_imports_nothing() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["loaded_after"] == [], result["loaded_after"][:20]
    assert result["loaded_by_warm"] > 0  # the warm-up did load what the first conversion needs
