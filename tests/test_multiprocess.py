"""`jax.distributed` with two real processes: 2 x 4 simulated CPU devices, one model over all 8.

Each process is started the way a multi-host YAML starts a host: `parallel.multihost` of the
shipped v5p-16 config (coordinator on 127.0.0.1 at a free port, 2 processes, its own process id)
through `runtime.mesh.initialize_multihost`, with gloo CPU collectives. Both build the mesh of the
config (data 2 x model 4) over the 8 devices of both processes, load the tiny hybrid checkpoint and
shard it (each process places only its own shards), then run the same forward pass (the same
inputs on every process: the deterministic lockstep a follower would run), gather the logits and
run a greedy decode loop through the paged caches. Logits must match the single-process,
single-device model to ~1e-5 and greedy tokens exactly, on both processes. Not covered: the
serving side of multi-host (process 0 serving HTTP, followers, SIGTERM, /health), which is not
built (issue 13).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
IDS = [5, 17, 300, 2, 999, 41, 7, 8, 9, 10, 11]

WORKER = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    def stage(name):
        print(f"[{time.perf_counter() - t0:6.1f}s] {name}", file=sys.stderr, flush=True)
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from configs import CONFIG_DIR, load_config
    from runtime.mesh import initialize_multihost, make_mesh

    src, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = load_config(CONFIG_DIR / "tpu-v5p-16-qwen3-next-80b-multihost.yaml", {
        "parallel.multihost.coordinator_address": f"127.0.0.1:{port}", "parallel.multihost.process_id": pid})
    assert initialize_multihost(config.parallel)
    stage("jax.distributed initialised")
    from jax.experimental import multihost_utils
    from models.batch import single_sequence_batch
    from models.model import _logits_fn, load_model
    from models.ops import KernelOptions
    from models.sharding import shard_model

    ids = json.loads(sys.argv[4])
    mesh = make_mesh(config.parallel.mesh.data, config.parallel.mesh.model)
    model = shard_model(load_model(src), mesh)
    stage("model sharded over %d devices" % len(jax.devices()))
    batch = single_sequence_batch(ids, 16, pad_to=16)
    caches = model.init_caches(4, 16, 2)
    opts = KernelOptions(tp=model.tp)
    logits = multihost_utils.process_allgather(_logits_fn(model.cfg, opts)(model.params, caches, batch), tiled=True)
    stage("logits gathered")
    report = {"process": jax.process_index(), "processes": jax.process_count(), "devices": len(jax.devices()),
              "local_devices": len(jax.local_devices()), "logits": logits[: len(ids)].tolist(),
              "greedy": model.greedy(ids, 4)}
    print("REPORT " + json.dumps(report), flush=True)
    multihost_utils.sync_global_devices("report printed")  # leave together: shutdown is a barrier too
    stage("shutting down")
    jax.distributed.shutdown()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_serve_one_sharded_model(tiny_checkpoint, tmp_path):
    from models.model import load_model

    src = tiny_checkpoint("qwen3_5")
    ref = load_model(src)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    logs = [(tmp_path / f"p{pid}.out", tmp_path / f"p{pid}.err") for pid in range(2)]
    procs = []
    try:  # output to files, not pipes: gloo chatters on stdout, and a full pipe would stall a worker
        for pid, (out, err) in enumerate(logs):
            with open(out, "w") as fout, open(err, "w") as ferr:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", WORKER, str(src), str(port), str(pid), json.dumps(IDS)],
                    cwd=REPO_ROOT, env=env, stdout=fout, stderr=ferr, text=True))
        for p in procs:
            p.wait(timeout=420)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    reports = []
    for p, (out, err) in zip(procs, logs):
        line = next((l for l in out.read_text().splitlines() if l.startswith("REPORT ")), None)
        assert p.returncode == 0 and line is not None, err.read_text()[-3000:]
        reports.append(json.loads(line[len("REPORT "):]))
    expected_logits = ref.logits(IDS)
    expected_tokens = ref.greedy(IDS, 4)
    for i, r in enumerate(reports):
        assert (r["process"], r["processes"], r["devices"], r["local_devices"]) == (i, 2, 8, 4)
        np.testing.assert_allclose(np.asarray(r["logits"]), expected_logits, atol=2e-5, rtol=1e-5)
        assert np.argmax(r["logits"], -1).tolist() == np.argmax(expected_logits, -1).tolist()
        assert r["greedy"] == expected_tokens
