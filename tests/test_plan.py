"""`jaxserve plan`: shapes-only models, the shipped configs compiled by libtpu's real compiler.

The abstract parameter tree is checked against the real loader on every tiny family; the
shipped real-model config.json files against the parameter counts their model cards publish;
each shipped accelerator config is compiled for its chip (TPU: libtpu, no TPU attached; GPU:
lowered for CUDA) with its real shapes and sizes, on the decode bucket only to keep CI short
(`jaxserve plan` compiles every bucket), and must fit; an oversized config is refused naming
the numbers.
"""

from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import pytest

from configs import CONFIG_DIR, load_config
from models.abstract import abstract_params
from models.config import parse_config
from models.model import load_model
from models.random_checkpoint import FAMILIES
from models.safetensors_io import read_json
from runtime.plan import PlanError, model_config_json, plan_config

ACCELERATOR_CONFIGS = ("gpu-h200-qwen3_5-9b.yaml", "tpu-v5e-8-qwen3_5-27b.yaml",
                       "tpu-v5p-16-qwen3-next-80b-multihost.yaml")
# Parameter counts the model cards publish (language model incl. embeddings; 9B / 27B / 80B).
PUBLISHED_PARAMS = {"qwen3_5-9b.json": 9e9, "qwen3_5-27b.json": 27e9, "qwen3-next-80b-a3b.json": 80e9}


@pytest.mark.parametrize("family", FAMILIES)
def test_abstract_params_match_the_loader(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    cfg = parse_config(read_json(path / "config.json"))
    loaded = load_model(path, dtype="bfloat16").params
    abstract = abstract_params(cfg, "bfloat16")
    assert jax.tree.structure(loaded) == jax.tree.structure(abstract)
    for real, shape in zip(jax.tree.leaves(loaded), jax.tree.leaves(abstract)):
        assert (real.shape, real.dtype) == (shape.shape, shape.dtype)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_shipped_model_configs_have_the_published_size(name):
    cfg = parse_config(read_json(CONFIG_DIR / "models" / name))
    count = sum(x.size for x in jax.tree.leaves(abstract_params(cfg, "bfloat16")))
    assert abs(count / PUBLISHED_PARAMS[name] - 1) < 0.05, count


@pytest.mark.parametrize("name", ACCELERATOR_CONFIGS)
def test_shipped_config_fits_its_chip(name):
    launch = load_config(CONFIG_DIR / name)
    assert model_config_json(launch).parent == CONFIG_DIR / "models"  # no checkpoint on this machine
    decode = next(b for b in (launch.scheduler.token_buckets or (16, 32, 64, 128, 256, 512, 1024, 2048, 4096))
                  if b >= launch.scheduler.max_num_seqs)
    report = plan_config(launch, name, token_buckets=(decode,), compile_sampler=False)
    assert report.fits, report.problems
    step = report.step("decode")
    assert step.tokens == decode and step.flops > 0 and step.bytes_accessed > 0
    # the compiler's figures account for at least the weights and the KV pool it was given
    assert step.argument_bytes >= report.weight_bytes + report.kv_bytes
    # a decode step reads every weight once: the cost analysis (scaled to the real depth) says so
    assert step.bytes_accessed >= 0.9 * report.weight_bytes
    # ... and does ~2 flops per parameter per token (of the parameters one device holds, MoE: fewer)
    assert step.flops <= 2.2 * report.param_count * decode / report.mesh[1]
    assert report.roofline("decode")["tokens_per_s_per_chip"] > 0


def test_a_config_that_does_not_fit_names_the_numbers():
    launch = load_config(CONFIG_DIR / "tpu-v5e-8-qwen3_5-27b.yaml",
                         {"parallel.mesh": {"data": 2, "model": 4}, "scheduler.max_num_seqs": 128})
    report = plan_config(launch, "too-big", token_buckets=(128,), compile_sampler=False)
    assert not report.fits
    with pytest.raises(PlanError, match=r"weights \d+\.\d\d GiB"):
        report.raise_if_unfit()


def test_plan_needs_a_target_chip():
    with pytest.raises(PlanError, match="parallel.chip"):
        plan_config(load_config(CONFIG_DIR / "gpu-h200-qwen3_5-9b.yaml", {"parallel.chip": None}))
