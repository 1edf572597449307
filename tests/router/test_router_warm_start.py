"""A router replica is warm before it serves: the real app's start-up loads and exercises the tokenizer
of every model it is told of (``RouterSettings.warm_models``) and of the nodes registered when it
starts, so a cluster's READY never hides a replica whose first requests pay seconds of imports."""

from __future__ import annotations

import asyncio

from fastapi.testclient import TestClient

from node_agent.model import default_model_dir
from router.edge.app import create_app
from router.settings import RouterSettings
from router.tokenizer import PromptTokenizer


def test_the_router_serves_only_after_its_tokenizer_is_loaded(redis_unit_url: str) -> None:
    model = str(default_model_dir())
    app = create_app(RouterSettings(redis_url=redis_unit_url, registry_refresh_s=60, warm_models=[model, "/no/such"]))
    with TestClient(app):  # returns once the lifespan has started: when uvicorn would listen
        assert app.state.orchestrator.tokenizer.loaded == {model}  # a folder not on this host is skipped


def test_warming_renders_a_chat_so_the_first_request_finds_the_template_compiled() -> None:
    from transformers.utils import chat_template_utils

    chat_template_utils._compile_jinja_template.cache_clear()
    asyncio.run(PromptTokenizer().warm([str(default_model_dir())]))
    assert chat_template_utils._compile_jinja_template.cache_info().currsize == 1
