"""`jax.distributed` with two real processes: 2 x 4 simulated CPU devices, one model over all 8.

Each process is started the way a multi-host YAML starts a host: `parallel.multihost` of the
shipped v5p-16 config (coordinator on 127.0.0.1 at a free port, 2 processes, its own process id)
through `runtime.parallel.mesh.initialize_multihost`, with gloo CPU collectives. Both build the mesh of the
config (data 2 x model 4) over the 8 devices of both processes, load the tiny hybrid checkpoint and
shard it (each process places only its own shards), then run the same forward pass (the same
inputs on every process: the deterministic lockstep a follower would run), gather the logits and
run a greedy decode loop through the paged caches. Logits must match the single-process,
single-device model to ~1e-5 and greedy tokens exactly, on both processes.

Serving (runtime/parallel/multihost.py): two `jaxserve serve` processes from the shipped
`configs/cpu-multihost-2x4.yaml` (ports, checkpoint and buckets replaced; mesh data 1 x model 8,
so every step all-reduces across the processes) serve the official `openai` client with the
single-device model's greedy tokens; SIGTERM to process 0 ends both with exit code 0; killing
process 1 turns /health 503 within seconds and ends process 0 with a non-zero code. Every process
gets the step channel's secret through JAXSERVE_MULTIHOST_SECRET, as a real deployment would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
IDS = [5, 17, 300, 2, 999, 41, 7, 8, 9, 10, 11]
SECRET = "test-multiprocess-step-channel-secret"  # parallel.multihost.secret, through the environment


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu", "JAXSERVE_MULTIHOST_SECRET": SECRET}


WORKER = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    def stage(name):
        print(f"[{time.perf_counter() - t0:6.1f}s] {name}", file=sys.stderr, flush=True)
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from configs import CONFIG_DIR, load_config
    from runtime.parallel.mesh import initialize_multihost, make_mesh

    src, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = load_config(CONFIG_DIR / "tpu-v5p-16-qwen3-next-80b-multihost.yaml", {
        "parallel.multihost.coordinator_address": f"127.0.0.1:{port}", "parallel.multihost.process_id": pid})
    assert config.parallel.multihost.secret is not None  # JAXSERVE_MULTIHOST_SECRET reached the config
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


@pytest.mark.slow  # start-up and logits only; the serving test below covers it end to end
def test_two_processes_serve_one_sharded_model(tiny_checkpoint, tmp_path):
    from models.model import load_model

    src = tiny_checkpoint("qwen3_5")
    ref = load_model(src)
    port = _free_port()
    env = _environment()
    logs = [(tmp_path / f"p{pid}.out", tmp_path / f"p{pid}.err") for pid in range(2)]
    procs = []
    try:  # output to files, not pipes: gloo chatters on stdout, and a full pipe would stall a worker
        for pid, (out, err) in enumerate(logs):
            with open(out, "w") as fout, open(err, "w") as ferr:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", WORKER, str(src), str(port), str(pid), json.dumps(IDS)],
                        cwd=REPO_ROOT,
                        env=env,
                        stdout=fout,
                        stderr=ferr,
                        text=True,
                    )
                )
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
        reports.append(json.loads(line[len("REPORT ") :]))
    expected_logits = ref.logits(IDS)
    expected_tokens = ref.greedy(IDS, 4)
    for i, r in enumerate(reports):
        assert (r["process"], r["processes"], r["devices"], r["local_devices"]) == (i, 2, 8, 4)
        np.testing.assert_allclose(np.asarray(r["logits"]), expected_logits, atol=2e-5, rtol=1e-5)
        assert np.argmax(r["logits"], -1).tolist() == np.argmax(expected_logits, -1).tolist()
        assert r["greedy"] == expected_tokens


# ---- multi-process serving: process 0 serves HTTP, process 1 follows (runtime/parallel/multihost.py) ----------
SERVE_FAMILY = "llama"  # tiny dense Llama: 8-way TP splits its MLP, so every step all-reduces across processes
SERVE_PROMPTS = ([5, 17, 300, 2, 999, 41, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28])
SERVE_TOKENS = 8
HEALTH_TIMEOUT_S = 400  # start-up under a contended machine: jax import, load, shard (compiles come later)


def _write_launch_yaml(tmp_path: Path, src: Path, cache_dir: Path) -> tuple[Path, int]:
    """The shipped CPU multi-host config with this test's checkpoint, free ports and small buckets."""
    import yaml

    config = yaml.safe_load((REPO_ROOT / "configs" / "cpu-multihost-2x4.yaml").read_text())
    http_port = _free_port()
    config["model"]["path"] = str(src)
    config["parallel"]["multihost"].update(coordinator_address=f"127.0.0.1:{_free_port()}", step_port=_free_port())
    config["scheduler"].update(max_num_batched_tokens=32, token_buckets=[32])  # one backbone to compile
    config["compile"].update(aot=False, cache_dir=str(cache_dir))  # the second launch reuses the first's compiles
    config["kernels"]["fuse_greedy"] = False
    config["server"].update(port=http_port, unhealthy_linger_s=3)
    path = tmp_path / "multihost.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, http_port


