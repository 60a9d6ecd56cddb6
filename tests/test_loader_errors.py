"""load_model on broken checkpoints: every error names the file and the tensor."""

import json
import shutil
import struct

import numpy as np
import pytest

from models import CheckpointError, ConfigError, load_model


@pytest.fixture
def llama_copy(tiny_checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), dst)
    return dst


def test_missing_config(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json.*missing"):
        load_model(llama_copy)


def test_missing_weights_file(llama_copy):
    for f in llama_copy.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_model(llama_copy)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_model(tmp_path / "nope")


def test_corrupt_header(llama_copy):
    f = next(llama_copy.glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[8:16] = b"{garbage"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{f.name}.*corrupt safetensors header"):
        load_model(llama_copy)


def test_truncated_file(llama_copy):
    f = next(llama_copy.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=rf"{f.name}.*tensor '.*'.*truncated or corrupt"):
        load_model(llama_copy)


def _rewrite(f, mutate):
    """Rewrite a safetensors file after `mutate(header, tensors)` (tensors as numpy float32)."""
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    tensors = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        assert info["dtype"] == "F32"
        tensors[name] = np.frombuffer(raw[8 + n + b : 8 + n + e], np.float32).reshape(info["shape"])
    mutate(tensors)
    new_header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        blob = np.ascontiguousarray(arr, np.float32).tobytes()
        new_header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    if meta is not None:
        new_header["__metadata__"] = meta
    h = json.dumps(new_header).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_shape_mismatch_names_tensor(llama_copy):
    f = next(llama_copy.glob("*.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(f, lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(CheckpointError, match=rf"{f.name}.*{name}.*shape"):
        load_model(llama_copy)


def test_missing_tensor_named(llama_copy):
    f = next(llama_copy.glob("*.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite(f, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"{name}.*missing"):
        load_model(llama_copy)


def test_unsupported_architecture(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="MambaForCausalLM.*supported: LlamaForCausalLM"):
        load_model(llama_copy)
