"""``tandem bench kv-cache``'s arithmetic on canned runs, and its probe's order of requests against a
scripted router (the runs themselves need engines: the bench)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx

from bench.kv_cache import ARMS, KVCacheBenchConfig, _spec, by_origin, result_line, targets
from bench.kv_probe import _probe, came_as_expected, summarize
from bench.loadgen import RequestResult
from bench.routing import _Tokens


def _req(prompt: int, ttft: float, engine: int, tier: int, peer: int = 0) -> dict:
    origin = {"engine": engine, "host_tier": tier, "peer": peer, "computed": prompt - engine - tier - peer}
    return {"ok": True, "prompt_tokens": prompt, "ttft_ms": ttft, "tandem": {"kv_origin": origin}}


def test_long_prompts_are_classed_by_where_most_of_them_came_from() -> None:
    run = {
        "per_request": [
            _req(100, 5.0, 0, 0),  # short: left out whatever its origin
            _req(2000, 50.0, 1800, 0),
            _req(2000, 70.0, 100, 1600),
            _req(2200, 90.0, 0, 2000),
            _req(2000, 60.0, 0, 600, 600),  # tier and peer together: remote
            _req(2400, 900.0, 0, 0),
            {"ok": False, "prompt_tokens": 3000, "ttft_ms": 1.0, "tandem": None},
        ]
    }
    got = by_origin([run])
    assert (got["local_hit_ttft_ms"], got["remote_hit_ttft_ms"], got["miss_ttft_ms"]) == (50.0, 70.0, 900.0)
    assert got["long_requests"] == {"engine": 1, "remote": 3, "computed": 1}


def test_no_origins_give_nan_and_every_nan_target_fails() -> None:
    got = by_origin([{"per_request": []}])
    assert all(math.isnan(v) for v in got.values())
    summary = dict.fromkeys(
        ("ceiling_hit", "retention_hit", "tier_hit", "bigger_cache_hit", "tier_ttft_p50_ms", "engines_ttft_p50_ms"),
        0.5,
    )
    summary.update(got)
    checks = targets(summary)
    assert not any(c["held"] for name, c in checks.items() if "remote" in name)
    assert "remote_hit_ttft_ms=nan" in result_line(summary)


def test_targets_hold_and_fail_on_their_bounds() -> None:
    s = {
        "ceiling_hit": 0.8,
        "retention_hit": 0.77,
        "tier_hit": 0.7,
        "bigger_cache_hit": 0.66,
        "engines_ttft_p50_ms": 400.0,
        "tier_ttft_p50_ms": 300.0,
        "local_hit_ttft_ms": 100.0,
        "remote_hit_ttft_ms": 130.0,
        "miss_ttft_ms": 200.0,
    }
    held = {k: v["held"] for k, v in targets(s).items()}
    assert held == {
        "retention_hit >= 0.95 * ceiling_hit": True,
        "tier_hit >= bigger_cache_hit + 0.05": False,
        "tier_ttft_p50_ms < engines_ttft_p50_ms": True,
        "remote_hit_ttft_ms <= 1.3 * local_hit_ttft_ms": True,
        "remote_hit_ttft_ms <= 0.5 * miss_ttft_ms": False,
    }


def test_the_arms_differ_only_in_cache_memory_and_retention() -> None:
    cfg = KVCacheBenchConfig()
    specs = {arm: _spec(cfg, arm, extra_blocks=50) for arm in ARMS}
    blocks = {arm: s.extra_node_args for arm, s in specs.items()}
    assert blocks["bigger_cache"] == (f"--num-gpu-blocks-override={cfg.node_blocks + 50}",)
    assert blocks["engines"] == blocks["tier"] == blocks["retention"]
    assert [specs[a].host_tier is not None for a in ARMS] == [False, True, False, True]
    assert [specs[a].peer_kv for a in ARMS] == [False, True, False, True]  # our tiers: host tier + peers
    retention = {a: dict(specs[a].router_env)["TANDEM_ROUTER_SESSION_RETENTION_S"] for a in ARMS}
    assert retention == {"engines": "0", "tier": "0", "bigger_cache": "0", "retention": "600"}


def test_the_tier_arms_set_the_one_tenant_s_pin_share_explicitly() -> None:
    cfg = KVCacheBenchConfig(pin_share=0.75)
    for arm in ARMS:
        assert dict(_spec(cfg, arm, extra_blocks=50).tier_env) == {"TANDEM_TIER_TENANT_PIN_SHARE": "0.75"}


def _probe_row(kind: str, ttft: float, prompt: int, **origin: int) -> dict:
    usage = {"prompt_tokens": prompt, "tandem": {"kv_origin": {"engine": 0, "host_tier": 0, "peer": 0, **origin}}}
    return {"kind": kind, "ttft_ms": ttft, "as_expected": came_as_expected(RequestResult(ok=True, usage=usage), kind)}


def test_the_probe_counts_a_request_only_where_its_prefix_came_from_where_its_kind_says() -> None:
    rows = [
        _probe_row("miss", 2000.0, 1900, computed=1900),
        _probe_row("miss", 2200.0, 1900, computed=1900),
        _probe_row("local", 150.0, 1900, engine=1856, computed=44),
        _probe_row("local", 900.0, 1900, computed=1900),  # A had lost it: not a local hit
        _probe_row("remote", 160.0, 1900, host_tier=1856, computed=44),
        _probe_row("remote", 170.0, 1900, peer=1000, host_tier=500, computed=400),
        _probe_row("remote", 2100.0, 1900, computed=1900),  # B computed it: not a remote hit
    ]
    got = summarize(rows)
    assert (got["miss_ttft_ms"], got["local_hit_ttft_ms"], got["remote_hit_ttft_ms"]) == (2100.0, 150.0, 165.0)
    assert (got["miss_as_expected"], got["local_as_expected"], got["remote_as_expected"]) == (2, 1, 2)
    assert math.isnan(summarize([r for r in rows if r["kind"] != "remote"])["remote_hit_ttft_ms"])


def test_every_measured_request_runs_on_a_node_that_has_just_served_one() -> None:
    """The probe's order against a scripted router: a node whose last request was not the one before
    first serves a one-token completion of a prompt too short to fill a KV block (so it stores nothing
    in the tier), which is not among the rows."""
    sent: list[tuple[str, str, str, int]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        node = request.headers["x-tandem-node"]
        if request.url.path == "/v1/completions":
            sent.append((node, "warm-up", body["prompt"], body["max_tokens"]))
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})
        sent.append((node, "probe", body["messages"][-1]["content"], body["max_tokens"]))
        chunks = [
            {"choices": [{"index": 0, "delta": {"content": "x"}}]},
            {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 1}},
        ]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    def messages(task: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": "s"}, {"role": "user", "content": "repo " + task}]

    rows = asyncio.run(
        _probe("http://router", "m", ("A", "B"), [messages, messages], 4, transport=httpx.MockTransport(answer))
    )
    assert [(r["kind"], r["node"]) for r in rows] == [("miss", "A"), ("local", "A"), ("remote", "B")] * 2
    assert [(node, what, n) for node, what, _, n in sent] == [
        ("A", "warm-up", 1), ("A", "probe", 4), ("A", "probe", 4), ("B", "warm-up", 1), ("B", "probe", 4),
        ("A", "warm-up", 1), ("A", "probe", 4), ("A", "probe", 4), ("B", "warm-up", 1), ("B", "probe", 4),
    ]  # fmt: skip
    tokens = _Tokens(None)
    warm_ups = {text for _, what, text, _ in sent if what == "warm-up"}
    assert warm_ups and all(tokens.text(text) < 16 for text in warm_ups)  # below any block size Tandem uses
