"""``infra.ray_deploy`` without a Ray cluster: the actor body's process ownership (a real child process,
in a real owner process, killed for real), the ``ray start`` command as Ray's own CLI parses it, and the
KubeRay manifest (``infra/helm/kuberay/tandem-ray.yaml``). The whole deployment, on a Ray cluster across
lab hosts, is ``tests/lab/test_ray.py``.

The manifest: no schema of KubeRay's resources is at hand here (``kubernetes-validate`` knows Kubernetes'
own kinds only), so the ConfigMap and every pod template (as a ``v1 PodTemplate``) are validated against
Kubernetes 1.37 in strict mode, and the rest is held to what the deployment needs: every placement of
the plan lands on a group offering its host's resource, every command is one the real ``tandem`` CLI
accepts, the secrets reach the pods only from Secrets (the plan, kept by Ray's GCS, carries none; the
database URL reaches the router's group only), Ray runs with token authentication and the pinned version,
and the RayJob runs the plan the head mounts on the RayCluster it selects. Each check is shown to catch
a manifest broken on purpose."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import psutil
import pytest
import yaml
from ray.scripts.scripts import start as ray_start
from typer.testing import CliRunner

from infra.ray_deploy import Placement, host_resource, ray_start_argv, read_plan
from tests.support.helpers import alive_pids, wait_for

ROOT = Path(__file__).resolve().parents[2]
# An owner process as Ray's worker would hold it: the actor body built, the child's pid printed, then
# (with "stop") the owner stops it itself and carries on.
_OWNER = """
import sys, time
from infra.ray_deploy import ProcessOwner
owner = ProcessOwner({"name": "sleeper", "host": "h", "argv": ["sleep", "600"]})
print(owner.pid(), flush=True)
if sys.argv[1] == "stop":
    print(owner.stop(timeout_s=10), flush=True)
    time.sleep(1.0)  # the watcher would have ended this process by now if it took the stop for a death
    print("alive", flush=True)
else:
    time.sleep(600)
