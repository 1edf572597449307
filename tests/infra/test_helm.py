"""The Helm chart (``infra/helm/tandem``): rendered by Helm itself, validated against Kubernetes' schemas,
and held to the invariants a P/D cluster needs.

Rendering
    ``helm_python`` (PyPI ``helm-python-sdk``, a dev dependency) binds ``libhelm_c``, a C build of Helm
    v4's own Go SDK: ``Chart.render`` runs the engine ``helm template`` runs (Go templates, Sprig, values
    coalesced over ``values.yaml``, ``fail``/``required``), with no helm binary and no cluster, in a child
    process (the Go runtime stays out of the test process). So there
    is no home-made renderer and no subset of Go templating to stay inside. ``lookup`` finds nothing here,
    as with ``helm template``, so generated secrets are random on every render.

Validation
    Every rendered object against the OpenAPI schemas of Kubernetes 1.37 (the newest
    ``kubernetes-validate`` ships) and 1.30 (the chart's ``kubeVersion`` floor), in strict mode: an
    unknown or misspelt field is an error, not silently dropped by the API server.

Invariants (each a function returning its problems, [] when it holds)
    - prefill and decode run one image, tagged ``<appVersion>-<variant>``;
    - the router has at least 2 replicas (or an autoscaler whose floor is 2);
    - every probe's port is a port its container declares;
    - every Secret a pod references is rendered, with the key asked for, and each key reaches only the
      components that use it (the cluster secret: nodes and routers; the database URL: routers);
    - the drain: the router has a preStop and a grace period that covers it plus the longest stream; the
      nodes drain on SIGTERM (the agent deregisters, waits for requests and leases: drain_timeout_s; then
      vLLM's --shutdown-timeout inside the agent's stop window) within their grace period;
    - NetworkPolicies: computed from the rendered selectors, who can reach which named port of which
      pods is exactly the intended matrix (routers -> engines, nodes and routers -> block servers, ...;
      with the nixl connector of the GPU values, nodes -> every node port, for UCX);
    - each container's command is a real ``tandem`` sub-command with real options, and each
      ``TANDEM_*`` variable a setting the process reads (``NodeSettings`` is built from the node's env);
    - GPU values request GPUs, pin to GPU machines and use the nixl connector (ours refuses device
      memory); CPU values request none; /dev/shm is sized.

Mutations
    Each invariant is shown to fail on a manifest broken on purpose (``test_invariant_catches``), and the
    chart's own guards refuse bad values at render time (``test_chart_refuses``).
"""

from __future__ import annotations

import copy
import inspect
import json
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from contracts.cluster import CLUSTER_ENV
from contracts.cluster import key as cluster_key
from contracts.config import REDIS_URL_ENV
from contracts.secret import SECRET_ENV
from node_agent.node import EngineProcess
from node_agent.settings import NodeSettings
from router.admission.context import AdmissionSettings
from router.settings import RouterSettings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "infra" / "helm" / "tandem"
RELEASE = "tandem"
NAMESPACE = "serving"
VALUE_FILES = ("values-cpu.yaml", "values-gpu.yaml")
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]

Obj = dict[str, Any]


# -- rendering ---------------------------------------------------------------------------------------


def _merge(base: Obj, over: Obj) -> Obj:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# Helm runs in a child process: libhelm_c brings a Go runtime (its own threads and signal handlers),
# which the rest of the suite, with its signals and child processes, should not share.
_HELM = """
import json, sys
import helm_python as helm
req = json.load(sys.stdin)
try:
    if req["op"] == "lint":
        out = helm.lint(req["chart"])
    else:
        with helm.Chart.load(req["chart"]) as chart:
            out = chart.render(req["values"], name=req["name"], namespace=req["namespace"])
except helm.HelmError as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
else:
    print(json.dumps({"ok": out}))
"""


class HelmRefused(Exception):
    """Helm refused the chart or its values (a template's ``fail``, a parse error)."""


def _helm(op: str, values: Obj | None = None, release: str = RELEASE) -> Any:
    request = {"op": op, "chart": str(CHART), "values": values or {}, "name": release, "namespace": NAMESPACE}
    proc = subprocess.run(
        [sys.executable, "-c", _HELM],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    answer = json.loads(proc.stdout)
    if "error" in answer:
        raise HelmRefused(answer["error"])
    return answer["ok"]


def render(values_file: str | None = None, overrides: Obj | None = None, release: str = RELEASE) -> list[Obj]:
    """``helm template <release> infra/helm/tandem -n serving -f <values_file>`` plus ``overrides``, parsed."""
    values: Obj = yaml.safe_load((CHART / values_file).read_text()) if values_file else {}
    out: dict[str, str] = _helm("render", _merge(values, overrides or {}), release)
    docs: list[Obj] = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {f: render(f) for f in VALUE_FILES}


# -- reading rendered objects ------------------------------------------------------------------------


def workloads(objs: list[Obj]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] in ("Deployment", "StatefulSet"))


