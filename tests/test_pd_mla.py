"""P/D of MLA latent pages (DeepSeek-V3) and of Kimi Linear (MLA pages + KDA state slots), in one process.

A test double connector (arrays handed over in a module dict) carries requests between a
prefill-role and a decode-role engine; references: a colocated engine with the decode side's
configuration, and HF `generate` for it (float KV). Checked: the latent descriptor validated
entry by entry without an engine (fast); DeepSeek-V3 greedy P/D == colocated == HF with a
prefill-side prefix hit, page 16 -> 32, FP8 latent pages on both sides (pages and scales copied
verbatim) and float32 -> FP8 (requantized by the decode side's own write: layer-0 pages and
scales against a colocated FP8 engine); tampered descriptors and pulled FP8 scales refused
(prefilled locally, counted) while the decode engine keeps serving; Kimi Linear (KDA conv +
recurrent state next to MLA pages) P/D == colocated == HF, and with FP8 on both sides the adopt
rule == a colocated FP8 engine. The
three-process versions over the proxy are tests/test_disagg.py's `deepseek_v3*` / `kimi_linear` layouts.
"""

from __future__ import annotations

import copy
import itertools

import jax
import numpy as np
import pytest
from engine_testing import drain, small_engine_config
from hf_reference import assert_greedy_match, hf_greedy

from models.config import ATTENTION, parse_config
from models.safetensors_io import read_json
from runtime.engine.llm_engine import LLMEngine
from runtime.kv_transfer import KV_CONNECTORS, KVConnector, KVTransferConfig, PullResult, TransferError
from runtime.kv_transfer.descriptor import build_descriptor, check_descriptor, model_signature
from runtime.kv_transfer.latent_layout import check_pulled_scales
from runtime.kv_transfer.layout import expected_arrays
from runtime.types import EngineRequest, SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
STORE: dict[str, list] = {}
_ids = itertools.count(1)


class InProcess(KVConnector):
    """Offered arrays wait in STORE; a pull takes them once (an unknown id fails the pull)."""

    def __init__(self, config):
        super().__init__(config)
        self._done = []

    def offer(self, arrays, descriptor):
        transfer_id = str(next(_ids))
        STORE[transfer_id] = arrays
        return {"transfer_id": transfer_id, "descriptor": descriptor}

    def start_pull(self, key, params, descriptor, specs):
        arrays = STORE.pop(params.get("transfer_id"), None)
        if arrays is None:
            self._done.append(PullResult(key, error="unknown or already pulled transfer id"))
        else:
            self._done.append(PullResult(key, arrays=[jax.device_put(a, s.sharding) for a, s in zip(arrays, specs)]))

    def poll(self):
        done, self._done = self._done, []
        return done

    def cancel(self, key):
        pass


CONNECTOR = "test_inprocess_mla"
if CONNECTOR not in KV_CONNECTORS:
    KV_CONNECTORS.register(CONNECTOR, InProcess)


def _prompts(n_shared_prefix: int = 40) -> list[list[int]]:
    """Lengths 1, 15, 16, 17, 70 and two sharing a 40-token prefix (the second: a prefix hit)."""
    rng = np.random.default_rng(7)
    ids = lambda n: [int(t) for t in rng.integers(3, 500, n)]
    shared = ids(n_shared_prefix)
    return [ids(n) for n in (1, 15, 16, 17, 70)] + [shared + ids(5), shared + ids(9)]


def _run(engine, prompt, params=None, rid="r", sampling=GREEDY):
    engine.add_request(EngineRequest(rid, prompt, sampling, kv_transfer_params=params))
    return drain(engine)[rid]


def _all_free(engine):
    s = engine.stats()
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"], s
    assert s["slots_free"] + s["slots_cached"] == s["slots_total"], s
    assert s.get("kv_transfer_requests_pulling", 0) == 0


def _engines(path, prefill=None, decode=None, colocated=None):
    role = lambda r: KVTransferConfig(role=r, connector=CONNECTOR)
    return (
        LLMEngine(small_engine_config(path, kv_transfer=role("prefill"), **(prefill or {}))),
        LLMEngine(small_engine_config(path, kv_transfer=role("decode"), **(decode or {}))),
        LLMEngine(small_engine_config(path, **(colocated if colocated is not None else decode or {}))),
    )


def _check_pd(prefill, decode, colocated, prompts, hf=None, tag=""):
    """Each prompt through prefill -> decode equals the colocated engine (and HF when given)."""
    for i, prompt in enumerate(prompts):
        want = _run(colocated, prompt, rid=f"c{tag}{i}").outputs[0].token_ids
        if hf is not None:
            hf_tokens, scores = hf_greedy(hf, prompt, MAX_TOKENS)
            assert_greedy_match(want, hf_tokens, scores, f"colocated prompt {i} (len {len(prompt)})")
        params = _run(prefill, prompt, {"do_remote_decode": True}, rid=f"p{tag}{i}").kv_transfer_params
        assert (params is None) == (len(prompt) == 1)
        got = _run(decode, prompt, params, rid=f"d{tag}{i}").outputs[0].token_ids
        assert got == want, f"prompt {i} (len {len(prompt)})"
    return params


