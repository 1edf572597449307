"""Edge codecs: Chat Completions, Responses and Anthropic Messages around one internal request.

Each API has one module with a decoder (request body -> ``internal.InternalRequest``) and a stateful stream
encoder (``internal`` events -> that API's events), the API's event sequence in its docstring. The engine is
always called with Chat Completions (``internal.to_chat_body``) and its chunks are read back into internal
events (``internal.ChatChunkReader``), so adding an API adds one module, not a pairwise adapter per API.
"""
