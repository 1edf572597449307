"""The sweep's reading of token times: which gaps are a batch decoding alone, which gap is the step that
computed a prompt beside it, and the wait for every stream to reach a token count."""

from __future__ import annotations

import asyncio

import pytest

from profiling.measure import DECODE_WARM, MIXED_START, Sweep, _Batch, decode_gaps, mixed_gap
from replay.client import Outcome


def _stream(start: float, steps: list[float]) -> list[float]:
    out, t = [], start
    for s in steps:
        t += s
        out.append(t)
    return out


def test_decode_gaps_start_once_every_stream_is_decoding_and_stop_at_the_first_mixed_prompt():
    # the second stream's prompt took longer: its first gaps are steps shared with the first's prefill
    a = _stream(0.0, [0.5] + [0.1] * 12)
    b = _stream(0.0, [0.9] + [0.1] * 12)
    until = 1.5  # a mixed prompt sent then
    gaps = decode_gaps([a, b], DECODE_WARM, until)
    gate = b[DECODE_WARM - 1]
    want = sum(1 for t in (a, b) for end in t[1:] if gate < end <= until)
    assert len(gaps) == want > 0
    assert gaps == pytest.approx([0.1] * want)
    assert 0.4 not in gaps  # the first stream's wait for the second's prompt never counts


def test_the_mixed_gap_is_the_one_ending_with_the_prompts_first_token():
    steps = [0.1] * 8 + [0.7] + [0.1] * 5  # the ninth step computed a prompt beside the batch
    streams = [_stream(0.002 * i, steps) for i in range(3)]
    first = streams[0][8] + 0.001  # the prompt's first token, out with the ninth step's tokens
    seconds, made = mixed_gap(streams, first)
    assert seconds == pytest.approx(0.7)
    assert made == 8
    # a first token far from any stream's token is no mixed step of theirs
    assert mixed_gap(streams, streams[0][8] + 0.35) is None


def test_a_batch_waits_for_every_stream_and_gives_up_when_one_ends():
    async def go() -> tuple[bool, bool]:
        batch = _Batch(2)
        outs = [Outcome(), Outcome()]
        watch = [batch.watch(0), batch.watch(1)]

        async def feed() -> None:
            for k in range(3):
                for i in (0, 1):
                    outs[i].chunk_times.append(float(k))
                    watch[i](outs[i])
                    await asyncio.sleep(0)
            batch.end()

        task = asyncio.create_task(feed())
        reached = await batch.reach(3)
        never = await batch.reach(10)
        await task
        return reached, never

    reached, never = asyncio.run(go())
    assert reached is True and never is False


def test_a_sweep_with_mixed_prompts_needs_streams_long_enough_for_them():
    with pytest.raises(ValueError):
        Sweep(mixed_prefill=(256, 1024), decode_tokens=MIXED_START + 2)
    ok = Sweep(mixed_prefill=(256, 1024), decode_tokens=32)
    assert ok.min_decode_tokens <= 32
