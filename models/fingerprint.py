"""A checkpoint's identity: a short hash that differs between two checkpoints of equal shapes.

P/D instances put it in every transfer descriptor (runtime/kv_transfer): during a rolling deploy
a decode instance serving a fine-tune or another revision must refuse the prefill side's state,
although every shape agrees. Computed once at load from the files, cheaply: each file's
relative name and size, and its first and last `SAMPLE_BYTES` (for safetensors that is the
header — every tensor's name, dtype, shape and offsets — plus the first and last tensors'
bytes; for GGUF the metadata plus tensor data; for orbax the metadata files whole). Any
retraining changes those tensor bytes; renaming or moving the directory does not change the
fingerprint.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLE_BYTES = 1 << 20
MAX_FILES = 4096
# Files that say nothing about the weights (a README edit must not split a deployment).
IGNORED_SUFFIXES = (".md", ".txt", ".lock", ".gitattributes")


def checkpoint_fingerprint(path: str | Path) -> str:
    """sha256 hex digest over the checkpoint at `path` (a directory or one file); "" if absent."""
    path = Path(path)
    if path.is_file():
        files, root = [path], path.parent
    elif path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not p.name.startswith(".") and not p.name.endswith(IGNORED_SUFFIXES)
        )[:MAX_FILES]
        root = path
    else:
        return ""
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        name = "" if file == path else file.relative_to(root).as_posix()  # a lone file: its name is no identity
        digest.update(f"{name}\0{size}\0".encode())
        with file.open("rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            if size > 2 * SAMPLE_BYTES:
                f.seek(size - SAMPLE_BYTES)
                digest.update(f.read(SAMPLE_BYTES))
            elif size > SAMPLE_BYTES:
                digest.update(f.read())
    return digest.hexdigest()
