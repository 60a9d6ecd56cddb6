"""Smoke tests of the benchmark scripts (fast, no model): workloads are reproducible data, and the
serve client measures TTFT / ITL / TPOT / e2e as `vllm bench serve` defines them, against a tiny
local aiohttp server that streams known tokens with known delays."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
from aiohttp import web

from benchmarks.serve import RequestResult, arrival_times, compute_metrics, run_load
from benchmarks.workloads import WORKLOADS, make_workload, shared_prefix_len, summarize, token_id_range

# ---- workloads ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_is_reproducible_and_in_vocab(name):
    a = make_workload(name, vocab_size=500, seed=3, scale=0.1, max_model_len=256)
    b = make_workload(name, vocab_size=500, seed=3, scale=0.1, max_model_len=256)
    c = make_workload(name, vocab_size=500, seed=4, scale=0.1, max_model_len=256)
    assert a == b
    assert summarize(a)["sha256"] == summarize(b)["sha256"] != summarize(c)["sha256"]
    low, high = token_id_range(500)
    for r in a:
        assert all(low <= t < high for t in r.prompt_ids)
        assert r.prompt_len >= 1 and r.max_tokens >= 1
        assert r.prompt_len + r.max_tokens <= 256


def test_workload_shapes():
    fixed = make_workload("fixed", vocab_size=1000, num_requests=5)
    assert [(r.prompt_len, r.max_tokens) for r in fixed] == [(128, 128)] * 5
    mixed = make_workload("mixed", vocab_size=1000, num_requests=400)
    p = np.array([r.prompt_len for r in mixed])
    o = np.array([r.max_tokens for r in mixed])
    assert p.min() >= 16 and p.max() <= 1024 and o.min() >= 16 and o.max() <= 256
    assert np.mean(p) > np.median(p)  # long tail to the right
    shared = make_workload("shared_prefix", vocab_size=1000, num_requests=6, max_model_len=4096)
    assert shared_prefix_len(shared) == 2048
    assert all(2048 + 16 <= r.prompt_len <= 2048 + 64 for r in shared)
    long = make_workload("long_context", vocab_size=1000, num_requests=4, max_model_len=512)
    assert all(512 - 16 - 15 <= r.prompt_len <= 512 - 16 and r.max_tokens == 16 for r in long)


def test_poisson_arrivals_have_the_requested_rate():
    times = arrival_times(4000, request_rate=8.0, seed=1)
    assert times[-1] == pytest.approx(4000 / 8)  # rescaled to end at n / rate, as vLLM does
    gaps = np.diff(times)
    assert abs(np.mean(gaps) - 1 / 8) < 0.01
    assert abs(np.std(gaps) - 1 / 8) < 0.015  # exponential: std == mean at burstiness 1
    assert not arrival_times(3, math.inf).any()


# ---- metrics by hand ------------------------------------------------------------------------


def test_metrics_definitions_by_hand():
    results = [
        RequestResult(prompt_len=10, success=True, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
        RequestResult(prompt_len=20, success=True, output_tokens=1, ttft=0.3, latency=0.3),
        RequestResult(prompt_len=30, success=False, error="boom"),
    ]
    m = compute_metrics(results, duration_s=2.0, slo_ms={"ttft": 200, "tpot": 150})
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    # TPOT only over requests with > 1 output token: (0.5 - 0.1) / 4
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["p50_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 200)  # linear interpolation
    # goodput: request 1 meets ttft 100<=200 and tpot 100<=150; request 2 misses ttft (300)
    assert m["request_goodput"] == pytest.approx(0.5)


# ---- the client against a stub server ---------------------------------------------------------

TTFT_S, ITL_S, USAGE_DELAY_S = 0.15, 0.05, 0.2


def _stub_app() -> web.Application:
    """Streams one chunk per token: the first after TTFT_S, the rest every ITL_S, then (after a
    long pause that must not count as latency) a usage chunk and [DONE]."""

    async def completions(request: web.Request):
        body = await request.json()
        assert body["stream"] and body["ignore_eos"] and isinstance(body["prompt"], list)
        n = body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(TTFT_S if i == 0 else ITL_S)
            chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await asyncio.sleep(USAGE_DELAY_S)
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def test_client_measures_known_delays():
    requests = make_workload("fixed", vocab_size=1000, num_requests=3, scale=6 / 128)  # 6 tokens out

    async def scenario():
        runner = web.AppRunner(_stub_app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await run_load(f"http://127.0.0.1:{port}", "stub", requests, max_concurrency=3)
        finally:
            await runner.cleanup()

    results, duration = asyncio.run(scenario())
    slack = 0.3  # a shared, loaded machine
    n = requests[0].max_tokens
    assert n == 6
    for r in results:
        assert r.success, r.error
        assert r.output_tokens == n
        assert len(r.itl) == n - 1
        assert TTFT_S <= r.ttft < TTFT_S + slack
        assert sum(r.itl) == pytest.approx(r.latency - r.ttft)  # ITL: gaps between consecutive chunks
        assert ITL_S * 0.95 <= np.mean(r.itl) < ITL_S + slack
        expected_e2e = TTFT_S + (n - 1) * ITL_S  # the usage chunk after the pause is excluded
        assert expected_e2e <= r.latency < expected_e2e + slack
    m = compute_metrics(results, duration)
    assert m["completed"] == 3 and m["total_output_tokens"] == 3 * n
    assert ITL_S * 1000 <= m["mean_tpot_ms"] < (ITL_S + slack / (n - 1)) * 1000
    assert duration >= TTFT_S + (n - 1) * ITL_S + USAGE_DELAY_S  # duration waits for whole responses


def test_jaxserve_command_is_a_valid_launch_config():
    from benchmarks.peers import jaxserve_serve_command
    from configs.schema import load_config, parse_override

    cmd = jaxserve_serve_command(
        "/ckpt",
        8201,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        enable_prefix_caching=False,
        compile_cache_dir="/tmp/cc",
    )
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    config = load_config(None, dict(parse_override(s) for s in sets))
    assert config.model.path == "/ckpt" and config.server.port == 8201
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.max_num_batched_tokens == 128
    assert config.cache.enable_prefix_caching is False and config.compile.aot is True
    assert config.cache.num_pages == 8 * 64 + 1  # every sequence can reach max_model_len


def test_saturation_variant_is_a_valid_launch_config():
    from benchmarks.peers import jaxserve_serve_command
    from benchmarks.saturation import parse_variant
    from configs.schema import load_config, parse_override

    label, kind, dtype, sets = parse_variant("gil5ms:server.gil_switch_interval_ms=5,scheduler.max_num_seqs=4")
    assert (label, kind, dtype) == ("ours-bf16-gil5ms", "ours", "bfloat16")
    cmd = jaxserve_serve_command(
        "/ckpt", 8201, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=128, dtype=dtype, extra_sets=sets
    )
    config = load_config(None, dict(parse_override(cmd[i + 1]) for i, a in enumerate(cmd) if a == "--set"))
    assert config.server.gil_switch_interval_ms == 5.0 and config.scheduler.max_num_seqs == 4
    assert config.model.dtype == "bfloat16"
    for bad in ("gil5ms", "gil5ms:", ":a=1", "x:a=1,b"):
        with pytest.raises(SystemExit, match="--ours-variant"):
            parse_variant(bad)


# ---- throughput.py's vLLM leg (no vLLM needed) --------------------------------------------------


def _throughput_args(tmp_path, **overrides):
    """The argparse fields throughput.py's vLLM helpers read."""
    fields = dict(
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        repeats=3,
        threads=1,
        vllm_venv=str(tmp_path / "no-such-venv"),
        vllm_timeout=60,
        prefix_caching=False,
    )
    fields.update(overrides)
    return type("Args", (), fields)()


