"""MXFP4 gpt-oss checkpoints (models/mxfp4.py) against HF transformers' own MXFP4 reading.

The checkpoint: the tiny random gpt-oss (models/random_gpt_oss.py) with intermediate size 64 (MXFP4
blocks of 32 need input dims that are multiples of 32), its experts converted by
`write_mxfp4_checkpoint`. The oracle: HF's `convert_moe_packed_tensors` (its MXFP4 dequantization)
and HF's `GptOssForCausalLM` loaded from the MXFP4 directory with `Mxfp4Config(dequantize=True)`
(on CPU HF dequantizes at load). Checked: our unpacking equals HF's dequantization bit for bit on
every byte value and the exponents that occur (host; in the step for exponents >= 2, see
`test_unpacking_in_the_step_equals_hf`), the writer's layout is what HF loads and its rounding is to
the nearest FP4 value, the experts stay int8 (engine accounting), fp32 logits within 1e-4 of HF,
bf16 logits as close to them as HF's own bf16 model, greedy and the engine's greedy under chunked
prefill equal to HF, the same split over a 2-device mesh, malformed tensors refused naming the
tensor.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from engine_testing import drain, small_engine_config
from hf_reference import assert_greedy_match, hf_greedy, hf_logits, random_prompt

from models import load_model
from models.mxfp4 import BLOCK, mxfp4_weight, write_mxfp4_checkpoint
from models.prequantized import CheckpointQuantization, dequantize_np, parse_quantization_config
from models.quantization import QuantizedWeight, dequantize, to_device
from models.safetensors_io import CheckpointError

E, H, I = 4, 64, 64  # experts, hidden, intermediate of the MXFP4 tiny gpt-oss
LAYERS = 4
EXPERT = "model.layers.{}.mlp.experts.{}"


def hf_dequantize(blocks: np.ndarray, scales: np.ndarray, dtype=torch.float32) -> np.ndarray:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
    return out.float().numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(float checkpoint, its MXFP4 conversion)."""
    from conftest import _limit_torch_threads

    from models.random_checkpoint import write_random_checkpoint

    _limit_torch_threads()
    root = tmp_path_factory.mktemp("mxfp4")
    float_dir = write_random_checkpoint("gpt_oss", root / "float", intermediate_size=I)
    return float_dir, write_mxfp4_checkpoint(float_dir, root / "mxfp4")


