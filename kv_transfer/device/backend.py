"""Where the KV cache lives, behind one small interface: the copies the connector makes between the
engine's cache and host memory, and how it knows they are done.

Two implementations share every caller. ``CudaBackend``: caches in GPU memory, host buffers pinned
(page-locked, so the copy engines DMA them at full speed and ``non_blocking`` copies really are
asynchronous), copies issued on a side stream of the connector's own that first waits on an event
recorded on the engine's stream (the copy sees every kernel the engine queued before it, and the
engine's stream is never synchronized or stalled), completion observed through events.
``CpuBackend``: caches in host memory (vLLM's CPU attention backend, and CI), copies done at once,
events that are complete when made; the callers cannot tell the difference except by speed.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Event(Protocol):
    def query(self) -> bool:
        """Whether the work recorded before this event has finished (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread (never a stream) until that work has finished."""
        ...


class Backend(Protocol):
    name: str
    device: torch.device

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer the copy engines can reach directly (pinned on CUDA)."""
        ...

    def engine_mark(self) -> Event:
        """An event on the engine's current stream: everything the engine has queued so far."""
        ...

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Event | None) -> Event:
        """Copy each (dst, src) on the connector's side stream once ``after`` has completed; returns
        the event that completes when all of them have. Never waits on the engine's stream."""
        ...


class DoneEvent:
    """An event whose work is already done (the CPU backend copies synchronously)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuBackend:
    name = "cpu"

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def engine_mark(self) -> Event:
        return DoneEvent()

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Event | None) -> Event:
        if after is not None:
            after.synchronize()
        for dst, src in pairs:
            dst.copy_(src)
        return DoneEvent()


class CudaBackend:
    """Copies on one side stream per backend (per engine worker: one GPU each)."""

    name = "cuda"

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA backend asked for, but torch sees no CUDA device")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.stream: Any = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def engine_mark(self) -> Event:
        event: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event  # type: ignore[no-any-return]

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Event | None) -> Event:
        done: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)  # a GPU-side wait: the host thread never blocks here
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                # the tensors' memory must outlive the queued copy even if the caller drops them
                if dst.is_cuda:
                    dst.record_stream(self.stream)
                if src.is_cuda:
                    src.record_stream(self.stream)
            done.record(self.stream)
        return done  # type: ignore[no-any-return]


def backend_for(device: str) -> Backend:
    """``cpu`` or ``cuda`` (``cuda:N``): the backend for caches on that device."""
    if device == "cpu":
        return CpuBackend()
    if device.startswith("cuda"):
        return CudaBackend(device)
    raise ValueError(f"no KV backend for device {device!r}")


def backend_of(t: torch.Tensor) -> Backend:
    return CpuBackend() if t.device.type == "cpu" else CudaBackend(t.device)
