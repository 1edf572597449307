"""``python -m bench.prefill_rate``'s bookkeeping, over a stand-in engine (not an engine: it computes
nothing, so only what is asked and how the rates are derived is checked here)."""

from __future__ import annotations

import asyncio

from bench.prefill_rate import Rep, measure
from bench.standin_engine import ServerThread, StandInEngine


def test_every_prompt_is_new_and_asks_one_token_of_the_length_asked() -> None:
    engine = StandInEngine()
    with ServerThread(engine.app) as url:
        reps = asyncio.run(measure(url, "m", tokens=64, reps=2, seed=7))
    bodies = engine.bodies("/v1/completions")
    assert [len(b["prompt"]) for b in bodies] == [64, 64, 32, 64, 64, 64, 32, 64, 64]  # warm-up, then per rep
    assert all(b["max_tokens"] == 1 for b in bodies)
    prompts = [tuple(b["prompt"]) for b in bodies]
    assert len(set(prompts)) == len(prompts)  # nothing the engine could have cached
    assert len(reps) == 2 and all(r.alone_s > 0 and r.pair_s > 0 for r in reps)


def test_rates_are_per_prompt_token_of_each_shape() -> None:
    rep = Rep(alone_s=1.536, half_s=0.6, pair_s=3.072, tokens=1536)
    assert rep.ms_per_token == {"alone": 1.0, "half": 0.781, "pair": 1.0}
