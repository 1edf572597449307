"""The router's record of each request: what it did, once it ends, to metrics, the lake and the session.

The request trace, the metrics, the accounting that settles a finished request, the lake's request and
KV-activity rows, the chat turn recorded in the session store, the index of produced responses. Every
other room imports it; it imports none of them.
"""
