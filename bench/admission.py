"""Admission fast-path overhead: auth + rate limit + session read, in-process against a real Redis.

Per request, exactly what the router does before routing: one Lua call that authenticates the key and
charges requests/min and tokens/min (tenant and global layers), then one read of the session's cached
history (a 6-turn agent session). Reported per request in microseconds (p50, p99, max). The store is a
throwaway SQLite file: after warm-up every key and session read is served by Redis, as in steady state.

    python -m bench.admission --redis redis://127.0.0.1:6379/4 -n 5000 --out results/admission.json

Last line: ``RESULT admit_p50_us=... admit_p99_us=...`` (``router_rps`` is added by the router bench).
"""

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from router.admission.context import AdmissionContext, AdmissionSettings
from router.sessions import FunctionCall, Message, ToolCall, Turn, Usage

TURNS = 6


async def _bench(redis_url: str, n: int, warmup: int) -> dict[str, float | int | str]:
    prefix = f"bench-{uuid.uuid4().hex[:8]}:"
    with tempfile.TemporaryDirectory() as tmp:
        settings = AdmissionSettings(
            redis_url=redis_url,
            key_prefix=prefix,
            database_url=f"sqlite:///{tmp}/bench.db",
            global_rpm=0,
            global_tpm=0,
        )
        ctx = await AdmissionContext.create(settings)
        try:
            _, key = await ctx.keys.create_key("bench", rpm=10_000_000, tpm=0)
            header = f"Bearer {key}"
            for i in range(TURNS):
                ctx.sessions.record_turn(
                    Turn(
                        turn_id=f"t{i}",
                        session_id="s-bench",
                        tenant_id="bench",
                        created_at=float(i),
                        messages=[Message(role="user", content="explain this function " * 20)],
                        response=Message(
                            role="assistant",
                            content="it reads the file " * 30,
                            tool_calls=[
                                ToolCall(id=f"c{i}", function=FunctionCall("read_file", '{"p":"x.py"}'))
                            ],
                        ),
                        usage=Usage(prompt_tokens=900, completion_tokens=120, total_tokens=1020),
                    )
                )
            await ctx.sessions.flush()
            samples: list[float] = []
            for i in range(warmup + n):
                t0 = time.perf_counter_ns()
                admission = await ctx.gate.admit(header, prompt_tokens=900, max_tokens=256)
                history = await ctx.sessions.get_history(admission.tenant.tenant_id, "s-bench")
                t1 = time.perf_counter_ns()
                if len(history) != TURNS:
                    raise RuntimeError(f"session read returned {len(history)} turns, expected {TURNS}")
                if i >= warmup:
                    samples.append((t1 - t0) / 1000)
        finally:
            keys = [k async for k in ctx.redis.scan_iter(match=f"{prefix}*", count=1000)]
            if keys:
                await ctx.redis.delete(*keys)
            await ctx.close()
    samples.sort()
    return {
        "what": "auth + rate limit (one Lua call) + session read (Redis hash, 6 turns), in-process",
        "redis_url": redis_url,
        "n": n,
        "admit_p50_us": round(statistics.median(samples), 1),
        "admit_p99_us": round(samples[min(len(samples) - 1, int(0.99 * len(samples)))], 1),
        "admit_max_us": round(samples[-1], 1),
        "admit_mean_us": round(statistics.fmean(samples), 1),
    }


def run_admission_bench(redis_url: str, n: int, out: Path | str | None, *, warmup: int = 200) -> dict:
    """Measure, write ``out`` (JSON) when given, print the RESULT line, return the numbers."""
    result = asyncio.run(_bench(redis_url, n, warmup))
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"RESULT admit_p50_us={result['admit_p50_us']} admit_p99_us={result['admit_p99_us']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/4")
    parser.add_argument("-n", type=int, default=5000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run_admission_bench(args.redis, args.n, args.out)


if __name__ == "__main__":
    main()
