"""P/D end to end: prefill, decode and proxy as three processes on 127.0.0.1.

Greedy completions through `jaxserve proxy` (official `openai` client, non-streaming and
streaming, eight requests in flight) must equal a colocated engine with the decode side's
configuration, whose tokens in turn equal HF `generate` (float KV; with FP8 KV on both sides the
colocated FP8 engine is the reference). 30 prompts per layout: lengths 1, page_size-1, page_size,
page_size+1, >= 200, six sharing a 40-token prefix (prefill-side prefix hits) and varied others.
Then scripted faults, on the dense and the hybrid checkpoint: replayed / malformed / wrong-prompt
transfer ids, an expired lease, clients leaving before / during the pull / mid-stream, the
prefill instance killed between the legs and mid-pull, a decode instance short of pages,
`on_pull_failure: error` over HTTP. Each ends exact (local prefill fallback, counted) or with an
OpenAI error, and every page, slot and lease free on both sides.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from engine_testing import drain
from hf_reference import assert_greedy_match, hf_greedy

from benchmarks.pd_cluster import TOKEN, PDCluster, scrape, wait_all_free
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams

PAGE = 16
MAX_TOKENS = 6
IN_FLIGHT = 8
# Test hook of the jax_transfer connector: sleep between claim and pull (a window to kill in).
PULL_DELAY = {"JAXSERVE_TEST_KV_PULL_DELAY_S": "0.5"}
CLAIMED = r"kv transfer \d+ claimed; test delay"


def _prompts(vocab: int) -> list[list[int]]:
    """30 prompts: the issue's edge lengths first (indices 0-4 are used by the fault tests)."""
    rng = np.random.default_rng(12)
    ids = lambda n: [int(t) for t in rng.integers(3, vocab, n)]
    shared = ids(40)
    lengths = [
        1,
        PAGE - 1,
        PAGE,
        PAGE + 1,
        203,
        250,
        2,
        3,
        5,
        8,
        11,
        23,
        31,
        32,
        33,
        47,
        57,
        64,
        65,
        77,
        90,
        120,
        150,
        211,
    ]
    return [ids(n) for n in lengths] + [shared + ids(k) for k in (1, 3, 5, 9, 17, 30)]


@dataclasses.dataclass(frozen=True)
class Layout:
    family: str
    prefill: tuple = ()
    decode: tuple = ()
    prefill_env: tuple = ()
    decode_env: tuple = ()
    decode_page: int = PAGE
    kv_cache_dtype: str = "auto"  # both sides and the colocated reference
    # FP8 rounds K/V, so an ulp of batch-shape-dependent float32 difference can move a code and
    # flip a near-tie token (colocated FP8 engines too): FP8 layouts run one request at a time
    # on both paths, so the two see the same batches.
    in_flight: int = IN_FLIGHT


