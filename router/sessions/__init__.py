"""Sessions: conversation history in a per-region Redis cache over PostgreSQL / SQLite.

FastAPI glue (``GET/DELETE /v1/sessions/{id}``, session headers) lives in ``router.sessions.http``.
"""

from router.sessions.models import (
    SESSION_HEADER,
    FunctionCall,
    Message,
    ToolCall,
    Turn,
    Usage,
    conversation,
    new_messages,
    new_session_id,
)
from router.sessions.sql import Database, open_database
from router.sessions.store import RegionCache, SessionStore, WriterStats

__all__ = [
    "SESSION_HEADER",
    "Database",
    "FunctionCall",
    "Message",
    "RegionCache",
    "SessionStore",
    "ToolCall",
    "Turn",
    "Usage",
    "WriterStats",
    "conversation",
    "new_messages",
    "new_session_id",
    "open_database",
]