# ---- the descriptor of an MLA model, checked without an engine ------------------------------------


def _cfg(tiny_checkpoint, family):
    return parse_config(read_json(tiny_checkpoint(family) / "config.json"))


def _latent_descriptor(cfg, prompt, kv_dtype="float32", num_groups=None):
    """A descriptor as the prefill side builds it for 33 tokens in 16-token pages (4 padded pages)."""
    G = num_groups or cfg.num_layers // cfg.layer_period()
    sig = model_signature(cfg, G, fingerprint="f" * 64)
    wire = "float32" if kv_dtype == "float32" else "uint8"
    arrays = []
    for j, kind in enumerate(sig["layer_types"]):
        if kind == ATTENTION:
            arrays.append([f"kv{j}.c", [G * 4, 16, cfg.mla.latent_width], wire])
            if kv_dtype != "float32":
                arrays.append([f"kv{j}.c_scale", [G * 4], "float32"])
        else:
            arrays += [[f"conv{j}", [G] + sig["conv"], "float32"], [f"rec{j}", [G] + sig["rec"], "float32"]]
    desc = build_descriptor(
        prompt_token_ids=prompt,
        num_tokens=len(prompt) - 1,
        page_size=16,
        num_pages=4,
        kv_dtype=kv_dtype,
        kv_wire="values" if kv_dtype == "float32" else "bits",
        signature=sig,
        arrays=arrays,
    )
    return desc, sig


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_linear"])
def test_latent_descriptor_validated_field_by_field(tiny_checkpoint, family):
    """What a prefill side of this model sends is accepted; each tampered field is refused with a
    message naming it: width, page count, page size, dtype, a missing FP8 scale, the MLA split
    (same width, other kv_lora_rank), a GQA page list in place of the latent rows."""
    cfg = _cfg(tiny_checkpoint, family)
    prompt = list(range(3, 37))  # 34 tokens: 33 shipped
    for kv_dtype in ("float32", "float8_e4m3fn"):
        desc, sig = _latent_descriptor(cfg, prompt, kv_dtype)
        assert check_descriptor(desc, prompt_token_ids=prompt, signature=sig) == 33
        assert expected_arrays(desc, cfg) == desc["arrays"]
    j = next(i for i, kind in enumerate(sig["layer_types"]) if kind == ATTENTION)
    k = [name for name, _, _ in desc["arrays"]].index(f"kv{j}.c")

    def refused(edit, match, check=expected_arrays):
        bad = copy.deepcopy(desc)
        edit(bad)
        with pytest.raises(TransferError, match=match):
            if check is expected_arrays:
                expected_arrays(bad, cfg)
            else:
                check_descriptor(bad, prompt_token_ids=prompt, signature=sig)

    width = cfg.mla.latent_width
    refused(lambda d: d["arrays"][k][1].__setitem__(2, width - 1), rf"latent width .*{width - 1}.* expects {width}")
    refused(lambda d: d["arrays"][k][1].__setitem__(0, 999), r"kv\d\.c: rows .* 999")
    refused(lambda d: d["arrays"][k][1].__setitem__(1, 32), r"kv\d\.c: page size 32, this model expects 16")
    refused(lambda d: d["arrays"][k].__setitem__(2, "uint16"), r"wire dtype 'uint16'.*'uint8'")
    refused(lambda d: d["arrays"].pop(k + 1), r"carries \d+ arrays; this MLA model expects \d+")
    refused(lambda d: d["arrays"].__setitem__(k, [f"kv{j}.k", [4, 1, 16, 8], "uint8"]), r"'kv\d\.k' where .*'kv\d\.c'")
    refused(lambda d: d.__setitem__("kv_dtype", "float32"), r"kv_wire 'bits' does not fit", check_descriptor)
    split = dict(
        sig["mla"], kv_lora_rank=sig["mla"]["kv_lora_rank"] - 2, qk_rope_head_dim=sig["mla"]["qk_rope_head_dim"] + 2
    )
    refused(lambda d: d["model"].__setitem__("mla", split), "model mismatch", check_descriptor)
    refused(lambda d: d["model"].pop("mla"), "model mismatch", check_descriptor)
    # pulled FP8 scales of the used pages must be finite and positive (padding pages are not read)
    arrays = [np.ones(shape, np.float32 if dtype == "float32" else np.uint8) for _, shape, dtype in desc["arrays"]]
    check_pulled_scales(arrays, desc, cfg)
    for value in (np.nan, 0.0, -1.0, np.inf):
        bad = [a.copy() for a in arrays]
        bad[k + 1][0] = value
        with pytest.raises(TransferError, match=rf"pulled kv{j}\.c_scale holds scales that are not finite"):
            check_pulled_scales(bad, desc, cfg)
    bad = [a.copy() for a in arrays]
    bad[k + 1][3] = np.nan  # page 3 of group 0: padding (33 tokens fill 3 pages)
    check_pulled_scales(bad, desc, cfg)


