"""The synthetic agent workload: deterministic, prefix-growing sessions over shared repositories,
fresh content per salt, inside the context budget."""

from __future__ import annotations

from dataclasses import replace

from bench.agent_workload import AgentWorkloadConfig, build_sessions


def _count(text: str) -> int:
    return max(1, len(text) // 4)


def _prompt(messages: list[dict[str, str]]) -> int:
    return sum(_count(m["content"]) + 4 for m in messages)


CFG = AgentWorkloadConfig(repos=2, sessions_per_repo=3, turns_min=4, turns_max=7, repo_tokens=600, context_budget=2500)


def test_same_seed_and_salt_same_sessions() -> None:
    assert build_sessions(CFG, "a", _count, _prompt) == build_sessions(CFG, "a", _count, _prompt)


def test_sessions_grow_by_prefix_and_share_repositories() -> None:
    sessions = build_sessions(CFG, "a", _count, _prompt)
    assert len(sessions) == CFG.sessions
    assert [s.start_s for s in sessions] == sorted(s.start_s for s in sessions) and sessions[0].start_s == 0
    repo_contexts = set()
    for s in sessions:
        assert 1 <= len(s.turns) <= CFG.turns_max and len(s.think_s) == len(s.turns) - 1
        for prev, nxt in zip(s.turns, s.turns[1:], strict=False):
            assert nxt[: len(prev)] == prev and [m["role"] for m in nxt[len(prev) :]] == ["assistant", "user"]
        assert all(_prompt(t) <= CFG.context_budget for t in s.turns)
        assert s.turns[0][0]["content"].startswith("[a] ")
        repo_contexts.add(s.turns[0][1]["content"].split("Task ")[0])
    assert len(repo_contexts) == CFG.repos  # sessions of one repository share its whole context
    assert sum(len(s.turns) for s in sessions) >= CFG.sessions * CFG.turns_min // 2


def test_another_salt_changes_only_the_first_characters() -> None:
    a, b = build_sessions(CFG, "run-0", _count, _prompt), build_sessions(CFG, "run-1", _count, _prompt)
    for sa, sb in zip(a, b, strict=True):
        assert sa.start_s == sb.start_s and sa.think_s == sb.think_s and len(sa.turns) == len(sb.turns)
        sys_a, sys_b = sa.turns[-1][0]["content"], sb.turns[-1][0]["content"]
        assert sys_a != sys_b and sys_a[len("[run-0]") :] == sys_b[len("[run-1]") :]
        assert sa.turns[-1][1:] == sb.turns[-1][1:]


def test_fanned_out_sessions_of_a_repository_arrive_together() -> None:
    cfg = replace(CFG, repos=3, fan_out_gap_s=0.5, session_gap_s=10.0)
    sessions = build_sessions(cfg, "a", _count, _prompt)
    repos = [s.turns[0][1]["content"].split("Task ")[0] for s in sessions]
    # repository by repository: each repository's sessions form one run of arrivals, 0.5 s apart
    runs = [repos[i] for i in range(len(repos)) if i == 0 or repos[i] != repos[i - 1]]
    assert len(runs) == len(set(runs)) == cfg.repos
    for a, b in zip(sessions, sessions[1:], strict=False):
        same = a.turns[0][1]["content"].split("Task ")[0] == b.turns[0][1]["content"].split("Task ")[0]
        assert (round(b.start_s - a.start_s, 3) == 0.5) == same
    # the content is the interleaved workload's, only the arrival order and times differ
    assert sorted(s.session_id for s in sessions) == sorted(
        s.session_id for s in build_sessions(replace(cfg, fan_out_gap_s=None), "a", _count, _prompt)
    )