@pytest.fixture(scope="module")
def hf_mxfp4(checkpoints):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(
        checkpoints[1], dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()


@pytest.fixture(scope="module")
def ours(checkpoints):
    return load_model(checkpoints[1], dtype="float32")


def _random_mxfp4(seed: int, exponents: np.ndarray):
    """Blocks holding every byte value (so every code in both nibbles), scales drawn from `exponents`
    with the extremes placed first."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (3, 8, 4, 16), dtype=np.uint8)
    blocks.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    scales = rng.choice(exponents, (3, 8, 4)).astype(np.uint8)
    extremes = [exponents.min(), exponents.min() + 1, 126, 127, 128, exponents.max() - 1, exponents.max()]
    scales.reshape(-1)[: len(extremes)] = extremes
    return blocks, scales


def test_unpacking_equals_hf_dequantization_bit_exactly():
    """Host unpacking (what the loader builds, dequantized in float32) for every exponent but 255."""
    blocks, scales = _random_mxfp4(0, np.arange(0, 255))
    expected = hf_dequantize(blocks, scales)  # [3, K, N]
    w = mxfp4_weight(blocks, scales)
    assert w.q.dtype == np.int8 and w.q.shape == (3, 4 * BLOCK, 8) and w.scale.shape == (3, 4, 8)
    assert set(np.unique(w.q)) == {0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12}
    with np.errstate(over="ignore"):  # exponent 254 times 6 overflows float32, in HF's too
        got = dequantize_np(w)
    tiny = np.abs(expected[expected != 0]).min()
    assert np.isinf(expected).any() and tiny < 2.0**-126, "the extremes (overflow, subnormals) are exercised"
    assert np.array_equal(got, expected), f"{np.sum(got != expected)} values differ"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unpacking_in_the_step_equals_hf(dtype):
    """Dequantized in the jitted step (`models.quantization.dequantize`), in the model's dtype, against
    HF's dequantization to that dtype. XLA:CPU flushes float32 subnormals, so scales 2^-128 and
    2^-127 (exponents 0 and 1: weights below 7e-38) come out as zeros there; from exponent 2 on,
    bit-exact."""
    blocks, scales = _random_mxfp4(1, np.arange(2, 255))
    expected = hf_dequantize(blocks, scales, getattr(torch, dtype))
    got = np.asarray(dequantize(to_device(mxfp4_weight(blocks, scales)), jnp.dtype(dtype))).astype(np.float32)
    assert np.array_equal(got, expected), f"{np.sum(got != expected)} values differ"


def test_writer_layout_is_what_hf_loads(checkpoints, hf_mxfp4):
    """Names, shapes and dtypes of HF's layout; HF's loader dequantizes each stored expert tensor into
    its model (no weight left at its init); every weight is the FP4 value nearest the float one."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    float_dir, mx_dir = checkpoints
    stored = load_file(mx_dir / "model.safetensors")
    config = json.loads((mx_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    hf_float = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    for layer in range(LAYERS):
        for proj, (n, k) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
            name = EXPERT.format(layer, proj)
            assert name not in stored
            blocks, scales = stored[name + "_blocks"], stored[name + "_scales"]
            assert (blocks.dtype, blocks.shape) == (np.uint8, (E, n, k // BLOCK, 16))
            assert (scales.dtype, scales.shape) == (np.uint8, (E, n, k // BLOCK))
            experts = hf_mxfp4.model.layers[layer].mlp.experts
            loaded = getattr(experts, proj).detach().numpy()  # [E, K, N]
            assert np.array_equal(loaded, hf_dequantize(blocks, scales))
            original = getattr(hf_float.model.layers[layer].mlp.experts, proj).detach().double().numpy()
            step = np.ldexp(1.0, scales.astype(np.int32) - 127)  # [E, N, K/32]
            step = np.repeat(np.swapaxes(step, 1, 2), BLOCK, axis=1)  # [E, K, N]
            nearest = np.abs(original[..., None] - np.sign(original)[..., None] * grid * step[..., None]).min(-1)
            assert np.all(np.abs(loaded - original) <= nearest + 1e-12)
            assert np.abs(original).max() <= 6 * step.max() and np.abs(loaded - original).max() > 0


def test_experts_stay_int8(ours, checkpoints):
    """The experts are int8 codes + a float32 scale per 32 (1.125 bytes a weight); the engine's own
    accounting (`Model.weight_bytes`) against the float checkpoint's counts the difference."""
    g = ours.params["groups"][0]
    for key in ("experts_gate_up", "experts_down"):
        assert isinstance(g[key], QuantizedWeight) and g[key].q.dtype == jnp.int8 and g[key].group_size == BLOCK
    assert ours.quantization == {"checkpoint": "mxfp4-g32"}
    expert_weights = LAYERS * E * (H * 2 * I + I * H)
    float_bytes = load_model(checkpoints[0], dtype="float32").weight_bytes()
    assert float_bytes - ours.weight_bytes() == expert_weights * (4 - 1 - 4 / BLOCK)


@pytest.mark.parametrize("unrolled", [False, True])
def test_logits_match_hf(checkpoints, hf_mxfp4, unrolled):
    model = load_model(checkpoints[1], dtype="float32")
    if unrolled:
        model.unstack_layers()
    hf_float_logits = None
    for n in (1, 8, 23, 70, 150):
        ids = random_prompt(model.cfg.vocab_size, n, seed=n)
        expected = hf_logits(hf_mxfp4, ids)
        err = np.abs(model.logits(ids) - expected).max()
        assert err <= 1e-4, f"unrolled={unrolled} T={n}: max abs logit error {err:.2e}"
        if n == 70:  # the float original is far off: the comparison sees the quantization
            hf_float_logits = np.abs(load_model(checkpoints[0], dtype="float32").logits(ids) - expected).max()
    assert hf_float_logits > 1e-2


@pytest.mark.parametrize("layout", ["stacked", "packed"])
def test_bf16_logits_as_close_to_fp32_as_hf_bf16(checkpoints, hf_mxfp4, layout):
    """Served in bf16 (the experts dequantized to bf16 in the step; the CPU plan's packed layout for
    the float projections): as close to HF's fp32 logits as HF's own bf16 MXFP4 model (within 2x)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from pallas_kernels import cpu_native

    if layout == "packed" and not cpu_native.matmul_simd():
        pytest.skip("this CPU has no AVX512-BF16: the plan keeps XLA's dot")
    model = load_model(checkpoints[1], dtype="bfloat16")
    if layout == "packed":
        model.unstack_layers()
        model.hold_packed()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(
        checkpoints[1], dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    for n in (1, 65):
        ids = random_prompt(model.cfg.vocab_size, n, seed=300 + n)
        reference = hf_logits(hf_mxfp4, ids)
        ours_err = np.abs(np.asarray(model.logits(ids), np.float32) - reference).max()
        hf_err = np.abs(hf_logits(hf_bf16, ids) - reference).max()
        assert hf_err > 0 and ours_err <= 2 * hf_err, f"{layout} T={n}: ours {ours_err:.3e} vs HF bf16 {hf_err:.3e}"


def test_greedy_matches_hf_generate(ours, hf_mxfp4):
    ids = random_prompt(ours.cfg.vocab_size, 30, seed=130)
    expected, scores = hf_greedy(hf_mxfp4, ids, 24)
    assert_greedy_match(ours.greedy(ids, 24), expected, scores, "mxfp4 prompt 30")


def test_engine_chunked_prefill_greedy_matches_hf(checkpoints, hf_mxfp4):
    """16-token steps: prompts prefilled in chunks with decodes riding along; the pool drains empty."""
    from runtime.engine.llm_engine import LLMEngine
    from runtime.types import EngineRequest, SamplingParams

    engine = LLMEngine(small_engine_config(checkpoints[1], max_num_batched_tokens=16, load_tokenizer=False))
    held = jax.tree.leaves(engine.model.params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    assert sum(isinstance(w, QuantizedWeight) for w in held) == 2 * LAYERS  # kept int8 in the engine
    vocab = engine.model.cfg.vocab_size
    prompts = {f"r{i}": random_prompt(vocab, n, seed=700 + i) for i, n in enumerate((5, 41, 19, 66))}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, params))
    outputs = drain(engine)
    for rid, ids in prompts.items():
        expected, scores = hf_greedy(hf_mxfp4, ids, 10)
        assert_greedy_match(outputs[rid].outputs[0].token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")


TP_SCRIPT = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np
from models.model import load_model
from models.quantization import QuantizedWeight
from runtime.parallel.mesh import make_mesh

model = load_model(sys.argv[1], mesh=make_mesh(1, 2, devices=jax.devices()[:2]))
experts = model.params["groups"][0]["experts_gate_up"]
assert isinstance(experts, QuantizedWeight) and len(experts.q.sharding.device_set) == 2, experts
expected = np.load(sys.argv[2])
ids = np.random.default_rng(0).integers(3, model.cfg.vocab_size, size=40).tolist()
print("ERR", float(np.abs(model.logits(ids) - expected).max()))
"""


def test_tensor_parallel_logits_match_hf(checkpoints, hf_mxfp4, tmp_path):
    """The int8 experts split over a 2-device CPU mesh (codes and scales by column; a subprocess, so
    the device count does not leak): logits within 1e-4 of HF's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    ids = np.random.default_rng(0).integers(3, hf_mxfp4.config.vocab_size, size=40).tolist()
    np.save(tmp_path / "hf.npy", hf_logits(hf_mxfp4, ids))
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, str(checkpoints[1]), str(tmp_path / "hf.npy")],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ERR ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    assert float(line.split()[1]) <= 1e-4, line


def test_quantization_config_parses():
    assert parse_quantization_config({"quant_method": "mxfp4"}) == CheckpointQuantization("mxfp4", 32)


def _broken_copy(src, dst, change) -> None:
    """`src` copied to `dst` with `change(tensors)` applied to its numpy tensors."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


GU = EXPERT.format(2, "gate_up_proj")
DOWN = EXPERT.format(1, "down_proj")


def _pop(name):
    return lambda t: t.pop(name)


def _set(name, fn):
    return lambda t: t.__setitem__(name, fn(t[name]))


MALFORMED = {
    "missing scales": (_pop(GU + "_scales"), GU + "_scales", "missing"),
    "missing blocks": (_pop(DOWN + "_blocks"), DOWN + "_blocks", "missing"),
    "blocks too short": (_set(DOWN + "_blocks", lambda a: a[:, :, :1]), DOWN + "_blocks", r"shape \[4, 64, 1, 16\]"),
    "blocks of 32 bytes": (
        _set(GU + "_blocks", lambda a: np.concatenate([a, a], -1)),
        GU + "_blocks",
        r"the config implies \[4, 128, 2, 16\]",
    ),
    "scales transposed": (_set(GU + "_scales", lambda a: np.swapaxes(a, 1, 2).copy()), GU + "_scales", "shape"),
    "blocks not uint8": (_set(DOWN + "_blocks", lambda a: a.view(np.int8)), DOWN + "_blocks", "int8, expected uint8"),
    "exponent 255": (_set(DOWN + "_scales", lambda a: np.full_like(a, 255)), DOWN + "_scales", "255"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_mxfp4_tensors_are_refused_naming_the_tensor(checkpoints, tmp_path, case):
    change, tensor, message = MALFORMED[case]
    _broken_copy(checkpoints[1], tmp_path / "broken", change)
    with pytest.raises(CheckpointError, match=message) as info:
        load_model(tmp_path / "broken")
    assert tensor in str(info.value)


def test_float_experts_under_an_mxfp4_config_load_as_float(checkpoints, tmp_path):
    """A checkpoint whose experts MXFP4 left unconverted: HF's loader reads the float tensors; so do we."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    shutil.copytree(checkpoints[0], tmp_path / "mixed")
    config = json.loads((tmp_path / "mixed" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "mixed" / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path / "mixed", dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    model = load_model(tmp_path / "mixed", dtype="float32")
    assert not isinstance(model.params["groups"][0]["experts_down"], QuantizedWeight)
    ids = random_prompt(model.cfg.vocab_size, 23, seed=23)
    assert np.abs(model.logits(ids) - hf_logits(hf, ids)).max() <= 1e-4


def test_mxfp4_on_another_architecture_is_refused(tmp_path, tiny_checkpoint):
    shutil.copytree(tiny_checkpoint("llama"), tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="only gpt-oss's experts"):
        load_model(tmp_path / "llama")
