"""`jaxserve convert`: an HF checkpoint directory loaded, cast and written as an orbax checkpoint.

    convert_checkpoint(hf_dir, out_dir, dtype="bfloat16", mesh=None)   # -> out_dir; load_model reads it

The format (what OUT_DIR holds, how it is restored into a sharding) is models/orbax_io.py's.
"""

from __future__ import annotations

from pathlib import Path

from jax.sharding import Mesh

from models.model import load_model
from models.orbax_io import write_checkpoint
from models.safetensors_io import CheckpointError


def convert_checkpoint(
    src: str | Path, out_dir: str | Path, dtype: str = "bfloat16", mesh: Mesh | None = None, progress: bool = False
) -> Path:
    """Load an HF checkpoint directory, cast to `dtype`, write it with orbax. With `mesh`, the
    arrays are written from their sharded placement (each process writes its shards)."""
    src, out_dir = Path(src), Path(out_dir)
    if not src.is_dir():
        raise CheckpointError(f"{src}: expected an HF checkpoint directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir}: exists and is not empty")
    model = load_model(src, dtype=dtype, progress=progress)
    return write_checkpoint(model.params, model.cfg, src, out_dir, dtype, mesh)
