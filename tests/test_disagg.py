"""P/D end to end: prefill, decode and proxy as three processes on 127.0.0.1.

Greedy completions through `jaxserve proxy` (official `openai` client, non-streaming and
streaming) must equal a colocated engine on the same checkpoint, whose tokens in turn equal HF
`generate`; prompts of 1, page_size-1, page_size, page_size+1 and >= 200 tokens and two sharing
a prefix (a prefill-side prefix hit). Then scripted faults: replayed / malformed transfer ids, an
expired lease, a client leaving mid-stream, the prefill instance gone; each ends with a correct
answer (local prefill fallback, counted) and every page, slot and lease free on both sides.
"""

from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import openai
import pytest
from engine_testing import drain
from hf_reference import assert_greedy_match, hf_greedy
from pd_testing import PDCluster, scrape, wait_all_free

from runtime.engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams

PAGE = 16
MAX_TOKENS = 6


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(12)
    ids = lambda n: [int(t) for t in rng.integers(3, vocab, n)]  # noqa: E731
    shared = ids(40)
    return [ids(1), ids(PAGE - 1), ids(PAGE), ids(PAGE + 1), ids(203), shared + ids(5), shared + ids(9)]


# name -> (family, prefill flags, decode flags, prefill env): equal layouts, and the bridged one
# (prefill: TP 2 on two simulated CPU devices, page 16; decode: one device, page 32).
LAYOUTS = {
    "llama": ("llama", [], [], {}),
    "qwen3_5": ("qwen3_5", [], [], {}),
    "qwen3_5-tp2-page32": ("qwen3_5", ["--set", "parallel.mesh.model=2"], ["--set", "cache.page_size=32"],
                           {"JAX_NUM_CPU_DEVICES": "2"}),
}


def _colocated(cluster, prompts) -> list:
    """The decode side's configuration as one colocated engine (built once per cluster)."""
    if cluster.colocated is None:
        cluster.colocated = LLMEngine(EngineConfig(
            model=str(cluster.path), dtype="float32", page_size=cluster.decode_page, num_pages=96, max_num_seqs=4,
            max_num_batched_tokens=64, max_model_len=512, aot_compile=False))
    engine, base = cluster.colocated, cluster.colocated.num_steps
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{base}-{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)))
    done = drain(engine)
    return [done[f"r{base}-{i}"].outputs[0] for i in range(len(prompts))]


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def cluster(request, tiny_checkpoint):
    family, prefill, decode, env = LAYOUTS[request.param]
    path = tiny_checkpoint(family)
    with PDCluster(path, prefill=["--set", "kv_transfer.lease_s=3", *prefill], decode=decode,
                   prefill_env=env) as pd:
        pd.family, pd.path, pd.colocated = family, path, None
        pd.decode_page = 32 if "page32" in request.param else PAGE
        pd.client = openai.OpenAI(base_url=pd.proxy_url + "/v1", api_key="x", max_retries=0, timeout=120)
        pd.model = pd.client.models.list().data[0].id
        yield pd


# CI time: the hybrid runs by default in the bridged layout; equal layouts for the hybrids (the
# same code path) run with `pytest -m slow`.
SLOW_LAYOUTS = {"qwen3_5", "qwen3_5_moe", "qwen3_next"}
LAYOUTS.update({name: (name, [], [], {}) for name in sorted(SLOW_LAYOUTS - {"qwen3_5"})})


@pytest.mark.parametrize("cluster", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_LAYOUTS else name
                                     for name in LAYOUTS], indirect=True)
