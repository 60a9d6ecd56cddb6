"""GGUF Q4_0 / Q4_1 / Q8_0 kept quantized (models/gguf_quant.py) instead of dequantized.

The repacked blocks must dequantize to exactly what gguf-py (llama.cpp's own Python package)
dequantizes; a model loaded with the blocks kept must give the logits and greedy tokens of the
same file loaded dequantized, at a fraction of the parameter bytes.
"""

import gguf
import numpy as np
import pytest
from test_gguf import tiny_state_dict, write_tiny_gguf

from models import load_model
from models.gguf_quant import repack
from models.prequantized import dequantize_np
from models.quantization import QuantizedWeight

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_repacked_blocks_dequantize_like_gguf_py(qtype):
    rows, cols = 40, 96  # 3 blocks per row
    weight = np.random.default_rng(int(qtype)).standard_normal((rows, cols)).astype(np.float32)
    weight[3] += 2.0  # a row with an offset: Q4_1's minimum matters
    raw = gguf.quants.quantize(weight, qtype)
    expected = gguf.quants.dequantize(raw, qtype)  # [rows, cols]
    packed = repack(raw, qtype, rows, cols)
    assert packed.shape == (cols, rows) and packed.group_size == 32
    assert packed.bits == (8 if qtype == Q.Q8_0 else 4) and (packed.offset is not None) == (qtype == Q.Q4_1)
    np.testing.assert_array_equal(dequantize_np(packed).T, expected)


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_kept_quantized_equals_dequantized_path(tmp_path, tied):
    path = tmp_path / "tiny_q8.gguf"
    write_tiny_gguf(path, tiny_state_dict(tied=tied, seed=3), quantized=True)
    kept = load_model(path)
    dequantized = load_model(path, keep_gguf_quantized=False)
    assert isinstance(kept.params["embed"], QuantizedWeight)
    assert isinstance(kept.params["groups"][0]["q_proj"], QuantizedWeight)
    assert kept.quantization == {"checkpoint": "gguf int8-g32"} and not dequantized.quantization
    ids = [5, 17, 3, 88, 41, 41, 9, 60, 2, 77, 13]
    np.testing.assert_allclose(kept.logits(ids), dequantized.logits(ids), rtol=0, atol=1e-4)
    assert kept.greedy(ids, 12) == dequantized.greedy(ids, 12)
    assert kept.weight_bytes() < 0.4 * dequantized.weight_bytes()


@pytest.mark.slow
def test_default_model_q4_1_kept_quantized(tmp_path):
    from models.default_model import ensure_default_model

    path = ensure_default_model()
    kept, dequantized = load_model(path), load_model(path, keep_gguf_quantized=False)
    ids = list(range(100, 140))
    np.testing.assert_allclose(kept.logits(ids), dequantized.logits(ids), rtol=0, atol=1e-4)
    assert kept.greedy(ids, 16) == dequantized.greedy(ids, 16)
    assert kept.weight_bytes() < 0.25 * dequantized.weight_bytes()
