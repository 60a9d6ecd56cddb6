"""`jaxserve convert` + orbax restore: the same logits and tokens as the safetensors checkpoint.

Single device on the tiny dense and hybrid (MoE) checkpoints, logits bit-for-bit; then, in ONE
subprocess with 8 simulated CPU devices, a hybrid checkpoint whose attention and GDN heads divide
by 4 restored straight into a (data 1, model 4) sharding: each leaf arrives split (each device
holds a quarter of the columns), the GDN channel reorder happens on the devices, and logits match
the single-device safetensors model to ~1e-5 with equal greedy tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from models.convert import convert_checkpoint
from models.model import load_model
from models.orbax_io import is_orbax_checkpoint
from models.safetensors_io import CheckpointError
from server.cli import main

REPO_ROOT = Path(__file__).resolve().parents[1]
IDS = [5, 17, 300, 2, 999, 41, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_orbax_restores_the_same_model(tiny_checkpoint, tmp_path, family):
    src = tiny_checkpoint(family)
    out = convert_checkpoint(src, tmp_path / "orbax", dtype="float32")
    assert is_orbax_checkpoint(out) and (out / "tokenizer.json").is_file() and not list(out.glob("*.safetensors"))
    ref, restored = load_model(src), load_model(out)
    np.testing.assert_array_equal(ref.logits(IDS), restored.logits(IDS))
    assert restored.tokenizer.encode("def f(x):") == ref.tokenizer.encode("def f(x):")


def test_convert_cli_and_dtype(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3_5")
    assert main(["convert", str(src), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    restored = load_model(tmp_path / "bf16", dtype="bfloat16")
    reference = load_model(src, dtype="bfloat16")
    np.testing.assert_array_equal(reference.logits(IDS), restored.logits(IDS))
    # a second convert into the same directory is refused; so is a checkpoint that contradicts config.json
    assert main(["convert", str(src), str(tmp_path / "bf16")]) == 2
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["intermediate_size"] += 8
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not match config.json"):
        load_model(tmp_path / "bf16", dtype="bfloat16")


SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from models.model import load_model
    from runtime.parallel.mesh import make_mesh

    src, out = sys.argv[1], sys.argv[2]
    ids = [5, 17, 300, 2, 999, 41, 7, 8, 9, 10, 11]
    ref = load_model(src)
    model = load_model(out, mesh=make_mesh(1, 4, devices=jax.devices()[:4]))
    g = {k: v for group in model.params["groups"] for k, v in group.items()}
    report = {
        "logits_err": float(np.abs(model.logits(ids) - ref.logits(ids)).max()),
        "tokens_equal": model.greedy(ids, 4) == ref.greedy(ids, 4),
        "in_qkv": [list(g["in_qkv"].shape), list(g["in_qkv"].addressable_shards[0].data.shape)],
        "q_proj": [list(g["q_proj"].shape), list(g["q_proj"].addressable_shards[0].data.shape)],
        "tp": model.tp is not None and model.tp.attention and model.tp.gdn,
    }
    # 8 devices, 4 KV heads: each restored KV head repeated twice (models.sharding.repeat_kv_heads)
    model = load_model(out, mesh=make_mesh(1, 8, devices=jax.devices()[:8]))
    k_proj = model.params["groups"][1]["k_proj"]
    report["repeat_8"] = {
        "logits_err": float(np.abs(model.logits(ids) - ref.logits(ids)).max()),
        "kv_repeat": model.tp.kv_repeat,
        "k_proj": [list(k_proj.shape), list(k_proj.addressable_shards[0].data.shape)],
    }
    print("REPORT " + json.dumps(report))
""")


def test_sharded_restore_on_8_simulated_devices(tmp_path):
    from models.random_checkpoint import write_random_checkpoint

    src = write_random_checkpoint(
        "qwen3_5",
        tmp_path / "hybrid",
        num_attention_heads=8,
        num_key_value_heads=4,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        vocab_size=1032,
    )
    out = convert_checkpoint(src, tmp_path / "orbax", dtype="float32")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(src), str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    report = json.loads(line[len("REPORT ") :])
    assert report["tp"]
    assert report["logits_err"] < 1e-4 and report["tokens_equal"], report
    for name in ("in_qkv", "q_proj"):
        full, shard = report[name]
        assert shard[:-1] == full[:-1] and shard[-1] * 4 == full[-1], (name, report[name])
    repeat = report["repeat_8"]  # head_dim 32: 4 KV heads held as 8, one per device
    assert repeat["kv_repeat"] == 2 and repeat["logits_err"] < 1e-4, repeat
    assert repeat["k_proj"] == [[1, 64, 8 * 32], [1, 64, 32]], repeat
