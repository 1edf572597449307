"""Tandem placed by Ray: every process of a cluster (Redis, routers, nodes) owned by a Ray actor pinned
to a host, restarted by Ray when it dies.

The Ray cluster
    One Ray node per machine: ``ray start --head`` on one, ``ray start --address=<head>:6379`` on the
    others (``ray_start_argv``), each started with one custom resource naming its machine,
    ``tandem_host_<host>`` (``host_resource``). Placing a process on a machine is asking for that
    resource; nothing else (CPUs, memory) is asked, since the processes size themselves (a node's
    ``--cores``). A Tandem cluster then needs nothing of Ray but these resources: the same plan runs on
    hosts started by hand, by the lab (``tests/lab/test_ray.py``) or by KubeRay
    (``infra/helm/kuberay/tandem-ray.yaml``, whose groups carry the resources).

The actors
    ``ProcessOwner`` is the one actor class: it starts its process as a child (own session, so one
    ``killpg`` reaches a node's engine; ``PR_SET_PDEATHSIG``, so the process dies with its owner even
    when the owner is SIGKILLed), and a thread waits on it. The child exiting while nobody asked it to
    stop ends the actor's worker process (``os._exit``), and Ray restarts the actor (``max_restarts``, -1:
    always), which starts the process anew: one rule, whichever of the two died first. Actors are named
    (``tandem`` namespace) and detached: they outlive the short-lived driver that placed them
    (``deploy``), and ``undeploy`` finds them by name, stops their processes (SIGTERM: a node
    deregisters and drains) and removes them without a restart.

Secrets
    An actor's arguments are kept by Ray's GCS and shown by ``ray list actors --detail``, so a plan
    carries no secret: the cluster secret and the store URLs (with their passwords) are in the
    environment of each machine's ``ray start``, which Ray's workers, and so the owned processes, inherit.
    Ray's own port accepts arbitrary code from anyone who reaches it; start every Ray node with
    ``RAY_AUTH_MODE=token`` and one ``RAY_AUTH_TOKEN`` (the lab test does), and keep Ray's ports off
    untrusted networks.

A plan is JSON, a list of ``Placement`` objects: ``python -m infra.ray_deploy up --address
HEAD:6379 plan.json`` places it (and returns once every process is started), ``down`` removes it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from node_agent.lifetime import die_with_parent, stop_group

NAMESPACE = "tandem"
GCS_PORT = 6379
HOST_CAPACITY = 100
"""How many processes one machine's resource admits (each placement asks for 1)."""


def host_resource(host: str) -> str:
    """The custom resource a machine's Ray node is started with, and that a placement on it asks for."""
    return f"tandem_host_{host}"


