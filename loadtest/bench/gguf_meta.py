"""Read a GGUF file's metadata (key/value) section without touching its tensors.

``gguf.GGUFReader`` parses every field into numpy views, which takes seconds for a 49k-token
vocabulary; a benchmark that only needs the tokenizer reads the header directly instead.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}


class GGUFMetadataError(ValueError):
    """The file is not a GGUF file this reader understands."""


class _Cursor:
    def __init__(self, data: bytes | mmap.mmap) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        raw = self.data[self.pos:self.pos + size]
        self.pos += size
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("<I"), self.unpack("<Q")
            return [self.value(item_kind) for _ in range(count)]
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFMetadataError(f"unknown GGUF value type {kind} at byte {self.pos}")
        return self.unpack(fmt)


def read_metadata(path: str | Path, prefixes: tuple[str, ...] = ()) -> dict[str, Any]:
    """The metadata keys (all, or those starting with one of ``prefixes``) and their values."""
    path = Path(path)
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != _MAGIC:
            raise GGUFMetadataError(f"{path}: not a GGUF file (bad magic)")
        cursor = _Cursor(data)
        cursor.pos = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise GGUFMetadataError(f"{path}: unsupported GGUF version {version}")
        cursor.unpack("<Q")  # tensor count
        kv_count = cursor.unpack("<Q")
        out: dict[str, Any] = {}
        try:
            for _ in range(kv_count):
                key = cursor.string()
                value = cursor.value(cursor.unpack("<I"))
                if not prefixes or key.startswith(prefixes):
                    out[key] = value
        except struct.error as exc:
            raise GGUFMetadataError(f"{path}: truncated GGUF metadata ({exc})") from exc
        return out