# ---- engines: DeepSeek-V3 -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek(tiny_checkpoint):
    """Prefill (page 16), decode (page 32) and a colocated engine like the decode side, built once."""
    return _engines(tiny_checkpoint("deepseek_v3"), decode=dict(page_size=32))


def test_deepseek_pd_equals_colocated_and_hf(deepseek, hf_model, tiny_checkpoint):
    """Latent rows of 16-token pages written token by token into 32-token pages; the two prompts
    sharing 40 tokens hit the prefill side's prefix cache; a replayed transfer id is refused and
    the request prefilled locally (exact, counted); nothing held afterwards."""
    prefill, decode, colocated = deepseek
    params = _check_pd(prefill, decode, colocated, _prompts(), hf_model("deepseek_v3"))
    hf = read_json(tiny_checkpoint("deepseek_v3") / "config.json")
    mla = {"kv_lora_rank": hf["kv_lora_rank"], "qk_rope_head_dim": hf["qk_rope_head_dim"], "rope": True}
    assert params["descriptor"]["model"]["mla"] == mla
    assert prefill.stats()["prefix_cache_hit_rate"] > 0
    assert decode.stats()["kv_transfer_fallbacks"] == 0
    prompt = _prompts()[-1]
    want = _run(colocated, prompt, rid="c-replay").outputs[0].token_ids
    assert _run(decode, prompt, params, rid="d-replay").outputs[0].token_ids == want  # already pulled
    assert decode.stats()["kv_transfer_fallbacks"] == 1
    for engine in deepseek:
        _all_free(engine)


def test_deepseek_tampered_descriptor_refused_decode_keeps_serving(deepseek):
    """A descriptor whose latent width, MLA split or page list was changed is refused before a
    byte is pulled (the request prefilled locally, exact, counted); a decode instance answering
    errors instead says why; the next untampered transfer goes through."""
    prefill, decode, colocated = deepseek
    prompt = _prompts()[3]
    want = _run(colocated, prompt, rid="c-t").outputs[0].token_ids
    edits = {
        "width": lambda d: d["arrays"][0][1].__setitem__(2, d["arrays"][0][1][2] + 1),
        "split": lambda d: d["model"]["mla"].update(kv_lora_rank=30, qk_rope_head_dim=10),
        "pages": lambda d: d["arrays"][0][1].__setitem__(0, d["arrays"][0][1][0] * 2),
    }
    for i, edit in enumerate(edits.values()):
        before = decode.stats()["kv_transfer_fallbacks"]
        params = _run(prefill, prompt, {"do_remote_decode": True}, rid=f"p-t{i}").kv_transfer_params
        params = copy.deepcopy(params)  # as over HTTP: the prefill side's own signature untouched
        edit(params["descriptor"])
        assert _run(decode, prompt, params, rid=f"d-t{i}").outputs[0].token_ids == want
        assert decode.stats()["kv_transfer_fallbacks"] == before + 1
        STORE.pop(params["transfer_id"], None)  # never pulled: the prefill side's lease would expire
    params = _run(prefill, prompt, {"do_remote_decode": True}, rid="p-ok").kv_transfer_params
    before = decode.stats()["kv_transfer_fallbacks"]
    assert _run(decode, prompt, params, rid="d-ok").outputs[0].token_ids == want
    assert decode.stats()["kv_transfer_fallbacks"] == before
    _all_free(decode)