"""


def _owner(mode: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _OWNER, mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_a_dead_child_ends_its_owner_for_ray_to_restart() -> None:
    owner, child = _owner("watch")
    try:
        assert psutil.Process(child).ppid() == owner.pid
        os.kill(child, signal.SIGKILL)
        assert owner.wait(30) == 1
    finally:
        owner.kill()


def test_a_stopped_child_leaves_its_owner_running() -> None:
    owner, child = _owner("stop")
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == str(-signal.SIGTERM)
        assert owner.stdout.readline().strip() == "alive"
        assert owner.wait(30) == 0
        assert not alive_pids({child})
    finally:
        owner.kill()


def test_a_killed_owner_takes_its_child_with_it() -> None:
    owner, child = _owner("watch")
    owner.kill()
    owner.wait(30)
    assert wait_for(lambda: not alive_pids({child}), 10), "the child outlived its SIGKILLed owner"


def test_ray_start_commands_are_what_ray_parses() -> None:
    head = ray_start_argv("router", "10.0.0.10", head=None, temp_dir=Path("/tmp/r/router"))
    worker = ray_start_argv("node", "10.0.0.11", head="10.0.0.10", temp_dir=Path("/tmp/r/node"))
    assert Path(head[0]).name == "ray" and head[1] == "start"
    h = ray_start.make_context("start", head[2:]).params
    w = ray_start.make_context("start", worker[2:]).params
    assert h["head"] and not w["head"]
    assert w["address"] == "10.0.0.10:6379" and h["port"] == 6379
    assert json.loads(h["resources"]) == {host_resource("router"): 100}
    assert json.loads(w["resources"]) == {host_resource("node"): 100}
    assert h["num_cpus"] == w["num_cpus"] == 0 and h["include_dashboard"] is False


def test_a_plan_reads_back(tmp_path: Path) -> None:
    plan = [Placement("node", "node", ["tandem", "node"], env={"TANDEM_NODE_HOST": "10.0.0.11"}, log="/tmp/x")]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([p.__dict__ for p in plan]))
    assert read_plan(path) == plan


# -- the KubeRay manifest ------------------------------------------------------------------------------

MANIFEST = ROOT / "infra" / "helm" / "kuberay" / "tandem-ray.yaml"
Obj = dict[str, Any]
_SECRET_LIKE = re.compile(r"SECRET|PASSWORD|TOKEN|_URL$")


def _objects() -> dict[str, Obj]:
    return {o["kind"]: o for o in yaml.safe_load_all(MANIFEST.read_text())}


def _groups(objs: dict[str, Obj]) -> dict[str, Obj]:
    spec = objs["RayCluster"]["spec"]
    return {"head": spec["headGroupSpec"]} | {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def _plan(objs: dict[str, Obj]) -> list[Placement]:
    return [Placement(**p) for p in json.loads(objs["ConfigMap"]["data"]["plan.json"])]


def _containers(group: Obj) -> list[Obj]:
    return list(group["template"]["spec"]["containers"])


def check_schemas(objs: dict[str, Obj]) -> list[str]:
    wrapped = [objs["ConfigMap"]] + [
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": group["template"]}
        for name, group in _groups(objs).items()
    ]
    problems = []
    for obj in wrapped:
        try:
            kubernetes_validate.validate(obj, "1.37.0", strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: {exc.message}")
    return problems


def check_placements(objs: dict[str, Obj]) -> list[str]:
    """Every placement asks for its host's resource (1); the groups' pods must offer enough of it."""
    offered: dict[str, float] = {}
    for group in _groups(objs).values():
        # KubeRay passes each rayStartParams value to `ray start` as is: the JSON within quotes.
        resources = json.loads(json.loads(group["rayStartParams"].get("resources", '"{}"')))
        for name, amount in resources.items():
            offered[name] = offered.get(name, 0) + amount * group.get("replicas", 1)
    wanted: dict[str, int] = {}
    for p in _plan(objs):
        wanted[host_resource(p.host)] = wanted.get(host_resource(p.host), 0) + 1
    return [f"{r}: {n} placements, {offered.get(r, 0)} offered" for r, n in wanted.items() if offered.get(r, 0) < n]


def check_commands(objs: dict[str, Obj]) -> list[str]:
    from tandem.cli import app

    problems = []
    for p in _plan(objs):
        if p.argv[0] != "tandem":
            problems.append(f"{p.name}: {p.argv[0]} is not the tandem console script")
            continue
        result = CliRunner().invoke(app, [*p.argv[1:], "--help"])
        if result.exit_code != 0:
            problems.append(f"{p.name}: `{' '.join(p.argv)}` is refused: {result.output.strip()[-300:]}")
    return problems


def check_secrets(objs: dict[str, Obj]) -> list[str]:
    problems = [f"plan {p.name}: {k} in the plan" for p in _plan(objs) for k in p.env if _SECRET_LIKE.search(k)]
    router_groups = {"head" if p.host == "router" else p.host for p in _plan(objs) if p.argv[1:2] == ["router"]}
    for name, group in _groups(objs).items():
        for c in _containers(group):
            env = {e["name"]: e for e in c.get("env", [])}
            if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
                problems.append(f"{name}: Ray without token authentication")
            for key in ("RAY_AUTH_TOKEN", "TANDEM_CLUSTER_SECRET", "TANDEM_REDIS_URL"):
                if "secretKeyRef" not in env.get(key, {}).get("valueFrom", {}):
                    problems.append(f"{name}: {key} not from a Secret")
            literal = [k for k, e in env.items() if _SECRET_LIKE.search(k) and "value" in e]
            problems += [f"{name}: {k} written in the manifest" for k in literal]
            if ("TANDEM_DATABASE_URL" in env) != (name in router_groups):
                problems.append(f"{name}: the database URL reaches a group that runs no router, or no router")
    return problems


def check_versions_and_job(objs: dict[str, Obj]) -> list[str]:
    problems = []
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    if [f"ray=={objs['RayCluster']['spec']['rayVersion']}"] != extras["ray"]:
        problems.append(f"rayVersion {objs['RayCluster']['spec']['rayVersion']}, the ray extra {extras['ray']}")
    job = objs["RayJob"]["spec"]
    if job["clusterSelector"].get("ray.io/cluster") != objs["RayCluster"]["metadata"]["name"]:
        problems.append("the RayJob selects another cluster")
    entry = job["entrypoint"].split()
    head = _groups(objs)["head"]["template"]["spec"]
    mounts = {
        m["mountPath"]: v["configMap"]["name"]
        for c in head["containers"]
        for m in c.get("volumeMounts", [])
        for v in head.get("volumes", [])
        if v["name"] == m["name"] and "configMap" in v
    }
    plan_path = Path(entry[-1])
    if entry[:4] != ["python", "-m", "infra.ray_deploy", "up"]:
        problems.append(f"the RayJob runs {job['entrypoint']!r}")
    if mounts.get(str(plan_path.parent)) != objs["ConfigMap"]["metadata"]["name"] or plan_path.name != "plan.json":
        problems.append(f"the head does not mount the plan at {plan_path}")
    return problems


CHECKS: list[Callable[[dict[str, Obj]], list[str]]] = [
    check_schemas,
    check_placements,
    check_commands,
    check_secrets,
    check_versions_and_job,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_kuberay_manifest_holds(check: Callable[[dict[str, Obj]], list[str]]) -> None:
    assert check(_objects()) == []


def _set_plan(objs: dict[str, Obj], edit: Callable[[list[Obj]], None]) -> None:
    plan = json.loads(objs["ConfigMap"]["data"]["plan.json"])
    edit(plan)
    objs["ConfigMap"]["data"]["plan.json"] = json.dumps(plan)


def _worker_env(objs: dict[str, Obj], name: str, value: str) -> None:
    env = objs["RayCluster"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    next(e for e in env if e["name"] == name).update({"value": value, "valueFrom": None})
    for e in env:
        if e.get("valueFrom") is None:
            e.pop("valueFrom", None)


MUTATIONS: dict[str, tuple[Callable[[dict[str, Obj]], None], Callable[[dict[str, Obj]], list[str]]]] = {
    "a placement on a host no group offers": (
        lambda o: _set_plan(o, lambda p: p[1].update(host="nowhere")),
        check_placements,
    ),
    "two nodes on a one-pod group": (
        lambda o: _set_plan(o, lambda p: p.append({**p[1], "name": "prefill-1"})),
        check_placements,
    ),
    "an option the node does not have": (
        lambda o: _set_plan(o, lambda p: p[1]["argv"].append("--no-such-option")),
        check_commands,
    ),
    "a password in the plan": (
        lambda o: _set_plan(o, lambda p: p[0].update(env={"REDIS_PASSWORD": "x"})),
        check_secrets,
    ),
    "the Ray token written in the manifest": (lambda o: _worker_env(o, "RAY_AUTH_TOKEN", "t0ken"), check_secrets),
    "Ray without token authentication": (lambda o: _worker_env(o, "RAY_AUTH_MODE", "disabled"), check_secrets),
    "another Ray version": (lambda o: o["RayCluster"]["spec"].update(rayVersion="2.9.0"), check_versions_and_job),
    "a misspelt pod field": (
        lambda o: _groups(o)["decode"]["template"]["spec"].update(restartPolicyy="Always"),
        check_schemas,
    ),
}


@pytest.mark.parametrize("mutation", MUTATIONS, ids=list(MUTATIONS))
def test_each_manifest_check_catches(mutation: str) -> None:
    objs = copy.deepcopy(_objects())
    mutate, check = MUTATIONS[mutation]
    mutate(objs)
    assert check(objs), f"{check.__name__} missed: {mutation}"
