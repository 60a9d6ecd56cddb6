"""Reading HF checkpoint directories: config.json, generation_config.json and *.safetensors.

The safetensors format is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes. We parse it ourselves (memory
mapped, zero-copy) so that every failure names the file and the tensor: a missing file, a
corrupt header, a truncated payload, a dtype we cannot read, a shape that does not match.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """The checkpoint on disk is incomplete, corrupt or does not fit the model."""


_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: corrupt safetensors header (file is only {size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n <= 0 or 8 + n > size or n > 100 * 2**20:
            raise CheckpointError(f"{path}: corrupt safetensors header (header length {n} for a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name!r}") from None
        if dtype not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        expect = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
        if end - begin != expect or begin < 0 or data_start + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype}{list(shape)}) has a bad byte range [{begin}, {end}) "
                f"in a file with {size - data_start} data bytes (truncated or corrupt)"
            )
    return header, data_start


class SafetensorsDir:
    """All tensors of a checkpoint directory, by name, read lazily."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        index_file = self.path / "model.safetensors.index.json"
        if index_file.exists():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_file}: unreadable index ({e})") from None
            wanted = sorted({self.path / f for f in weight_map.values()})
            missing = [str(f) for f in wanted if not f.exists()]
            if missing:
                raise CheckpointError(f"{index_file} lists missing file(s): {', '.join(missing)}")
            files = wanted
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files found")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for f in files:
            header, start = _read_header(f)
            for name, info in header.items():
                self._where[name] = (f, info, start)
        self._maps: dict[Path, np.memmap] = {}

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor `name` as a read-only numpy array; `shape` is checked when given."""
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        f, info, start = self._where[name]
        if f not in self._maps:
            self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        arr = self._maps[f][start + begin : start + end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"{f}: tensor {name!r} has shape {list(arr.shape)}, the config implies {list(shape)}")
        return arr


def read_json(path: Path, required: bool = True) -> dict | None:
    if not path.exists():
        if required:
            raise CheckpointError(f"{path}: file is missing (an HF checkpoint directory needs it)")
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
