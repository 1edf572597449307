"""The two processes of the device KV bench: a prefill side (its cache on the device, its block server
on the cache's pinned host mirror, its leases) and a decode side (its cache, its puller, CUDA IPC
opens), each driven over a pipe by ``kv_cuda_bench``. Only torch, pyzmq, msgspec, xxhash and our
packages: no vLLM, so this runs on a machine vLLM cannot be installed on.

Each command answers with plain numbers; timings are taken in the side that does the work, around
a completed event (``synchronize`` on the copy's own event, never on the device)."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer import wire
from kv_transfer.device.backend import Backend, backend_for
from kv_transfer.device.ipc import export_parts, open_parts, pull_ipc
from kv_transfer.device.staging import DeviceKV

BLOCK_SIZE = 16
SECRET = b"tandem-device-bench-secret-0123456789"


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def token_nbytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.empty(0, dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype


def make_kv(shape: Shape, num_blocks: int, device: str, fill_seed: int | None) -> DeviceKV:
    """Per layer a cache in vLLM's GPU layout ``[2, num_blocks, block_size, kv_heads, head_dim]``
    (K/V-major), random bytes when ``fill_seed`` is given, else zeros. A CPU cache lives in shared
    memory (the IPC stand-in needs it) and keeps a staging mirror, as a GPU cache does."""
    backend: Backend = backend_for(device)
    gen = torch.Generator(device=backend.device)
    caches = []
    for layer in range(shape.layers):
        t = torch.zeros(
            (2, num_blocks, BLOCK_SIZE, shape.kv_heads, shape.head_dim), dtype=shape.torch_dtype, device=backend.device
        )
        if fill_seed is not None:
            gen.manual_seed(fill_seed + layer)
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=backend.device, generator=gen))
        if device == "cpu":
            t.share_memory_()
        caches.append(t)
    return DeviceKV(caches, num_blocks, backend, mirror=True)


def _sync(kv: DeviceKV) -> None:
    if kv.backend.name == "cuda":
        torch.cuda.synchronize()  # bench set-up only, between measurements: no engine runs here


def compute(kv: DeviceKV, ms: float, cycles_per_ms: float) -> None:
    """Simulated engine work of ``ms`` on the engine's stream (a GPU spin; on CPU the thread sleeps)."""
    if kv.backend.name == "cuda":
        torch.cuda._sleep(int(ms * cycles_per_ms))  # noqa: SLF001 - torch's own test kernel
    else:
        time.sleep(ms / 1000)


def calibrate(kv: DeviceKV) -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep`` (1 on CPU)."""
    if kv.backend.name != "cuda":
        return 1.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # noqa: SLF001
    start.record()
    torch.cuda._sleep(10_000_000)  # noqa: SLF001
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _timed(fn: Any, repeats: int) -> list[float]:
    """Seconds of ``repeats`` runs of ``fn`` (which returns an event), after one that is not counted
    (first touches of fresh memory, lazy CUDA set-up)."""
    fn().synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn().synchronize()
        out.append(time.perf_counter() - t0)
    return out


def ceilings(kv: DeviceKV, nbytes: int, repeats: int) -> dict[str, float]:
    """Seconds (best of ``repeats``) of torch's own copies of ``nbytes`` in one piece: the ceiling."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=kv.backend.device)
    dev2 = torch.empty_like(dev)
    host = kv.backend.host_buffer(nbytes)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host), ("d2d", dev2, dev)):
        out[name] = min(_timed(lambda dst=dst, src=src: kv.backend.copy([(dst, src)], None), repeats))
    return out


