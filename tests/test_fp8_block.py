"""HF fine-grained (block) FP8 checkpoints (`quant_method: fp8`, `weight_block_size`), as DeepSeek-V3/R1,
Kimi K2 and Qwen3-Next-FP8 ship them: models/prequantized.py keeps the FP8 codes and block scales.

The writer here quantizes a tiny float checkpoint per block in torch (one scale per block, drawn
with a random extra factor so a block mis-indexed anywhere moves the logits), stores `weight`
float8_e4m3fn + `weight_scale_inv` float32 as HF does, and leaves modules out as the real
releases do (embedding, lm_head, norms, the MoE router; one layer's kv_a_proj_with_mqa, listed in
`modules_to_not_convert`). The oracle is HF transformers' float model over the same weights
dequantized block by block in numpy here (independent of our loader). The tiny dims (72, 24, 28,
100, ...) do not divide the blocks, so every matrix has partial last blocks; block [8, 32] also
joins the experts' gate | up scales block-wise (24 rows fill three blocks of 8).
"""

from __future__ import annotations

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from hf_reference import assert_greedy_match, hf_greedy, hf_logits, random_prompt

from models import load_model
from models.prequantized import parse_quantization_config
from models.quantization import QuantizedWeight
from models.safetensors_io import CheckpointError

FLOAT_FAMILY = "deepseek_v3"
BLOCKS = ([16, 16], [8, 32])
NOT_CONVERTED = ("model.layers.0.self_attn.kv_a_proj_with_mqa",)
KEEP = ("norm", "mlp.gate.", "shared_expert_gate", "conv1d", "A_log", "dt_bias")


def _quantized(name: str, t: torch.Tensor) -> bool:
    module = name.removesuffix(".weight")
    return (
        ".layers." in name
        and name.endswith(".weight")
        and t.ndim == 2
        and not any(k in name for k in KEEP)
        and module not in NOT_CONVERTED
    )


def quantize_blocks(w: torch.Tensor, bo: int, bi: int, gen: torch.Generator):
    """[out, in] float -> (float8_e4m3fn [out, in], scale_inv float32 [ceil(out/bo), ceil(in/bi)])."""
    out, inp = w.shape
    bo, bi = bo or out, bi or inp  # None: one scale for the matrix
    ro, ri = -(-out // bo), -(-inp // bi)
    padded = torch.zeros(ro * bo, ri * bi)
    padded[:out, :inp] = w
    amax = padded.reshape(ro, bo, ri, bi).abs().amax(dim=(1, 3)).clamp(min=1e-8)
    scale = amax / 448.0 * 2.0 ** (2 * torch.rand(ro, ri, generator=gen))  # codes within +-448
    full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out, :inp]
    return (w / full).to(torch.float8_e4m3fn), scale.float()


def dequantize_blocks(q: np.ndarray, scale: np.ndarray, bo: int, bi: int) -> np.ndarray:
    """The definition, block by block: w[block (r, c)] = fp8 codes * scale_inv[r, c]."""
    w = q.astype(np.float32)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            w[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi] *= scale[r, c]
    return w


