"""Tiny random HF checkpoints and a locally trained tokenizer, for tests and benchmarks.

`write_random_checkpoint(family, out_dir)` builds an HF transformers model (torch, CPU) with deliberately
awkward small dimensions (GQA ratios > 1, head_dim != hidden / heads, odd vocab, non-default hybrid layer
patterns), fills every weight from a seeded normal distribution and saves it in the HF layout: config.json,
model.safetensors (Qwen3.5 / Qwen3-Next: mtp.safetensors too, models/random_mtp.py), generation_config.json,
tokenizer.json, tokenizer_config.json. HF transformers' PyTorch model of the same directory is the oracle.
The tokenizer is a byte-level BPE trained in about a second on the Python standard library's own
sources (nothing is downloaded), with the ChatML special tokens and chat template.

torch, transformers and tokenizers are imported inside functions: importing this module is free.

CLI (bigger random checkpoints for benchmarks), e.g. a ~0.98B Qwen3.5-shaped model
(16 layers, HF's 3 GDN : 1 attention pattern when --num-hidden-layers is given):
    python -m models.random_checkpoint qwen3_5 /tmp/q35-1b --dtype bfloat16 --hidden-size 2048 \
        --num-hidden-layers 16 --intermediate-size 6144 --num-attention-heads 8 --num-key-value-heads 2 \
        --head-dim 256 --linear-num-key-heads 16 --linear-num-value-heads 16 --linear-key-head-dim 128 \
        --linear-value-head-dim 128 --vocab-size 32003 --max-position-embeddings 32768 --set tie_word_embeddings=true
"""

from __future__ import annotations

import argparse
import functools
import json
import sysconfig
from pathlib import Path
from typing import Any

from models.random_deepseek import DEEPSEEK_SPECS
from models.random_gemma3 import GEMMA3_SPEC
from models.random_gpt_oss import GPT_OSS_SPEC
from models.random_kimi import KIMI_SPECS
from models.random_mtp import MTP_FAMILIES, write_mtp
from models.random_nemotron_h import NEMOTRON_H_SPECS

FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next")  # the shared parametrized suites'
OWN_SPECS = dict(gpt_oss=GPT_OSS_SPEC, gemma3=GEMMA3_SPEC, **NEMOTRON_H_SPECS, **DEEPSEEK_SPECS, **KIMI_SPECS)
ALL_FAMILIES = (*FAMILIES, *OWN_SPECS)  # OWN_SPECS: each with its own test module

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
TOKENIZER_VOCAB_SIZE = 1000
CORPUS_CAP_BYTES = 3_000_000

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('ChatML roles are system, user and assistant, got ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Per family: the HF config class, the causal-LM class, and the tiny awkward config.
# vocab_size is odd and >= the tokenizer's 1000 entries, so the embedding has unused rows.
_COMMON = dict(vocab_size=1031, max_position_embeddings=1024, rms_norm_eps=1e-6)
_GDN_TINY = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=6,  # Hv / Hk = 3
    linear_key_head_dim=16,
    linear_value_head_dim=32,  # K != V
    linear_conv_kernel_dim=4,
)
_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            **_COMMON,
            hidden_size=96,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,  # GQA 3
            head_dim=32,  # != 96 / 6
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=128,
            ),
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            **_COMMON,
            hidden_size=64,
            intermediate_size=144,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,  # GQA 4
            head_dim=32,  # != 64 / 8
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            **_COMMON,
            **_GDN_TINY,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            num_attention_heads=4,
            num_key_value_heads=4,  # GQA 1
            head_dim=32,  # != 64 / 4
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000.0,
                partial_rotary_factor=0.25,  # rotary dim 8 of 32
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
        ),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            **_COMMON,
            **_GDN_TINY,
            hidden_size=64,
            num_hidden_layers=3,
            layer_types=["full_attention", "linear_attention", "linear_attention"],
            num_attention_heads=6,
            num_key_value_heads=2,  # GQA 3
            head_dim=32,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000.0,
                partial_rotary_factor=0.25,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
        ),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            **_COMMON,
            **_GDN_TINY,
            hidden_size=64,
            intermediate_size=128,  # unused: every layer is MoE (decoder_sparse_step 1)
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,  # GQA 2
            head_dim=32,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
        ),
    ),
    **OWN_SPECS,
}
RANDOM_BUFFERS = ("e_score_correction_bias",)  # drawn like weights: HF's zeros would hide their omission