def prefill_main(conn: Any, shape: Shape, num_blocks: int, device: str, tcp: str, ipc: str) -> None:
    from kv_transfer.stats import TransferStats
    from prefill_nodes.block_server import BlockServer
    from prefill_nodes.lease import LeaseTable

    kv = make_kv(shape, num_blocks, device, fill_seed=11)
    _sync(kv)
    server = BlockServer(kv.host, LeaseTable("bench-prefill"), [tcp, ipc], TransferStats(), wire.Codec(SECRET))
    server.start()
    cycles = calibrate(kv)
    conn.send(("ready", os.getpid()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            server.close()
            conn.send("bye")
            return
        conn.send(_prefill_cmd(kv, server, cycles, cmd, args))


def _prefill_cmd(kv: DeviceKV, server: Any, cycles: float, cmd: str, args: list[Any]) -> Any:
    if cmd == "d2h":
        ids, repeats = args
        return _timed(lambda: kv.stage_out(ids), repeats)
    if cmd == "ceil":
        return ceilings(kv, *args)
    if cmd == "offer":
        tid, ids = args
        server.offer(tid, ids, time.time() + 60)
        return True
    if cmd == "export":
        return export_parts(kv)
    if cmd == "sums":
        kv.stage_out(args[0]).synchronize()
        return kv.checksums(args[0])
    if cmd == "whole":  # compute every layer, then stage it all out; the lease is offered after
        tid, ids, layer_ms = args
        for _ in range(kv.num_layers):
            compute(kv, layer_ms, cycles)
        if kv.backend.name == "cuda":
            torch.cuda.current_stream().synchronize()  # the bench's end of compute, not the connector's
        end = time.time()  # exposed from here: the staging copy is part of what a whole pull adds
        kv.stage_out(ids).synchronize()
        server.offer(tid, ids, time.time() + 60)
        return end
    if cmd == "layerwise":
        return _layerwise(kv, server, cycles, *args)
    raise ValueError(f"unknown command {cmd}")


def _layerwise(kv: DeviceKV, server: Any, cycles: float, tid: str, ids: list[int], layer_ms: float) -> float:
    """The prefill's forward, layer by layer: each layer's compute queued on the engine's stream, its
    staging copy queued behind it on the side stream, and the block server told a layer is ready
    once that copy's event completes (a watcher thread; the engine thread never waits)."""
    server.open_fill(tid, 60.0)
    events: list[Any] = []
    ready = threading.Condition()

    def watch() -> None:
        for layer in range(kv.num_layers):
            with ready:
                ready.wait_for(lambda: len(events) > layer)  # noqa: B023 - called before the loop moves on
            events[layer].synchronize()
            server.fill(
                tid, (layer + 1) * kv.map.per_layer, ids if layer == 0 else None, done=layer == kv.num_layers - 1
            )

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    for layer in range(kv.num_layers):
        compute(kv, layer_ms, cycles)
        ev = kv.stage_out(ids, [layer])
        with ready:
            events.append(ev)
            ready.notify()
    if kv.backend.name == "cuda":
        torch.cuda.current_stream().synchronize()  # the bench's end of compute, not the connector's
    end = time.time()
    watcher.join()
    return end


def decode_main(conn: Any, shape: Shape, num_blocks: int, device: str) -> None:
    from decode_nodes.puller import Puller
    from kv_transfer.stats import TransferStats

    kv = make_kv(shape, num_blocks, device, fill_seed=None)
    _sync(kv)
    puller = Puller(kv.host, TransferStats(), wire.Codec(SECRET), threads=2)
    peer: list[torch.Tensor] = []
    conn.send(("ready", os.getpid()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            puller.close()
            conn.send("bye")
            return
        if cmd == "open":
            peer[:] = open_parts(args[0])
            conn.send(True)
            continue
        conn.send(_decode_cmd(kv, puller, peer, cmd, args))


def _decode_cmd(kv: DeviceKV, puller: Any, peer: list[torch.Tensor], cmd: str, args: list[Any]) -> Any:
    from decode_nodes.puller import PullJob

    if cmd == "h2d":
        ids, repeats = args
        return _timed(lambda: kv.stage_in(ids), repeats)
    if cmd == "ipc":
        remote, local, repeats = args
        return _timed(lambda: pull_ipc(kv.backend, kv, peer, remote, local), repeats)
    if cmd == "zero":
        for p in kv.parts:
            p.zero_()
        for s in kv.staging:
            s.zero_()
        _sync(kv)
        return True
    if cmd == "sums":
        kv.stage_out(args[0]).synchronize()
        return kv.checksums(args[0])
    if cmd == "pull":  # (transport, endpoint, tid, remote ids or positions, local ids, layerwise)
        transport, endpoint, tid, remote, local, layerwise = args
        t0 = time.perf_counter()
        puller.submit(
            PullJob(
                tid,
                tid,
                endpoint,
                transport,
                wire.segments_of(remote, local),
                local,
                time.monotonic() + 60,
                checksum=True,
                layerwise=layerwise,
            )
        )
        out = puller.outcomes.get(timeout=120)
        t1 = time.perf_counter()
        kv.stage_in(local).synchronize()
        return {
            "ok": out.ok,
            "reason": out.reason,
            "bytes": out.nbytes,
            "pull_s": t1 - t0,
            "h2d_s": time.perf_counter() - t1,
            "end": time.time(),
        }
    raise ValueError(f"unknown command {cmd}")


def endpoints(port: int) -> tuple[str, str]:
    d = tempfile.mkdtemp(prefix="tandem-kv-dev-")
    return f"tcp://127.0.0.1:{port}", f"ipc://{d}/kv.sock"
