"""The edge bounds what a client can make the router hold or compute (issue 13, item 1), against the
router in its own process, as ``tandem`` runs it: a 100 MB body is refused with 413 before it is read
(within 1 s, the router's RSS growing < 50 MB), whether announced by Content-Length or chunked; a
100,000-deep JSON is a 400, never a 500; message count and size are bounded; a model name no node
serves never becomes a metrics label."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.security.support import router_process, rss_bytes

MB = 1024 * 1024
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    with router_process(tmp_path_factory.mktemp("edge")) as (url, pid):
        # Warm: the first request imports and allocates what every later one reuses.
        httpx.post(url + CHAT, json={"model": "warm", "messages": [{"role": "user", "content": "x"}]}, timeout=30)
        yield url, pid


def _raw_post(url: str, head: bytes, body: Iterable[bytes]) -> tuple[bytes, float]:
    """Send ``head`` then ``body`` on a raw socket while reading the answer; returns the answer's
    head and the seconds from the first byte sent to the answer's arrival. Sending stops once the
    answer is in (or the server stops reading)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(10)
    got: dict[str, object] = {}

    def read() -> None:
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        got["at"], got["data"] = time.monotonic(), data

    reader = threading.Thread(target=read, daemon=True)
    t0 = time.monotonic()
    sock.sendall(head)
    reader.start()
    try:
        for chunk in body:
            if "at" in got:
                break
            sock.sendall(chunk)
    except OSError:
        pass  # the server closed the connection after answering
    reader.join(15)
    sock.close()
    assert "at" in got, "no answer"
    return got["data"], got["at"] - t0  # type: ignore[return-value,operator]


def _status(head: bytes) -> int:
    return int(head.split(b" ", 2)[1])


def _megabytes(n: int, chunked: bool) -> Iterator[bytes]:
    block = b"x" * MB
    for _ in range(n):
        yield b"%x\r\n%s\r\n" % (len(block), block) if chunked else block
    if chunked:
        yield b"0\r\n\r\n"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_100_mb_body_is_413_within_a_second_and_never_held(served: tuple[str, int], chunked: bool) -> None:
    url, pid = served
    before = rss_bytes(pid)
    length = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % (100 * MB)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + length
        + b"\r\n\r\n"
    )
    answer, seconds = _raw_post(url, head, _megabytes(100, chunked))
    assert _status(answer) == 413, answer[:300]
    assert seconds < 1.0
    assert rss_bytes(pid) - before < 50 * MB
    # And the router still serves.
    assert httpx.get(url + "/health", timeout=10).status_code in (200, 503)


def _error(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    return err


def test_json_nested_100000_deep_is_400_not_500(served: tuple[str, int]) -> None:
    url, _ = served
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _error(httpx.post(url + CHAT, content=deep, timeout=30), 400, "json_too_deep")
    objects = b'{"a": ' * 100_000 + b"1" + b"}" * 100_000
    _error(httpx.post(url + "/v1/completions", content=objects, timeout=30), 400, "json_too_deep")
    # Deeper than the limit (64) yet shallow enough for the decoder: refused all the same.
    nested: object = "x"
    for _ in range(100):
        nested = [nested]
    body = {"model": "m", "messages": [{"role": "user", "content": nested}]}
    _error(httpx.post(url + CHAT, json=body, timeout=30), 400, "json_too_deep")


def test_message_count_and_size_are_bounded(served: tuple[str, int]) -> None:
    url, _ = served
    many = {"model": "m", "messages": [{"role": "user", "content": "x"}] * 4097}
    _error(httpx.post(url + CHAT, json=many, timeout=30), 400, "too_many_messages")
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * (2 * MB + 1)}]}
    err = _error(httpx.post(url + CHAT, json=big, timeout=30), 400, "message_too_large")
    assert err["param"] == "messages.0.content"
    parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x" * MB}] * 3}]}
    _error(httpx.post(url + CHAT, json=parts, timeout=30), 400, "message_too_large")


def test_unknown_model_names_collapse_to_one_metrics_label(served: tuple[str, int]) -> None:
    url, _ = served
    names = [f"probe-{uuid.uuid4().hex}" for _ in range(3)]
    for name in names:
        body = {"model": name, "messages": [{"role": "user", "content": "x"}]}
        _error(httpx.post(url + CHAT, json=body, timeout=30), 404, "model_not_found")
    page = httpx.get(url + "/metrics", timeout=30).text
    assert not any(name in page for name in names)
    assert 'model="(unknown)"' in page


def test_feedback_is_bounded(served: tuple[str, int]) -> None:
    url, _ = served
    resp = httpx.post(url + "/v1/feedback", json={"response_id": "r", "rating": 1, "comment": "x" * 5000}, timeout=30)
    assert resp.status_code == 422, resp.text
    resp = httpx.post(url + "/v1/feedback", json={"response_id": "r", "rating": 1, "labels": ["l"] * 100}, timeout=30)
    assert resp.status_code == 422, resp.text
    for rating in ("5", True, 1.5):  # a JSON integer, as the document says, not whatever converts to one
        resp = httpx.post(url + "/v1/feedback", json={"response_id": "r", "rating": rating}, timeout=30)
        assert resp.status_code == 422, (rating, resp.text)


def test_auth_required_refuses_to_start_without_a_key(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="router exited"), router_process(tmp_path, TANDEM_AUTH="required"):
        pass


def _probe_while(url: str, work: threading.Thread) -> float:
    """The slowest ``/health`` answer while ``work`` runs: how long the router's event loop was held."""
    worst = 0.0
    with httpx.Client(timeout=30) as client:
        work.start()
        while work.is_alive():
            t0 = time.monotonic()
            client.get(url + "/health")
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.01)
    work.join()
    return worst


@pytest.mark.parametrize("shape", ["10 MiB of [],", "1 MB of tool-call arguments"])
def test_a_body_built_to_be_slow_to_parse_never_holds_the_loop(served: tuple[str, int], shape: str) -> None:
    """Millions of tiny arrays are refused from a count of their brackets before any parse (parsing them
    took seconds of the event loop); a megabyte of tool-call arguments is one string, parsed at once.
    Meanwhile the same router answers ``/health`` as fast as ever."""
    url, _ = served
    if shape.startswith("10 MiB"):
        body = b'{"model": "m", "messages": [' + b"[]," * (10 * MB // 3 - 20) + b"[]]}"
    else:
        call = {"id": "c1", "type": "function", "function": {"name": "write", "arguments": "x" * MB}}
        msgs = [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "go"}]
        body = httpx.Request("POST", "/", json={"model": f"m-{uuid.uuid4().hex[:6]}", "messages": msgs}).read()
    got: dict[str, httpx.Response] = {}

    def attack() -> None:
        got["r"] = httpx.post(url + CHAT, content=body, headers={"content-type": "application/json"}, timeout=60)

    worst = _probe_while(url, threading.Thread(target=attack))
    r = got["r"]
    if shape.startswith("10 MiB"):
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_containers", r.text[:300]
    else:
        assert r.status_code == 404, r.text[:300]  # parsed, validated, and only then: no node serves the model
    assert worst < 0.5, f"/health took {worst:.2f} s while the router handled the body"
