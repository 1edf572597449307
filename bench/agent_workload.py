"""A synthetic coding-agent workload: many sessions over a few repositories, each turn resending the
whole growing context, scripted in advance so every policy gets the same request sequence.

Per session (all text deterministic from ``seed``, the repository index and the session index):
    system    shared by every session of a run: agent rules and tool descriptions (~system_tokens);
              it opens with the run's ``salt``, so two runs share no block and one cannot warm the next
    user      the repository's context (~repo_tokens of its files, shared by the sessions of that
              repository) followed by the session's own task
    turn k>0  + assistant (a scripted reply that calls a tool, ~reply_tokens)
              + user (the tool's output: a file, a test log or a grep, ~tool_tokens)
Sessions take turns_min..turns_max turns; a turn whose prompt would exceed ``context_budget`` tokens
ends its session early (counted in the bench's JSON). Session i arrives at the sum of i exponential
gaps of mean ``session_gap_s`` (repositories interleaved); with ``fan_out_gap_s``, a repository's
sessions arrive together instead, that many seconds apart (parallel agents on one repository), and
repositories arrive ``session_gap_s`` apart on average. Between turns the agent "runs the tool" for an
exponential think time of mean ``think_s``. Sizes are in tokens of the served model's tokenizer (``count_tokens``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from bench.loadgen import SessionScript

WORDS = (
    "cache",
    "block",
    "router",
    "node",
    "prefill",
    "decode",
    "session",
    "token",
    "index",
    "event",
    "queue",
    "lease",
    "state",
    "config",
    "batch",
    "stream",
    "worker",
    "retry",
    "span",
    "record",
    "buffer",
    "limit",
    "score",
    "policy",
    "hash",
    "chain",
    "table",
    "frame",
    "schema",
    "store",
)
TOOLS = ("read_file", "run_tests", "grep", "list_dir", "apply_patch", "git_diff")


@dataclass(frozen=True)
class AgentWorkloadConfig:
    repos: int = 2
    """Repositories; each has its own context, shared by its sessions."""
    sessions_per_repo: int = 3
    turns_min: int = 6
    turns_max: int = 10
    system_tokens: int = 200
    repo_tokens: int = 800
    tool_tokens: tuple[int, int] = (33, 100)
    """Tool-output size range per turn (uniform)."""
    reply_tokens: tuple[int, int] = (15, 35)
    context_budget: int = 7600
    """Largest prompt a turn may have; must leave room for max_tokens inside the model's 8k window."""
    session_gap_s: float = 5.0
    fan_out_gap_s: float | None = None
    """None: sessions arrive one by one, repositories interleaved. A number: a repository's sessions
    arrive together, this many seconds apart, as when one agent fans out over a repository or a team
    starts parallel agents on it (their shared context is then wanted on several nodes at once)."""
    think_s: float = 1.0
    seed: int = 7
    # The defaults are sized for a 2-core CPU host that prefills ~70-100 tokens/s per core (float32,
    # SmolLM2-135M): ~50 requests and ~7k uncached prompt tokens per run. Agent traffic at its real
    # scale (repo contexts of a few thousand tokens, longer tool outputs) is the same generator with
    # larger sizes.

    @property
    def sessions(self) -> int:
        return self.repos * self.sessions_per_repo


def _ident(rng: random.Random) -> str:
    return "_".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))


def _code(rng: random.Random, path: str) -> str:
    """One fake Python file (a few functions)."""
    lines = [f"# {path}", f'"""{_ident(rng).replace("_", " ").capitalize()} helpers."""', ""]
    for _ in range(rng.randint(2, 4)):
        fn, arg = _ident(rng), _ident(rng)
        lines += [
            f"def {fn}({arg}, limit={rng.randint(1, 512)}):",
            f"    if {arg} is None or limit <= {rng.randint(0, 9)}:",
            f"        raise ValueError('{fn}: {arg} missing')",
            f"    return [{_ident(rng)}(x) for x in {arg}][:limit]",
            "",
        ]
    return "\n".join(lines)


def _grow(
    rng: random.Random, count_tokens: Callable[[str], int], target: int, piece: Callable[[random.Random, int], str]
) -> str:
    """Join pieces until the text reaches ``target`` tokens, then drop trailing lines beyond it (a
    piece may be a whole file), so sizes hold to within a line."""
    lines: list[str] = []
    n = i = 0
    while n < target:
        text = piece(rng, i)
        i += 1
        lines += text.split("\n")
        n += count_tokens(text) + 1
    while len(lines) > 1 and count_tokens("\n".join(lines)) > target:
        lines.pop()
    return "\n".join(lines)


def _system(salt: str, cfg: AgentWorkloadConfig, count_tokens: Callable[[str], int]) -> str:
    rng = random.Random(f"{cfg.seed}-system")
    head = f"[{salt}] You are a coding agent. Work step by step; call one tool per turn.\nTools:\n"
    body = _grow(
        rng,
        count_tokens,
        cfg.system_tokens - count_tokens(head),
        lambda r, i: (
            f"- {TOOLS[i % len(TOOLS)]}({_ident(r)}: str): {_ident(r).replace('_', ' ')} of the {r.choice(WORDS)}."
            if i < len(TOOLS)
            else f"Rule {i}: keep each {r.choice(WORDS)} small and test the {r.choice(WORDS)}."
        ),
    )
    return head + body


