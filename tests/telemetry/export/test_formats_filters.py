"""Formats and filters on hand-built examples: no database, no lake."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from telemetry.export import formats
from telemetry.export.filters import FeedbackFilter, Filters, apply
from telemetry.export.formats import Format, PairRule
from telemetry.export.source import Example, Feedback, TurnRow, build_examples

U1 = {"role": "user", "content": "Open README.md"}
CALL = {
    "role": "assistant",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}],
}
RES = {"role": "tool", "tool_call_id": "c1", "content": "# Tandem"}
A2 = {"role": "assistant", "content": "It is about serving."}


def ex(rid: str, *, tenant: str = "t", rating: int | None = None, at: float = 1.0, **kw) -> Example:
    fb = Feedback(rating, None, [], at + 10) if rating is not None else None
    return Example(
        tenant_id=tenant,
        session_id=kw.pop("session", "s"),
        request_id=rid,
        turn_index=0,
        created_at=at,
        model=kw.pop("model", "m"),
        context=kw.pop("context", [U1]),
        response=kw.pop("response", {"role": "assistant", "content": f"answer {rid}"}),
        lake=kw.pop("lake", {}),
        feedback=fb,
    )


def test_context_rebuilt_from_earlier_turns_and_whole_history_requests() -> None:
    rows = [
        TurnRow("t", "s", "r1", 1.0, {"messages": [U1], "response": CALL}),
        TurnRow("t", "s", "r2", 2.0, {"messages": [RES], "response": A2}),
        # the client sent its own history again (a regenerate of the first turn): stored whole
        TurnRow("t", "s", "r3", 3.0, {"messages": [U1], "response": {"role": "assistant", "content": "x"}}),
        TurnRow("t", "other", "r4", 1.5, {"messages": [U1], "response": A2}),
    ]
    e1, e2, e3, e4 = build_examples(rows)
    assert (e1.context, e1.response, e1.turn_index) == ([U1], CALL, 0)
    assert (e2.context, e2.response, e2.turn_index) == ([U1, CALL, RES], A2, 1)
    assert e3.context == [U1] and e3.turn_index == 2
    assert e4.context == [U1] and e4.turn_index == 0


def test_chat_line_weights_only_the_answer_of_its_turn() -> None:
    e = build_examples(
        [
            TurnRow("t", "s", "r1", 1.0, {"messages": [U1], "response": CALL}),
            TurnRow("t", "s", "r2", 2.0, {"messages": [RES], "response": A2}),
        ]
    )[1]
    line = formats.chat_line(formats.record(e))
    assert line["messages"] == [U1, {**CALL, "weight": 0}, RES, {**A2, "weight": 1}]
    assert line["metadata"]["request_id"] == "r2" and line["metadata"]["turn_index"] == 1


def test_pairs_per_context_chosen_by_rating() -> None:
    other = [{"role": "user", "content": "something else"}]
    rated = [
        ex("a", rating=1, at=1),
        ex("b", rating=-1, at=2),
        ex("c", rating=1, at=3),
        ex("d", rating=1, context=other),
    ]
    recs = [(e, formats.record(e)) for e in rated]
    got = formats.pairs(recs, PairRule.ALL)
    # a-b and b-c differ; a-c tie; d has no partner
    assert sorted(
        (p[1]["metadata"]["chosen"]["request_id"], p[1]["metadata"]["rejected"]["request_id"]) for p in got
    ) == [
        ("a", "b"),
        ("c", "b"),
    ]
    pos, line = next(p for p in got if p[1]["metadata"]["chosen"]["request_id"] == "a")
    assert line["input"]["messages"] == [U1]
    assert line["preferred_output"] == [{"role": "assistant", "content": "answer a"}]
    assert line["non_preferred_output"] == [{"role": "assistant", "content": "answer b"}]
    assert pos == (12.0, "a", "b")  # the later feedback's time
    assert len(formats.pairs(recs, PairRule.EXTREMES)) == 1
    assert formats.pairs([(e, formats.record(e)) for e in rated[:1]], PairRule.ALL) == []


def test_parquet_rows_keep_messages_and_tool_calls(tmp_path) -> None:
    parts = [{"type": "text", "text": "hi"}]
    e = ex("r", rating=1, context=[{"role": "user", "content": parts}, CALL, RES], lake={"status": "ok", "ttft_s": 0.5})
    row = formats.parquet_row(formats.record(e))
    path = tmp_path / "p.parquet"
    path.write_bytes(formats.encode(Format.PARQUET, [row, {**row, "request_id": "r2", "unknown_key": 1}]))
    t = pq.read_table(path)
    assert t.schema == formats.SCHEMA and t.num_rows == 2
    first = t.to_pylist()[0]
    assert json.loads(first["messages"][0]["content"]) == parts
    assert first["messages"][1]["tool_calls"][0]["function"]["name"] == "read_file"
    assert first["messages"][1]["weight"] == 0 and first["messages"][3]["weight"] == 1
    assert (first["status"], first["ttft_s"], first["rating"]) == ("ok", 0.5, 1)


def test_jsonl_is_one_object_per_line() -> None:
    data = formats.encode(Format.CHAT_JSONL, [{"messages": [U1]}, {"messages": [A2]}])
    assert [json.loads(x) for x in data.decode().splitlines()] == [{"messages": [U1]}, {"messages": [A2]}]


@pytest.mark.parametrize(
    ("filters", "example", "reason"),
    [
        (Filters(), ex("r", tenant="nobody"), "no_consent"),
        (Filters(tenants=frozenset({"u"})), ex("r"), "tenant"),
        (Filters(models=frozenset({"other"})), ex("r"), "model"),
        (Filters(since=5.0), ex("r", at=1.0), "time"),
        (Filters(), ex("r", response=None), "empty"),
        (Filters(), ex("r", response={"role": "assistant"}), "empty"),
        (Filters(), ex("r", lake={"status": "cancelled"}), "failed"),
        (Filters(), ex("r", lake={"status": "error"}), "failed"),
        (Filters(feedback=FeedbackFilter.RATED), ex("r"), "feedback"),
        (Filters(feedback=FeedbackFilter.UNRATED), ex("r", rating=1), "feedback"),
        (Filters(min_rating=1), ex("r", rating=0), "feedback"),
        (Filters(min_rating=1), ex("r"), "feedback"),
        (Filters(max_rating=0), ex("r", rating=1), "feedback"),
    ],
)
def test_each_filter_names_its_reason(filters: Filters, example: Example, reason: str) -> None:
    kept, dropped = apply([example], filters, frozenset({"t"}))
    assert kept == [] and dropped == {reason: 1}


def test_kept_examples_and_failed_ones_on_request_marked() -> None:
    failed = ex("f", lake={"status": "error"})
    ok = [ex("a"), ex("b", rating=5), ex("c", lake={"status": "ok"})]
    kept, dropped = apply([*ok, failed], Filters(include_failed=True, min_rating=None), frozenset({"t"}))
    assert kept == [*ok, failed] and not dropped
    assert formats.record(failed)["metadata"]["failed"] is True
    assert formats.record(ok[0])["metadata"]["failed"] is False
