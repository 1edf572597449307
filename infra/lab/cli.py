"""``tandem lab``: make, use and remove a lab of namespaced hosts (``infra.lab.network``).

The lab outlives the command that made it (namespaces are the kernel's): ``up`` writes its spec to the
state folder, and the other commands read it back by name. Root only (namespaces, bridges)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from contracts.cli import clean_errors, console
from contracts.errors import ConfigError
from infra.lab.network import Lab, LabSpec

lab_app = typer.Typer(
    help="Many hosts on one machine: network namespaces on bridges, links to cut and heal.", no_args_is_help=True
)

StateDir = Annotated[Path, typer.Option(help="Where lab specs are kept between commands.")]
Name = Annotated[str, typer.Option(help="The lab's name (1-4 characters of [a-z0-9]).")]
_DEFAULT_STATE = Path("/run/tandem-lab")


def _load(name: str, state_dir: Path) -> Lab:
    path = state_dir / f"{name}.json"
    if not path.exists():
        raise ConfigError(f"no lab named {name!r} (no {path}): make it with `tandem lab up --name {name}`")
    raw = json.loads(path.read_text())
    return Lab(LabSpec(raw["name"], {h: int(r) for h, r in raw["hosts"].items()}, raw["net"]))


@lab_app.command("up")
def lab_up(
    hosts: Annotated[
        str, typer.Option(help="Comma-separated hosts; `host@1` puts a host in region 1 (default region 0).")
    ] = "router,prefill,decode,redis",
    name: Name = "lab",
    net: Annotated[int, typer.Option(help="Second octet of the lab's addresses (10.<net>.<region>.<host>).")] = 231,
    state_dir: StateDir = _DEFAULT_STATE,
) -> None:
    """Make the lab's hosts (one namespace each) and its bridges; print each host's address."""
    with clean_errors():
        spec_hosts: dict[str, int] = {}
        for item in filter(None, (h.strip() for h in hosts.split(","))):
            host, _, region = item.partition("@")
            spec_hosts[host] = int(region or 0)
        lab = Lab(LabSpec(name, spec_hosts, net)).up()
        state_dir.mkdir(parents=True, exist_ok=True)
        (state_dir / f"{name}.json").write_text(json.dumps({"name": name, "hosts": spec_hosts, "net": net}))
        for h in lab.hosts.values():
            console.print(f"{h.name:<20} region {h.region}  {h.address:<15} netns {h.namespace}")


@lab_app.command("down")
def lab_down(name: Name = "lab", state_dir: StateDir = _DEFAULT_STATE) -> None:
    """Remove the lab: its hosts' processes are killed, its namespaces, links and bridges deleted."""
    with clean_errors():
        _load(name, state_dir).down()
        (state_dir / f"{name}.json").unlink(missing_ok=True)
        console.print(f"lab {name} removed")


@lab_app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lab_exec(ctx: typer.Context, host: str, name: Name = "lab", state_dir: StateDir = _DEFAULT_STATE) -> None:
    """Run a command in HOST's namespace: `tandem lab exec decode -- tandem node --role decode ...`."""
    with clean_errors():
        lab = _load(name, state_dir)
        if host not in lab.hosts:
            raise ConfigError(f"lab {name} has no host {host!r} (hosts: {', '.join(lab.hosts)})")
        raise typer.Exit(subprocess.call(lab.command(host, ctx.args)))


@lab_app.command("cut")
def lab_cut(host: str, name: Name = "lab", state_dir: StateDir = _DEFAULT_STATE) -> None:
    """Partition HOST from its region (its link set down); `heal` undoes it. HOST `regions`: the inter-region link."""
    with clean_errors():
        lab = _load(name, state_dir)
        lab.cut_regions() if host == "regions" else lab.cut(host)
        console.print(f"cut {host}")


@lab_app.command("heal")
def lab_heal(host: str, name: Name = "lab", state_dir: StateDir = _DEFAULT_STATE) -> None:
    """Bring HOST's link (or, for `regions`, the inter-region link) back up."""
    with clean_errors():
        lab = _load(name, state_dir)
        lab.heal_regions() if host == "regions" else lab.heal(host)
        console.print(f"healed {host}")
