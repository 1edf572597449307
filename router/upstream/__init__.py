"""The router's upstream: HTTP to the engines' OpenAI servers and the streams read from them.

The only room that speaks httpx and sockets to the nodes, and the only place their errors become our
error tree (``contracts.errors``). It knows nothing of plans, clients or records.
"""