FP8 = ("--set", "cache.kv_cache_dtype=fp8_e4m3")
TP2 = (("--set", "parallel.mesh.model=2"), (("JAX_NUM_CPU_DEVICES", "2"),))
TP4 = (("--set", "parallel.mesh.model=4"), (("JAX_NUM_CPU_DEVICES", "4"),))
PAGE32 = ("--set", "cache.page_size=32")
LAYOUTS = {
    "llama": Layout("llama"),
    # FP8 on both sides: pages and scales copied verbatim, the prefill side computes token N
    "llama-fp8": Layout("llama", prefill=FP8, decode=FP8, kv_cache_dtype="fp8_e4m3", in_flight=1),
    # the hybrid bridged: prefill TP 2 on two simulated CPU devices with 16-token pages -> decode
    # on one device with 32-token pages (its faults use the pull delay)
    "qwen3_5-tp2-page32": Layout(
        "qwen3_5",
        prefill=TP2[0],
        decode=PAGE32,
        prefill_env=TP2[1],
        decode_env=tuple(PULL_DELAY.items()),
        decode_page=32,
    ),
    # faults only: a decode instance short of pages that answers errors instead of recomputing
    "llama-faults": Layout(
        "llama",
        decode=(
            "--set",
            "cache.num_pages=14",
            "--set",
            "model.max_model_len=200",
            "--set",
            "kv_transfer.on_pull_failure=error",
        ),
        decode_env=tuple(PULL_DELAY.items()),
    ),
    # slow (pytest -m slow): FP8 above, the dense checkpoint page 16 -> 32, the other hybrids with
    # equal and bridged layouts, and the hybrid with FP8 on both sides (the adopt rule: the
    # prefill side ships the state after all N tokens and its first token, which decode emits)
    "llama-page32": Layout("llama", decode=PAGE32, decode_page=32),
    "qwen3_5": Layout("qwen3_5"),
    "qwen3_5-fp8": Layout("qwen3_5", prefill=FP8, decode=FP8, kv_cache_dtype="fp8_e4m3", in_flight=1),
    "qwen3_5_moe": Layout("qwen3_5_moe"),
    "qwen3_5_moe-tp2-page32": Layout("qwen3_5_moe", prefill=TP2[0], decode=PAGE32, prefill_env=TP2[1], decode_page=32),
    "qwen3_next": Layout("qwen3_next"),
    "qwen3_next-tp2-page32": Layout("qwen3_next", prefill=TP2[0], decode=PAGE32, prefill_env=TP2[1], decode_page=32),
    # 2 KV heads on a decode side of 4 devices: it repeats each head twice (models/sharding.py)
    # and the received pages' heads with them
    "qwen3_next-decode-tp4": Layout("qwen3_next", decode=TP4[0], decode_env=TP4[1]),
    # MLA latent pages (runtime/kv_transfer/latent_layout.py): DeepSeek-V3 float32 with 16 -> 32-token
    # pages (token by token through the latent write), FP8 latent pages and scales copied verbatim,
    # and Kimi Linear (KDA conv + recurrent state slots next to its MLA pages)
    "deepseek_v3": Layout("deepseek_v3", decode=PAGE32, decode_page=32),
    "deepseek_v3-fp8": Layout("deepseek_v3", prefill=FP8, decode=FP8, kv_cache_dtype="fp8_e4m3", in_flight=1),
    "kimi_linear": Layout("kimi_linear"),
    # MLA bridged: prefill TP 5 (the 5 query heads split, latent rows on every device) -> decode
    # on one device with 32-token pages; Kimi's decode side on 2 devices (its MLA and KDA layers
    # whole on each: 5 heads), the pulled arrays replicated onto its mesh
    "deepseek_v3-tp5-page32": Layout(
        "deepseek_v3",
        prefill=("--set", "parallel.mesh.model=5"),
        decode=PAGE32,
        prefill_env=(("JAX_NUM_CPU_DEVICES", "5"),),
        decode_page=32,
    ),
    "kimi_linear-decode-tp2": Layout("kimi_linear", decode=TP2[0], decode_env=TP2[1]),
}
# CI time: FP8 runs one request at a time (~100 s contended), so it joins the slow matrix; the
# verbatim page copy itself runs by default (equal layouts take that path with float32 pages).
SLOW_LAYOUTS = {
    "llama-fp8",
    "llama-page32",
    "qwen3_5",
    "qwen3_5-fp8",
    "qwen3_5_moe",
    "qwen3_5_moe-tp2-page32",
    "qwen3_next",
    "qwen3_next-tp2-page32",
    "qwen3_next-decode-tp4",
    "deepseek_v3",
    "deepseek_v3-fp8",
    "kimi_linear",
    "deepseek_v3-tp5-page32",
    "kimi_linear-decode-tp2",
}
EXACTNESS = [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_LAYOUTS else name
    for name in LAYOUTS
    if name != "llama-faults"
]


def _colocated(cluster, prompts, ignore_eos: bool = False) -> list:
    """The decode side's configuration as one colocated engine (built once per cluster)."""
    if cluster.colocated is None:
        layout = cluster.layout
        cluster.colocated = LLMEngine(
            EngineConfig(
                model=str(cluster.path),
                dtype="float32",
                page_size=layout.decode_page,
                num_pages=96,
                max_num_seqs=4,
                max_num_batched_tokens=64,
                max_model_len=512,
                aot_compile=False,
                kv_cache_dtype=layout.kv_cache_dtype,
            )
        )
    engine, base = cluster.colocated, cluster.colocated.num_steps
    for i, prompt in enumerate(prompts):
        engine.add_request(
            EngineRequest(
                f"r{base}-{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=ignore_eos)
            )
        )
    done = drain(engine)
    return [done[f"r{base}-{i}"].outputs[0] for i in range(len(prompts))]