def test_vllm_spec_round_trips_the_workload(tmp_path):
    from benchmarks.throughput import write_vllm_spec
    from benchmarks.vllm_offline import read_spec
    from benchmarks.workloads import BenchRequest

    requests = make_workload("mixed", vocab_size=4096, seed=5, num_requests=9, scale=0.1, max_model_len=256)
    assert len({r.prompt_len for r in requests}) > 1  # a non-uniform workload, order matters
    args = _throughput_args(tmp_path)
    spec = read_spec(write_vllm_spec(tmp_path / "spec.json", "/ckpt", args, requests))
    assert [BenchRequest(tuple(ids), n) for ids, n in spec["requests"]] == requests
    assert summarize([BenchRequest(tuple(ids), n) for ids, n in spec["requests"]]) == summarize(requests)
    assert (
        spec["checkpoint"],
        spec["dtype"],
        spec["max_num_seqs"],
        spec["max_num_batched_tokens"],
        spec["max_model_len"],
        spec["repeats"],
    ) == ("/ckpt", "float32", 4, 64, 256, 3)
    assert spec["enable_prefix_caching"] is False and spec["warmup"] == 2
    (tmp_path / "bad.json").write_text(json.dumps({"checkpoint": "/ckpt", "requests": []}))
    with pytest.raises(ValueError, match="missing keys"):
        read_spec(tmp_path / "bad.json")


