"""Every command in the README and the docs pages it reaches is run, or at least parsed.

A command is one of:

- **run**: every ``--help`` form, the cheap commands in ``RUN`` (no engine, a few seconds; run in a
  scratch folder, in page order, so a page's later command finds what an earlier one wrote), ``curl``
  and the Python examples (against a real router over stand-in engines: ``tests.support.standin_cluster``,
  serving the documented model name);
- **parsed**: the expensive ones in ``EXPENSIVE`` (they start engines or need a cluster, a GPU, a
  Kubernetes cluster): a ``tandem`` command is parsed by the real CLI (its options, their types and
  choices, without running it), a ``make`` command is dry-run (``make -n``), ``helm`` and ``kubectl``
  have their repository paths checked and any ``tandem`` command they carry parsed.

A command that is neither fails the test: put it in ``RUN`` if it is cheap, in ``EXPENSIVE`` if not.
TOML blocks are parsed (a models file by the router's own reader) and Python blocks compiled."""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer
from typer._click.exceptions import UsageError
from typer.core import TyperGroup

from contracts.models_file import read_models_file
from contracts.registry import Role
from tandem.cli import app
from tests.docs.pages import ROOT, SHELL_LANGS, Block, commands, fenced_blocks, pages
from tests.support.standin_cluster import standin_cluster

DOC_URL = "http://127.0.0.1:8000"
DOC_MODEL = "SmolLM2-135M-Instruct"

RUN: frozenset[str] = frozenset(
    {
        "tandem lake questions",
        "tandem lake consent acme --allow --note 'opted in'",
        "tandem lake export --dry-run",
        "tandem lake export --format chat-jsonl --out exports/chat --name chat",
        "tandem lake export --format preference-jsonl --out exports/pref --name dpo --pairs extremes",
        "tandem settings",
        "tandem settings --check",
        "tandem telemetry schema requests",
        "tandem trace synth agentic --sessions 50 --seed 1 --out synth.parquet",
        "tandem trace stats synth.parquet --block-size 512",
    }
)
"""Cheap commands, run as written (in a scratch folder)."""