def _post(url: str, body: dict, token: str | None = TOKEN) -> tuple[int, dict]:
    """POST as the proxy does (with the internal token) or, `token=None`, as any client."""
    headers = {"Content-Type": "application/json", **({"X-KV-Transfer-Token": token} if token else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def cluster(request, tiny_checkpoint):
    layout = LAYOUTS[request.param]
    path = tiny_checkpoint(layout.family)
    with PDCluster(
        path,
        prefill=list(layout.prefill),
        decode=list(layout.decode),
        prefill_env=dict(layout.prefill_env),
        decode_env=dict(layout.decode_env),
    ) as pd:
        pd.layout, pd.family, pd.path, pd.colocated = layout, layout.family, path, None
        pd.client = openai.OpenAI(base_url=pd.proxy_url + "/v1", api_key="x", max_retries=0, timeout=120)
        pd.model = pd.client.models.list().data[0].id
        yield pd
        for process in pd.processes:  # shown with a failure
            print(f"---- {process.name} ----\n" + "".join(process.tail))


def _through_proxy(cluster, prompts) -> list[tuple]:
    """Each prompt non-streaming and streaming, `layout.in_flight` at a time -> [(text, finish reason,
    streamed text, streamed usage.completion_tokens)]."""

    def one(prompt):
        kw = dict(
            model=cluster.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )  # HF generates MAX_TOKENS whatever the tokens
        got = cluster.client.completions.create(**kw)
        chunks = list(cluster.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        return (
            got.choices[0].text,
            got.choices[0].finish_reason,
            "".join(c.choices[0].text for c in chunks if c.choices),
            chunks[-1].usage.completion_tokens,
        )

    with ThreadPoolExecutor(cluster.layout.in_flight) as pool:
        return list(pool.map(one, prompts))


def _settled(url: str) -> dict:
    time.sleep(1.0)  # /metrics reads the engine loop's stats snapshot, refreshed every <= 0.5 s when idle
    return wait_all_free(url, timeout_s=60)


def _assert_all_free(cluster, *, prefill: bool = True) -> None:
    for url in (cluster.decode.url, cluster.prefill.url) if prefill else (cluster.decode.url,):
        m = _settled(url)
        assert m["jaxserve_kv_transfer_leases_held"] == 0 and m["jaxserve_num_requests_running"] == 0, (url, m)
        assert m["jaxserve_kv_pages_free"] + m["jaxserve_kv_pages_cached"] == m["jaxserve_kv_pages_total"], (url, m)
        assert m["jaxserve_state_slots_free"] + m["jaxserve_state_slots_cached"] == m["jaxserve_state_slots_total"]
        assert m.get("jaxserve_kv_transfer_requests_pulling", 0) == 0 and m["jaxserve_num_requests_waiting"] == 0


@pytest.mark.parametrize("cluster", EXACTNESS, indirect=True)
def test_proxy_greedy_equals_colocated_and_hf(cluster, hf_model):
    vocab = hf_model(cluster.family).config.vocab_size
    prompts = _prompts(min(vocab, 1000))
    if cluster.layout.in_flight == 1:
        expected = [_colocated(cluster, [prompt], ignore_eos=True)[0] for prompt in prompts]
    else:
        expected = _colocated(cluster, prompts, ignore_eos=True)
    if cluster.layout.kv_cache_dtype == "auto":  # float KV: the colocated engine equals HF
        for i, (prompt, want) in enumerate(zip(prompts, expected)):
            hf_tokens, scores = hf_greedy(hf_model(cluster.family), prompt, MAX_TOKENS)
            assert_greedy_match(want.token_ids, hf_tokens, scores, f"colocated prompt {i} (len {len(prompt)})")
    before_d, before_p = scrape(cluster.decode.url), scrape(cluster.prefill.url)
    for i, (got, want) in enumerate(zip(_through_proxy(cluster, prompts), expected)):
        text, finish, streamed, usage = got
        assert text == want.text, f"prompt {i} (len {len(prompts[i])})"
        assert finish == want.finish_reason and streamed == want.text, f"stream prompt {i}"
        assert usage == len(want.token_ids)
    decode, prefill = _settled(cluster.decode.url), _settled(cluster.prefill.url)
    delta = lambda m, b, k: m[f"jaxserve_kv_transfer_{k}"] - b[f"jaxserve_kv_transfer_{k}"]
    pulled = 2 * sum(len(p) > 1 for p in prompts)
    assert delta(decode, before_d, "transfers_started") == pulled, decode
    assert delta(decode, before_d, "fallbacks") == 0
    assert delta(prefill, before_p, "transfers_completed") == pulled, prefill
    assert prefill["jaxserve_prefix_cache_hit_rate"] > 0  # the shared prefix, and every repeat
    _assert_all_free(cluster)


@pytest.mark.parametrize("cluster", ["llama"], indirect=True)
def test_chat_through_proxy_equals_prefill_instance_alone(cluster):
    """A prefill instance answers requests without transfer parameters like `both`: the colocated
    reference for the server-side chat template path."""
    messages = [{"role": "user", "content": "Name three colours and a fruit."}]
    direct = openai.OpenAI(base_url=cluster.prefill.url + "/v1", api_key="x", max_retries=0, timeout=120)
    want = direct.chat.completions.create(model=cluster.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    got = cluster.client.chat.completions.create(
        model=cluster.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=2
    )
    assert got.choices[0].message.content == want.choices[0].message.content
    assert len(got.choices[0].logprobs.content) == got.usage.completion_tokens


def _prefill_leg(cluster, prompt, **params) -> dict:
    """The proxy's first leg by hand (`lease_s=2`: this request's state is held for 2 s only)."""
    status, body = _post(
        cluster.prefill.url + "/v1/completions",
        {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, **params}},
    )
    assert status == 200, body
    return body["kv_transfer_params"]


def _decode_leg(cluster, prompt, params) -> str:
    status, body = _post(
        cluster.decode.url + "/v1/completions",
        {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": params},
    )
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["qwen3_5-fp8"], indirect=True)
def test_hybrid_fp8_adopted_first_token_once_or_local_prefill(cluster):
    """The adopt rule through the proxy: `max_tokens: 1` is answered by the adopted token alone
    (once, streamed once, usage 1); a request asking for logprobs cannot adopt the prefill side's
    greedy token (no logprobs shipped) and prefills locally, exactly, counted; nothing left held."""
    prompt = _prompts(500)[3]
    want = _colocated(cluster, [prompt])[0].text  # (builds cluster.colocated)
    cluster.colocated.add_request(EngineRequest("one", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
    want_one = drain(cluster.colocated)["one"].outputs[0].text
    before = scrape(cluster.decode.url)
    kw = dict(model=cluster.model, prompt=prompt, temperature=0)
    got = cluster.client.completions.create(**kw, max_tokens=1)
    assert (got.choices[0].text, got.choices[0].finish_reason, got.usage.completion_tokens) == (want_one, "length", 1)
    chunks = list(
        cluster.client.completions.create(**kw, max_tokens=1, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want_one
    assert chunks[-1].usage.completion_tokens == 1
    got = cluster.client.completions.create(**kw, max_tokens=MAX_TOKENS, logprobs=1)
    assert got.choices[0].text == want and len(got.choices[0].logprobs.tokens) == got.usage.completion_tokens
    decode = _settled(cluster.decode.url)
    assert decode["jaxserve_kv_transfer_fallbacks"] - before["jaxserve_kv_transfer_fallbacks"] == 1, decode
    _assert_all_free(cluster)


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
    expired = _prefill_leg(cluster, prompt, lease_s=2)
    assert expired["lease_s"] == 2  # a request may ask for a shorter hold than the instance's 60 s
    time.sleep(3.0)  # the prefill side frees it first
    assert _decode_leg(cluster, prompt, expired) == want
    time.sleep(1.0)  # /metrics reads the engine loop's stats snapshot, refreshed every <= 0.5 s when idle
    decode, prefill = wait_all_free(cluster.decode.url), wait_all_free(cluster.prefill.url)
    assert decode["jaxserve_kv_transfer_fallbacks"] - before == 4, decode
    assert prefill["jaxserve_kv_transfer_leases_expired"] >= 1 and prefill["jaxserve_kv_transfer_claims_refused"] >= 2
    for metrics, url in ((decode, cluster.decode.url), (prefill, cluster.prefill.url)):
        assert metrics["jaxserve_kv_transfer_leases_held"] == 0, url


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["deepseek_v3"], indirect=True)
def test_mla_tampered_layout_refused_decode_keeps_serving(cluster):
    """A descriptor whose latent rows were resized, or whose MLA split names another checkpoint's,
    is refused by the decode instance before it pulls (the log says which field; the request is
    prefilled locally, exact, counted); the untampered transfer after them goes through."""
    prompt = _prompts(500)[3]
    want = _colocated(cluster, [prompt])[0].text
    before = scrape(cluster.decode.url)["jaxserve_kv_transfer_fallbacks"]
    params = _prefill_leg(cluster, prompt)
    wide = json.loads(json.dumps(params))
    wide["descriptor"]["arrays"][0][1][2] += 1
    assert _decode_leg(cluster, prompt, wide) == want
    split = json.loads(json.dumps(params))
    split["descriptor"]["model"]["mla"]["kv_lora_rank"] -= 2
    split["descriptor"]["model"]["mla"]["qk_rope_head_dim"] += 2
    assert _decode_leg(cluster, prompt, split) == want
    assert _decode_leg(cluster, prompt, params) == want  # the lease is still there: pulled
    time.sleep(1.0)  # /metrics reads the engine loop's stats snapshot, refreshed every <= 0.5 s when idle
    decode = wait_all_free(cluster.decode.url)
    assert decode["jaxserve_kv_transfer_fallbacks"] - before == 2, decode
    log = "".join(cluster.decode.tail)
    assert "latent width (kv_lora_rank + qk_rope_head_dim)" in log and "model mismatch" in log, log[-3000:]
    _assert_all_free(cluster)


@pytest.mark.parametrize("cluster", ["llama"], indirect=True)
def test_pd_ports_fail_closed_over_http(cluster):
    """Issue 29 over HTTP: transfer parameters from a client without the token are a 400 naming
    the field, and the decode instance dials nothing (the test's own listener sees no
    connection); the control port refuses claims without the token; malformed descriptors (they
    used to kill the engine) are prefilled locally, exact, and the instance keeps serving."""
    import socket

    prompt = _prompts(500)[3]
    want = _colocated(cluster, [prompt])[0].text
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    try:
        port = listener.getsockname()[1]
        params = _prefill_leg(cluster, prompt)
        lure = {**params, "control_url": f"http://127.0.0.1:{port}"}
        for url, transfer in ((cluster.decode.url, lure), (cluster.prefill.url, {"do_remote_decode": True})):
            for token in (None, "a-wrong-token-0123456789"):
                status, body = _post(
                    url + "/v1/completions",
                    {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": transfer},
                    token=token,
                )
                assert status == 400 and body["error"]["param"] == "kv_transfer_params", body
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
    claim = {
        "transfer_id": params["transfer_id"],
        "token_digest": params["descriptor"]["token_digest"],
        "model_fingerprint": params["descriptor"]["model"]["fingerprint"],
    }
    assert _post(params["control_url"] + "/kv_transfer/claim", claim, token=None)[0] == 401
    assert _decode_leg(cluster, prompt, params) == want  # the genuine offer is still there, pulled
    desc = params["descriptor"]
    for bad in (
        {**desc, "kv_dtype": None},
        {k: v for k, v in desc.items() if k != "kv_dtype"},
        {**desc, "kv_dtype": "float64"},
        {**desc, "num_pages": 3},
        {**desc, "page_size": 3},
    ):
        assert _decode_leg(cluster, prompt, {**params, "descriptor": bad}) == want
        with urllib.request.urlopen(cluster.decode.url + "/health", timeout=10) as response:
            assert response.status == 200
    other = _prompts(500)[5]
    assert _decode_leg(cluster, other, None) == _colocated(cluster, [other])[0].text
    _assert_all_free(cluster)


@pytest.mark.parametrize("cluster", ["llama"], indirect=True)
def test_client_disconnects_free_both_sides(cluster):
    import asyncio

    import aiohttp

    async def leave_early(i):
        body = {
            "model": cluster.model,
            "prompt": _prompts(500)[4][: 100 + i],
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        }
        async with aiohttp.ClientSession() as session:
            async with session.post(cluster.proxy_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readline()  # the first event: the decode leg is running

    async def leave_before(i):  # gone during the prefill leg
        body = {"model": cluster.model, "prompt": _prompts(500)[4][: 150 + i], "max_tokens": 5}
        async with aiohttp.ClientSession() as session:
            try:
                await asyncio.wait_for(session.post(cluster.proxy_url + "/v1/completions", json=body), 0.05)
            except TimeoutError:
                pass

    async def run():
        await asyncio.gather(*(leave_early(i) for i in range(3)), *(leave_before(i) for i in range(3)))

    asyncio.run(run())
    for url in (cluster.decode.url, cluster.prefill.url):
        metrics = wait_all_free(url, timeout_s=60)
        assert metrics["jaxserve_kv_transfer_leases_held"] == 0 and metrics["jaxserve_num_requests_running"] == 0, url
        assert (
            metrics["jaxserve_kv_pages_free"] + metrics["jaxserve_kv_pages_cached"]
            == metrics["jaxserve_kv_pages_total"]
        )


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


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        try:
            result["value"] = fn(*args)
        except Exception as err:
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _complete(cluster, prompt) -> str:
    got = cluster.client.completions.create(model=cluster.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return got.choices[0].text


def _leave_during_pull(cluster, prompt) -> None:
    """Send a request to the proxy and close the connection once the decode side has claimed."""
    mark = cluster.decode.num_lines
    address = urllib.parse.urlsplit(cluster.proxy_url)
    conn = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"model": cluster.model, "prompt": prompt, "max_tokens": MAX_TOKENS}),
            {"Content-Type": "application/json"},
        )
        cluster.decode.wait_for_line(CLAIMED, since=mark)
    finally:
        conn.close()


@pytest.mark.parametrize("cluster", ["qwen3_5-tp2-page32"], indirect=True)
def test_hybrid_faults_free_state_slots_on_both_sides(cluster):
    """Expired lease, a client leaving during the pull, the prefill instance killed mid-pull
    (after the claim, inside the connector's test delay): every answer exact via local prefill,
    every page, state slot and lease free. Last of this cluster's tests: kills its prefill."""
    prompts = _prompts(500)
    want = {i: out.text for i, out in zip((3, 4), _colocated(cluster, [prompts[3], prompts[4]]))}
    before = scrape(cluster.decode.url)["jaxserve_kv_transfer_fallbacks"]
    expired = _prefill_leg(cluster, prompts[3], lease_s=2)
    time.sleep(3.0)  # the prefill side frees it first
    assert _decode_leg(cluster, prompts[3], expired) == want[3]
    _leave_during_pull(cluster, prompts[4][:180])
    _assert_all_free(cluster)

    mark = cluster.decode.num_lines
    thread, result = _in_thread(_complete, cluster, prompts[4])
    cluster.decode.wait_for_line(CLAIMED, since=mark)
    cluster.prefill.kill()
    thread.join(120)
    assert result.get("value") == want[4], result
    decode = _settled(cluster.decode.url)
    assert decode["jaxserve_kv_transfer_fallbacks"] - before == 2, decode
    _assert_all_free(cluster, prefill=False)


@pytest.mark.parametrize("cluster", ["llama-faults"], indirect=True)
def test_decode_short_of_pages_queues_and_stays_exact(cluster):
    """14 pages of 16 tokens on decode, six ~130-token prompts at once: queued, all exact."""
    rng = np.random.default_rng(30)
    prompts = [[int(t) for t in rng.integers(3, 500, 120 + 5 * i)] for i in range(6)]
    expected = _colocated(cluster, prompts)
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _complete(cluster, p), prompts))
    assert got == [out.text for out in expected]
    assert scrape(cluster.decode.url)["jaxserve_kv_transfer_errors"] == 0
    _assert_all_free(cluster)


@pytest.mark.parametrize("cluster", ["llama-faults"], indirect=True)
def test_pull_failure_error_reaches_the_client_through_the_proxy(cluster):
    """`on_pull_failure: error`: the prefill instance killed mid-pull -> an OpenAI error JSON
    through the proxy, nothing held. Last of this cluster's tests: kills its prefill."""
    mark = cluster.decode.num_lines
    thread, result = _in_thread(_complete, cluster, _prompts(500)[4][:150])  # decode max_model_len 200
    cluster.decode.wait_for_line(CLAIMED, since=mark)
    cluster.prefill.kill()
    thread.join(120)
    err = result.get("error")
    # the server's generic 500 for engine errors (the reason is in the decode instance's log)
    assert isinstance(err, openai.InternalServerError) and err.body["type"] == "internal_error", result
    assert scrape(cluster.decode.url)["jaxserve_kv_transfer_errors"] >= 1
    _assert_all_free(cluster, prefill=False)
