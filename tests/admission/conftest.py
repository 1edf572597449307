from tests.admission.support import (  # noqa: F401
    clock,
    ctx,
    db_url,
    make_settings,
    open_ctx,
    pg_url,
    prefix,
    redis_a,
    redis_b,
)
