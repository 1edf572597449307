"""Where part files go: a local folder or any fsspec filesystem URI (``s3://bucket/prefix`` with the
endpoint and credentials of ``ExportSettings``; ``gs://``, ``abfs://`` ... where their fsspec package is
installed).

``write`` returns only once the part is durable and whole under its final name: locally a temporary
file in the same folder, fsynced, renamed over the name, then the folder fsynced; on object storage one
PUT of the whole object (an object store never shows half an object). A name written twice (a resumed
run rewriting a part whose watermark never committed) is replaced, never duplicated.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from contracts.errors import StoreError


class Sink:
    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None) -> None:
        self.uri = uri.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.uri, **(storage_options or {}))
        except (ImportError, ValueError) as exc:
            raise StoreError(f"cannot open {uri}: {exc}") from exc
        self.local = isinstance(self.fs, LocalFileSystem)

    def uri_of(self, filename: str) -> str:
        return f"{self.uri}/{filename}"

    def write(self, filename: str, data: bytes) -> str:
        """Write ``data`` as ``filename`` under the destination, durably; its URI."""
        path = f"{self.root}/{filename}"
        try:
            if self.local:
                self._write_local(path, data)
            else:
                self.fs.pipe_file(path, data)
        except OSError as exc:
            raise StoreError(f"writing {self.uri_of(filename)} failed: {exc}") from exc
        return self.uri_of(filename)

    @staticmethod
    def _write_local(path: str, data: bytes) -> None:
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def listing(self) -> list[str]:
        """File names under the destination (none if it does not exist yet)."""
        try:
            return sorted(os.path.basename(p) for p in self.fs.ls(self.root, detail=False))
        except FileNotFoundError:
            return []
