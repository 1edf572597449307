"""schemathesis against the real router and its real OpenAPI document (issue 13's acceptance): every
operation the router's ``/openapi.json`` lists, stateless (schemathesis's examples, coverage and fuzzing
phases, valid and invalid inputs) and stateful (sequences of calls the document links), with every
check schemathesis has, each enabled.

Real parts: the router app in a uvicorn thread, real Redis (DB 14), a real key store holding one real
admin key (so auth is on, and the ``ignored_auth`` check sends every operation without a key and with
a wrong one), and one STAND-IN engine (``bench.standin_engine``) serving the only model the router
knows. Examples are bounded (``MAX_EXAMPLES`` per operation and phase) to fit the suite's time.

The stateless tests are built by ``schemathesis.pytest.lazy.get_all_tests``, the builder behind
``@schema.parametrize()``, and run here one operation after another: ``parametrize`` over a schema
loaded from a fixture (the router exists only once the fixture runs) does not run under pytest 9,
which dropped the ``Node._nodeid`` attribute schemathesis 4.32 renames its sub-tests through."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup
from schemathesis.pytest.lazy import get_all_tests

from tests.security.support import Router, router_sync

MAX_EXAMPLES = 25
SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    # The router answers over real HTTP: slow examples and large generated bodies are the point here.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
OPERATIONS = 16
"""Every route the router has (a new one must show up in the document, and so here)."""


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, dict[str, str]]]:
    with router_sync(Path(tmp_path_factory.mktemp("fuzz")), admin_key=True) as pair:
        yield pair


def load(url: str, token: str | None) -> schemathesis.BaseSchema:
    """The router's own document (``url + "/openapi.json"``), requests sent to that router; every check
    enabled for every operation. With ``token`` (an admin key), the key is configured for the document's
    own security scheme (``apiKey``, a bearer token), so schemathesis knows it for the caller's key:
    ``ignored_auth`` probes each operation without it and with a wrong one, and the invalid inputs it
    generates for the ``Authorization`` header are sent as such. Without: the document must say that
    no key is needed (auth is off), or ``ignored_auth`` fails every operation that answers."""
    config = SchemathesisConfig.from_dict({"auth": {"openapi": {"apiKey": {"bearer": token}}}} if token else {})
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=config, headers=headers)
    load_all_checks()
    labels = []
    for result in schema.get_all_operations():
        op = result.ok()
        labels.append(op.label)
        config = schema.config.checks_config_for(operation=op, phase=None)
        disabled = [name for name in CHECKS.get_all_names() if not config.get_by_name(name=name).enabled]
        assert not disabled, (op.label, disabled)
    assert len(labels) == OPERATIONS, labels
    return schema


def load_live(live: tuple[Router, dict[str, str]]) -> schemathesis.BaseSchema:
    return load(live[0].url, live[1]["Authorization"].removeprefix("Bearer "))


def fuzz(
    schema: schemathesis.BaseSchema, only: tuple[str, ...] | None = None, bounds: settings = SETTINGS
) -> list[str]:
    """Every operation's stateless tests (``bounds``: hypothesis's settings); schemathesis's failure reports."""

    def call_and_validate(case: schemathesis.Case) -> None:
        case.call_and_validate()

    def before_call(context: Any, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
        if isinstance(case.body, dict) and "tool_choice" in case.body:
            case.body = with_a_satisfiable_tool_choice(case.body)

    failures = []
    schemathesis.hook(before_call)  # hooks on calls are global only: unregistered right after
    try:
        failures = _run(schema, only, bounds, call_and_validate)
    finally:
        schemathesis.hooks.unregister(before_call)
    return failures


def _run(schema: schemathesis.BaseSchema, only: tuple[str, ...] | None, bounds: settings, test_func: Any) -> list[str]:
    failures = []
    for result in get_all_tests(schema=schema, test_func=test_func, settings=bounds, given_kwargs=None):
        op, test = result.ok()
        if only is not None and op.path not in only:
            continue
        try:
            test()
        except FailureGroup as exc:
            failures.append(f"{op.label}: {exc}")
    return failures


def test_every_operation_conforms(live: tuple[Router, dict[str, str]]) -> None:
    started = time.monotonic()
    failures = fuzz(load_live(live))
    assert not failures, "\n\n".join(failures)
    assert time.monotonic() - started < 90


BUDGET_FIELD = {
    "/v1/chat/completions": "max_tokens",
    "/v1/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
    "/v1/messages": "max_tokens",
}
"""The output budget each generation route reads (chat's ``max_completion_tokens`` is its alias)."""


def _in_vocabulary(prompt: list[Any], vocab: int) -> list[Any]:
    def fold(x: Any) -> Any:
        if isinstance(x, list):
            return [fold(v) for v in x]
        if isinstance(x, int | float) and not isinstance(x, bool) and x >= vocab:
            return int(x) % vocab
        return x

    return [fold(v) for v in prompt]


def _tool_names(tools: list[Any]) -> list[str]:
    """The names a tool_choice may name, as the codecs read tools: Responses' function tools (those in a
    namespace too), Messages' custom tools (no ``type`` is custom)."""
    names: list[str] = []
    for t in tools:
        if not isinstance(t, dict):
            continue
        kind = t.get("type", "custom")
        if kind in ("function", "custom") and isinstance(t.get("name"), str):
            names.append(t["name"])
        elif kind == "namespace" and isinstance(t.get("tools"), list):
            names.extend(_tool_names(t["tools"]))
    return names


def with_a_satisfiable_tool_choice(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with its ``tool_choice`` made one its ``tools`` satisfy, when it is well formed: a choice
    that demands a call (``required``, ``any``, a named tool) without tools is dropped, and a named one
    names the first tool. That a named tool is among the tools is a rule between two fields that no
    static schema states (``router.edge.codecs.internal.checked_tool_choice`` refuses it with a 400, as the
    APIs do); hypothesis would almost never guess a matching name."""
    choice, tools = body.get("tool_choice"), body.get("tools")
    names = _tool_names(tools) if isinstance(tools, list) else []
    demanding = choice == "required" or (
        isinstance(choice, dict) and choice.get("type") in ("any", "tool", "function") and len(choice) > 0
    )
    if not demanding:
        return body
    if not names:
        return {k: v for k, v in body.items() if k != "tool_choice"}
    if isinstance(choice, dict) and isinstance(choice.get("name"), str):
        return {**body, "tool_choice": {**choice, "name": names[0]}}
    return body


@contextmanager
def naming_the_served_model(
    model: str, *, cap: int = 64, budgeted: bool = False, vocab: int | None = None
) -> Iterator[None]:
    """Every generation request names ``model``, the one the stand-in serves: a generated model name
    is one no node serves (404 before the body is even looked at), so only this way do bodies reach
    the edge's checks, tokenizing, admission and the engine, and answers link to sessions and
    feedback. Output budgets over ``cap`` are cut to it; with ``budgeted``, a body without one gets
    ``cap`` (a real engine would otherwise write up to the context window, minutes on a CPU); with
    ``vocab``, a prompt's token ids are folded into the model's vocabulary."""

    def before_call(context: Any, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
        # Edited in ``before_call``, a case is validated again (a ``map_body`` hook's edit is not): a
        # body this makes valid is then judged as a valid one. The output budget is kept inside the
        # served model's context window (``max_model_len``; past it a 400 ``context_length_exceeded``,
        # as OpenAI answers), which no static schema can state. JSON Schema's integers include floats
        # with no fraction (2.6e12), as pydantic's do.
        if case.operation.path not in GENERATION or not isinstance(case.body, dict):
            return
        body = {**case.body, "model": model}
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(field)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > cap:
                body[field] = cap
        if budgeted and all(body.get(f) is None for f in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
            body[BUDGET_FIELD[case.operation.path]] = cap
        if vocab is not None and isinstance(body.get("prompt"), list):
            # Token ids inside the served model's vocabulary (the engine refuses others: a per-model bound).
            body["prompt"] = _in_vocabulary(body["prompt"], vocab)
        case.body = with_a_satisfiable_tool_choice(body)

    schemathesis.hook(before_call)  # hooks on calls are global only: unregistered right after
    try:
        yield
    finally:
        schemathesis.hooks.unregister(before_call)


def test_generation_with_the_served_model_conforms(live: tuple[Router, dict[str, str]]) -> None:
    schema = load_live(live)
    started = time.monotonic()
    with naming_the_served_model(live[0].model):
        failures = fuzz(schema, only=GENERATION)
    assert not failures, "\n\n".join(failures)
    assert time.monotonic() - started < 60


def test_stateful(live: tuple[Router, dict[str, str]]) -> None:
    """Sequences the document's links allow: a completion, then its session (read, deleted, read
    again: ``use_after_free``) and feedback on its answer; with the served model, so that answers exist."""
    answered: Counter[tuple[str, int]] = Counter()
    failed: list[str] = []

    class Counted(load_live(live).as_state_machine()):  # type: ignore[misc]
        def after_call(self, response: Any, case: schemathesis.Case) -> None:
            answered[(case.path, response.status_code)] += 1
            super().after_call(response, case)

        def step(self, input: Any) -> Any:
            try:
                return super().step(input)
            except Exception as exc:
                failed.append(f"{input.case.method} {input.case.path}: {type(exc).__name__}: {str(exc)[:2000]}")
                raise

    started = time.monotonic()
    with naming_the_served_model(live[0].model):
        try:
            Counted.run(settings=SETTINGS)
        except Exception as exc:
            # A call whose answer differs when hypothesis replays the sequence (a server in another state
            # by then) surfaces as FlakyStrategyDefinition, which names no failure: name the first here.
            raise AssertionError(f"stateful run failed; first failing step: {failed[:1]}") from exc
    assert time.monotonic() - started < 60
    # It went past the first call: answers were given, and the link to feedback on them followed.
    assert answered["/v1/chat/completions", 200] + answered["/v1/completions", 200] > 0, answered
    assert answered["/v1/feedback", 202] > 0, answered