def test_vllm_missing_prints_a_note_instead_of_failing(tmp_path, capsys):
    from benchmarks.throughput import run_vllm

    requests = make_workload("fixed", vocab_size=1000, num_requests=2, scale=0.05)
    assert run_vllm("/ckpt", _throughput_args(tmp_path), requests) is None
    note = capsys.readouterr().out
    assert "vLLM: skipped" in note and str(tmp_path / "no-such-venv") in note


def test_vllm_failure_is_reported_with_its_log(tmp_path, capsys):
    """A venv whose python exits non-zero: the result carries the error and the log's tail."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text("#!/bin/sh\necho 'ImportError: no vllm here'\nexit 3\n")
    fake.chmod(0o755)
    from benchmarks.throughput import run_vllm

    requests = make_workload("fixed", vocab_size=1000, num_requests=2, scale=0.05)
    out = run_vllm("/ckpt", _throughput_args(tmp_path, vllm_venv=str(venv)), requests)
    assert out["error"] == "exit 3" and "ImportError: no vllm here" in out["log_tail"]
    assert "vLLM: failed" in capsys.readouterr().out


# ---- bare loop over a ragged workload's own requests -------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_ragged_bare_loop_matches_hf_generate(family, tiny_checkpoint, hf_model):
    """The bare-loop ceiling for mixed workloads runs the requests themselves: its greedy tokens
    (two waves, ragged prompts, outputs cut to each request's max_tokens) are HF's."""
    from benchmarks.bare_loop import run_bare_loop_requests
    from models.model import load_model
    from tests.hf_reference import assert_greedy_match, hf_greedy

    model = load_model(tiny_checkpoint(family))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, model.cfg.vocab_size, size=n).tolist() for n in (5, 23, 17)]
    max_tokens = [6, 3, 9]
    out = run_bare_loop_requests(model, prompts, max_tokens, batch=2, repeats=1)
    assert out["waves"] == 2 and out["output_tokens_per_s"] > 0
    hf = hf_model(family)
    for i, (ids, n) in enumerate(zip(prompts, max_tokens)):
        expected, scores = hf_greedy(hf, ids, n)
        assert len(out["tokens"][i]) == n
        assert_greedy_match(out["tokens"][i], expected, scores, f"{family} request {i}")


def test_benchmark_server_sends_fresh_prompts_per_run(monkeypatch):
    """compare_servers' default: the warm-up and every rate get prompts of their own, so a
    server's prefix cache carries nothing from one run to the next."""
    import benchmarks.serve as serve

    sent = []

    async def fake_run_load(url, model, requests, **kwargs):
        sent.append(list(requests))
        return [], 1.0

    monkeypatch.setattr(serve, "run_load", fake_run_load)
    monkeypatch.setattr(serve, "compute_metrics", lambda results, duration, slo=None: {})
    sets = [make_workload("mixed", vocab_size=500, seed=s, num_requests=3, scale=0.05) for s in (1, 2)]
    warm = make_workload("mixed", vocab_size=500, seed=9, num_requests=2, scale=0.05)
    out = serve.benchmark_server(
        "http://x",
        "stub",
        sets[0],
        rates=[1.0, math.inf],
        concurrencies=[None],
        model="m",
        warmup_requests=warm,
        request_sets=sets,
        verbose=False,
    )
    assert sent == [warm, sets[0], sets[1]] and len(out["runs"]) == 2
    sent.clear()
    serve.benchmark_server(
        "http://x", "stub", sets[0], rates=[1.0, 2.0], concurrencies=[None], model="m", warmup=1, verbose=False
    )  # the old scheme: warm up on the first request
    assert sent == [sets[0][:1], sets[0], sets[0]]
    with pytest.raises(ValueError, match="request sets"):
        serve.benchmark_server(
            "http://x",
            "stub",
            sets[0],
            rates=[1.0, 2.0, 3.0],
            concurrencies=[None],
            model="m",
            request_sets=sets,
            verbose=False,
        )


def test_server_cpu_groups_threads():
    """benchmarks/server_cpu.py: the main thread is the HTTP loop, XLA's pool threads are `xla`,
    the busiest other Python thread is the engine loop, the rest `other`; threads that started
    during the run count from zero."""
    from benchmarks.server_cpu import _classify

    before = {100: ("python", 1.0), 101: ("python", 0.5), 102: ("tf_XLAEigen", 2.0), 103: ("python", 0.1)}
    after = {
        100: ("python", 1.5),
        101: ("python", 1.7),
        102: ("tf_XLAEigen", 4.0),
        103: ("python", 0.3),
        104: ("tf_XLAEigen", 0.25),
        105: ("python", 0.05),
    }
    groups = _classify(100, before, after)
    assert groups == pytest.approx({"http": 0.5, "engine": 1.2, "xla": 2.25, "other": 0.25})


def test_server_cpu_reads_the_engine_process_threads():
    """The engine runs in a child process of the server: its threads count (a real child here)."""
    import os
    import subprocess
    import sys

    from benchmarks.server_cpu import _thread_cpu, process_tree

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in process_tree(os.getpid())
        assert child.pid in _thread_cpu(os.getpid())  # its main thread, by tid
    finally:
        child.kill()
        child.wait(10)


# ---- the roofline profile's matmul count --------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_roofline_times_every_linear_layer_hf_has(family, tiny_checkpoint, hf_model):
    """`benchmarks/roofline.py`'s matmuls-alone ceiling covers exactly the projections of HF's
    model: one matmul per `nn.Linear` of the decoder layers, plus the LM head on the sampling
    rows, with the FLOPs those shapes imply."""
    import torch

    from benchmarks.roofline import _matmul_weights, matmul_ms
    from models.model import load_model

    hf = hf_model(family)
    layers = [m for m in hf.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    per_token = sum(m.in_features * m.out_features for m in layers)
    head = hf.lm_head.in_features * hf.lm_head.out_features
    model = load_model(tiny_checkpoint(family))
    weights, lm_head = _matmul_weights(model.params)
    assert len(weights) == len(layers)
    assert sorted((w.shape[-2], w.shape[-1]) for w in weights) == sorted(
        (m.in_features, m.out_features) for m in layers
    )
    assert (lm_head.shape[-2], lm_head.shape[-1]) == (hf.lm_head.in_features, hf.lm_head.out_features)
    ms, gflop = matmul_ms(model.params, model.dtype, tokens=8, sample_rows=4, reps=1)
    assert ms > 0 and gflop == pytest.approx(2 * (8 * per_token + 4 * head) / 1e9)
