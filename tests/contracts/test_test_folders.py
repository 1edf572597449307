"""Every folder of tests is a package, so that a fixture of ``scope="package"`` ends with its folder.

pytest ends such a fixture after the last test of the package its conftest belongs to; in a folder
without ``__init__.py`` that is the enclosing package, here ``tests``: the whole session. The end-to-end
cluster (``tests/e2e/conftest.py``, three float32 engines) was held that way under the lab's engines."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_folder_holding_tests_is_a_package() -> None:
    folders = {p.parent for p in TESTS.rglob("*.py") if p.name == "conftest.py" or p.name.startswith("test_")}
    missing = sorted(str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"without __init__.py (their package-scoped fixtures would live all session): {missing}"
