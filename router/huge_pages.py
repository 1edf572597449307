"""The router's Python heap on transparent huge pages: what a wake-up costs it on a virtual machine.

A router relaying tokens at a CPU engine's pace wakes for every batch of chunks, and between them it
sleeps. On the 2-core VMs this project runs on (Firecracker guests, the ``haltpoll`` cpuidle
governor), a wake-up costs a large process far more than a small one, and a Python process touches
thousands of 4 KiB pages per wake-up (objects spread over a heap of half a gigabyte). The figures fit
a wake-up that pays for the address translations the guest lost while it slept, so that the router's
CPU per wake-up grows with its working set in pages, not with its work (these guests have no
performance counters to count TLB misses with).
On an AMX Xeon VM, an idle router took 6-10 ms of CPU per wake-up (a bare ``time.sleep`` loop 0.37 ms),
and a paced stream's relay 250 µs per chunk (``tandem bench overhead``'s paced stand-in).

With CPython's objects in glibc's ``malloc`` (``PYTHONMALLOC=malloc``) and glibc asked to back its heap
with transparent huge pages (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: ``madvise(MADV_HUGEPAGE)`` on
what it maps, honoured where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or
``madvise``), the same heap spans 2 MiB pages, 512 times fewer translations. Measured over a paced
stand-in (16 streams of 32 tokens at 100 ms per token, four runs each, alternated; ``/proc`` scheduler
counters; AMX Xeon VM): 3.4-4.4 ms of router CPU per request against 5.5-8.9, and idle 2.7-4.9 ms of
CPU a second against 4.9-15.2. Either half alone did not do it (``PYTHONMALLOC=malloc`` alone: 7.6 and
8.3 ms; the tunable alone, which leaves CPython's own arenas on small pages: 4.9 and 8.8). CPU-bound
relaying (no sleeps) was level (1.79-1.89 ms against 1.66-1.85 per 256-token request). The price is
about 10 MB more resident memory.

Both variables are read when a process starts, so a router started without them replaces itself
(``os.execve``, same pid, same arguments) once its settings say so (``RouterSettings.huge_pages``),
before it opens anything: about a second of start-up (the command's imports, twice). A variable the
operator set (another ``PYTHONMALLOC``, a ``glibc.malloc.hugetlb`` of their own) is left as it is, and
nothing is done where the kernel has no transparent huge pages (``never``, or no such file).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("tandem.router.huge_pages")

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
TUNABLE = "glibc.malloc.hugetlb"
ALLOCATOR = "PYTHONMALLOC"
TUNABLES = "GLIBC_TUNABLES"


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), None if unknown."""
    try:
        match = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def huge_page_env(environ: Mapping[str, str], mode: str | None) -> dict[str, str] | None:
    """The environment to restart this process with, or None: already on huge pages, the operator chose
    an allocator or the tunable themselves, or the kernel offers no transparent huge pages."""
    if mode not in ("always", "madvise"):
        return None
    allocator = environ.get(ALLOCATOR, "")
    tunables = [t for t in environ.get(TUNABLES, "").split(":") if t]
    hugetlb = next((v for k, _, v in (t.partition("=") for t in tunables) if k == TUNABLE), None)
    if allocator not in ("", "malloc") or hugetlb not in (None, "1") or (allocator, hugetlb) == ("malloc", "1"):
        return None  # the operator's allocator or tunable value, or already on huge pages
    env = {**environ, ALLOCATOR: "malloc"}
    if hugetlb is None:
        env[TUNABLES] = ":".join([*tunables, f"{TUNABLE}=1"])
    return env


def restart_on_huge_pages(enabled: bool) -> None:
    """Replace this process with itself on huge pages (see the module docstring) when ``enabled`` and
    it is not on them yet; otherwise return. Call it before the process opens anything.

    Only a process started as the router command (``tandem router ...``, ``python -m tandem router
    ...``) is replaced: the command called from within another program (a test's ``CliRunner``, an
    embedding script) returns here, since replacing that program would start it over from its first line,
    with whatever environment it had changed by then."""
    if not enabled or sys.argv[1:2] != ["router"]:
        return
    env = huge_page_env(os.environ, thp_mode())
    if env is None:
        return
    log.info("restarting on transparent huge pages (%s=malloc, %s=%s)", ALLOCATOR, TUNABLES, env[TUNABLES])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
