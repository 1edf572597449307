"""Codex CLI and Claude Code, the coding agents most developers run, installed from npm and pointed at a
Tandem router or a bare engine: what the agent-client test and the docs use.

Installed with the ordinary npm client into a cache folder (``~/.cache/tandem/npm`` by default), at the
pinned versions below, and reused while their ``--version`` answers those versions.

How each is pointed at an endpoint (measured with codex-cli 0.171.0 and Claude Code 2.1.197):

Codex CLI, ``codex exec PROMPT``
    A model provider in ``$CODEX_HOME/config.toml`` with ``wire_api = "responses"`` (the only wire API
    Codex still speaks), ``base_url`` ending in ``/v1`` (Codex appends ``/responses``) and ``env_key``
    naming the variable that holds the key (sent as ``authorization: Bearer``). ``[analytics]
    enabled = false`` keeps it from reporting home; retries are off so a failure shows at once.
    ``--dangerously-bypass-approvals-and-sandbox`` and ``--skip-git-repo-check`` let it run unattended
    in any folder; stdin must be closed (it reads more prompt from a pipe).
    It sends one ``POST /v1/responses`` per model call, streamed, with the conversation's id in
    ``session-id``, ``thread-id`` and ``x-client-request-id`` (and in the body's ``prompt_cache_key``),
    plus ``x-codex-window-id`` and ``x-codex-turn-metadata`` (JSON); ``store: false``, ``include:
    ["reasoning.encrypted_content"]``, ``parallel_tool_calls``, nine function tools and its instructions
    as a ``developer`` message: about 4.5k prompt tokens of SmolLM2's tokenizer.
    With ``supports_websockets = true`` on the provider it opens ``GET /v1/responses`` as a WebSocket
    instead (its ``OpenAI-Beta`` header names the WebSocket mode's version) and sends each model call as a
    ``response.create`` message on it; a refused upgrade makes it fall back to HTTP, so only the
    router's record says which transport served it.

Claude Code, ``claude -p PROMPT``
    ``ANTHROPIC_BASE_URL`` (no ``/v1``), ``ANTHROPIC_API_KEY`` (sent as ``x-api-key``; a gateway token
    goes in ``ANTHROPIC_AUTH_TOKEN`` as a bearer), the served model through ``--model`` and the
    ``ANTHROPIC_DEFAULT_{OPUS,SONNET,HAIKU}_MODEL`` aliases (its background calls use the small model),
    ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`` and ``DISABLE_TELEMETRY`` (no other host is called),
    and a ``HOME`` of its own (it writes its settings and transcripts there).
    It sends ``HEAD /`` (a connectivity probe), then ``POST /v1/messages?beta=true``, streamed, with
    ``X-Claude-Code-Session-Id``, ``anthropic-version``, a long ``anthropic-beta`` list,
    ``max_tokens: 32000``, ``thinking: {"type": "adaptive"}``, ``context_management``,
    ``output_config``, ``system`` as blocks (a billing-header block first, ``cache_control`` on some),
    ``metadata.user_id`` (JSON holding the session id again) and 24 tools. By default the last message
    is a mid-conversation ``system`` message (beta ``mid-conversation-system``) listing its agents and
    skills, after the user's prompt; ``--tools`` without ``Agent`` and ``--disable-slash-commands`` leave
    it out, so the prompt ends with the user's turn.

What the serving engine must allow (``AGENT_ENGINE``): Claude Code's ``max_tokens`` of 32000 must fit
the context window beside the prompt (the router and vLLM refuse a request whose ``max_tokens`` alone
fills it), so the window is raised past SmolLM2's 8,192 positions (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``;
the prompts themselves, 2-5k tokens, stay inside the trained range). The answer is made greedy and
capped through the engine's generation config, which applies where the client sends no value. An
answer that hits a cap ends with ``stop_reason: max_tokens``, which Claude Code answers by asking the
model to continue, three times, then exits 1 ("exceeded the 32000 output token maximum"); so a turn
completes only when the model ends its answer itself, which the 135M model did on some hosts and not
on a CI host (its prompt holds the date and the host's details). The engine's logits processor
``infra.agent_turns.EndTurn`` ends every answer with the model's end token by its 48th token, under
the cap, so every turn completes on every host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from contracts.errors import ConfigError

CODEX = ("@openai/codex", "0.171.0")
CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.197")

AGENT_CONTEXT = 40960
"""Context window of an engine serving these clients: Claude Code's 32000 output tokens plus its
prompt. vLLM refuses to start an engine whose KV cache cannot hold one request this long."""
AGENT_KV_CACHE_GIB = 2
"""KV cache of such an engine: one 40960-token request takes 0.88 GiB in bfloat16 (23 KB per token of
SmolLM2-135M) and 1.76 GiB in float32, the dtype a node picks on a CPU without bfloat16 math
(``node_agent.dtype``); with the node's default 1 GiB its engine fails to start there."""
AGENT_GENERATION = {"max_new_tokens": 256, "temperature": 0}
"""The engine's generation config (``--override-generation-config``): defaults where the request has
no value. Neither client sends a temperature; both send a max_tokens the cap then lowers."""