def write_fp8_block(float_dir, out_dir, block, seed=0):
    """-> (block-FP8 checkpoint dir, float dir of its block-dequantized weights for HF)."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for f in sorted(float_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(seed)
    quant, deq = {}, {}
    for name, t in sorted(tensors.items()):
        if not _quantized(name, t):
            quant[name] = deq[name] = t.contiguous()
            continue
        bo, bi = block or t.shape
        q, s = quantize_blocks(t.float(), bo, bi, gen)
        quant[name], quant[name.removesuffix("weight") + "weight_scale_inv"] = q, s if block else s.reshape(())
        codes = q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        deq[name] = torch.from_numpy(dequantize_blocks(codes, s.numpy(), bo, bi))
    config = json.loads((float_dir / "config.json").read_text())
    dirs = []
    for sub, state, qc in (
        ("fp8", quant, dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=block)),
        ("deq", deq, None),
    ):
        d = out_dir / sub
        d.mkdir(parents=True)
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(config)
        if qc is not None:
            cfg["quantization_config"] = {**qc, "modules_to_not_convert": ["lm_head", *NOT_CONVERTED]}
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        if (float_dir / "generation_config.json").exists():
            shutil.copy(float_dir / "generation_config.json", d / "generation_config.json")
        dirs.append(d)
    return tuple(dirs)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    """(family, block) -> (fp8 dir, dequantized float dir, HF model on the latter)."""
    from transformers import AutoModelForCausalLM

    built = {}

    def get(family: str, block):
        key = (family, block and tuple(block))
        if key not in built:
            out = tmp_path_factory.mktemp(f"{family}-fp8-{block[0]}x{block[1]}" if block else f"{family}-fp8-tensor")
            fp8, deq = write_fp8_block(tiny_checkpoint(family), out, block)
            hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32, attn_implementation="eager").eval()
            built[key] = fp8, deq, hf
        return built[key]

    return get


def _quantized_leaves(params) -> list[QuantizedWeight]:
    return [w for w in jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, QuantizedWeight)) if hasattr(w, "q")]


@pytest.fixture(scope="module")
def ours(checkpoints):
    loaded = {}

    def get(family: str, block):
        key = (family, block and tuple(block))
        if key not in loaded:
            loaded[key] = load_model(checkpoints(family, block)[0], dtype="float32")
        return loaded[key]

    return get


@pytest.mark.parametrize(
    "family,block",
    [(FLOAT_FAMILY, b) for b in BLOCKS]
    + [("deepseek_v3_qnone", [16, 16]), pytest.param("qwen3_next", [16, 16], marks=pytest.mark.slow)]
    + [pytest.param(FLOAT_FAMILY, None, marks=pytest.mark.slow)],  # weight_block_size null: per tensor
    ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, list) else str(v),
)
def test_logits_match_hf_on_block_dequantized_weights(checkpoints, ours, family, block):
    """Also the q_proj / four-layer-scan variant, whose layer-0 kv_a_proj in float among three FP8
    ones is stacked as float (dequantized)."""
    model, hf = ours(family, block), checkpoints(family, block)[2]
    assert model.quantization == {"checkpoint": f"fp8-block-{block[0]}x{block[1]}" if block else "fp8-block"}
    for seed, n in ((1, 41), (2, 7)):
        ids = random_prompt(model.cfg.vocab_size, n, seed=seed)
        err = np.abs(model.logits(ids) - hf_logits(hf, ids)).max()
        assert err <= 1e-4, f"block {block}, {n} tokens: max abs logit error {err:.2e}"


@pytest.mark.slow  # a bf16 compile and HF bf16 model on top of the module's (~15-30 s here)
def test_bf16_logits_as_close_to_fp32_as_hf_bf16(checkpoints):
    """bf16 activations over the FP8 codes (dequantized per block to bf16 in the step): per position
    our logits are as close to HF's float32 model as HF's own bf16 model on the dequantized weights
    is, within 2x at the median (as tests/test_deepseek.py: near-tied expert picks flip in bf16)."""
    from transformers import AutoModelForCausalLM

    fp8, deq, hf = checkpoints(FLOAT_FAMILY, [16, 16])
    model = load_model(fp8, dtype="bfloat16")
    hf_bf16 = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.bfloat16, attn_implementation="eager").eval()
    ids = random_prompt(model.cfg.vocab_size, 65, seed=3)
    reference = hf_logits(hf, ids)
    ours = np.median(np.abs(np.asarray(model.logits(ids), np.float32) - reference).max(-1))
    theirs = np.median(np.abs(hf_logits(hf_bf16, ids) - reference).max(-1))
    assert theirs > 0 and ours <= 2 * theirs, f"ours {ours:.3e} vs HF bf16 {theirs:.3e}"


def test_weights_stay_fp8_with_block_scales(ours):
    """Every quantized projection (MLA q_a/q_b/kv_a/kv_b/o, dense and shared MLPs, the routed experts
    stacked per expert) is held as FP8 codes with [ceil(in/bi), ceil(out/bo)] scales; the layer-0
    kv_a_proj the checkpoint left in float stays float."""
    model = ours(FLOAT_FAMILY, [8, 32])
    g0, g1, _ = model.params["groups"]  # the dense first layer, then the MoE layers (no period: one each)
    names = ("q_a_proj", "q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "down_proj", "shared_down_proj")
    for name in names:
        w = (g0 if name in g0 else g1)[name]
        assert isinstance(w, QuantizedWeight) and w.q.dtype == jax.numpy.float8_e4m3fn, name
        _, k, n = w.q.shape
        assert (w.group_size, w.block_n) == (32, 8) and w.scale.shape[1:] == (-(-k // 32), -(-n // 8)), name
    assert not isinstance(g0["kv_a_proj"], QuantizedWeight) and isinstance(g1["kv_a_proj"], QuantizedWeight)
    E, H, I = model.cfg.num_experts, model.cfg.hidden_size, model.cfg.moe_intermediate_size
    gate_up, down = g1["experts_gate_up"], g1["experts_down"]
    assert gate_up.q.shape == (1, E, H, 2 * I) and gate_up.scale.shape == (1, E, 3, 2 * I // 8)
    assert down.q.shape == (1, E, I, H) and down.scale.shape == (1, E, 1, 9)
    assert not any(isinstance(model.params[k], QuantizedWeight) for k in ("embed", "lm_head"))
    partial = ours(FLOAT_FAMILY, [16, 16]).params
    gate_up = partial["groups"][1]["experts_gate_up"]  # 24 rows = 1.5 blocks of 16: joined per column
    assert gate_up.q.dtype == jax.numpy.float8_e4m3fn and (gate_up.block_n, gate_up.scale.shape) == (
        1,
        (1, E, 5, 2 * I),
    )


def test_engine_greedy_matches_hf(checkpoints):
    """The engine (chunked prefill, paged latent cache) over the [16, 16] checkpoint: HF's greedy output."""
    from engine_testing import drain, small_engine_config

    from runtime.engine.llm_engine import LLMEngine
    from runtime.types import EngineRequest, SamplingParams

    fp8, _, hf = checkpoints(FLOAT_FAMILY, [16, 16])
    engine = LLMEngine(
        small_engine_config(fp8, page_size=8, num_pages=40, max_num_batched_tokens=16, load_tokenizer=False)
    )
    prompts = {f"r{i}": random_prompt(hf.config.vocab_size, n, seed=40 + i) for i, n in enumerate((5, 29, 18))}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, params))
    outputs = drain(engine)
    for rid, ids in prompts.items():
        expected, scores = hf_greedy(hf, ids, 12)
        assert_greedy_match(outputs[rid].outputs[0].token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")


def _edited_copy(src, dst, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


MODULE = "model.layers.1.self_attn.q_b_proj"


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda s: s.__setitem__(f"{MODULE}.weight_scale_inv", s[f"{MODULE}.weight_scale_inv"][:-1]),
            rf"{MODULE}.weight_scale_inv has shape \[6, 2\], expected \[7, 2\] \(weight \[100, 24\] in blocks of \[16, 16\]\)",
        ),
        (
            lambda s: s.__setitem__(f"{MODULE}.weight_scale_inv", s[f"{MODULE}.weight_scale_inv"].T.contiguous()),
            rf"{MODULE}.weight_scale_inv has shape \[2, 7\], expected \[7, 2\]",
        ),
        (
            lambda s: s.pop(f"{MODULE}.weight_scale_inv"),
            rf"{MODULE}.weight is float8_e4m3fn but its scale .* is missing",
        ),
        (
            lambda s: s.__setitem__(f"{MODULE}.weight", s[f"{MODULE}.weight"].float()),
            rf"{MODULE}.weight is float32, expected float8_e4m3fn",
        ),
    ],
    ids=["scale-rows", "scale-transposed", "scale-missing", "weight-not-fp8"],
)
def test_malformed_checkpoint_is_refused(checkpoints, tmp_path, edit, match):
    bad = _edited_copy(checkpoints(FLOAT_FAMILY, [16, 16])[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=match):
        load_model(bad, dtype="float32")


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(activation_scheme="static"), r"activation_scheme: only 'dynamic'"),
        (dict(fmt="e5m2"), r"fmt: only 'e4m3'"),
        (dict(weight_block_size=[128]), r"weight_block_size: expected two positive integers"),
        (dict(weight_block_size=[128, 0]), r"weight_block_size: expected two positive integers"),
        (dict(expert_dtype="fp4"), r"expert_dtype: only 'fp8'"),
    ],
)
def test_unsupported_quantization_config_is_refused(change, match):
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    with pytest.raises(CheckpointError, match=match):
        parse_quantization_config({**qc, **change})