EXPENSIVE: dict[str, str] = {
    "tandem lab up --name demo --hosts router,prefill,decode,far@1": "makes namespaces (tests/infra/test_lab.py)",
    "tandem lab exec decode --name demo -- python -c 'import socket; print(socket.gethostname())'": "needs the lab",
    "tandem lab cut decode --name demo": "needs the lab (tests/infra/test_lab.py cuts hosts)",
    "tandem lab heal decode --name demo": "needs the lab",
    "tandem lab cut regions --name demo": "needs the lab (tests/infra/test_lab.py cuts regions)",
    "tandem lab heal regions --name demo": "needs the lab",
    "tandem lab down --name demo": "needs the lab (tests/infra/test_lab.py removes one)",
    "tandem settings --write": "rewrites the repository's own files",
    "make up": "installs everything and starts engines",
    "make test": "the whole suite",
    "make install TARGET=gpu VENV=.venv-gpu": "a GPU host's install",
    ".venv/bin/python infra/device/kv_cuda_bench.py --device cpu": "a benchmark of a minute or two",
    "infra/device/run_kv_cuda.sh --fetch-wheels": "downloads wheels",
    "infra/device/run_kv_cuda.sh --device cuda --out '$OUT/kv_cuda.json'": "needs a GPU",
    "tandem bench kv-transfer --device cuda --standalone": "needs a GPU",
    "make up TARGET=gpu VENV=.venv-gpu": "a GPU host's cluster",
    "tandem up --prefill 2 --decode 1": "starts engines",
    "tandem up --colocated": "starts an engine",
    "tandem up --colocated --host-tier 2GiB": "starts an engine and a tier",
    "tandem up --colocated --models models.toml": "starts engines",
    "tandem up --colocated --model a= --model b=/models/other": "starts engines",
    "tandem up --prefill 1 --decode 1 --both 1": "starts engines",
    "tandem node --role decode --port 8200": "starts an engine",
    "tandem router --port 8000": "serves until stopped",
    "tandem router --models models.toml": "serves until stopped",
    "tandem cluster status": "needs a running cluster",
    "tandem lake query 'SELECT routing_reason_code, avg(ttft_s) FROM requests GROUP BY 1'": "needs a lake",
    "tandem lake report --out results/lake-report": "needs a lake",
    "tandem lake export --format parquet --out s3://training/tandem --name lake-parquet --since 2026-12-01": (
        "needs an S3 endpoint"
    ),
    "tandem trace import mooncake mooncake_conversation_trace.jsonl --out mc.parquet": "needs Mooncake's file",
    "tandem trace from-lake --lake .tandem/lake --out lake.parquet": "needs a lake",
    "tandem replay synth.parquet --url http://127.0.0.1:8000 --mode closed --out replay.parquet": "needs a cluster",
    "tandem profile --launch 2 --quick --out profiles/here.json": "starts engines",
    "tandem plan --trace mc.parquet --rate 20000 --slo ttft_p90=1.5s,itl_p90=50ms --profile "
    "profiles/assumed-gpu-smollm2.json --out results/plan-mooncake-20k.json": "needs Mooncake's file; ~30 s",
    "tandem bench pd --out results/bench-pd.json": "a benchmark on engines",
    "tandem bench overhead --out results/bench-overhead.json": "a benchmark on engines",
    "tandem bench kv-transfer --out results/bench-kv.json": "a benchmark on engines",
    "tandem bench kv-cache --out results/bench-kv-cache.json": "a benchmark on engines",
    "tandem bench routing --out results/bench-routing.json": "a benchmark on engines",
    "tandem bench fleet --nodes 2 --out results/bench-fleet.json": "a benchmark on engines",
    "tandem bench agents --out results/bench-agents.json": "a benchmark on engines",
    (
        "tandem bench agents --api responses-chain --api responses-ws --target tandem --rounds 2 "
        "--sessions-per-repo 3 --turns 6 --out results/bench-agents-ws.json"
    ): "a benchmark on engines",
    "tandem bench chaos --out results/bench-chaos.json": "a benchmark on engines",
    "tandem bench hosts --out results/bench-hosts.json": "a benchmark on engines, in a lab (root)",
    "tandem bench admission --out results/bench-admission.json": "a benchmark (a router and Redis)",
    "tandem bench telemetry --out results/bench-tel.json": "a benchmark on engines",
    "tandem bench sim --out results/bench-sim.json": "a benchmark on engines",
    "tandem bench sim --from-json results/bench-sim.json --out results/resim.json": "needs a recorded run",
    "helm install tandem infra/helm/tandem -n serving --create-namespace -f infra/helm/tandem/values-gpu.yaml": (
        "needs a Kubernetes cluster"
    ),
    "kubectl -n serving port-forward svc/tandem-router 8000:80": "needs a Kubernetes cluster",
    "kubectl -n serving apply -f infra/helm/kuberay/tandem-ray.yaml": "needs a Kubernetes cluster with KubeRay",
    "kubectl -n serving exec deploy/tandem-router -- tandem keys create --tenant admin --admin": (
        "needs a Kubernetes cluster"
    ),
}
"""Commands too expensive to run here, each with why; the test parses them instead."""


def _normal(argv: list[str]) -> list[str]:
    """``.venv/bin/tandem`` is ``tandem``."""
    return ["tandem", *argv[1:]] if argv and argv[0].endswith("/tandem") else argv


def _documented() -> list[tuple[Block, list[str]]]:
    return [
        (block, _normal(argv))
        for page in pages()
        for block in fenced_blocks(page)
        if block.lang in SHELL_LANGS
        for argv in commands(block)
    ]


DOCUMENTED = _documented()


def _id(item: tuple[Block, list[str]]) -> str:
    block, argv = item
    return f"{block.where}: {shlex.join(argv)[:60]}"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _run_tandem(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem", *argv[1:]], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=60
    )


def parse_tandem(argv: list[str]) -> str:
    """Parse ``tandem ...`` with the real CLI, down to its sub-command, running nothing; its path."""
    command: object = typer.main.get_command(app)
    name: str | None = "tandem"
    parent = None
    args = list(argv[1:])
    while True:
        ctx = command.make_context(name, args, parent=parent)  # type: ignore[attr-defined]
        if not isinstance(command, TyperGroup):
            return str(ctx.command_path)
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        name, command, args = command.resolve_command(ctx, rest)
        parent = ctx


def test_every_command_is_run_or_allowed() -> None:
    loose = [
        _id((b, a))
        for b, a in DOCUMENTED
        if "--help" not in a and shlex.join(a) not in RUN and shlex.join(a) not in EXPENSIVE and a[0] != "curl"
    ]
    assert not loose, f"commands neither run nor allowed (add each to RUN or EXPENSIVE): {loose}"


