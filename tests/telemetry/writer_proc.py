"""A lake writer in its own process, for the SIGKILL tests.

    python -m tests.telemetry.writer_proc REDIS_URL PREFIX LAKE CONSUMER MODE READY_FILE

MODE ``hang``: write the first part's files, create READY_FILE, then wait forever before the commit
(the test kills it there). MODE ``run``: consume normally with one entry per part.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from telemetry.lake_files import Part
from telemetry.lake_writer import LakeWriter, WriterConfig


class HangBeforeCommit(LakeWriter):
    def __init__(self, config: WriterConfig, ready: Path) -> None:
        super().__init__(config)
        self._ready = ready

    def commit(self, part: Part) -> None:
        self._ready.write_text(part.part_id)
        threading.Event().wait()  # until SIGKILL


def main() -> None:
    redis_url, prefix, lake, consumer, mode, ready = sys.argv[1:7]
    cfg = WriterConfig(lake=Path(lake), redis_url=redis_url, stream_prefix=prefix, consumer=consumer, batch_entries=1)
    if mode == "hang":
        HangBeforeCommit(cfg, Path(ready)).drain()
    else:
        Path(ready).write_text("started")
        LakeWriter(cfg).run(threading.Event())


if __name__ == "__main__":
    main()