def test_published_config_parses():
    """DeepSeek-V3's quantization_config as published (no modules_to_not_convert: the tensors say)."""
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    parsed = parse_quantization_config(qc)
    assert (parsed.method, parsed.block) == ("fp8-block", (128, 128))


TP_SCRIPT = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 5)
import numpy as np
from models.model import load_model
from models.sharding import shard_model
from runtime.parallel.mesh import make_mesh

ids = np.random.default_rng(0).integers(3, 1031, size=40).tolist()
for path, devices, ep in ((sys.argv[1], 5, False), (sys.argv[2], 2, True)):
    ref = load_model(path).logits(ids)
    model = shard_model(load_model(path), make_mesh(1, devices, devices=jax.devices()[:devices]), expert_parallel=ep)
    g = model.params["groups"][-1]
    q_b = g["q_b_proj" if "q_b_proj" in g else "q_proj"]
    kv_b, down = g["kv_b_proj"], g["experts_down"]
    print("SPEC", ep, q_b.q.sharding.spec, q_b.scale.sharding.spec, kv_b.q.sharding.spec, kv_b.scale.sharding.spec)
    print("EXPERTS", down.q.sharding.spec, down.scale.sharding.spec)
    print("ERR", float(np.abs(model.logits(ids) - ref).max()))
