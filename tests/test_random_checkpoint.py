"""Tests for models/random_checkpoint.py: every family builds, reloads through HF's Auto classes
and runs; configs have the awkward properties they promise; the tokenizer round-trips and
renders ChatML; builds are byte-for-byte reproducible."""

from __future__ import annotations

import json

import pytest

from models import random_checkpoint
from models.random_checkpoint import FAMILIES, describe, write_random_checkpoint

torch = pytest.importorskip("torch", reason="needs the test extra (torch)")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
MOE_FAMILIES = ("qwen3_5_moe", "qwen3_next")
EXPECTED_GQA_RATIO = {"llama": 3, "qwen3": 4, "qwen3_5": 1, "qwen3_5_moe": 3, "qwen3_next": 2}


def _config(checkpoint_dir):
    return transformers.AutoConfig.from_pretrained(checkpoint_dir)


def _tokenizer(checkpoint_dir):
    return transformers.AutoTokenizer.from_pretrained(checkpoint_dir)


def _tensor_names(checkpoint_dir):
    with safe_open(str(checkpoint_dir / "model.safetensors"), "pt") as file:
        return set(file.keys())


@pytest.mark.parametrize("family", FAMILIES)
def test_reloads_with_auto_class_and_runs(family, tiny_checkpoint, hf_model):
    checkpoint_dir = tiny_checkpoint(family)
    expected_files = {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert expected_files <= {path.name for path in checkpoint_dir.iterdir()}
    model = hf_model(family)
    assert type(model).__name__ == describe(family)["model_class"]
    assert next(model.parameters()).dtype == torch.float32 and not model.training

    prompt_ids = _tokenizer(checkpoint_dir)("def add(a, b):\n    return a + b")["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0]  # [T, vocab]
    assert logits.shape == (len(prompt_ids), model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # random weights give non-degenerate logits
    assert not torch.allclose(logits[0], logits[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_config_is_awkward(family, tiny_checkpoint, hf_model):
    checkpoint_dir = tiny_checkpoint(family)
    config = _config(checkpoint_dir)
    assert config.vocab_size % 2 == 1 and config.vocab_size > len(_tokenizer(checkpoint_dir))
    assert config.num_attention_heads // config.num_key_value_heads == EXPECTED_GQA_RATIO[family]
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.head_dim * config.num_attention_heads != config.hidden_size
    assert 2 <= config.num_hidden_layers <= 4 and 64 <= config.hidden_size <= 96
    assert config.max_position_embeddings == 1024
    assert config.bos_token_id is None
    assert config.eos_token_id == _tokenizer(checkpoint_dir).convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((checkpoint_dir / "generation_config.json").read_text())
    assert config.eos_token_id in generation["eos_token_id"]

    names = _tensor_names(checkpoint_dir)
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    if family == "llama":
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.rope_parameters["factor"] > 1
        assert not config.tie_word_embeddings
    if family == "qwen3":
        assert config.tie_word_embeddings
        assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= names


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_layers_are_awkward_and_instantiated(family, tiny_checkpoint, hf_model):
    config = _config(tiny_checkpoint(family))
    layer_types = list(config.layer_types)
    hf_default = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(len(layer_types))]
    assert layer_types != hf_default
    assert set(layer_types) == {"linear_attention", "full_attention"}
    assert config.linear_num_value_heads == 3 * config.linear_num_key_heads
    assert config.linear_key_head_dim != config.linear_value_head_dim
    assert 0 < config.rope_parameters["partial_rotary_factor"] < 1

    for layer_type, layer in zip(layer_types, hf_model(family).model.layers, strict=True):
        has_gdn = hasattr(layer, "linear_attn")
        assert has_gdn == (layer_type == "linear_attention")
        assert hasattr(layer, "self_attn") == (not has_gdn)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_has_shared_expert_and_topk(family, tiny_checkpoint, hf_model):
    config = _config(tiny_checkpoint(family))
    assert 1 < config.num_experts_per_tok < config.num_experts <= 8
    for layer in hf_model(family).model.layers:
        assert hasattr(layer.mlp, "shared_expert") and hasattr(layer.mlp, "shared_expert_gate")
        assert layer.mlp.experts.num_experts == config.num_experts


def test_norm_weights_sit_around_their_neutral_value(tiny_checkpoint):
    """Plain RMSNorm weights (x * w) centre on 1, zero-centred ones (x * (1 + w)) on 0."""
    with safe_open(str(tiny_checkpoint("llama") / "model.safetensors"), "pt") as file:
        llama_norm = file.get_tensor("model.layers.0.input_layernorm.weight")
    with safe_open(str(tiny_checkpoint("qwen3_5") / "model.safetensors"), "pt") as file:
        qwen35_norm = file.get_tensor("model.layers.0.input_layernorm.weight")
        gated_norm = file.get_tensor("model.layers.0.linear_attn.norm.weight")  # plain weight
        a_log = file.get_tensor("model.layers.0.linear_attn.A_log")
    for weight, neutral in ((llama_norm, 1.0), (qwen35_norm, 0.0), (gated_norm, 1.0)):
        assert abs(weight.mean().item() - neutral) < 0.05
        assert 0.02 < weight.std().item() < 0.2
    assert torch.all(a_log.exp() >= 0.5 - 1e-6) and torch.all(a_log.exp() <= 4.0 + 1e-6)


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog. It wasn't me!",
        "def fib(n: int) -> int:\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
        "naïve café — 東京 ✓ 🙂  trailing spaces   ",
    ],
)
def test_tokenizer_round_trips(text, tiny_checkpoint):
    tokenizer = _tokenizer(tiny_checkpoint("qwen3"))
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned


def test_tokenizer_specials_and_chat_template(tiny_checkpoint):
    tokenizer = _tokenizer(tiny_checkpoint("qwen3"))
    assert 900 <= len(tokenizer) <= 1000
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token is None
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tokenizer(token)["input_ids"] == [tokenizer.convert_tokens_to_ids(token)]
    assert tokenizer("hello")["input_ids"][0] != tokenizer.convert_tokens_to_ids("<|im_start|>")

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == expected + "<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, return_dict=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2


def test_same_seed_builds_are_byte_identical(tmp_path):
    first = write_random_checkpoint("qwen3_next", tmp_path / "a", seed=3)
    second = write_random_checkpoint("qwen3_next", tmp_path / "b", seed=3)
    other_seed = write_random_checkpoint("qwen3_next", tmp_path / "c", seed=4)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other_seed / "model.safetensors").read_bytes()


def test_cli_overrides_and_bfloat16(tmp_path):
    out_dir = tmp_path / "bigger"
    random_checkpoint.main(
        [
            "qwen3_5",
            str(out_dir),
            "--hidden-size",
            "128",
            "--num-hidden-layers",
            "8",
            "--dtype",
            "bfloat16",
            "--set",
            "tie_word_embeddings=true",
        ]
    )
    config = _config(out_dir)
    assert config.hidden_size == 128 and config.tie_word_embeddings
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    with safe_open(str(out_dir / "model.safetensors"), "pt") as file:
        assert file.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown family"):
        describe("gpt2")
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        write_random_checkpoint("llama", tmp_path / "x", vocab_size=999)
    with pytest.raises(ValueError, match="dtype"):
        write_random_checkpoint("llama", tmp_path / "y", dtype="int8")


def test_cache_key_tracks_builder_spec(monkeypatch):
    from conftest import checkpoint_cache_key

    before = checkpoint_cache_key("qwen3")
    assert before == checkpoint_cache_key("qwen3") != checkpoint_cache_key("llama")
    changed = dict(random_checkpoint._SPECS)
    config_class, model_class, config = changed["qwen3"]
    changed["qwen3"] = (config_class, model_class, {**config, "hidden_size": 80})
    monkeypatch.setattr(random_checkpoint, "_SPECS", changed)
    assert checkpoint_cache_key("qwen3") != before


def test_concurrent_cache_builds_agree(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from conftest import build_cached_checkpoint

    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: build_cached_checkpoint("qwen3", tmp_path), range(2)))
    assert paths[0] == paths[1] and (paths[0] / "model.safetensors").exists()
    assert [path.name for path in tmp_path.iterdir()] == [paths[0].name]  # no staging left over
    assert build_cached_checkpoint("qwen3", tmp_path) == paths[0]
