"""Which requests ask the host tier to keep their context, for how long and as whose (``router.planning.retention``)."""

from __future__ import annotations

import pytest

from router.planning.retention import RETAIN_FIELD, parse_ttl, retention_for


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5m", 300.0), ("1h", 3600.0), ("90s", 90.0), ("300", 300.0), (42, 42.0), (" 2m ", 120.0)],
)
def test_ttls_in_the_forms_clients_send(value: object, seconds: float) -> None:
    assert parse_ttl(value) == seconds


@pytest.mark.parametrize("value", ["forever", "-5m", "", None, True, 0, -3, "5d"])
def test_anything_else_is_no_ttl(value: object) -> None:
    assert parse_ttl(value) is None


def test_a_session_is_kept_for_the_default_as_its_tenant_s() -> None:
    hint = retention_for({"messages": []}, "sess-1", "acme", 300.0, 3600.0)
    assert hint is not None and (hint.ttl_s, hint.owner, hint.tenant) == (300.0, "acme/sess-1", "acme")
    assert hint.params() == {RETAIN_FIELD: {"ttl_s": 300.0, "owner": "acme/sess-1", "tenant": "acme"}}


def test_the_session_names_the_owner_else_prompt_cache_key_and_two_tenants_never_share_one() -> None:
    # a prompt_cache_key is often shared by many conversations: the session, when there is one, owns the pins
    s = retention_for({"prompt_cache_key": "repo-x"}, "sess-1", "a", 300.0, 3600.0)
    a = retention_for({"prompt_cache_key": "repo-x"}, None, "a", 300.0, 3600.0)
    b = retention_for({"prompt_cache_key": "repo-x"}, None, "b", 300.0, 3600.0)
    assert s is not None and a is not None and b is not None
    assert (s.owner, a.owner, b.owner) == ("a/sess-1", "a/repo-x", "b/repo-x")


def test_a_request_naming_no_session_is_not_retained_and_zero_turns_it_off() -> None:
    assert retention_for({"messages": []}, None, "a", 300.0, 3600.0) is None
    assert retention_for({}, "s", "a", 0.0, 3600.0) is None


def test_cache_control_ttls_override_the_default_the_largest_wins_capped_at_the_max() -> None:
    body = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "repo", "cache_control": {"type": "ephemeral"}}]},
            {"role": "user", "content": "go", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ]
    }
    hint = retention_for(body, "s", "t", 60.0, 7200.0)
    assert hint is not None and hint.ttl_s == 3600.0
    capped = retention_for(body, "s", "t", 60.0, 600.0)
    assert capped is not None and capped.ttl_s == 600.0
    plain = retention_for(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, "s", "t", 60.0, 600.0
    )
    assert plain is not None and plain.ttl_s == 60.0