"""


def test_tensor_and_expert_parallel_logits_match_single_device(checkpoints):
    """5 devices, heads split: q_b_proj's 100 columns in 25 blocks of 4 split with their scales;
    kv_b_proj's 28 column blocks do not divide by 5 (scales replicated, codes split). 2 devices with
    expert parallelism: the FP8 experts and their block scales split by expert. A subprocess (the
    device count must not leak); the same logits as one device."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    paths = [str(checkpoints(FLOAT_FAMILY, [4, 16])[0]), str(checkpoints("deepseek_v3_qnone", [16, 16])[0])]
    proc = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, *paths], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    specs = [x for x in proc.stdout.splitlines() if x.startswith("SPEC ")]
    errs = [float(x.split()[1]) for x in proc.stdout.splitlines() if x.startswith("ERR ")]
    experts = [x for x in proc.stdout.splitlines() if x.startswith("EXPERTS ")]
    split, whole = "P(None, None, 'model')", "P()"
    assert specs[0] == f"SPEC False {split} {split} {split} {whole}", specs
    assert experts[1] == "EXPERTS P(None, 'model', None, None) P(None, 'model', None, None)", experts
    assert len(errs) == 2 and max(errs) <= 1e-5, errs


def test_plan_abstract_params_are_the_loaded_tree(ours):
    """`jaxserve plan`'s abstract block-FP8 params (models/abstract.py) have the loaded model's tree,
    shapes and dtypes, for whole-block ([8, 32]) and per-column ([16, 16]) expert gate | up scales."""
    from models.abstract import abstract_model, block_fp8_params

    for block in ([8, 32], [16, 16]):
        model = ours(FLOAT_FAMILY, block)
        loaded = model.params
        abstract = block_fp8_params(abstract_model(model.cfg, "float32").params, tuple(block))
        # the checkpoint's one float layer-0 kv_a_proj is a per-checkpoint choice: compare the rest
        abstract["groups"][0]["kv_a_proj"] = jax.ShapeDtypeStruct(loaded["groups"][0]["kv_a_proj"].shape, np.float32)
        shapes = lambda tree: jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), tree)
        assert jax.tree.structure(abstract) == jax.tree.structure(loaded), block
        assert shapes(abstract) == shapes(loaded), block
