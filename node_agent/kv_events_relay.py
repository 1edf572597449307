"""KV events off the host, only to the cluster: a ZeroMQ CURVE relay beside an engine on a real interface.

Why. An engine's KV events carry the token ids of every prompt it caches, i.e. tenants' prompts, and
its replay endpoint hands out its whole buffer to whoever asks. vLLM's publisher has no authentication,
so a node on a real interface never lets its engine bind one: the engine publishes and replays on ipc
sockets of the host (``NodeSettings.kv_events_bind``, ``kv_replay_bind``), and this relay, run by the
node agent for the node's whole life (engine restarts included: ZeroMQ reconnects to the new engine's
sockets by itself), serves both on TCP with CURVE:

    engine PUB  ipc://…/kv-events-<port>.sock ──SUB──┐                 ┌── PUB  tcp://<bind>:port+1 (CURVE)
                                                     ├─ relay thread ──┤
    engine ROUTER ipc://…/kv-replay-<port>.sock ◄─DEALER (one request   └── ROUTER tcp://<bind>:port+2 (CURVE)
                                                  at a time, answered in full: batches, then the end marker)

CURVE encrypts every frame and authenticates both ends: the server key pair and the one client key the
relay admits (its ZAP handler refuses any other) derive from the cluster secret
(``contracts.secret.curve_keys``), so a router needs nothing but the secret, and anything without it
gets no handshake, hence no event. Routers learn to use CURVE from the node's registry entry
(``NodeInfo.kv_events_auth == "curve"``). A loopback node (``tandem up``) needs none of this: its events
stay on an ipc socket and its replay on 127.0.0.1.

The relay adds one hop per event batch (one batch per engine step) in the node agent's process; replays
are rare (a subscriber's gap or start) and are served one at a time.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading

import zmq
from zmq.auth.thread import ThreadAuthenticator

from contracts.secret import CurveKeys

log = logging.getLogger("tandem.node.kv_events_relay")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""vLLM's replay end marker (``ZmqEventPublisher.END_SEQ``)."""
_ids = itertools.count()


class _OnlyClient:
    """ZAP credentials check: the cluster's client key and no other."""

    def __init__(self, client_public: bytes) -> None:
        self._key = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self._key
        if not ok:
            log.warning("KV events: refused a CURVE client with another key (not of this cluster)")
        return ok


class KVEventsRelay:
    def __init__(
        self,
        *,
        engine_events: str,
        engine_replay: str,
        events_bind: str,
        replay_bind: str,
        keys: CurveKeys,
        replay_timeout_s: float = 5.0,
    ) -> None:
        self.engine_events, self.engine_replay = engine_events, engine_replay
        self.events_bind, self.replay_bind = events_bind, replay_bind
        self._keys = keys
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._auth: ThreadAuthenticator | None = None
        self._thread: threading.Thread | None = None
        self._wake: zmq.Socket[bytes] | None = None
        self.replays = 0
        """Replay requests served (an outsider's never reaches here: no CURVE handshake)."""

    def _server(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.curve_server = True
        sock.curve_secretkey = self._keys.server_secret
        sock.curve_publickey = self._keys.server_public
        sock.linger = 0
        sock.bind(endpoint)
        return sock

    def start(self) -> None:
        """Bind both public endpoints (raises ``zmq.ZMQError`` if a port is taken) and start relaying."""
        ctx = self._ctx = zmq.Context()
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=_OnlyClient(self._keys.client_public))
        sub = ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.engine_events)
        pub = self._server(zmq.PUB, self.events_bind)
        front = self._server(zmq.ROUTER, self.replay_bind)
        stop_at = f"inproc://kv-events-relay-stop-{next(_ids)}"
        stop = ctx.socket(zmq.PAIR)
        stop.bind(stop_at)
        self._wake = ctx.socket(zmq.PAIR)
        self._wake.connect(stop_at)
        self._thread = threading.Thread(
            target=self._run, args=(sub, pub, front, stop), name="kv-events-relay", daemon=True
        )
        self._thread.start()
        log.info("KV events relayed with CURVE on %s (replay %s)", self.events_bind, self.replay_bind)

    def _run(
        self, sub: zmq.Socket[bytes], pub: zmq.Socket[bytes], front: zmq.Socket[bytes], stop: zmq.Socket[bytes]
    ) -> None:
        poller = zmq.Poller()
        for sock in (sub, front, stop):
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())  # no timeout: an idle node's relay never wakes
                if stop in ready:
                    return
                if sub in ready:
                    while True:
                        try:
                            msg = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        pub.send_multipart(msg)
                if front in ready:
                    self._replay(front.recv_multipart(), front)
        except zmq.ZMQError as exc:  # the context closed under us (shutdown)
            if exc.errno != zmq.ETERM:
                log.error("KV events relay stopped: %s", exc)
        finally:
            for sock in (sub, pub, front, stop):
                sock.close(linger=0)

    def _replay(self, frame: list[bytes], front: zmq.Socket[bytes]) -> None:
        """Ask the engine for the batches from the requested seq on and pass every reply back."""
        if len(frame) != 3:
            return
        client, _, start = frame
        assert self._ctx is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.linger = 0
        try:
            dealer.connect(self.engine_replay)
            dealer.send_multipart([b"", start])
            while dealer.poll(self._replay_timeout_ms):
                reply = dealer.recv_multipart()  # b"", topic, seq, payload
                front.send_multipart([client, *reply])
                if len(reply) >= 3 and reply[2] == END_SEQ:
                    break
            else:
                log.warning("KV events relay: the engine did not finish a replay within the timeout")
            self.replays += 1
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        if self._wake is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._wake.send(b"stop")
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._wake is not None:
            self._wake.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()
        self._thread = self._wake = self._auth = self._ctx = None


__all__ = ["END_SEQ", "KVEventsRelay"]