def agent_engine_args() -> tuple[str, ...]:
    """Extra ``vllm serve`` arguments of an engine serving the agent clients."""
    return (
        "--override-generation-config",
        json.dumps(AGENT_GENERATION),
        "--logits-processors",
        "infra.agent_turns:EndTurn",
    )


def agent_node_env() -> dict[str, str]:
    """Environment of ``tandem up`` (or ``tandem node``) whose nodes serve the agent clients: the raised
    context window and the generation config, through the node settings (``TANDEM_NODE_*``)."""
    return {
        "TANDEM_NODE_MAX_MODEL_LEN": str(AGENT_CONTEXT),
        "TANDEM_NODE_KV_CACHE_GIB": str(AGENT_KV_CACHE_GIB),
        "TANDEM_NODE_EXTRA_ENGINE_ARGS": json.dumps(list(agent_engine_args())),
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    }


def default_cache() -> Path:
    return Path.home() / ".cache" / "tandem" / "npm"


@dataclass(frozen=True)
class AgentClients:
    codex: Path
    claude: Path


@dataclass(frozen=True)
class AgentRun:
    """One run of a client: its exit status, what it printed, how long it took."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _version_ok(binary: Path, version: str) -> bool:
    if not binary.exists():
        return False
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and version in out.stdout


def install(cache: Path | None = None, timeout_s: float = 600.0) -> AgentClients:
    """Both clients at their pinned versions under ``cache`` (installed with npm unless already there).
    ConfigError when npm is missing or the install fails."""
    cache = cache or default_cache()
    bins = AgentClients(
        codex=cache / "node_modules" / ".bin" / "codex", claude=cache / "node_modules" / ".bin" / "claude"
    )
    if _version_ok(bins.codex, CODEX[1]) and _version_ok(bins.claude, CLAUDE_CODE[1]):
        return bins
    npm = shutil.which("npm")
    if npm is None:
        raise ConfigError("npm is not installed: the coding-agent clients are npm packages (install Node.js 18+)")
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--prefix", str(cache), "--no-audit", "--no-fund", "--no-save"]
    cmd += [f"{name}@{version}" for name, version in (CODEX, CLAUDE_CODE)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0 or not (_version_ok(bins.codex, CODEX[1]) and _version_ok(bins.claude, CLAUDE_CODE[1])):
        raise ConfigError(f"npm install of the agent clients failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return bins


def codex_config(base_url: str, model: str, key_env: str = "TANDEM_API_KEY", websockets: bool = False) -> str:
    """``config.toml`` of a Codex home whose default provider is ``base_url`` (an OpenAI-style base
    ending in ``/v1``); ``websockets``: the provider says it serves the Responses WebSocket mode."""
    return (
        f'model = "{model}"\n'
        'model_provider = "tandem"\n'
        f"model_context_window = {AGENT_CONTEXT}\n"
        "\n[analytics]\nenabled = false\n"
        "\n[model_providers.tandem]\n"
        'name = "Tandem"\n'
        f'base_url = "{base_url}"\n'
        f'env_key = "{key_env}"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
        f"supports_websockets = {'true' if websockets else 'false'}\n"
    )


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> AgentRun:
    start = time.monotonic()
    done = subprocess.run(
        cmd,
        cwd=cwd,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return AgentRun(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


@dataclass(frozen=True)
class Endpoint:
    """What an agent is pointed at: a server's root URL (no ``/v1``), the served model's name, an API key."""

    url: str
    model: str
    api_key: str


def run_codex(
    clients: AgentClients,
    endpoint: Endpoint,
    prompt: str,
    workdir: Path,
    timeout_s: float = 600,
    websockets: bool = False,
) -> AgentRun:
    """``codex exec PROMPT`` in ``workdir`` against ``endpoint`` (Codex is given ``…/v1``), with a Codex
    home of its own; ``websockets``: over the Responses WebSocket mode."""
    home = workdir / ".codex-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(codex_config(f"{endpoint.url}/v1", endpoint.model, websockets=websockets))
    cmd = [str(clients.codex), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", prompt]
    return _run(cmd, workdir, {"CODEX_HOME": str(home), "TANDEM_API_KEY": endpoint.api_key}, timeout_s)


def run_claude(
    clients: AgentClients,
    endpoint: Endpoint,
    prompt: str,
    workdir: Path,
    tools: str | None = "Bash,Read,Edit,Write",
    timeout_s: float = 600,
) -> AgentRun:
    """``claude -p PROMPT`` in ``workdir`` against ``endpoint`` (the server root). ``tools``: the built-in
    tools it offers (``--tools``; None: all of them, and skills, as a user gets by default)."""
    model = endpoint.model
    home = workdir / ".claude-home"
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": endpoint.url,
        "ANTHROPIC_API_KEY": endpoint.api_key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        **{f"ANTHROPIC_DEFAULT_{size}_MODEL": model for size in ("OPUS", "SONNET", "HAIKU")},
    }
    cmd = [str(clients.claude), "-p", prompt, "--model", model]
    if tools is not None:
        cmd += ["--tools", tools, "--disable-slash-commands"]
    return _run(cmd, workdir, env, timeout_s)