def test_the_lists_name_only_documented_commands() -> None:
    documented = {shlex.join(a) for _, a in DOCUMENTED}
    assert not (RUN | set(EXPENSIVE)) - documented, "RUN or EXPENSIVE names a command no page shows any more"


@pytest.mark.parametrize("item", [d for d in DOCUMENTED if "--help" in d[1]], ids=_id)
def test_help_runs(item: tuple[Block, list[str]], tmp_path: Path) -> None:
    _, argv = item
    done = _run_tandem(argv, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout


@pytest.mark.parametrize(
    "page", sorted({b.page for b, a in DOCUMENTED if shlex.join(a) in RUN}), ids=lambda p: str(p.relative_to(ROOT))
)
def test_cheap_commands_run(page: Path, tmp_path: Path) -> None:
    for block, argv in DOCUMENTED:
        if block.page == page and shlex.join(argv) in RUN:
            done = _run_tandem(argv, tmp_path)
            assert done.returncode == 0, f"{shlex.join(argv)}: {done.stderr[-2000:]}"
            assert done.stdout.strip(), f"{shlex.join(argv)} printed nothing"


@pytest.mark.parametrize("item", [d for d in DOCUMENTED if shlex.join(d[1]) in EXPENSIVE], ids=_id)
def test_expensive_commands_parse(item: tuple[Block, list[str]]) -> None:
    _, argv = item
    if argv[0] == "tandem":
        parse_tandem(argv)
    elif argv[0] == "make":
        done = subprocess.run(["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    elif argv[0] in ("helm", "kubectl"):
        paths = [a for a in argv if a.startswith("infra/")]
        assert all((ROOT / p).exists() for p in paths), paths
        if "--" in argv and argv[argv.index("--") + 1] == "tandem":
            parse_tandem(argv[argv.index("--") + 1 :])
    elif argv[0] == ".venv/bin/python" or argv[0].startswith("infra/"):
        script = ROOT / (argv[1] if argv[0] == ".venv/bin/python" else argv[0])
        assert script.is_file(), script
        if script.suffix == ".sh":
            done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
    else:
        raise AssertionError(f"no way to check {argv[0]}")


def test_parsing_catches_a_wrong_command() -> None:
    """The parse check is a real check: an unknown option or a bad value fails it."""
    for bad in (["tandem", "up", "--prefil", "2"], ["tandem", "up", "--prefill", "two"], ["tandem", "nosuch"]):
        with pytest.raises(UsageError):
            parse_tandem(bad)


def test_toml_blocks_parse() -> None:
    blocks = [b for p in pages() for b in fenced_blocks(p) if b.lang == "toml"]
    for block in blocks:
        tomllib.loads(block.text)


def test_the_models_file_example_is_a_valid_models_file(tmp_path: Path) -> None:
    (block,) = [b for b in fenced_blocks(ROOT / "docs" / "models.md") if b.lang == "toml"]
    path = tmp_path / "models.toml"
    path.write_text(block.text)
    spec = read_models_file(path)
    assert set(spec.served) == {"smol", "smol-bf16"}


def test_python_blocks_compile() -> None:
    for page in pages():
        for block in fenced_blocks(page):
            if block.lang == "python":
                compile(block.text, block.where, "exec")


async def test_curl_and_python_examples_run_against_a_router(tmp_path: Path) -> None:
    """The README's ``curl`` and openai-SDK examples, as written but for the router's address, against a
    real router whose node (a stand-in engine) serves the documented model."""
    curls = [a for _, a in DOCUMENTED if a[0] == "curl"]
    snippets = [b for b in fenced_blocks(ROOT / "README.md") if b.lang == "python" and DOC_URL in b.text]
    assert curls and snippets
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, models={"n": DOC_MODEL}) as cluster:
        for argv in curls:
            argv = [a.replace(DOC_URL, cluster.url) for a in argv]
            done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
            assert "data: [DONE]" in done.stdout, done.stdout[-500:]
        for block in snippets:
            script = tmp_path / "example.py"
            script.write_text(block.text.replace(DOC_URL, cluster.url))
            done = await asyncio.to_thread(
                subprocess.run, [sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 0, done.stderr[-2000:]
            assert done.stdout.strip(), "the example printed nothing"