def ray_start_argv(host: str, address: str, *, head: str | None, temp_dir: Path) -> list[str]:
    """``ray start`` for one machine: ``head`` None makes the head (GCS on ``GCS_PORT``), else the head's
    address to join. No CPU is offered (no Ray task of ours asks for one, and Ray then prestarts no idle
    workers), a small object store (Tandem passes no object through Ray), no dashboard UI."""
    resources = json.dumps({host_resource(host): HOST_CAPACITY})
    argv = [str(Path(sys.executable).with_name("ray")), "start", f"--node-ip-address={address}"]
    argv += ["--num-cpus=0", "--num-gpus=0", "--object-store-memory=80000000", f"--resources={resources}"]
    argv += [f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    if head is None:
        return [*argv, "--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
    return [*argv, f"--address={head}:{GCS_PORT}"]


@dataclass(frozen=True)
class Placement:
    """One process of the cluster and the machine it runs on."""

    name: str
    """The actor's name (unique in the ``tandem`` namespace): ``router``, ``node-decode``, ..."""
    host: str
    """The machine: its Ray node carries ``host_resource(host)``."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Added to the machine's environment; no secret here (see the module docstring)."""
    log: str | None = None
    """A file on the machine for the process's output; None: the actor's worker log (Ray's)."""
    max_restarts: int = -1


class ProcessOwner:
    """A Ray actor's body (``ray.remote`` is applied in ``deploy``, so importing this needs no Ray)."""

    def __init__(self, placement: dict[str, Any]) -> None:
        self.placement = Placement(**placement)
        self._stopping = threading.Event()
        # The log file is the child's: it is closed here once the child holds its own descriptor.
        out = open(self.placement.log, "ab") if self.placement.log else None  # noqa: SIM115
        # Spawned from the actor's main thread (its tasks run there): PR_SET_PDEATHSIG follows the
        # thread that forked, and this one lives as long as the worker process.
        self._child = subprocess.Popen(
            self.placement.argv,
            env={**os.environ, **self.placement.env},
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        if out is not None:
            out.close()
        threading.Thread(target=self._watch, name="tandem-owner-watch", daemon=True).start()

    def _watch(self) -> None:
        code = self._child.wait()
        if not self._stopping.is_set():
            print(f"tandem: {self.placement.name} exited with {code}; ending the actor for Ray to restart it")
            sys.stdout.flush()
            os._exit(1)

    def pid(self) -> int:
        """The owned process's pid (a node: its agent, the engine's parent)."""
        return self._child.pid

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """Stop the process (SIGTERM to its group, SIGKILL after ``timeout_s``) without a restart."""
        self._stopping.set()
        stop_group(self._child.pid, sig=signal.SIGTERM, timeout_s=timeout_s)
        return self._child.poll()


def _connect(address: str) -> Any:  # noqa: ANN401 - the ray module, imported only where Ray is installed
    import ray  # the `ray` extra: only a Ray deployment needs it

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    return ray


def deploy(address: str, placements: Sequence[Placement], timeout_s: float = 300.0) -> dict[str, int]:
    """Place every process (an actor already running under a name is kept) and wait until each has
    started; returns name -> pid of the owned process."""
    ray = _connect(address)
    owner = ray.remote(ProcessOwner)
    handles = {
        p.name: owner.options(
            name=p.name,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=p.max_restarts,
            num_cpus=0,
            resources={host_resource(p.host): 1},
        ).remote(asdict(p))
        for p in placements
    }
    pids = ray.get([h.pid.remote() for h in handles.values()], timeout=timeout_s)
    return dict(zip(handles, pids, strict=True))


def pids(address: str, names: Sequence[str], timeout_s: float = 300.0) -> dict[str, int]:
    """The owned processes' pids now (after a restart: the new process's)."""
    ray = _connect(address)
    refs = [ray.get_actor(name).pid.remote() for name in names]
    return dict(zip(names, ray.get(refs, timeout=timeout_s), strict=True))


def undeploy(address: str, names: Sequence[str], timeout_s: float = 180.0) -> None:
    """Stop the named processes, in order (routers before nodes before stores), and remove their actors."""
    ray = _connect(address)
    for name in names:
        try:
            actor = ray.get_actor(name)
        except ValueError:  # not placed, or already removed
            continue
        try:
            ray.get(actor.stop.remote(), timeout=timeout_s)
        finally:
            ray.kill(actor, no_restart=True)


def read_plan(path: Path) -> list[Placement]:
    return [Placement(**item) for item in json.loads(path.read_text())]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m infra.ray_deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("plan", type=Path, help="JSON list of placements (name, host, argv, env, log)")
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS", "auto"),
        help="the Ray head, HOST:PORT (default: RAY_ADDRESS, as Ray's jobs get it; else this machine's Ray)",
    )
    args = parser.parse_args(argv)
    plan = read_plan(args.plan)
    if args.action == "up":
        for name, pid in deploy(args.address, plan).items():
            print(f"{name} pid {pid}")
    else:
        undeploy(args.address, [p.name for p in reversed(plan)])


if __name__ == "__main__":
    main()
