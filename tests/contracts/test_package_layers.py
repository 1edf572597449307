"""No package-level import cycle among our top-level packages, and every one of them placed in the
import-linter layers contract (so ``lint-imports`` keeps it so): a new package left out of the layers, or
an import from a lower package back into a higher one (as the connector shell once did into the role
packages), fails here. The graph is the one import-linter builds (grimp), read from the source."""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES: list[str] = CONFIG["root_packages"]


def _package_edges() -> dict[str, set[str]]:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    edges: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for module in graph.modules:
        source = module.split(".")[0]
        for imported in graph.find_modules_directly_imported_by(module):
            target = imported.split(".")[0]
            if target != source and target in edges:
                edges[source].add(target)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as the packages along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_package_level_cycle() -> None:
    cycle = _cycle(_package_edges())
    assert cycle is None, "package-level import cycle: " + " -> ".join(cycle or [])


def test_every_top_level_package_is_in_the_layers_contract_and_installed() -> None:
    [layers] = [c for c in CONFIG["contracts"] if c["id"] == "layers"]
    layered = {p.strip() for layer in layers["layers"] for p in layer.split("|")}
    assert layered == set(PACKAGES)
    assert not any("ignore_imports" in c for c in CONFIG["contracts"])
    here = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert here == set(PACKAGES)


def test_packages_sharing_a_layer_are_independent() -> None:
    """``a | b`` in import-linter's layers means a and b import neither each other (``:`` would allow it)."""
    [layers] = [c for c in CONFIG["contracts"] if c["id"] == "layers"]
    assert not any(":" in entry for entry in layers["layers"])