def describe(family: str) -> dict[str, Any]:
    """The tiny default config of `family`: {"config_class", "model_class", "config": {...}}."""
    config_class, model_class, config = _spec(family)
    return {"config_class": config_class, "model_class": model_class, "config": json.loads(json.dumps(config))}


def _spec(family: str) -> tuple[str, str, dict[str, Any]]:
    if family not in _SPECS:
        raise ValueError(f"unknown family {family!r}; choose one of {ALL_FAMILIES}")
    return _SPECS[family]


def _import_torch_stack():
    try:
        import torch
        import transformers
    except ImportError as error:
        raise ImportError(
            "models.random_checkpoint needs torch and transformers: install the test extra, `pip install -e '.[test]'`"
        ) from error
    return torch, transformers


# ----------------------------------------------------------------------------- tokenizer


def _stdlib_corpus(cap_bytes: int = CORPUS_CAP_BYTES) -> list[str]:
    """Text of the stdlib's own .py files, in sorted path order, up to `cap_bytes`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    texts, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if skipped.intersection(path.relative_to(stdlib).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= cap_bytes:
            break
    if total < cap_bytes // 10:
        raise RuntimeError(f"found only {total} bytes of stdlib source under {stdlib}")
    return texts


def train_tokenizer(out_dir: str | Path) -> Path:
    """Write a byte-level BPE tokenizer (vocab 1000, ChatML specials and chat template) as
    tokenizer.json + tokenizer_config.json into `out_dir`; deterministic for a given Python
    stdlib. Trained once per process (~2 s), then copied."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, content in _trained_tokenizer_files().items():
        (out_dir / name).write_bytes(content)
    return out_dir


@functools.cache
def _trained_tokenizer_files() -> dict[str, bytes]:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as error:
        raise ImportError("train_tokenizer needs the `tokenizers` package (a jaxserve dependency)") from error
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_stdlib_corpus(), trainer=trainer)
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "added_tokens_decoder": {
            str(index): {
                "content": token,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for token, index in special_ids.items()
        },
        "chat_template": CHATML_TEMPLATE,
    }
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True).encode(),
        "tokenizer_config.json": (json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n").encode(),
    }


def special_token_ids(tokenizer_dir: str | Path) -> dict[str, int]:
    """{token: id} of the ChatML special tokens in `tokenizer_dir/tokenizer.json`."""
    vocab_entries = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())["added_tokens"]
    return {entry["content"]: entry["id"] for entry in vocab_entries if entry["content"] in SPECIAL_TOKENS}


# ----------------------------------------------------------------------------- weights


def _build_config(family: str, overrides: dict[str, Any], special_ids: dict[str, int]):
    _, transformers = _import_torch_stack()
    config_class, model_class, defaults = _spec(family)
    kwargs = json.loads(json.dumps(defaults))  # deep copy
    if "num_hidden_layers" in overrides and "layer_types" in kwargs and "layer_types" not in overrides:
        del kwargs["layer_types"]  # HF default: 3 linear-attention layers, then 1 full attention
    kwargs.update(overrides)
    rope = kwargs.get("rope_parameters") or {}  # Nemotron-H has none
    if "mrope_section" in rope and "rope_parameters" not in overrides:
        rope["mrope_section"] = _mrope_section(int(kwargs["head_dim"] * rope["partial_rotary_factor"]))
    if kwargs["vocab_size"] < TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"vocab_size {kwargs['vocab_size']} is smaller than the tokenizer ({TOKENIZER_VOCAB_SIZE})")
    kwargs.update(bos_token_id=None, eos_token_id=special_ids[IM_END], pad_token_id=special_ids[ENDOFTEXT])
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [model_class]
    return config, getattr(transformers, model_class)