def test_proxy_greedy_equals_colocated_and_hf(cluster, hf_model):
    vocab = hf_model(cluster.family).config.vocab_size
    prompts = _prompts(min(vocab, 1000))
    expected = _colocated(cluster, prompts)
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        hf_tokens, scores = hf_greedy(hf_model(cluster.family), prompt, MAX_TOKENS)
        assert_greedy_match(want.token_ids, hf_tokens, scores, f"colocated prompt {i} (len {len(prompt)})")
        got = cluster.client.completions.create(model=cluster.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0)
        assert got.choices[0].text == want.text, f"prompt {i} (len {len(prompt)})"
        assert got.choices[0].finish_reason == want.finish_reason
        stream = cluster.client.completions.create(model=cluster.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text, f"stream prompt {i}"
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    time.sleep(1.0)  # /metrics reads the engine loop's stats snapshot, refreshed every <= 0.5 s when idle
    decode, prefill = wait_all_free(cluster.decode.url), wait_all_free(cluster.prefill.url)
    pulled = 2 * sum(len(p) > 1 for p in prompts)
    assert decode["jaxserve_kv_transfer_transfers_started"] == pulled, decode
    assert decode["jaxserve_kv_transfer_fallbacks"] == 0
    assert prefill["jaxserve_kv_transfer_transfers_completed"] == pulled, prefill
    assert prefill["jaxserve_prefix_cache_hit_rate"] > 0  # the shared prefix, and every repeat
    for metrics in (decode, prefill):
        assert metrics["jaxserve_kv_transfer_leases_held"] == 0 and metrics["jaxserve_kv_pages_total"] > 0


@pytest.mark.parametrize("cluster", ["llama"], indirect=True)
def test_chat_through_proxy_equals_prefill_instance_alone(cluster):
    """A prefill instance answers requests without transfer parameters like `both`: the colocated
    reference for the server-side chat template path."""
    messages = [{"role": "user", "content": "Name three colours and a fruit."}]
    direct = openai.OpenAI(base_url=cluster.prefill.url + "/v1", api_key="x", max_retries=0, timeout=120)
    want = direct.chat.completions.create(model=cluster.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    got = cluster.client.chat.completions.create(model=cluster.model, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, logprobs=True, top_logprobs=2)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert len(got.choices[0].logprobs.content) == got.usage.completion_tokens


def _prefill_leg(cluster, prompt) -> dict:
    status, body = _post(cluster.prefill.url + "/v1/completions",
                         {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, body
    return body["kv_transfer_params"]


def _decode_leg(cluster, prompt, params) -> str:
    status, body = _post(cluster.decode.url + "/v1/completions",
                         {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": params})
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.mark.parametrize("cluster", ["llama"], indirect=True)
def test_replayed_malformed_and_expired_transfers_fall_back_exactly(cluster):
    prompt = _prompts(500)[3]
    want = _colocated(cluster, [prompt])[0].text
    before = scrape(cluster.decode.url)["jaxserve_kv_transfer_fallbacks"]
    params = _prefill_leg(cluster, prompt)
    assert _decode_leg(cluster, prompt, params) == want  # pulled
    assert _decode_leg(cluster, prompt, params) == want  # replayed: claim refused -> local prefill
    forged = {**params, "transfer_id": "not-a-number"}
    assert _decode_leg(cluster, prompt, forged) == want  # malformed
    other = _prompts(500)[4]
    assert _decode_leg(cluster, other, params) == _colocated(cluster, [other])[0].text  # wrong prompt
    expired = _prefill_leg(cluster, prompt)
    time.sleep(4.0)  # lease_s=3: the prefill side frees it first
    assert _decode_leg(cluster, prompt, expired) == want
    time.sleep(1.0)  # /metrics reads the engine loop's stats snapshot, refreshed every <= 0.5 s when idle
    decode, prefill = wait_all_free(cluster.decode.url), wait_all_free(cluster.prefill.url)
    assert decode["jaxserve_kv_transfer_fallbacks"] - before == 4, decode
    assert prefill["jaxserve_kv_transfer_leases_expired"] >= 1 and prefill["jaxserve_kv_transfer_claims_refused"] >= 2
    for metrics, url in ((decode, cluster.decode.url), (prefill, cluster.prefill.url)):
        assert metrics["jaxserve_kv_transfer_leases_held"] == 0, url


@pytest.mark.parametrize("cluster", ["llama"], indirect=True)
def test_client_disconnects_free_both_sides(cluster):
    import aiohttp
    import asyncio

    async def leave_early(i):
        body = {"model": cluster.model, "prompt": _prompts(500)[4][:100 + i], "max_tokens": 200, "stream": True,
                "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(cluster.proxy_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readline()  # the first event: the decode leg is running

    async def leave_before(i):  # gone during the prefill leg
        body = {"model": cluster.model, "prompt": _prompts(500)[4][:150 + i], "max_tokens": 5}
        async with aiohttp.ClientSession() as session:
            try:
                await asyncio.wait_for(session.post(cluster.proxy_url + "/v1/completions", json=body), 0.05)
            except asyncio.TimeoutError:
                pass

    async def run():
        await asyncio.gather(*(leave_early(i) for i in range(3)), *(leave_before(i) for i in range(3)))

    asyncio.run(run())
    for url in (cluster.decode.url, cluster.prefill.url):
        metrics = wait_all_free(url, timeout_s=60)
        assert metrics["jaxserve_kv_transfer_leases_held"] == 0 and metrics["jaxserve_num_requests_running"] == 0, url
        assert metrics["jaxserve_kv_pages_free"] + metrics["jaxserve_kv_pages_cached"] == metrics["jaxserve_kv_pages_total"]


@pytest.mark.parametrize("cluster", ["llama"], indirect=True)
def test_prefill_instance_gone_decode_prefills_locally(cluster):
    """Last of the llama cluster's tests: kills its prefill instance."""
    prompt = _prompts(500)[2]
    want = _colocated(cluster, [prompt])[0].text
    params = _prefill_leg(cluster, prompt)
    cluster.prefill.kill()
    assert _decode_leg(cluster, prompt, params) == want
    got = cluster.client.completions.create(model=cluster.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == want  # the proxy's prefill leg fails: decode prefills locally
    assert wait_all_free(cluster.decode.url)["jaxserve_kv_transfer_requests_pulling"] == 0
