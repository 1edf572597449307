"""What a response asked for on a WebSocket brings to the one generation path (``router.edge.exchange``).

A socket is one agent session (``router.edge.codecs.websocket``): every response on it runs through the same
``Exchange`` as an HTTP request, with three differences carried here: the store it chains through keeps
the socket's last response in memory (``SocketResponses``), a response naming no session belongs to the
socket's, its prompt is encoded from the end of the previous one (``PrefixTokens``), and its record says
it came by ``websocket``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.edge.codecs.store import SocketResponses
from router.tokenizer import PrefixTokens


@dataclass(frozen=True, slots=True)
class SocketTurn:
    responses: SocketResponses
    session_id: str
    """The socket's session: the upgrade's ``x-session-id``, else one made for the socket."""
    tokens: PrefixTokens = field(default_factory=PrefixTokens)
    """The socket's last prompt, encoded: the next one is encoded from its end (``router.tokenizer``)."""