def component(obj: Obj) -> str:
    return str(obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])


def by_component(objs: list[Obj], name: str) -> Obj:
    found = [w for w in workloads(objs) if component(w) == name]
    assert len(found) == 1, f"expected one {name} workload, found {len(found)}"
    return found[0]


def containers(workload: Obj) -> list[Obj]:
    return list(workload["spec"]["template"]["spec"]["containers"])


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions; {} selects everything)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and present and labels[key] in values)
            or (op == "Exists" and not present)
            or (op == "DoesNotExist" and present)
        ):
            return False
    return True


NODE_ROLES = ("prefill", "decode")


# -- the invariants ----------------------------------------------------------------------------------


def check_engine_images(objs: list[Obj], variant: str) -> list[str]:
    images = {role: [c["image"] for c in containers(by_component(objs, role))] for role in NODE_ROLES}
    problems = []
    if images["prefill"] != images["decode"]:
        problems.append(f"prefill and decode run different images: {images}")
    for role, imgs in images.items():
        for image in imgs:
            tag = image.rpartition(":")[2]
            if tag != f"{APP_VERSION}-{variant}":
                problems.append(f"{role} image {image} is not pinned to {APP_VERSION}-{variant}")
    return problems


def check_router_replicas(objs: list[Obj]) -> list[str]:
    router = by_component(objs, "router")
    hpas = [
        o
        for o in objs
        if o["kind"] == "HorizontalPodAutoscaler"
        and o["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        and o["spec"]["scaleTargetRef"]["name"] == router["metadata"]["name"]
    ]
    if hpas:
        problems = [
            f"autoscaler floor {h['spec'].get('minReplicas', 1)} < 2"
            for h in hpas
            if h["spec"].get("minReplicas", 1) < 2
        ]
        if "replicas" in router["spec"]:
            problems.append("router Deployment sets replicas while an autoscaler owns the count")
        return problems
    replicas = router["spec"].get("replicas", 1)
    return [] if replicas >= 2 else [f"router has {replicas} replica(s) and no autoscaler"]


def check_probe_ports(objs: list[Obj]) -> list[str]:
    problems = []
    for w in workloads(objs):
        for c in containers(w):
            names = {p.get("name") for p in c.get("ports", [])}
            numbers = {p["containerPort"] for p in c.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind) or {}
                for handler in ("httpGet", "tcpSocket", "grpc"):
                    if handler not in probe:
                        continue
                    port = probe[handler]["port"]
                    if port not in (names if isinstance(port, str) else numbers):
                        problems.append(
                            f"{w['metadata']['name']}/{c['name']} {kind} port {port!r} is not a container port"
                        )
    return problems


def check_secret_refs(objs: list[Obj], external: frozenset[str] = frozenset()) -> list[str]:
    secrets = {
        o["metadata"]["name"]: set(o.get("data", {})) | set(o.get("stringData", {}))
        for o in objs
        if o["kind"] == "Secret"
    }
    problems = []
    for w in workloads(objs):
        for c in containers(w):
            for e in c.get("env", []):
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref is None or ref["name"] in external:
                    continue
                if ref["name"] not in secrets:
                    problems.append(f"{w['metadata']['name']}/{c['name']} {e['name']}: no Secret {ref['name']}")
                elif ref["key"] not in secrets[ref["name"]]:
                    problems.append(
                        f"{w['metadata']['name']}/{c['name']} {e['name']}: Secret {ref['name']} has no {ref['key']}"
                    )
    return problems


# Which components may read which Secret key: each process gets the credentials it uses, no more.
SECRET_SCOPE = {
    "cluster-secret": {"prefill", "decode", "router"},  # the KV wire's HMAC: nodes and the routers' control calls
    "redis-url": {"prefill", "decode", "router", "lake-writer"},
    "database-url": {"router"},  # keys, tenants, sessions
    "redis-password": {"redis"},
    "postgres-password": {"postgresql"},
}


def check_secret_scope(objs: list[Obj]) -> list[str]:
    problems = []
    for w in workloads(objs):
        for c in containers(w):
            for e in c.get("env", []):
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref is not None and component(w) not in SECRET_SCOPE.get(ref["key"], set()):
                    problems.append(f"{component(w)} reads Secret key {ref['key']}, which is not its to read")
            if c.get("envFrom"):
                problems.append(f"{component(w)} takes a whole Secret or ConfigMap (envFrom)")
    return problems


def _engine_args(container: Obj) -> list[str]:
    return list(json.loads(env_of(container)["TANDEM_NODE_EXTRA_ENGINE_ARGS"]["value"]))


AGENT_STOP_WINDOW_S = inspect.signature(EngineProcess.stop).parameters["timeout_s"].default
"""How long the node agent lets its engine stop before SIGKILL (node_agent/node.py)."""


def check_drain(objs: list[Obj]) -> list[str]:
    problems = []
    router = by_component(objs, "router")
    grace = router["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    for c in containers(router):
        pre = (c.get("lifecycle") or {}).get("preStop")
        if not pre:
            problems.append(f"router container {c['name']} has no preStop")
            continue
        sleep = (pre.get("sleep") or {}).get("seconds", 0)
        timeout = float(
            (env_of(c).get("TANDEM_ROUTER_REQUEST_TIMEOUT_S") or {}).get("value") or RouterSettings().request_timeout_s
        )
        if grace < sleep + timeout:
            problems.append(f"router grace {grace} s < preStop {sleep} s + longest stream {timeout:.0f} s")
    for role in NODE_ROLES:
        node = by_component(objs, role)
        grace = node["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        for c in containers(node):
            args = _engine_args(c)
            if "--shutdown-timeout" not in args:
                problems.append(
                    f"{role}: the engine is not started with --shutdown-timeout (SIGTERM aborts its streams)"
                )
                continue
            wait = float((env_of(c).get("TANDEM_NODE_DRAIN_TIMEOUT_S") or {}).get("value") or 0)
            if wait <= 0:
                problems.append(f"{role}: the agent does not drain (TANDEM_NODE_DRAIN_TIMEOUT_S unset or 0)")
            elif grace < wait + AGENT_STOP_WINDOW_S:
                problems.append(
                    f"{role}: grace {grace} s < drain {wait:.0f} s + the agent's {AGENT_STOP_WINDOW_S:.0f} s"
                )
            drain = int(args[args.index("--shutdown-timeout") + 1])
            if not 0 < drain < AGENT_STOP_WINDOW_S:
                problems.append(
                    f"{role}: --shutdown-timeout {drain} s not within the agent's {AGENT_STOP_WINDOW_S:.0f} s to stop"
                )
            if grace <= AGENT_STOP_WINDOW_S:
                problems.append(
                    f"{role}: grace {grace} s does not cover the agent's {AGENT_STOP_WINDOW_S:.0f} s stop window"
                )
    return problems


# Who may open a connection to which named port of which component: "*" is anyone (no `from`),
# "external" a namespace or IP peer; port ANY_PORT stands for a rule without ports (every port, those UCX
# picks at run time included). Compared with what the rendered policies' selectors allow.
ANY_PORT = "<any>"


def intended_reach(connector: str) -> dict[tuple[str, str], set[str]]:
    nodes = set(NODE_ROLES)
    if connector == "nixl":  # UCX data connections between nodes on ports it picks; routers as with tandem
        node_rules = {
            **{
                (role, port): {"router"} | nodes for role in NODE_ROLES for port in ("engine", "kv-events", "kv-replay")
            },
            **{(role, port): nodes for role in NODE_ROLES for port in ("kv-blocks", ANY_PORT)},
        }
    else:
        node_rules = {
            **{(role, port): {"router"} for role in NODE_ROLES for port in ("engine", "kv-events", "kv-replay")},
            **{(role, "kv-blocks"): nodes | {"router"} for role in NODE_ROLES},
        }
    return {
        **node_rules,
        ("router", "http"): {"*"},
        ("redis", "redis"): nodes | {"router", "lake-writer"},
        ("postgresql", "postgresql"): {"router"},
    }


def reach(objs: list[Obj]) -> tuple[dict[tuple[str, str], set[str]], list[str]]:
    """(component, port name) -> components allowed in, computed from the rendered NetworkPolicies and pod
    labels; plus problems: pods no policy isolates, policy ports no selected pod declares."""
    pods = {component(w): (w["spec"]["template"]["metadata"]["labels"], containers(w)) for w in workloads(objs)}
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    allowed: dict[tuple[str, str], set[str]] = {}
    problems = []
    for name, (labels, _) in pods.items():
        if not any(selects(p["spec"]["podSelector"], labels) for p in policies):
            problems.append(f"{name} pods are selected by no NetworkPolicy (open to everyone)")
    for policy in policies:
        targets = [n for n, (labels, _) in pods.items() if selects(policy["spec"]["podSelector"], labels)]
        if not targets:
            problems.append(f"NetworkPolicy {policy['metadata']['name']} selects no pod")
        for rule in policy["spec"].get("ingress") or []:
            if "from" in rule:
                sources: set[str] = set()
                for peer in rule["from"]:
                    if "podSelector" in peer and "namespaceSelector" not in peer:
                        sources |= {n for n, (labels, _) in pods.items() if selects(peer["podSelector"], labels)}
                    else:
                        sources.add("external")
            else:
                sources = {"*"}
            for target in targets:
                declared = {p["name"]: p["containerPort"] for c in pods[target][1] for p in c.get("ports", [])}
                if not rule.get("ports"):
                    allowed.setdefault((target, ANY_PORT), set()).update(sources)
                ports = [p["port"] for p in rule.get("ports") or []] or list(declared)
                for port in ports:
                    port_name = (
                        port if isinstance(port, str) else next((n for n, v in declared.items() if v == port), None)
                    )
                    if port_name not in declared:
                        problems.append(f"NetworkPolicy {policy['metadata']['name']}: {target} has no port {port!r}")
                        continue
                    allowed.setdefault((target, port_name), set()).update(sources)
    return allowed, problems


def check_network_policies(objs: list[Obj]) -> list[str]:
    allowed, problems = reach(objs)
    present = {component(w) for w in workloads(objs)}
    connectors = {env_of(containers(by_component(objs, r))[0])["TANDEM_NODE_CONNECTOR"]["value"] for r in NODE_ROLES}
    if len(connectors) != 1:
        return [*problems, f"prefill and decode use different connectors: {sorted(connectors)}"]
    intended_all = intended_reach(connectors.pop())
    for key, intended in intended_all.items():
        if key[0] in present and allowed.get(key, set()) != intended:
            problems.append(
                f"{key[0]}:{key[1]} reachable from {sorted(allowed.get(key, set()))}, intended {sorted(intended)}"
            )
    for key, sources in allowed.items():
        if key not in intended_all:
            problems.append(f"{key[0]}:{key[1]} reachable from {sorted(sources)}, intended from nobody")
    return problems


KNOWN_SHARED_ENV = {REDIS_URL_ENV, SECRET_ENV, CLUSTER_ENV}


def _settings_env(prefix: str, model: type[Any]) -> set[str]:
    return {f"{prefix}{name.upper()}" for name in model.model_fields}


def check_settings_env(objs: list[Obj]) -> list[str]:
    """Every TANDEM_* variable is a setting its process reads; a node's literal env builds a NodeSettings
    whose role and ports match its Deployment."""
    router_known = (
        KNOWN_SHARED_ENV | _settings_env("TANDEM_ROUTER_", RouterSettings) | _settings_env("TANDEM_", AdmissionSettings)
    )
    node_known = KNOWN_SHARED_ENV | _settings_env("TANDEM_NODE_", NodeSettings)
    problems = []
    for w in workloads(objs):
        comp = component(w)
        known = {"router": router_known, "lake-writer": KNOWN_SHARED_ENV}.get(comp, node_known)
        for c in containers(w):
            for name in env_of(c):
                if name.startswith("TANDEM_") and name not in known:
                    problems.append(f"{comp}: {name} is read by no setting of `tandem {comp}`")
    for role in NODE_ROLES:
        (c,) = containers(by_component(objs, role))
        literal = {k: str(e["value"]) for k, e in env_of(c).items() if "value" in e and k.startswith("TANDEM_NODE_")}
        literal["TANDEM_NODE_HOST"] = "10.1.2.3"  # status.podIP
        try:
            with pytest.MonkeyPatch.context() as mp:
                for key, value in literal.items():
                    mp.setenv(key, value)
                settings = NodeSettings()
        except ValueError as exc:
            problems.append(f"{role}: its env does not build NodeSettings: {exc}")
            continue
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        if settings.role.value != role:
            problems.append(f"{role}: the node's role setting is {settings.role.value}")
        expected = {
            "engine": settings.port,
            "kv-events": settings.port + 1,
            "kv-replay": settings.port + 2,
            "kv-blocks": settings.nixl_port,
        }
        if ports != expected:
            problems.append(f"{role}: container ports {ports} != the node's ports {expected}")
        if settings.is_loopback or not set(settings.engine_ports) <= set(ports.values()):
            problems.append(
                f"{role}: the engine binds {sorted(settings.engine_ports)}, the pod declares {sorted(ports.values())}"
            )
    (c,) = containers(by_component(objs, "router"))
    literal = {k: str(e["value"]) for k, e in env_of(c).items() if "value" in e and k.startswith("TANDEM_ROUTER_")}
    try:
        with pytest.MonkeyPatch.context() as mp:
            for key, value in literal.items():
                mp.setenv(key, value)
            router = RouterSettings()
    except ValueError as exc:
        return [*problems, f"router: its env does not build RouterSettings: {exc}"]
    if router.port != next(p["containerPort"] for p in c["ports"] if p["name"] == "http") or router.host != "0.0.0.0":
        problems.append(f"router listens on {router.host}:{router.port}, not on the pod's http port")
    return problems


def check_commands(objs: list[Obj]) -> list[str]:
    """Each Tandem container runs the `tandem` console script with a sub-command and options it has."""
    from tandem.cli import app

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    problems = []
    runner = CliRunner()
    for w in workloads(objs):
        if component(w) in ("redis", "postgresql"):
            continue
        for c in containers(w):
            if c.get("command") != ["tandem"] or "tandem" not in scripts:
                problems.append(f"{component(w)}: command {c.get('command')} is not the tandem console script")
                continue
            result = runner.invoke(app, [*c["args"], "--help"])
            if result.exit_code != 0:
                problems.append(
                    f"{component(w)}: `tandem {' '.join(c['args'])}` is refused: {result.output.strip()[-300:]}"
                )
    return problems


def check_gpu(objs: list[Obj], gpus: bool) -> list[str]:
    problems = []
    for w in workloads(objs):
        for c in containers(w):
            req = (c.get("resources") or {}).get("requests", {}).get("nvidia.com/gpu")
            lim = (c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu")
            wants = gpus and component(w) in NODE_ROLES
            if wants and not (req and lim and int(req) == int(lim) >= 1):
                problems.append(f"{component(w)}: GPU requests {req} / limits {lim}")
            if not wants and (req or lim):
                problems.append(f"{component(w)} asks for a GPU")
        spec = w["spec"]["template"]["spec"]
        if gpus and component(w) in NODE_ROLES:
            connector = env_of(containers(w)[0])["TANDEM_NODE_CONNECTOR"]["value"]
            if connector != "nixl":
                problems.append(f"{component(w)}: connector {connector} on a GPU (ours moves host-memory caches only)")
            if not spec.get("nodeSelector"):
                problems.append(f"{component(w)}: no nodeSelector for GPU machines")
            if not any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", [])):
                problems.append(f"{component(w)}: does not tolerate the GPU machines' taint")
    return problems


def check_node_pods(objs: list[Obj]) -> list[str]:
    """/dev/shm is a sized memory volume, and the spread constraint selects the role's own pods."""
    problems = []
    for role in NODE_ROLES:
        w = by_component(objs, role)
        spec = w["spec"]["template"]["spec"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        shm = [m for c in containers(w) for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        empty = (volumes.get(shm[0]["name"], {}).get("emptyDir") or {}) if shm else {}
        if not (empty.get("medium") == "Memory" and empty.get("sizeLimit")):
            problems.append(f"{role}: /dev/shm is not a sized memory volume")
        spread = spec.get("topologySpreadConstraints") or []
        if not any(selects(s["labelSelector"], labels) for s in spread):
            problems.append(f"{role}: no topology spread over its own pods")
    return problems


def all_problems(objs: list[Obj], values_file: str) -> list[str]:
    variant = yaml.safe_load((CHART / values_file).read_text())["image"]["variant"]
    return [
        *check_engine_images(objs, variant),
        *check_router_replicas(objs),
        *check_probe_ports(objs),
        *check_secret_refs(objs),
        *check_secret_scope(objs),
        *check_drain(objs),
        *check_network_policies(objs),
        *check_settings_env(objs),
        *check_commands(objs),
        *check_gpu(objs, gpus=variant == "gpu"),
        *check_node_pods(objs),
    ]


# -- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values_file", VALUE_FILES)
def test_every_object_validates(rendered: dict[str, list[Obj]], values_file: str, version: str) -> None:
    objs = rendered[values_file]
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "StatefulSet", "Service", "Secret", "NetworkPolicy", "HorizontalPodAutoscaler"} <= kinds
    errors = []
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert errors == []


def test_helm_lint_finds_no_error() -> None:
    assert _helm("lint")["errors"] == []


@pytest.mark.parametrize("values_file", VALUE_FILES)
def test_invariants_hold(rendered: dict[str, list[Obj]], values_file: str) -> None:
    assert all_problems(rendered[values_file], values_file) == []


def test_external_datastores_render_without_bundled_ones() -> None:
    objs = render(
        "values-cpu.yaml",
        {
            "redis": {"bundled": False, "existingSecret": "ops-redis"},
            "postgresql": {"bundled": False, "url": "postgresql://tandem:pw@db.internal:5432/tandem"},
            "clusterSecret": {"existingSecret": "ops-cluster"},
        },
    )
    assert {component(w) for w in workloads(objs)} == {"prefill", "decode", "router", "lake-writer"}
    assert check_secret_refs(objs, external=frozenset({"ops-redis", "ops-cluster"})) == []
    assert check_secret_refs(objs) != []  # the external ones are not rendered: the check sees them missing
    assert check_network_policies(objs) == []


def test_no_per_role_image_can_split_prefill_from_decode() -> None:
    """The roles take their image from `image` alone: a per-role image or tag is refused, not ignored."""
    for key in ("image", "tag"):
        with pytest.raises(HelmRefused, match=f"/prefill': additional properties '{key}' not allowed"):
            render("values-gpu.yaml", {"prefill": {key: "tandem:0.0.9-gpu"}})


def _set_env(objs: list[Obj], role: str, name: str, value: str) -> None:
    c = containers(by_component(objs, role))[0]
    env_of(c)[name]["value"] = value


def _rename_env(objs: list[Obj], role: str, old: str, new: str) -> None:
    env_of(containers(by_component(objs, role))[0])[old]["name"] = new


def _node_policy(objs: list[Obj]) -> Obj:
    return next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-nodes"))


def _router_hpa_floor(objs: list[Obj], floor: int) -> None:
    next(o for o in objs if o["kind"] == "HorizontalPodAutoscaler")["spec"]["minReplicas"] = floor


def _drop_hpa_one_replica(objs: list[Obj]) -> None:
    objs[:] = [o for o in objs if o["kind"] != "HorizontalPodAutoscaler"]
    by_component(objs, "router")["spec"]["replicas"] = 1


MUTATIONS: dict[str, tuple[Callable[[list[Obj]], None], Callable[[list[Obj]], list[str]]]] = {
    "decode on another tag": (
        lambda o: containers(by_component(o, "decode"))[0].update(image="tandem:0.0.9-cpu"),
        lambda o: check_engine_images(o, "cpu"),
    ),
    "router autoscaler floor 1": (lambda o: _router_hpa_floor(o, 1), check_router_replicas),
    "router one replica, no autoscaler": (_drop_hpa_one_replica, check_router_replicas),
    "readiness probe on an undeclared port": (
        lambda o: containers(by_component(o, "decode"))[0]["readinessProbe"]["httpGet"].update(port="http"),
        check_probe_ports,
    ),
    "liveness probe on a wrong port number": (
        lambda o: containers(by_component(o, "router"))[0]["livenessProbe"]["tcpSocket"].update(port=8001),
        check_probe_ports,
    ),
    "secret name misspelt": (
        lambda o: env_of(containers(by_component(o, "router"))[0])["TANDEM_DATABASE_URL"]["valueFrom"][
            "secretKeyRef"
        ].update(name="tandem-postgres"),
        check_secret_refs,
    ),
    "secret key misspelt": (
        lambda o: env_of(containers(by_component(o, "prefill"))[0])["TANDEM_CLUSTER_SECRET"]["valueFrom"][
            "secretKeyRef"
        ].update(key="secret"),
        check_secret_refs,
    ),
    "cluster secret handed to the lake writer": (
        lambda o: containers(by_component(o, "lake-writer"))[0]["env"].append(
            env_of(containers(by_component(o, "router"))[0])["TANDEM_CLUSTER_SECRET"]
        ),
        check_secret_scope,
    ),
    "database URL handed to a decode node": (
        lambda o: containers(by_component(o, "decode"))[0]["env"].append(
            env_of(containers(by_component(o, "router"))[0])["TANDEM_DATABASE_URL"]
        ),
        check_secret_scope,
    ),
    "router preStop removed": (lambda o: containers(by_component(o, "router"))[0].pop("lifecycle"), check_drain),
    "router grace shorter than a stream": (
        lambda o: by_component(o, "router")["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=60),
        check_drain,
    ),
    "node engine without --shutdown-timeout": (
        lambda o: _set_env(o, "decode", "TANDEM_NODE_EXTRA_ENGINE_ARGS", "[]"),
        check_drain,
    ),
    "node agent without a drain": (
        lambda o: _set_env(o, "prefill", "TANDEM_NODE_DRAIN_TIMEOUT_S", "0"),
        check_drain,
    ),
    "node grace shorter than its drain": (
        lambda o: by_component(o, "decode")["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=60),
        check_drain,
    ),
    "node drain longer than the agent waits": (
        lambda o: _set_env(o, "prefill", "TANDEM_NODE_EXTRA_ENGINE_ARGS", '["--shutdown-timeout", "60"]'),
        check_drain,
    ),
    "engines open to the lake writer": (
        lambda o: _node_policy(o)["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].update(
            {"app.kubernetes.io/component": "lake-writer"}
        ),
        check_network_policies,
    ),
    "node policy misses decode pods": (
        lambda o: _node_policy(o)["spec"]["podSelector"]["matchExpressions"][0].update(values=["prefill"]),
        check_network_policies,
    ),
    "block servers open to everyone": (
        lambda o: _node_policy(o)["spec"]["ingress"][1].pop("from"),
        check_network_policies,
    ),
    "policy names a port no pod has": (
        lambda o: _node_policy(o)["spec"]["ingress"][0]["ports"].append({"port": "kv-event", "protocol": "TCP"}),
        check_network_policies,
    ),
    "postgresql open to nodes": (
        lambda o: next(p for p in o if p["kind"] == "NetworkPolicy" and p["metadata"]["name"].endswith("-postgresql"))[
            "spec"
        ]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].pop("app.kubernetes.io/component"),
        check_network_policies,
    ),
    "node setting misspelt": (
        lambda o: _rename_env(o, "prefill", "TANDEM_NODE_KV_TRANSPORT", "TANDEM_NODE_KV_TRANSPROT"),
        check_settings_env,
    ),
    "node setting of the wrong type": (
        lambda o: _set_env(o, "decode", "TANDEM_NODE_KV_TRANSPORT", "rdma"),
        check_settings_env,
    ),
    "node port off by one": (lambda o: _set_env(o, "decode", "TANDEM_NODE_PORT", "8101"), check_settings_env),
    "router policy misspelt": (
        lambda o: _set_env(o, "router", "TANDEM_ROUTER_POLICY", "cache-aware"),
        check_settings_env,
    ),
    "router bound to loopback": (
        lambda o: _set_env(o, "router", "TANDEM_ROUTER_HOST", "127.0.0.1"),
        check_settings_env,
    ),
    "lake writer option misspelt": (
        lambda o: containers(by_component(o, "lake-writer"))[0]["args"].__setitem__(2, "--lakes"),
        check_commands,
    ),
    "router runs a sub-command that does not exist": (
        lambda o: containers(by_component(o, "router"))[0].update(args=["routers"]),
        check_commands,
    ),
    "block servers open to every node port (the nixl rule on the tandem connector)": (
        lambda o: _node_policy(o)["spec"]["ingress"][1].pop("ports"),
        check_network_policies,
    ),
    "decode asks for a GPU on CPU values": (
        lambda o: containers(by_component(o, "decode"))[0]["resources"]["limits"].update({"nvidia.com/gpu": 1}),
        lambda o: check_gpu(o, gpus=False),
    ),
    "/dev/shm left at the container default": (
        lambda o: containers(by_component(o, "prefill"))[0].update(
            volumeMounts=[
                m for m in containers(by_component(o, "prefill"))[0]["volumeMounts"] if m["mountPath"] != "/dev/shm"
            ]
        ),
        check_node_pods,
    ),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_invariant_catches(rendered: dict[str, list[Obj]], name: str) -> None:
    mutate, check = MUTATIONS[name]
    objs = copy.deepcopy(rendered["values-cpu.yaml"])
    assert check(objs) == []
    mutate(objs)
    assert check(objs) != []


def test_gpu_values_use_the_connector_that_moves_device_memory(rendered: dict[str, list[Obj]]) -> None:
    """Why the GPU values switch to nixl: our connector refuses a cache that is not in host memory."""
    import torch

    from kv_transfer.layout import KVLayout

    with pytest.raises(ValueError, match="host-memory KV caches only"):
        KVLayout.from_torch({"layer.0": torch.empty(4, 2, 16, 8, device="meta")}, num_blocks=4)
    objs = copy.deepcopy(rendered["values-gpu.yaml"])
    assert check_gpu(objs, gpus=True) == [] and check_network_policies(objs) == []
    _set_env(objs, "decode", "TANDEM_NODE_CONNECTOR", "tandem")
    assert check_gpu(objs, gpus=True) != []
    assert check_network_policies(objs) == ["prefill and decode use different connectors: ['nixl', 'tandem']"]
    # the nixl policy (every node port open to nodes) is wrong for the tandem connector, and the other way round
    cpu = copy.deepcopy(rendered["values-cpu.yaml"])
    _node_policy(cpu)["spec"]["ingress"][1] = _node_policy(rendered["values-gpu.yaml"])["spec"]["ingress"][1]
    assert check_network_policies(cpu) != []


def test_gpu_check_catches_gpu_values_without_gpus(rendered: dict[str, list[Obj]]) -> None:
    objs = copy.deepcopy(rendered["values-gpu.yaml"])
    assert check_gpu(objs, gpus=True) == []
    for role in NODE_ROLES:
        for key in ("requests", "limits"):
            containers(by_component(objs, role))[0]["resources"][key].pop("nvidia.com/gpu")
    assert len(check_gpu(objs, gpus=True)) == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"router": {"replicas": 1, "autoscaling": {"enabled": False}}}, "/router/replicas': minimum: got 1, want 2"),
        ({"router": {"autoscaling": {"minReplicas": 1}}}, "/router/autoscaling/minReplicas': minimum: got 1, want 2"),
        ({"routr": {"replicas": 3}}, "additional properties 'routr' not allowed"),
        ({"prefill": {"connector": "rdma"}}, "/prefill/connector': value must be one of 'tandem', 'nixl', 'none'"),
        ({"decode": {"kvTransprot": "tcp"}}, "additional properties 'kvTransprot' not allowed"),
        ({"clusterSecret": {"value": "short"}}, "at least 32 characters"),
        ({"image": {"variant": "tpu"}}, "/image/variant': value must be one of 'cpu', 'gpu'"),
        ({"decode": {"port": 8200}}, "prefill.port and decode.port must be equal"),
        ({"redis": {"bundled": False}}, "set redis.url or redis.existingSecret"),
    ],
)
def test_chart_refuses(overrides: Obj, message: str) -> None:
    with pytest.raises(HelmRefused, match=message):
        render("values-cpu.yaml", overrides)


def test_values_schema_names_what_the_processes_accept() -> None:
    """values.schema.json's enums are the settings' own choices, so the chart refuses what a node or a
    router would refuse at start, and nothing they accept."""
    from kv_transfer import ConnectorKind, TransportName
    from router.policies import PolicyName

    schema = json.loads((CHART / "values.schema.json").read_text())
    node = schema["$defs"]["node"]["properties"]
    assert node["connector"]["enum"] == [c.value for c in ConnectorKind]
    assert node["kvTransport"]["enum"] == [t.value for t in TransportName]
    assert NodeSettings.model_fields["kv_transport"].annotation is TransportName
    assert schema["properties"]["router"]["properties"]["policy"]["enum"] == [p.value for p in PolicyName]


def test_router_autoscaler_has_no_fixed_count_and_a_fixed_one_without_it() -> None:
    objs = render("values-cpu.yaml", {"router": {"replicas": 3, "autoscaling": {"enabled": False}}})
    assert by_component(objs, "router")["spec"]["replicas"] == 3
    assert not [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
    assert check_router_replicas(objs) == []


def _cluster_of(objs: list[Obj]) -> dict[str, str]:
    """Each Tandem workload's cluster: its TANDEM_CLUSTER, or the lake writer's --stream-prefix."""
    out = {}
    for w in workloads(objs):
        (c,) = containers(w)
        if component(w) == "lake-writer":
            args = c["args"]
            out["lake-writer"] = args[args.index("--stream-prefix") + 1]
        elif "command" in c and c["command"] == ["tandem"]:
            out[component(w)] = env_of(c)[CLUSTER_ENV]["value"]
    return out


def test_two_releases_on_one_redis_use_their_own_cluster_names() -> None:
    """Two releases in one namespace on one (external) Redis: every process of each runs under its own
    release's cluster name, so their registries, keys, sessions and telemetry streams differ, and the lake
    writer reads the streams its routers write."""
    external = {"redis": {"bundled": False, "url": "redis://shared-redis:6379/0"}}
    names = {}
    for release in ("staging", "prod"):
        clusters = _cluster_of(render("values-cpu.yaml", external, release=release))
        assert set(clusters) >= {"router", "prefill", "decode", "lake-writer"}, clusters
        name = clusters["router"]
        assert clusters["prefill"] == clusters["decode"] == name
        assert clusters["lake-writer"] == cluster_key(name, "telemetry")
        names[release] = name
    assert names == {"staging": "staging-tandem", "prod": "prod-tandem"}


def test_cluster_name_value_overrides_the_release_and_bad_names_are_refused() -> None:
    clusters = _cluster_of(render("values-cpu.yaml", {"clusterName": "default"}))
    assert clusters["router"] == "default" and clusters["lake-writer"] == "tandem:telemetry"
    with pytest.raises(HelmRefused):
        render("values-cpu.yaml", {"clusterName": "Prod:x"})
