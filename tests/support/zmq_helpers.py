"""A KV-event publisher that speaks vLLM's wire format on real ZeroMQ sockets, with knobs to drop
messages, forget its replay buffer or not answer replays; and a deadline poller for tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import BlockStored, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ZmqEventPublisher.END_SEQ


async def until(cond: Callable[[], bool], within_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def stored(keys: list[int], block_size: int = 16, parent: int | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=keys,
        parent_block_hash=parent,
        token_ids=[0] * (block_size * len(keys)),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


class FakePublisher:
    """Like vLLM's ZmqEventPublisher (PUB ``[topic, seq, payload]`` + ROUTER replay), seq by seq."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay_endpoint: str | None, *, answer: bool = True):
        self._enc = msgspec.msgpack.Encoder()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(endpoint)
        self.buffer: dict[int, bytes] = {}
        self.replay_requests: list[int] = []
        self.seq = 0
        self.router = None
        self._task = None
        if replay_endpoint is not None:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.bind(replay_endpoint)
            if answer:
                self._task = asyncio.create_task(self._serve())

    def publish(self, events: list, *, drop: bool = False) -> int:
        """Buffer a batch under the next seq and send it, unless ``drop`` (lost on the wire)."""
        seq, self.seq = self.seq, self.seq + 1
        payload = self._enc.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        self.buffer[seq] = payload
        if not drop:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        return seq

    async def _serve(self) -> None:
        while True:
            client, empty, start_b = await self.router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            self.replay_requests.append(start)
            for seq in sorted(self.buffer):
                if seq >= start:
                    await self.router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq]))
            await self.router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def connected(self, is_live: Callable[[], bool]) -> None:
        """Publish empty batches until the subscriber has seen one live (PUB/SUB joins late)."""
        deadline = time.monotonic() + 15
        while not is_live():
            if time.monotonic() > deadline:
                raise AssertionError("subscriber never received a live batch")
            self.publish([])
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
