"""The model table's resolution (router.model_table): aliases, canary weights counted exactly, fallbacks
when a model has no live node, unknown names passed through, and which names may be metrics labels."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from contracts.errors import ConfigError
from contracts.models_file import ModelsFile
from router.model_table import ModelTable, Resolution, Via
from router.planning.orchestrator import RequestTrace, note_resolution
from router.record.records import request_record
from telemetry.schemas import SCHEMAS

TOML = """
[served.a]
[served.b]
dtype = "bfloat16"
[served.c]

[aliases]
small = "a"
code = "coder"

[fallbacks]
b = "a"
c = "b"

[canaries.coder]
a = 90
b = 10
"""


def _table(tmp_path: Path) -> ModelTable:
    path = tmp_path / "models.toml"
    path.write_text(TOML)
    return ModelTable.load(path)


def _all_live(_: str) -> bool:
    return True


def test_alias_resolves_to_its_served_name(tmp_path: Path) -> None:
    r = _table(tmp_path).resolve("small", _all_live)
    assert (r.requested, r.served, r.via) == ("small", "a", Via.ALIAS)


def test_served_and_unknown_names_pass_through(tmp_path: Path) -> None:
    table = _table(tmp_path)
    assert table.resolve("a", _all_live).via is Via.DIRECT
    r = table.resolve("nobody-serves-this", _all_live)
    assert (r.served, r.via, r.fallback) == ("nobody-serves-this", Via.DIRECT, None)
    assert ModelTable().resolve("x", _all_live).served == "x"  # the empty table


def test_canary_splits_exactly_by_weight_and_interleaves(tmp_path: Path) -> None:
    table = _table(tmp_path)
    picks = [table.resolve("coder", _all_live) for _ in range(200)]
    assert {p.via for p in picks} == {Via.CANARY}
    assert Counter(p.served for p in picks) == {"a": 180, "b": 20}
    # Smooth: the canary's share is spread out, one in every ten, not a block of 20 at the end.
    assert [Counter(p.served for p in picks[i : i + 10])["b"] for i in range(0, 200, 10)] == [1] * 20


def test_alias_of_a_canary_takes_the_same_split(tmp_path: Path) -> None:
    table = _table(tmp_path)
    picks = Counter(table.resolve("code", _all_live).served for _ in range(100))
    assert picks == {"a": 90, "b": 10}


def test_fallback_when_the_model_has_no_live_node(tmp_path: Path) -> None:
    table = _table(tmp_path)
    r = table.resolve("b", lambda m: m != "b")
    assert (r.served, r.via, r.fallback) == ("a", Via.FALLBACK, None)
    # Live: the model itself, with its fallback kept for a capacity refusal.
    r = table.resolve("b", _all_live)
    assert (r.served, r.via, r.fallback) == ("b", Via.DIRECT, "a")


def test_fallback_is_one_hop_and_needs_a_live_target(tmp_path: Path) -> None:
    table = _table(tmp_path)
    # c -> b, and b is down too: no move (b's own fallback a is not followed); the fleet answers 404.
    r = table.resolve("c", lambda m: m == "a")
    assert (r.served, r.via) == ("c", Via.DIRECT)


def test_canary_pick_falls_back_when_its_arm_is_down(tmp_path: Path) -> None:
    table = _table(tmp_path)
    picks = [table.resolve("coder", lambda m: m != "b") for _ in range(10)]
    assert Counter((p.served, p.via) for p in picks) == {("a", Via.CANARY): 9, ("a", Via.FALLBACK): 1}


def test_known_names_are_the_tables_only(tmp_path: Path) -> None:
    table = _table(tmp_path)
    assert all(table.known(n) for n in ("a", "b", "c", "small", "code", "coder"))
    assert not table.known("anything-a-client-sends")
    assert table.public_names == ["small", "code", "coder"]
    assert (table.parent("small"), table.parent("coder"), table.parent("code")) == ("a", "a", "coder")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"canaries": {"x": {"a": 100}}}, "canaries.x: needs at least two served names"),
        ({"canaries": {"x": {"a": 90, "b": 0}}}, "canaries.x.b: weight 0 is not a positive integer"),
        ({"aliases": {"x": "y", "y": "a"}}, "aliases.x: points at another alias"),
        ({"fallbacks": {"a": "a"}}, "fallbacks.a: a model cannot be its own fallback"),
        ({"aliases": {"x": "a"}, "canaries": {"x": {"a": 1, "b": 1}}}, "x: both an alias and a canary name"),
        ({"served": {"a": {}}, "aliases": {"a": "b"}}, "a: both served and public name"),
        ({"served": {"a": {}}, "aliases": {"x": "b"}}, "aliases.x: 'b' is not a served model (a)"),
        ({"served": {"a": {}}, "fallbacks": {"a": "z"}}, "fallbacks.a: 'z' is not a served model"),
        ({"aliases": {"x": "a"}, "fallbacks": {"x": "a"}}, "fallbacks.x: fallbacks go from a served name"),
        ({"canaries": {"x": {"a": 1, "y": 1}}, "aliases": {"y": "a"}}, "canaries.x.y: a canary splits between"),
    ],
)
def test_bad_tables_are_refused_with_the_entry_named(spec: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ModelTable(ModelsFile.model_validate(spec), source="m.toml")
    assert err.value.message.startswith("m.toml: ") and message in err.value.message, err.value.message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[aliases\n", "not valid TOML"),
        ("[canaries.x]\na = 1.5\nb = 1\n", "canaries.x.a"),
        ("[alias]\nx = 'a'\n", "alias: Extra inputs are not permitted"),
        ("[served.a]\npath = 3\n", "served.a.path"),
    ],
)
def test_bad_files_are_refused_with_the_file_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        ModelTable.load(path)
    assert str(path) in err.value.message and message in err.value.message, err.value.message


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        ModelTable.load(tmp_path / "absent.toml")


def test_the_lake_row_names_the_served_and_the_requested_model() -> None:
    trace = RequestTrace(request_id="chatcmpl-1", kind="chat", model="coder")
    note_resolution(trace, Resolution("coder", "b", Via.CANARY, "a"))
    row = request_record(trace, endpoint="chat", http_status=200)
    assert (row["model"], row["requested_model"], row["model_resolution"]) == ("b", "coder", "canary")
    assert set(row) <= set(SCHEMAS["requests"].names)
