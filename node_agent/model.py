"""Where a node finds its model: a folder path, or the default model prepared by ``tandem model prepare``
(``infra.model``) under ``$TANDEM_HOME/models/<name>``."""

from __future__ import annotations

from pathlib import Path

from contracts.config import shared_settings
from contracts.errors import ConfigError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
PREPARED_MARKER = ".tandem-prepared.json"
"""Written last into a prepared folder (``infra.model``): a folder without it is incomplete."""


def tandem_home() -> Path:
    return shared_settings().home


def default_model_dir() -> Path:
    return tandem_home() / "models" / DEFAULT_MODEL


def resolve_model(model: str | None) -> Path:
    """A model argument is a folder path, or the default model's name; returns an existing folder."""
    if model is None or model == DEFAULT_MODEL:
        path = default_model_dir()
        if not (path / PREPARED_MARKER).exists():
            raise ConfigError(f"default model not prepared at {path}; run `tandem model prepare`")
        return path
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise ConfigError(f"model folder {path} has no config.json (give a Hugging Face model folder)")
    return path