class _TwoProcessServer:
    """`jaxserve serve` twice from one YAML (process ids 0 and 1); every child killed in `close()`."""

    def __init__(self, tmp_path: Path, src: Path, cache_dir: Path, name: str):
        config, self.port = _write_launch_yaml(tmp_path, src, cache_dir)
        env = _environment()
        self.logs = [tmp_path / f"{name}-p{pid}.log" for pid in range(2)]
        self.procs: list[subprocess.Popen] = []
        for pid, log_path in enumerate(self.logs):
            with open(log_path, "w") as log_file:  # a file, not a pipe: a full pipe would stall the process
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "server.cli",
                            "serve",
                            "--config",
                            str(config),
                            "--process-id",
                            str(pid),
                        ],
                        cwd=REPO_ROOT,
                        env=env,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                    )
                )
        self.url = f"http://127.0.0.1:{self.port}"

    def health(self) -> int | None:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return None

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health() != 200:
            dead = [p.returncode for p in self.procs if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"not serving (exit codes {dead}):\n{self.tail()}"
            time.sleep(0.5)

    def wait_exit(self, pid: int, timeout_s: float) -> int:
        try:
            return self.procs[pid].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process {pid} still running after {timeout_s} s:\n{self.tail()}") from None

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- process {i}:\n{p.read_text()[-chars:]}" for i, p in enumerate(self.logs))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    """One persistent compilation cache for both launches: the second compiles nothing."""
    return tmp_path_factory.mktemp("xla")


@pytest.mark.parametrize("family", [SERVE_FAMILY, pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_two_processes_serve_openai_clients_and_stop_on_sigterm(tiny_checkpoint, tmp_path, xla_cache, family):
    """Process 0 serves the official client (plain, streaming, two at once, sampled with a seed)
    with the single-process model's greedy tokens; both processes replay the same steps (the
    leader checks each follower's token digest every step, so a divergence would turn /health
    503); SIGTERM to process 0 stops both with exit code 0. The weights come from an orbax
    checkpoint (`jaxserve convert`), each process restoring only its own shards; the reference
    is the safetensors checkpoint on one device. The GDN hybrid (qwen3_5) runs with `-m slow`."""
    import openai
    from transformers import AutoTokenizer

    from models.convert import convert_checkpoint
    from models.model import load_model

    src = tiny_checkpoint(family)
    ref = load_model(src)
    tok = AutoTokenizer.from_pretrained(src)
    expected = [tok.decode(ref.greedy(p, SERVE_TOKENS)) for p in SERVE_PROMPTS]
    orbax_dir = convert_checkpoint(src, tmp_path / "orbax", dtype="float32")
    server = _TwoProcessServer(tmp_path, orbax_dir, xla_cache, "serve")
    try:
        server.wait_healthy(HEALTH_TIMEOUT_S)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        kw = dict(model=model, max_tokens=SERVE_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(prompt=SERVE_PROMPTS[0], **kw).choices[0].text == expected[0]
        stream = client.completions.create(prompt=SERVE_PROMPTS[1], stream=True, **kw)
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected[1]
        both = client.completions.create(prompt=list(SERVE_PROMPTS), **kw)  # one batch, two sequences
        assert sorted((c.index, c.text) for c in both.choices) == list(enumerate(expected))
        sampled = dict(model=model, prompt=SERVE_PROMPTS[0], max_tokens=SERVE_TOKENS, temperature=0.9, seed=7)
        first, again = (client.completions.create(**sampled).choices[0].text for _ in range(2))
        assert first == again
        assert server.health() == 200, server.tail()  # no lost follower, no divergence
        leader_log = server.logs[0].read_text()
        assert "follower 1 authenticated" in leader_log and "UNAUTHENTICATED" not in leader_log, server.tail()
        server.procs[0].send_signal(signal.SIGTERM)
        assert server.wait_exit(0, 60) == 0, server.tail()
        assert server.wait_exit(1, 60) == 0, server.tail()
    finally:
        server.close()


def test_follower_death_turns_health_503_and_ends_the_leader(tiny_checkpoint, tmp_path, xla_cache):
    """kill -9 of process 1: process 0 answers /health 503 within a few seconds (not a hang in a
    collective), fails the request in flight, then exits non-zero."""
    import openai

    server = _TwoProcessServer(tmp_path, tiny_checkpoint(SERVE_FAMILY), xla_cache, "kill")
    try:
        server.wait_healthy(HEALTH_TIMEOUT_S)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        client.completions.create(model=model, prompt=SERVE_PROMPTS[0], max_tokens=2, temperature=0)  # steps flow
        stream = client.completions.create(
            model=model,
            prompt=SERVE_PROMPTS[1],
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        for chunk in chunks:  # until the request in flight is decoding: steps that all-reduce with process 1
            if chunk.choices and chunk.choices[0].text:
                break
        server.procs[1].kill()
        killed_at = time.monotonic()
        while server.health() != 503:
            assert time.monotonic() - killed_at < 10, f"/health is {server.health()}:\n{server.tail()}"
            time.sleep(0.1)
        with pytest.raises(openai.APIError):  # the request in flight ends with an error, not a hang
            for _ in chunks:
                pass
        assert server.wait_exit(0, 60) != 0, server.tail()
    finally:
        server.close()