def _repo(repo: int, cfg: AgentWorkloadConfig, count_tokens: Callable[[str], int]) -> str:
    rng = random.Random(f"{cfg.seed}-repo-{repo}")
    name = f"acme/{_ident(rng)}-{repo}"
    files = _grow(rng, count_tokens, cfg.repo_tokens, lambda r, i: _code(r, f"src/{_ident(r)}_{i}.py"))
    return f"Repository {name}. Its main files:\n{files}\n"


def _tool_output(rng: random.Random, tokens: int, count_tokens: Callable[[str], int]) -> tuple[str, str]:
    tool = rng.choice(TOOLS)
    if tool == "run_tests":
        out = _grow(
            rng,
            count_tokens,
            tokens,
            lambda r, i: f"tests/test_{_ident(r)}.py::test_{_ident(r)} {'PASSED' if r.random() < 0.8 else 'FAILED'}",
        )
    elif tool == "grep":
        out = _grow(
            rng,
            count_tokens,
            tokens,
            lambda r, i: f"src/{_ident(r)}.py:{r.randint(1, 400)}:    {_ident(r)} = {_ident(r)}({_ident(r)})",
        )
    else:
        out = _grow(rng, count_tokens, tokens, lambda r, i: _code(r, f"src/{_ident(r)}.py"))
    return tool, out


def _reply(rng: random.Random, tool: str, tokens: int, count_tokens: Callable[[str], int]) -> str:
    text = _grow(
        rng,
        count_tokens,
        tokens - 12,
        lambda r, i: (
            f"The {r.choice(WORDS)} {r.choice(WORDS)} looks {r.choice(('wrong', 'fine', 'slow', 'unused'))} "
            f"in {_ident(r)}; next I check the {r.choice(WORDS)}."
        ),
    )
    return f'{text}\nCalling {tool}("{_ident(rng)}").'


def shared_context(
    cfg: AgentWorkloadConfig, salt: str, repo: int, count_tokens: Callable[[str], int]
) -> tuple[str, str]:
    """(system prompt, repository context) as every session of ``repo`` in a run salted ``salt`` opens:
    the workload's longest shared prefix (``bench.kv_probe`` measures prompts of that length)."""
    return _system(salt, cfg, count_tokens), _repo(repo, cfg, count_tokens)


def build_sessions(
    cfg: AgentWorkloadConfig,
    salt: str,
    count_tokens: Callable[[str], int],
    prompt_tokens: Callable[[list[dict[str, str]]], int],
) -> list[SessionScript]:
    """The run's sessions, in arrival order. ``count_tokens`` measures a text, ``prompt_tokens`` a
    whole rendered chat (for the context budget)."""
    system = _system(salt, cfg, count_tokens)
    repos = [_repo(r, cfg, count_tokens) for r in range(cfg.repos)]
    timing = random.Random(f"{cfg.seed}-timing")
    order = list(range(cfg.sessions))
    timing.shuffle(order)  # repositories interleave in arrival order
    if cfg.fan_out_gap_s is not None:  # ... or arrive together, repository by repository
        first = {idx % cfg.repos: k for k, idx in reversed(list(enumerate(order)))}
        order.sort(key=lambda idx: first[idx % cfg.repos])
    sessions, start = [], 0.0
    for k, idx in enumerate(order):
        repo = idx % cfg.repos
        rng = random.Random(f"{cfg.seed}-session-{idx}")
        task = (
            f"Task {idx}: the {rng.choice(WORDS)} {rng.choice(WORDS)} is {rng.choice(('flaky', 'slow', 'wrong'))}"
            f" after the last change to {_ident(rng)}. Find the cause and fix it."
        )
        messages = [{"role": "system", "content": system}, {"role": "user", "content": repos[repo] + task}]
        turns = [messages]
        for _ in range(rng.randint(cfg.turns_min, cfg.turns_max) - 1):
            tool, output = _tool_output(rng, rng.randint(*cfg.tool_tokens), count_tokens)
            reply = _reply(rng, tool, rng.randint(*cfg.reply_tokens), count_tokens)
            nxt = [
                *turns[-1],
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"Output of {tool}:\n{output}"},
            ]
            if prompt_tokens(nxt) > cfg.context_budget:
                break
            turns.append(nxt)
        if k and cfg.fan_out_gap_s is not None and repo == order[k - 1] % cfg.repos:
            start += cfg.fan_out_gap_s
        elif k:
            start += timing.expovariate(1.0 / cfg.session_gap_s)
        pause = random.Random(f"{cfg.seed}-think-{idx}")
        think = [pause.expovariate(1.0 / cfg.think_s) for _ in turns[1:]]
        sessions.append(SessionScript(session_id=f"{salt}-s{idx}", start_s=round(start, 3), turns=turns, think_s=think))
    return sessions
