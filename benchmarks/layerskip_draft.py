"""A LayerSkip-style self-draft for `speculative_config.method: draft_model`: the target's first N
decoder layers, its final norm and its lm_head (tied: the embedding), written as an HF checkpoint
directory (config.json + model.safetensors, float32) into the model cache dir.

    python -m benchmarks.layerskip_draft ~/.cache/jaxserve/SmolLM2-135M-Instruct.Q4_1.gguf --layers 6
    -> ~/.cache/jaxserve/SmolLM2-135M-Instruct.Q4_1.first6/

No smaller model sharing SmolLM2's tokenizer ships here; an early exit of the target itself shares
it by construction (the same vocabulary and embedding). Its weights are the target's, dequantized
as the engine dequantizes them (`models.gguf.read_gguf`, `keep_gguf_quantized: false`), so the
draft is exactly the target cut after N layers (no early-exit training: LayerSkip's trained exits
accept more). benchmarks/spec_decode.py `--draft-layers 6,10` builds and measures them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def draft_dir(target: Path, layers: int) -> Path:
    """Where the N-layer self-draft of `target` is written: beside it in the cache dir."""
    target = Path(target)
    stem = target.stem if target.suffix == ".gguf" else target.name
    return target.parent / f"{stem}.first{layers}"


def write_layerskip_draft(target: str | Path, layers: int, out: Path | None = None) -> Path:
    """The first `layers` layers + final norm + lm_head of the llama GGUF / HF checkpoint `target`,
    written to `out` (default `draft_dir`); reused when already there."""
    from safetensors.numpy import save_file

    target = Path(target).expanduser()
    out = out or draft_dir(target, layers)
    if (out / "model.safetensors").is_file():
        return out
    config, tensors = _read(target)
    if not 0 < layers <= config["num_hidden_layers"]:
        raise ValueError(f"--layers {layers}: the target has {config['num_hidden_layers']} layers")
    kept = {}
    for name, array in tensors.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            continue
        kept[name] = np.ascontiguousarray(np.asarray(array, dtype=np.float32))
    staging = out.with_name(out.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(staging / "model.safetensors"), metadata={"format": "pt"})
    draft_config = {**config, "num_hidden_layers": layers, "torch_dtype": "float32"}
    (staging / "config.json").write_text(json.dumps(draft_config, indent=2))
    staging.rename(out)
    return out


def _read(target: Path) -> tuple[dict, dict]:
    if target.suffix == ".gguf":
        from models.gguf import read_gguf

        ckpt = read_gguf(target, keep_quantized=False)
        return ckpt.config, ckpt.tensors
    from safetensors.numpy import load_file

    tensors = {}
    for f in sorted(target.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return json.loads((target / "config.json").read_text()), tensors


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    print(write_layerskip_draft(args.target, args.layers, args.out))


if __name__ == "__main__":
    main()