@pytest.mark.slow
def test_deepseek_fp8_latent_pages_copied_verbatim_and_bad_scales_refused(tiny_checkpoint, hf_model):
    """FP8 latent pages on both sides, page 16: pages and per-page scales copied verbatim (the
    prefill side computes token N too so the last page has a colocated engine's scale); greedy
    tokens equal a colocated FP8 engine's. Pulled scales that are NaN / zero are refused after the
    pull, before admission: the request is prefilled locally, exact, counted."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3", max_num_seqs=1)
    path = tiny_checkpoint("deepseek_v3")
    prefill, decode, colocated = _engines(path, prefill=fp8, decode=fp8)
    params = _check_pd(prefill, decode, colocated, _prompts()[1:])
    desc = params["descriptor"]
    assert desc["kv_dtype"] == "float8_e4m3fn" and desc["rule"] == "prefill_n_minus_1"
    assert any(name.endswith(".c_scale") for name, _, _ in desc["arrays"])
    assert decode.stats()["kv_transfer_fallbacks"] == 0
    prompt = _prompts()[3]
    want = _run(colocated, prompt, rid="c-s").outputs[0].token_ids
    scale = next(i for i, (name, _, _) in enumerate(desc["arrays"]) if name.endswith(".c_scale"))
    for i, value in enumerate((np.nan, 0.0)):
        params = _run(prefill, prompt, {"do_remote_decode": True}, rid=f"p-s{i}").kv_transfer_params
        arrays = STORE[params["transfer_id"]]
        arrays[scale] = arrays[scale].at[0].set(value)
        assert _run(decode, prompt, params, rid=f"d-s{i}").outputs[0].token_ids == want
        assert decode.stats()["kv_transfer_fallbacks"] == i + 1
    for engine in (prefill, decode):
        _all_free(engine)


# ---- engines: Kimi Linear (MLA pages + KDA state slots) ---------------------------------------------


@pytest.mark.slow
def test_kimi_linear_pd_equals_colocated_and_hf(tiny_checkpoint, hf_model):
    """KDA conv states (the q/k/v short convs' inputs, [W-1, 3 H K]) and recurrent states travel
    as GDN's (conv{j} / rec{j}), next to the MLA layers' latent rows; page 16 -> 32."""
    path = tiny_checkpoint("kimi_linear")
    prefill, decode, colocated = _engines(path, decode=dict(page_size=32))
    params = _check_pd(prefill, decode, colocated, _prompts()[1:5], hf_model("kimi_linear"))
    names = [name for name, _, _ in params["descriptor"]["arrays"]]
    assert any(n.startswith("conv") for n in names) and any(n.endswith(".c") for n in names), names
    assert decode.stats()["kv_transfer_fallbacks"] == 0
    for engine in (prefill, decode):
        _all_free(engine)


@pytest.mark.slow
def test_deepseek_float_prefill_to_fp8_decode_quantizes_with_its_own_scales(tiny_checkpoint):
    """float32 latent pages on prefill, fp8_e4m3 on decode: the received rows go through the decode
    side's own latent write, so the first layer's pages and per-page scales equal a colocated FP8
    engine's up to float32 rounding of the rows themselves (computed in other batch shapes: scales
    within 1e-6, < 1% of FP8 codes one step apart). Deeper layers differ by design (the colocated
    engine attended over FP8 pages there), as for GQA (tests/test_kv_transfer.py)."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3", max_num_seqs=1)
    prefill, decode, colocated = _engines(tiny_checkpoint("deepseek_v3"), decode=fp8)
    # 65 tokens: 64 shipped fill 4 pages; token 65 opens the next page on both sides (a partly
    # shipped last page would be requantized when token N joins it, unlike a colocated prefill's)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 500, 65)]
    params = _run(prefill, prompt, {"do_remote_decode": True}).kv_transfer_params
    assert params["descriptor"]["kv_dtype"] == "float32"
    one = SamplingParams(max_tokens=1, temperature=0.0)
    _run(decode, prompt, params, rid="d", sampling=one), _run(colocated, prompt, rid="c", sampling=one)
    assert decode.stats()["kv_transfer_fallbacks"] == 0
    pages = 64  # num_pages per layer: layer 0 owns pages [0, 64) of the stacked pool
    got, want = decode.caches["kv"][0], colocated.caches["kv"][0]
    np.testing.assert_allclose(np.asarray(got.c_scale[:pages]), np.asarray(want.c_scale[:pages]), rtol=1e-6)
    a, b = (np.asarray(x.load(x.c[:pages]).astype(np.float32)) for x in (got, want))
    assert np.abs(b).max() > 0 and np.mean(a != b) < 0.01
    np.testing.assert_allclose(a, b, rtol=0.07, atol=0)  # at most one e4m3 step (2^-3)
    _all_free(decode)


@pytest.mark.slow
def test_kimi_linear_fp8_both_sides_adopts_the_first_token(tiny_checkpoint):
    """FP8 latent pages on both sides of the hybrid: the adopt rule (KDA state and pages after all
    N tokens, plus the prefill side's first greedy token, emitted once by the decode side); greedy
    tokens equal a colocated FP8 engine's."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3", max_num_seqs=1)
    prefill, decode, colocated = _engines(tiny_checkpoint("kimi_linear"), prefill=fp8, decode=fp8)
    params = _check_pd(prefill, decode, colocated, _prompts()[2:5])
    desc = params["descriptor"]
    assert desc["rule"] == "prefill_n_adopt" and desc["num_tokens"] == len(_prompts()[4])
    assert decode.stats()["kv_transfer_fallbacks"] == 0
    for engine in (prefill, decode):
        _all_free(engine)
