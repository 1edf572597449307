"""The router's HTTP edge: what a client sees, and nothing the cluster decides.

The app and its server, the exchange that owns one request's life, the edge's limits on a client's body,
the request schemas, the API codecs (Chat Completions, Responses, Anthropic Messages, WebSockets), the
SSE writing and the client's disconnect. The edge alone turns our error tree into each API's error body
and SSE error event. It calls planning for a plan and the upstream streams through the relay; it never
picks a node itself.
"""
