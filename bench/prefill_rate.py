"""An engine's cold-prefill rate, by itself: what one prompt of N tokens costs alone, half of it, and
two at once, in milliseconds per prompt token. ``bench fleet``'s burst is judged against it: a node's
share of the burst should end at its tokens times this rate, and whatever it takes beyond that is the
cluster's doing, not the engine's.

    python -m bench.prefill_rate --url http://127.0.0.1:8100 --model SmolLM2-135M-Instruct --reps 3

Prompts are random token ids (``/v1/completions`` takes them as a list), new for every request, so
nothing is cached; each asks for one token, so the time is the prefill's (plus one HTTP round trip).
Start the engine as the benchmark under study starts it (its flags, its cores); nothing else should run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass

import httpx


@dataclass(frozen=True)
class Rep:
    """One repetition: seconds for a prompt alone, a half-size one alone, and two at once (both done)."""

    alone_s: float
    half_s: float
    pair_s: float
    tokens: int

    @property
    def ms_per_token(self) -> dict[str, float]:
        return {
            "alone": round(self.alone_s / self.tokens * 1e3, 3),
            "half": round(self.half_s / (self.tokens // 2) * 1e3, 3),
            "pair": round(self.pair_s / (2 * self.tokens) * 1e3, 3),
        }


async def _prefill_s(client: httpx.AsyncClient, url: str, model: str, ids: list[int]) -> float:
    started = time.perf_counter()
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    resp = await client.post(f"{url}/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    return time.perf_counter() - started


async def measure(url: str, model: str, tokens: int = 1536, reps: int = 3, seed: int | None = None) -> list[Rep]:
    rng = random.Random(seed if seed is not None else time.time_ns())

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    out = []
    async with httpx.AsyncClient() as client:
        await _prefill_s(client, url, model, prompt(64))  # the engine's first step is not measured
        for _ in range(reps):
            alone = await _prefill_s(client, url, model, prompt(tokens))
            half = await _prefill_s(client, url, model, prompt(tokens // 2))
            started = time.perf_counter()
            await asyncio.gather(*(_prefill_s(client, url, model, prompt(tokens)) for _ in range(2)))
            out.append(Rep(alone, half, time.perf_counter() - started, tokens))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the engine's base URL (its own port, not a router's)")
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--tokens", type=int, default=1536, help="prompt tokens (bench fleet's contexts: ~1.5k)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    reps = asyncio.run(measure(args.url, args.model, args.tokens, args.reps))
    for i, r in enumerate(reps):
        print(f"rep {i}: {json.dumps({**asdict(r), 'ms_per_token': r.ms_per_token})}", flush=True)
    rates = {k: [r.ms_per_token[k] for r in reps] for k in ("alone", "half", "pair")}
    print("RESULT " + " ".join(f"{k}_ms_per_token={min(v)}-{max(v)}" for k, v in rates.items()))


if __name__ == "__main__":
    main()
