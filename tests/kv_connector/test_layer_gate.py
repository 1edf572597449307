"""The split prefill's layer gate (``kv_connector.layer_gate``): a layer's wait returns once every pull
of the step has written that layer; a pull that fails or stalls is handed back once, so that its
blocks are recomputed, and the step goes on. Pull threads are real threads here; nothing sleeps to
synchronise: each waits on the gate's own condition or on an event."""

from __future__ import annotations

import threading

from kv_connector.layer_gate import LayerGate


def _run(target) -> threading.Thread:  # type: ignore[no-untyped-def]
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def test_a_layer_waits_for_every_pull_of_the_step() -> None:
    gate = LayerGate(stall_s=30)
    a, b = gate.open("a", [1, 2]), gate.open("b", [3])
    returned = threading.Event()
    waiter = _run(lambda: (gate.wait(2), returned.set()))
    a.layers(3)
    assert not returned.wait(0.05)  # b has written nothing
    b.layers(2)
    assert not returned.wait(0.05)  # b has layers 0-1 only
    b.layers(3)
    waiter.join(5)
    assert returned.is_set()
    assert gate.wait(1) == []  # already written: no wait, nothing failed


def test_a_pull_that_ended_well_never_holds_a_layer() -> None:
    gate = LayerGate(stall_s=30)
    gate.open("a", [1]).ended(True)
    assert gate.wait(5) == []


def test_a_failed_pull_is_handed_back_once_with_its_blocks() -> None:
    gate = LayerGate(stall_s=30)
    a = gate.open("a", [7, 8])
    a.layers(1)
    failed: list[list[str]] = []
    waiter = _run(lambda: failed.append([e.request_id for e in gate.wait(3)]))
    a.ended(False)
    waiter.join(5)
    assert failed == [["a"]]
    assert gate.wait(4) == []  # reported once; later layers do not wait on it
    assert a.block_ids == [7, 8]


def test_a_silent_pull_is_given_up_after_the_stall_time() -> None:
    gate = LayerGate(stall_s=0.2)
    gate.open("a", [1])
    assert [e.request_id for e in gate.wait(0)] == ["a"]


def test_a_new_step_forgets_the_last_ones_pulls() -> None:
    gate = LayerGate(stall_s=30)
    gate.open("a", [1])
    gate.begin_step()
    assert len(gate) == 0 and gate.wait(0) == []


def test_the_worker_recomputes_a_failed_split_pull_and_keeps_it_out_of_vllms_receives() -> None:
    """What the connector does with a split pull: a layer wait that finds it failed makes its blocks load
    errors (vLLM recomputes them); its outcome is reported to the router but is no finished or failed
    receive of vLLM's (vLLM never waited for it as a whole); an ordinary pull's outcome still is."""
    import numpy as np

    from decode_nodes.puller import Puller, PullOutcome
    from kv_connector.worker import TandemWorker
    from kv_transfer import wire
    from kv_transfer.layout import KVLayout
    from kv_transfer.settings import ConnectorSettings

    w = TandemWorker(ConnectorSettings(port=9112), "engine-x", num_blocks=4)
    w.puller = Puller(KVLayout.from_arrays([np.zeros((4, 8), np.uint8)]), w.stats, wire.Codec(b"x" * 32), threads=1)
    w._layer_index = {"layer.0": 0, "layer.1": 1}
    w._split.add("split-req")
    w.gate.open("split-req", [2, 3]).ended(False)
    w.wait_layer("layer.0")
    assert w.take_load_errors() == {2, 3}
    w.puller.outcomes.put(PullOutcome("split-req", False, [2, 3], reason="peer died"))
    w.puller.outcomes.put(PullOutcome("plain-req", True, [0]))
    sending, recving, failed = w.transfer_results(set())
    assert recving == {"plain-req"} and not failed
    assert set(w.take_reports().reports) == {"split-req", "plain-req"}  # type: ignore[union-attr]
    w.wait_layer("layer.1")  # no split pull open any more: returns at once
