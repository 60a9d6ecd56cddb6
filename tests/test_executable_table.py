"""The executable table (runtime/steps/executables.py) from shapes alone: one `compile(key)` for
every kind, the start-up set that `compile_all` compiles and seals, and key names that stay the
ones `compile_seconds` has always reported. The numbers the executables compute are checked
elsewhere (tests/test_engine_hf.py against HF, tests/test_no_compile_after_startup.py end to end).
"""

from __future__ import annotations

import pytest

from models.abstract import abstract_caches, abstract_model
from models.config import parse_config
from models.ops import KernelOptions
from models.safetensors_io import read_json
from runtime.steps.executables import KINDS, CompileAfterStartup, StepExecutables, StepKey

MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def table(tiny_checkpoint):
    def build(family: str, **kwargs) -> StepExecutables:
        cfg = parse_config(read_json(tiny_checkpoint(family) / "config.json"))
        model = abstract_model(cfg, "float32")
        caches = abstract_caches(model, 17, 16, 3)
        opts = KernelOptions(attention="reference", gdn="reference")
        return StepExecutables(
            model,
            caches,
            opts,
            token_buckets=(8, 32),
            seq_buckets=(4, 8),
            max_num_seqs=MAX_NUM_SEQS,
            max_blocks_per_seq=4,
            **kwargs,
        )

    return build


def test_key_names_are_the_reported_executable_names():
    assert StepKey("backbone", 64).name == "backbone[T=64]"
    assert StepKey("backbone", 8, greedy=True).name == "greedy_backbone[T=8]"
    assert StepKey("scoring_backbone", 64).name == "scoring_backbone[T=64]"
    assert StepKey("prepare", 64).name == "prepare[T=64]"
    assert StepKey("write_table", 64).name == "write_table"
    assert StepKey("copy_states").name == "copy_states"
    assert StepKey.sampler(8).name == "sampler[S=8,logprobs=0,pen=0/0,banned=0,bias=0]"
    full = StepKey.sampler(4, greedy=True, mask_width=33, num_logprobs=20, widths=(256, 512, 16, 32))
    assert full.name == "sampler[S=4,logprobs=20,pen=256/512,banned=16,bias=32,greedy,masked]"
    assert StepKey.sampler(4, greedy=1) == StepKey.sampler(4, greedy=True)  # one key, one executable
    with pytest.raises(ValueError, match="unknown executable kind"):
        StepKey("sampler_v2", 4)


def test_start_up_set_then_sealed(table):
    exes = table("qwen3_5", fuse_greedy=True, max_model_len=64)
    keys = exes.startup_keys(bitmask_width=0, every_variant=True)
    assert len(keys) == len(set(keys))
    assert {k.kind for k in keys} == set(KINDS) - {"batch_backbone"}
    assert [k.size for k in keys if k.kind == "backbone" and not k.greedy] == [8, 32]
    assert [k.size for k in keys if k.kind == "backbone" and k.greedy] == [8]  # decode buckets only
    assert {k.size for k in keys if k.kind in ("scoring_backbone", "prepare", "write_table")} == {32}
    assert len([k for k in keys if k.kind == "sampler"]) == 2 * 4  # 2 buckets x plain/full x greedy or not

    compiled = exes.compile_all(progress=False, every_variant=True)
    assert list(compiled) == [k.name for k in keys]  # compile order = key order, each key once
    assert set(exes.executables) == set(keys) and exes.sealed
    with pytest.raises(CompileAfterStartup, match=r"sampler\[S=4,.*masked\]"):
        exes.compile(StepKey.sampler(4, mask_width=33))
    with pytest.raises(CompileAfterStartup, match="batch_backbone"):
        exes.executable(StepKey("batch_backbone", 8))
    assert exes.executable(StepKey("backbone", 32)) is exes.executables[StepKey("backbone", 32)]  # no recompile


def test_compile_and_lower_any_key_on_demand(table):
    exes = table("llama")
    assert exes.startup_keys() == [
        StepKey("backbone", 8),
        StepKey("backbone", 32),
        StepKey.sampler(4),
        StepKey.sampler(4, greedy=True),
        StepKey.sampler(8),
        StepKey.sampler(8, greedy=True),
        StepKey("write_table", 32),
    ]
    key = StepKey("batch_backbone", 8)
    assert "@main" in exes.lower(key).as_text()  # lowered, not compiled (what `jaxserve plan` does for CUDA)
    assert exes.compile(key).memory_analysis() is not None
    assert list(exes.compile_seconds) == ["batch_backbone[T=8]"] and not exes.sealed
    batch = exes.batch_spec(8)
    assert batch.input_ids.shape == (8,) and batch.block_tables.shape == (MAX_NUM_SEQS, 4)
