"""Pre-quantized checkpoints (models/prequantized.py): AWQ, GPTQ (desc_act false / true) and
compressed-tensors FP8, written by models/quantized_checkpoint.py with each format's packing.

The oracle is HF transformers' float model with every quantized Linear replaced by a
dequantization written here from the formats' definitions (nibble loops in torch, GPTQ groups
looked up through g_idx row by row); our loader keeps the weights quantized and must give the
same logits to 1e-4.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from models import load_model
from models.quantization import QuantizedWeight
from models.quantized_checkpoint import write_quantized_checkpoint
from models.safetensors_io import CheckpointError

AWQ_COLUMN_OF_NIBBLE = [0, 2, 4, 6, 1, 3, 5, 7]


def _nibble(words: torch.Tensor, i: int) -> torch.Tensor:
    return torch.bitwise_and(torch.bitwise_right_shift(words, 4 * i), 15)


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:  # [R, C/8] -> [R, C]
    out = torch.zeros(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    for i in range(8):
        out[:, AWQ_COLUMN_OF_NIBBLE[i] :: 8] = _nibble(words.long(), i)
    return out


def _gptq_unpack_rows(words: torch.Tensor) -> torch.Tensor:  # [K/8, N] -> [K, N]
    out = torch.zeros(words.shape[0] * 8, words.shape[1], dtype=torch.int64)
    for j in range(8):
        out[j::8] = _nibble(words.long(), j)
    return out


def _gptq_unpack_cols(words: torch.Tensor) -> torch.Tensor:  # [G, N/8] -> [G, N]
    out = torch.zeros(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    for j in range(8):
        out[:, j::8] = _nibble(words.long(), j)
    return out


def hand_dequantized_state(qdir) -> dict[str, torch.Tensor]:
    """{HF parameter name: float32 tensor} of a pre-quantized checkpoint, dequantized by hand."""
    from safetensors.torch import load_file

    tensors = load_file(str(qdir / "model.safetensors"))
    qc = json.loads((qdir / "config.json").read_text())["quantization_config"]
    state = {}
    for name, value in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "qweight":
            scales = tensors[module + ".scales"].float()
            if qc["quant_method"] == "awq":
                q, z = _awq_unpack(value), _awq_unpack(tensors[module + ".qzeros"])
                g = qc["group_size"]
                w = (q - z.repeat_interleave(g, 0)).float() * scales.repeat_interleave(g, 0)
            else:
                q = _gptq_unpack_rows(value)
                z = _gptq_unpack_cols(tensors[module + ".qzeros"]) + 1
                g_idx = tensors[module + ".g_idx"].long()
                w = (q - z[g_idx]).float() * scales[g_idx]  # row k uses group g_idx[k]
            state[module + ".weight"] = w.T.contiguous()
        elif suffix == "weight" and value.dtype == torch.float8_e4m3fn:
            state[name] = value.float() * tensors[module + ".weight_scale"].float()
        elif suffix not in ("qzeros", "scales", "g_idx", "weight_scale"):
            state[name] = value.float()
    return state


@pytest.fixture(scope="module")
def quantized_dir(tiny_checkpoint, tmp_path_factory):
    built = {}

    def get(family: str, method: str):
        if (family, method) not in built:
            out = tmp_path_factory.mktemp(f"{family}-{method}")
            built[family, method] = write_quantized_checkpoint(tiny_checkpoint(family), out, method, group_size=32)
        return built[family, method]

    return get


@pytest.fixture(scope="module")
def fresh_hf_model(tiny_checkpoint):
    models = {}

    def get(family: str):
        if family not in models:
            from transformers import AutoModelForCausalLM

            models[family] = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32).eval()
        return models[family]

    return get


def _quantized_leaves(params) -> list[QuantizedWeight]:
    import jax

    return [
        leaf
        for leaf in jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, QuantizedWeight))
        if isinstance(leaf, QuantizedWeight)
    ]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("method", ["awq", "gptq", "gptq-desc-act", "fp8"])
def test_prequantized_logits_equal_hand_dequantized_hf(family, method, quantized_dir, fresh_hf_model):
    qdir = quantized_dir(family, method)
    ours = load_model(qdir)
    leaves = _quantized_leaves(ours.params)
    assert leaves and all(w.bits == (8 if method == "fp8" else 4) for w in leaves)
    assert any(w.perm is not None for w in leaves) == (method == "gptq-desc-act")
    hf = fresh_hf_model(family)
    missing, unexpected = hf.load_state_dict(hand_dequantized_state(qdir), strict=False)
    unexpected = [k for k in unexpected if not k.startswith("mtp.")]  # the MTP layer: HF's model has none
    assert not unexpected and all("rotary" in m or "lm_head" in m for m in missing), (missing, unexpected)
    ids = np.random.default_rng(1).integers(3, ours.cfg.vocab_size, size=41).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float().numpy()
    err = np.abs(ours.logits(ids) - expected).max()
    assert err <= 1e-4, f"{family} {method}: max abs logit error {err:.2e}"


def test_fp8_dynamic_activations_load_as_w8a8(quantized_dir):
    ours = load_model(quantized_dir("qwen3_5", "fp8-dynamic"))
    assert {w.act for w in _quantized_leaves(ours.params)} == {"fp8"}
    assert np.isfinite(ours.logits([5, 6, 7])).all()


@pytest.mark.parametrize(
    "method,change,field",
    [
        ("awq", {"quant_method": "bnb"}, "quantization_config.quant_method"),
        ("awq", {"bits": 3}, "quantization_config.bits"),
        ("awq", {"version": "gemv"}, "quantization_config.version"),
        ("gptq", {"group_size": "32"}, "quantization_config.group_size"),
        ("gptq", {"desc_act": "yes"}, "quantization_config.desc_act"),
        ("gptq", {"checkpoint_format": "gptq_v2"}, "quantization_config.checkpoint_format"),
        ("gptq", {"group_size": 48}, "q_proj.scales. has shape"),  # tensors that do not fit the config
        ("fp8", {"format": "pack-quantized"}, "quantization_config.format"),
        (
            "fp8",
            {"config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
            "config_groups.group_0.weights.strategy",
        ),
    ],
)
def test_malformed_quantization_config_names_the_field(method, change, field, quantized_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(quantized_dir("llama", method), bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"].update(change)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=field):
        load_model(bad)


def test_missing_packed_tensor_names_it(quantized_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(quantized_dir("llama", "awq"), bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.qzeros"):
        load_model(bad)