def _mrope_section(rotary_dim: int) -> list[int]:
    """Split rotary_dim / 2 frequencies over (t, h, w) like Qwen3.5 does (64 -> [11, 11, 10])."""
    half = rotary_dim // 2
    return [half // 3 + (axis < half % 3) for axis in range(3)]


def _is_norm(module) -> bool:
    return "Norm" in type(module).__name__


def _fill_random_(model, *, seed: int, std: float) -> None:
    """Overwrite every parameter from one seeded generator, in named_parameters order.

    Norm weights become neutral value + N(0, std), where the neutral value is what HF
    initialised (1 for plain RMSNorm, 0 for the zero-centred `x * (1 + w)` variant), so a JAX
    model that confuses the two fails. GDN decays are kept in a useful range: exp(A_log) in
    [0.5, 4] and dt_bias ~ N(-2, 0.5) put the per-token decay alpha at median ~0.8 (5-95%: ~0.3-0.97), so the
    recurrent state carries information across many tokens instead of resetting each step.
    The depthwise conv uses a fan-in std (1/sqrt(kernel)) so its output is not vanishingly small.
    """
    torch, _ = _import_torch_stack()
    generator = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, param in model.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            module = modules[module_name]

            def normal(mean: float, scale: float):
                return torch.randn(param.shape, generator=generator, dtype=torch.float32) * scale + mean

            if _is_norm(module) and leaf == "weight":
                neutral = param.detach().float()
                if not torch.all(neutral == neutral.flatten()[0]):
                    raise RuntimeError(f"{name}: expected HF to initialise a norm weight to a constant")
                value = normal(float(neutral.flatten()[0]), std)
            elif leaf == "A_log":
                value = torch.empty(param.shape, dtype=torch.float32).uniform_(0.5, 4.0, generator=generator).log()
            elif leaf == "dt_bias":
                value = normal(-2.0, 0.5)
            elif module_name.endswith("conv1d") and leaf == "weight":
                value = normal(0.0, param.shape[-1] ** -0.5)
            else:
                value = normal(0.0, std)
            param.copy_(value.to(param.dtype))
        for buffer in (b for n, b in model.named_buffers() if n.rpartition(".")[2] in RANDOM_BUFFERS):
            buffer.copy_(torch.randn(buffer.shape, generator=generator, dtype=torch.float32) * std)


def write_random_checkpoint(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    std: float = 0.08,
    dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Build a random `family` model with the tiny awkward defaults (see `describe`) updated by
    `config_overrides`, and save it with tokenizer and generation config under `out_dir`."""
    torch, transformers = _import_torch_stack()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    out_dir = Path(out_dir)
    train_tokenizer(out_dir)
    special_ids = special_token_ids(out_dir)
    config, model_class = _build_config(family, config_overrides, special_ids)
    torch.manual_seed(seed)  # HF's own init (overwritten below, but keep it reproducible)
    model = model_class(config).eval()
    _fill_random_(model, seed=seed, std=std)
    model = model.to(torch_dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    if family in MTP_FAMILIES:  # the MTP layer HF does not hold (models/random_mtp.py)
        write_mtp(model, out_dir, functools.partial(_fill_random_, std=std), seed)
    eos = [special_ids[IM_END], special_ids[ENDOFTEXT]]
    generation_config = transformers.GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=eos[1])
    generation_config.save_pretrained(out_dir)
    return out_dir


# ----------------------------------------------------------------------------- CLI


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m models.random_checkpoint",
        description="Write a random HF checkpoint (tiny awkward defaults; override any config field).",
    )
    parser.add_argument("family", choices=ALL_FAMILIES)
    parser.add_argument("out_dir", type=Path, nargs="?")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.08)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    int_fields = (
        "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim vocab_size "
        "max_position_embeddings num_experts num_experts_per_tok moe_intermediate_size shared_expert_intermediate_size "
        "linear_num_key_heads linear_num_value_heads linear_key_head_dim linear_value_head_dim"
    )
    for field in int_fields.split():
        parser.add_argument("--" + field.replace("_", "-"), dest=field, type=int)
    parser.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="any other config field, e.g. --set tie_word_embeddings=true",
    )
    parser.add_argument("--describe", action="store_true", help="print the family's defaults and exit")
    args = parser.parse_args(argv)
    if args.describe:
        print(json.dumps(describe(args.family), indent=2))
        return
    if args.out_dir is None:
        parser.error("OUT_DIR is required unless --describe is given")
    reserved = {"family", "out_dir", "seed", "std", "dtype", "extra", "describe"}
    overrides = {key: value for key, value in vars(args).items() if key not in reserved and value is not None}
    for item in args.extra:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = _parse_value(value)
    path = write_random_checkpoint(
        args.family, args.out_dir, seed=args.seed, std=args.std, dtype=args.dtype, **overrides
    )
    print(path)


if __name__ == "__main__":
    main()
