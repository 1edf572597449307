"""The settings tables of the README and ``docs/settings.md`` are what the settings classes say now, and
the generator reads what a settings class declares (prefix, alias, nested section, docstring, default)."""

from __future__ import annotations

import enum
import shutil
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import AliasChoices, BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem import settings_doc
from tandem.settings_doc import BEGIN, collect, full_table, settings_classes, short_table, targets


def test_the_tables_are_fresh() -> None:
    stale = [
        str(path.relative_to(settings_doc.ROOT))
        for path, text in targets().items()
        if path.read_text(encoding="utf-8") != text
    ]
    assert not stale, f"stale settings table in {stale}: run `python -m tandem.settings_doc --write`"


def test_a_changed_setting_makes_the_table_stale(tmp_path: Path) -> None:
    for name in ("README.md", "docs/settings.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(settings_doc.ROOT / name, tmp_path / name)
    readme = tmp_path / "README.md"
    fresh = targets(tmp_path)[readme]
    readme.write_text(fresh.replace("| `TANDEM_REDIS_URL` | `redis://", "| `TANDEM_REDIS_URL` | `rediss://"))
    assert targets(tmp_path)[readme] == fresh != readme.read_text()


def test_every_settings_class_of_the_project_is_read() -> None:
    classes = settings_classes()
    assert classes, "no BaseSettings class found"
    envs = {s.env for s in collect(classes)}
    for cls in classes:
        prefix = str(cls.model_config.get("env_prefix", ""))
        assert any(env.startswith(prefix.upper()) for env in envs), cls


class _Colour(enum.StrEnum):
    """A colour for the test."""

    RED = "red"
    BLUE = "blue"


class _Section(BaseModel):
    depth: int = 3
    """How deep."""


class _OwnNames(BaseModel):
    ENV_PREFIX: ClassVar[str] = "OWN_"
    limit: int = 5
    """Read as OWN_LIMIT, whatever the root's prefix."""


class _Example(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EX_", env_nested_delimiter="__")

    plain: float = 1.5
    """A plain field. Its second sentence."""
    aliased: str = Field(default="x", validation_alias="EX_OTHER_NAME")
    """Read under another name."""
    renamed: int = Field(default=2, validation_alias=AliasChoices("EX_NEW_NAME", "EX_OLD_NAME"))
    """Renamed."""
    colour: _Colour = _Colour.RED
    mode: Literal["a", "b"] = "a"
    """Which mode."""
    tags: frozenset[str] = frozenset({"b", "a"})
    section: _Section = Field(default_factory=_Section)
    own: _OwnNames = Field(default_factory=_OwnNames)


def test_the_generator_reads_names_defaults_and_docstrings() -> None:
    rows = {s.env: s for s in collect([_Example])}
    assert set(rows) == {
        *(
            "EX_PLAIN",
            "EX_OTHER_NAME",
            "EX_NEW_NAME",
            "EX_COLOUR",
            "EX_MODE",
            "EX_TAGS",
            "EX_SECTION__DEPTH",
            "OWN_LIMIT",
        )
    }
    assert rows["EX_NEW_NAME"].doc == "Renamed. Deprecated name, still read: `EX_OLD_NAME`."
    assert rows["EX_PLAIN"].default == "`1.5`"
    assert rows["EX_PLAIN"].doc == "A plain field. Its second sentence."
    assert rows["EX_OTHER_NAME"].doc == "Read under another name."
    assert rows["EX_COLOUR"].default == "`red`"
    assert rows["EX_COLOUR"].doc == "A colour for the test."
    assert rows["EX_COLOUR"].described("A colour.") == "A colour. (one of `red`, `blue`)"
    assert rows["EX_MODE"].described(rows["EX_MODE"].doc) == "Which mode. (one of `a`, `b`)"
    assert rows["EX_MODE"].described("`a` or `b`.") == "`a` or `b`."
    assert rows["EX_TAGS"].default == '`["a", "b"]`'
    assert rows["EX_SECTION__DEPTH"].doc == "How deep."
    assert "| `EX_PLAIN` | `1.5` | `_Example` | A plain field. Its second sentence. |" in full_table(
        list(rows.values())
    )
    short = short_table(list(rows.values()), ("EX_PLAIN",))
    assert short.splitlines()[-1] == "| `EX_PLAIN` | `1.5` | A plain field. |"


def test_a_readme_setting_that_is_gone_stops_the_generator() -> None:
    try:
        short_table(collect([_Example]), ("EX_GONE",))
    except SystemExit as exc:
        assert "EX_GONE" in str(exc)
    else:
        raise AssertionError("no error for a name no settings class reads")


def test_the_markers_are_in_both_files() -> None:
    for path in targets():
        assert BEGIN in path.read_text(encoding="utf-8"), path
