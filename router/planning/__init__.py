"""The router's planning: which nodes serve a request, and how its legs run.

The orchestrator turns a request and the fleet's snapshot into a plan with the routing policies
(``router.policies``, pure choices), then runs its legs: P/D or colocated, retry on the prefill node,
layer-wise pairs, cross-node prefix reuse, session retention, per-tenant cache salts. Planning imports
the upstream room to open legs and the record room to fill the request's trace; never the edge.
"""
