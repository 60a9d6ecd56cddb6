"""The registry, the connector interface (through an installed plugin), and P/D inside one process.

A tiny plugin distribution is installed into a temp directory on sys.path (a dist-info with an
entry point in the `jaxserve.plugins` group); its in-process connector then carries requests
between a prefill-role and a decode-role engine without any change to the engine. The same two
engines check the decode side's own layout (page 16 -> 32, FP8 KV), its failure modes (error
instead of local prefill; a pull refused) and a decode instance short of pages. References: a
colocated engine with the decode side's configuration, and HF for that engine (test_engine_hf).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import textwrap

import numpy as np
import pytest
from engine_testing import drain, small_engine_config

from models.ops import ATTENTION_BACKENDS, GDN_BACKENDS, KernelOptions
from runtime.engine.llm_engine import LLMEngine
from runtime.kv_transfer import KV_CONNECTORS, KVTransferConfig
from runtime.kv_transfer.leases import ClaimRefused, Lease, LeaseTable
from runtime.registry import Registry
from runtime.types import EngineRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)

PLUGIN = '''
"""A test double transport: offered arrays wait in a module dict, a pull takes them (once)."""
import itertools

import jax

from runtime.kv_transfer.base import KVConnector, PullResult

STORE = {}
_ids = itertools.count(1)


class InProcessConnector(KVConnector):
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


CALLS = []


def spy_attention(*operands, interpret=False, **kwargs):
    """An attention back-end: the jnp reference, recording that it was traced."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    CALLS.append(operands[0].shape)
    return ragged_paged_attention(*operands, impl="reference", **kwargs)


def lifo_policy():
    """A scheduling policy: the newest request first."""
    from runtime.scheduling.policies import SchedulingPolicy
    return SchedulingPolicy("lifo", lambda request: (-request.sequence_number,))
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """Install `jaxserve_test_plugin` (module + dist-info with its entry point) on sys.path."""
    root = tmp_path_factory.mktemp("site")
    (root / "jaxserve_test_plugin.py").write_text(PLUGIN)
    info = root / "jaxserve_test_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: jaxserve-test-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent("""\
        [jaxserve.plugins]
        kv_connector.inproc = jaxserve_test_plugin:InProcessConnector
        attention_backend.spy = jaxserve_test_plugin:spy_attention
        scheduling_policy.lifo = jaxserve_test_plugin:lifo_policy
        """)
    )
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    yield "inproc"
    sys.path.remove(str(root))
    sys.modules.pop("jaxserve_test_plugin", None)


def test_registry_is_lazy_and_names_what_it_knows():
    registry = Registry("widget")
    registry.register("json", "json:dumps")
    registry.register("local", lambda: 42)
    assert registry.names() == ["json", "local"]
    assert registry.create("local") == 42
    assert registry.get("json")({"a": 1}) == '{"a": 1}'
    with pytest.raises(KeyError, match=r"unknown widget 'nope'; known: \['json', 'local'\]"):
        registry.get("nope")
    with pytest.raises(ValueError, match="module:attribute"):
        registry.register("bad", "no_colon")
    sys.modules.pop("jaxserve_lazy_probe", None)
    registry.register("probe", "jaxserve_lazy_probe:thing")  # not importable: fine until used
    with pytest.raises(ModuleNotFoundError):
        registry.get("probe")


def test_plugin_entry_point_joins_the_connector_registry(plugin):
    assert plugin in KV_CONNECTORS.names() and "jax_transfer" in KV_CONNECTORS.names()
    assert KV_CONNECTORS.get(plugin).__module__ == "jaxserve_test_plugin"


def test_plugin_attention_backend_is_picked_by_name(plugin, tiny_checkpoint):
    """`attention_backend: spy` from the plugin's entry point serves the engine; unknown names
    are refused with the registered ones listed."""
    import jaxserve_test_plugin

    path, prompt = tiny_checkpoint("llama"), _prompts()[4]
    want = _run(LLMEngine(_config(path, attention_backend="reference")), prompt).outputs[0].token_ids
    got = _run(LLMEngine(_config(path, attention_backend="spy")), prompt).outputs[0].token_ids
    assert got == want and jaxserve_test_plugin.CALLS
    assert "spy" in ATTENTION_BACKENDS.names() and "reference" in GDN_BACKENDS.names()
    with pytest.raises(ValueError, match=r"attention_backend must be 'auto' or one of \[.*'spy'"):
        KernelOptions(attention="nope")
    with pytest.raises(ValueError, match=r"gdn_backend must be 'auto' or one of"):
        KernelOptions(gdn="spy")


def test_plugin_attention_backend_from_yaml_and_from_llm(plugin, tiny_checkpoint, tmp_path):
    """The plugin's back-end by name from a launch YAML (the schema reads installed entry points)
    and from `LLM()`: output equal to the built-in path; an unknown name is a ConfigError
    listing the installed ones."""
    import jaxserve_test_plugin

    from configs.schema import ConfigError, load_config
    from runtime.engine.llm import LLM
    from runtime.engine.loading import engine_config_from_launch

    path, prompt = tiny_checkpoint("llama"), _prompts()[4]
    want = _run(LLMEngine(_config(path, attention_backend="reference")), prompt).outputs[0].token_ids
    yaml_file = tmp_path / "spy.yaml"
    yaml_file.write_text("kernels:\n  attention_backend: spy\n")
    launch = load_config(
        yaml_file,
        {
            "model.dtype": "float32",
            "compile.aot": False,
            "cache.num_pages": 64,
            "scheduler.max_num_seqs": 4,
            "scheduler.max_num_batched_tokens": 64,
            "model.max_model_len": 256,
        },
    )
    assert launch.kernels.attention_backend == "spy"
    jaxserve_test_plugin.CALLS.clear()
    assert _run(LLMEngine(engine_config_from_launch(launch, str(path))), prompt).outputs[0].token_ids == want
    assert jaxserve_test_plugin.CALLS
    jaxserve_test_plugin.CALLS.clear()
    llm = LLM(
        str(path),
        dtype="float32",
        attention_backend="spy",
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        aot_compile=False,
    )
    assert llm.generate([prompt], GREEDY)[0].token_ids == want and jaxserve_test_plugin.CALLS
    with pytest.raises(ConfigError, match=r"unknown attention_backend 'nope'.*'spy'"):
        load_config(None, {"kernels.attention_backend": "nope"})


def test_plugin_policy_from_yaml_reaches_the_scheduler(plugin):
    """A plugin's scheduling policy passes the one name check (the schema's and the engine
    config's) and the scheduler serves by it; an unknown one is refused naming the plugin's."""
    from configs.schema import load_config
    from runtime.engine_config import SchedulerConfig, build_engine_config
    from runtime.scheduling.scheduler import Scheduler

    config = build_engine_config(load_config(None, {"scheduler.policy": "lifo"}), "m")
    cache = config.cache_config(num_pages=16, max_model_len=64).build_manager()
    assert Scheduler(config.scheduler_config(max_model_len=64), cache).policy.name == "lifo"
    with pytest.raises(ValueError, match=r"^policy: unknown scheduling_policy 'lifo2'.*'lifo'"):
        SchedulerConfig(policy="lifo2")


_config = small_engine_config


def _prompts():
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(3, 500, n)] for n in (1, 15, 16, 17, 40, 70)]


def _run(engine, prompt, params=None, rid="r"):
    engine.add_request(EngineRequest(rid, prompt, GREEDY, kv_transfer_params=params))
    return drain(engine)[rid]


def _all_free(engine):
    s = engine.stats()
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"], s
    assert s["slots_free"] + s["slots_cached"] == s["slots_total"], s
    assert s.get("kv_transfer_requests_pulling", 0) == 0


@pytest.mark.parametrize(
    "family",
    ["llama", pytest.param("qwen3_5", marks=pytest.mark.slow), pytest.param("nemotron_h", marks=pytest.mark.slow)],
)
def test_plugin_connector_carries_state_into_larger_pages(plugin, tiny_checkpoint, family):
    """Page 16 on prefill, 32 on decode (the GDN hybrid also runs end to end in test_disagg; Nemotron-H
    carries Mamba-2 conv and SSM states, and its MLP-only blocks have no state)."""
    path = tiny_checkpoint(family)
    prefill = LLMEngine(_config(path, kv_transfer=KVTransferConfig(role="prefill", connector=plugin)))
    decode = LLMEngine(_config(path, page_size=32, kv_transfer=KVTransferConfig(role="decode", connector=plugin)))
    colocated = LLMEngine(_config(path, page_size=32))
    for i, prompt in enumerate(_prompts()[:1] + _prompts()[3:5]):
        want = _run(colocated, prompt).outputs[0].token_ids
        params = _run(prefill, prompt, {"do_remote_decode": True}).kv_transfer_params
        assert (params is None) == (len(prompt) == 1)
        assert _run(decode, prompt, params).outputs[0].token_ids == want, f"prompt {i} (len {len(prompt)})"
    assert _run(decode, prompt, params).outputs[0].token_ids == want  # replayed: refused, prefilled locally
    assert decode.stats()["kv_transfer_fallbacks"] == 1
    for engine in (prefill, decode):
        _all_free(engine)


def test_fp8_decode_side_quantizes_with_its_own_scales(plugin, tiny_checkpoint):
    """float32 KV on prefill, fp8_e4m3 on decode: the received pages are quantized by the decode
    side's own KV write (its per-page scales), so the first layer's pages equal a colocated FP8
    engine's up to float32 rounding of K/V themselves (the two computed them in different batch
    shapes: scales within 1e-6, < 1% of FP8 codes one step apart). Deeper layers differ by
    design: a colocated FP8 engine computed their
    K/V from attention over FP8 pages, the prefill instance over float32 ones; token equality
    with a colocated FP8 engine needs FP8 on the prefill side too (docs/disaggregation.md)."""
    path = tiny_checkpoint("llama")
    prefill = LLMEngine(_config(path, kv_transfer=KVTransferConfig(role="prefill", connector=plugin)))
    decode = LLMEngine(
        _config(
            path,
            kv_cache_dtype="fp8_e4m3",
            max_num_seqs=1,
            kv_transfer=KVTransferConfig(role="decode", connector=plugin),
        )
    )
    colocated = LLMEngine(_config(path, kv_cache_dtype="fp8_e4m3", max_num_seqs=1))
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 500, 33)]
    params = _run(prefill, prompt, {"do_remote_decode": True}).kv_transfer_params
    assert params["descriptor"]["kv_dtype"] == "float32"
    one = SamplingParams(max_tokens=1, temperature=0.0)
    decode.add_request(EngineRequest("d", prompt, one, kv_transfer_params=params))
    colocated.add_request(EngineRequest("c", prompt, one))
    drain(decode), drain(colocated)
    pages = 64  # num_pages per layer: layer 0 owns pages [0, 64) of the stacked pool
    got, want = decode.caches["kv"][0], colocated.caches["kv"][0]
    for name in ("k_scale", "v_scale"):
        np.testing.assert_allclose(
            np.asarray(getattr(got, name)[:pages]), np.asarray(getattr(want, name)[:pages]), rtol=1e-6, err_msg=name
        )
    for name in ("k", "v"):
        a, b = (np.asarray(x.load(getattr(x, name)[:pages]).astype(np.float32)) for x in (got, want))
        assert np.abs(b).max() > 0 and np.mean(a != b) < 0.01, name
        np.testing.assert_allclose(a, b, rtol=0.07, atol=0, err_msg=name)  # at most one e4m3 step (2^-3)
    _all_free(decode)


@pytest.mark.parametrize("family, rule", [("llama", "prefill_n_minus_1"), ("qwen3_5", "prefill_n_adopt")])
def test_fp8_both_sides_copies_pages_and_scales_verbatim(plugin, tiny_checkpoint, family, rule):
    """FP8 KV and page 16 on both sides (the verbatim path: pages and scales copied, the
    prefill side computing token N too): greedy tokens equal a colocated FP8 engine's. The
    hybrid takes the adopt rule (state after N + the prefill side's first token, emitted once by
    the decode side); a request asking for logprobs cannot adopt it and prefills locally. The
    three-process versions over 30 prompts are test_disagg.py's `llama-fp8` / `qwen3_5-fp8`."""
    path = tiny_checkpoint(family)
    fp8 = dict(kv_cache_dtype="fp8_e4m3", max_num_seqs=1)
    prefill = LLMEngine(_config(path, **fp8, kv_transfer=KVTransferConfig(role="prefill", connector=plugin)))
    decode = LLMEngine(_config(path, **fp8, kv_transfer=KVTransferConfig(role="decode", connector=plugin)))
    colocated = LLMEngine(_config(path, **fp8))
    for i, prompt in enumerate(_prompts()[2:]):
        want = _run(colocated, prompt, rid=f"c{i}").outputs[0].token_ids
        params = _run(prefill, prompt, {"do_remote_decode": True}, rid=f"p{i}").kv_transfer_params
        assert params["descriptor"]["kv_dtype"] == "float8_e4m3fn" and params["descriptor"]["rule"] == rule
        assert params["descriptor"]["num_tokens"] == len(prompt) - (rule == "prefill_n_minus_1")
        assert _run(decode, prompt, params, rid=f"d{i}").outputs[0].token_ids == want, f"prompt {i} (len {len(prompt)})"
    assert decode.stats()["kv_transfer_fallbacks"] == 0
    if rule == "prefill_n_adopt":  # one token: finished by the adopted token alone
        one = SamplingParams(max_tokens=1, temperature=0.0)
        params = _run(prefill, prompt, {"do_remote_decode": True}, rid="p1").kv_transfer_params
        decode.add_request(EngineRequest("d1", prompt, one, kv_transfer_params=params))
        out = drain(decode)["d1"]
        assert out.outputs[0].token_ids == want[:1] and out.outputs[0].finish_reason == "length"
        assert decode.stats()["kv_transfer_fallbacks"] == 0
        lp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
        params = _run(prefill, prompt, {"do_remote_decode": True}, rid="p2").kv_transfer_params
        decode.add_request(EngineRequest("d2", prompt, lp, kv_transfer_params=params))
        out = drain(decode)["d2"]
        assert out.outputs[0].token_ids == want and len(out.outputs[0].logprobs) == len(want)
        assert decode.stats()["kv_transfer_fallbacks"] == 1
    _all_free(decode)
    _all_free(prefill)


@pytest.mark.slow
def test_bf16_prefill_to_fp8_decode_agreement_with_colocated_fp8(plugin, tiny_checkpoint):
    """bf16 KV on prefill, fp8_e4m3 on decode (requantized with the decode side's scales) against
    a colocated FP8 engine, 30 prompts x 8 greedy tokens. Not exact by construction (the
    colocated engine computed deeper layers over FP8 pages): measured 25/30 sequences equal,
    first divergence at generated token 1-4, every first token equal (docs/disaggregation.md).
    FP8 on both sides is exact (test_disagg.py, layout llama-fp8)."""
    path = tiny_checkpoint("llama")
    big = dict(num_pages=96, max_model_len=512)
    prefill = LLMEngine(
        _config(path, kv_cache_dtype="bfloat16", **big, kv_transfer=KVTransferConfig(role="prefill", connector=plugin))
    )
    decode = LLMEngine(
        _config(path, kv_cache_dtype="fp8_e4m3", **big, kv_transfer=KVTransferConfig(role="decode", connector=plugin))
    )
    colocated = LLMEngine(_config(path, kv_cache_dtype="fp8_e4m3", **big))
    rng = np.random.default_rng(7)
    ids = lambda n: [int(t) for t in rng.integers(3, 500, n)]
    shared = ids(40)
    lengths = (1, 15, 16, 17, 203, 2, 3, 5, 8, 31, 32, 33, 47, 64, 65, 90, 120, 150, 211, 250)
    prompts = (
        [ids(n) for n in lengths]
        + [shared + ids(k) for k in (1, 3, 7, 12, 20, 33)]
        + [ids(n) for n in (11, 23, 57, 77)]
    )
    eight = SamplingParams(max_tokens=8, temperature=0.0)
    equal = 0
    for i, prompt in enumerate(prompts):
        colocated.add_request(EngineRequest(f"c{i}", prompt, eight))
        want = drain(colocated)[f"c{i}"].outputs[0].token_ids
        params = _run(prefill, prompt, {"do_remote_decode": True}, rid=f"p{i}").kv_transfer_params
        decode.add_request(EngineRequest(f"d{i}", prompt, eight, kv_transfer_params=params))
        got = drain(decode)[f"d{i}"].outputs[0].token_ids
        assert got[0] == want[0], f"prompt {i} (len {len(prompt)}): first token"
        equal += got == want
    assert equal >= 20, f"{equal}/30 sequences equal the colocated FP8 engine (measured 23-25/30)"
    assert decode.stats()["kv_transfer_fallbacks"] == 0
    _all_free(decode)


def test_on_pull_failure_error_answers_with_an_error(plugin, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prefill = LLMEngine(_config(path, kv_transfer=KVTransferConfig(role="prefill", connector=plugin)))
    decode = LLMEngine(
        _config(path, kv_transfer=KVTransferConfig(role="decode", connector=plugin, on_pull_failure="error"))
    )
    prompt = _prompts()[3]
    params = _run(prefill, prompt, {"do_remote_decode": True}).kv_transfer_params
    assert _run(decode, prompt, params).error is None
    replayed = _run(decode, prompt, params)
    assert replayed.finished and "kv transfer failed: unknown or already pulled" in replayed.error
    with pytest.raises(ValueError, match="token digest"):
        _run(decode, _prompts()[2] + [7], params)
    with pytest.raises(ValueError, match="role is 'decode', not prefill"):
        _run(decode, prompt, {"do_remote_decode": True})
    assert decode.stats()["kv_transfer_errors"] == 2
    _all_free(decode)


def test_decode_short_of_pages_queues_pulled_requests(plugin, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prefill = LLMEngine(_config(path, kv_transfer=KVTransferConfig(role="prefill", connector=plugin)))
    decode = LLMEngine(
        _config(path, num_pages=9, max_model_len=128, kv_transfer=KVTransferConfig(role="decode", connector=plugin))
    )
    colocated = LLMEngine(_config(path))
    prompts = [p for p in _prompts() if len(p) >= 40] * 2
    params = [
        _run(prefill, p, {"do_remote_decode": True}, rid=f"p{i}").kv_transfer_params for i, p in enumerate(prompts)
    ]
    for i, (p, t) in enumerate(zip(prompts, params)):
        decode.add_request(EngineRequest(f"d{i}", p, GREEDY, kv_transfer_params=t))
    done = drain(decode)
    for i, p in enumerate(prompts):
        assert done[f"d{i}"].outputs[0].token_ids == _run(colocated, p, rid=f"c{i}").outputs[0].token_ids
    assert decode.stats()["kv_transfer_fallbacks"] == 0
    _all_free(decode)


def _refused(table, *args, **kwargs) -> int:
    with pytest.raises(ClaimRefused) as info:
        table.claim(*args, **kwargs)
    return info.value.status


def test_lease_table_is_one_shot_and_expires():
    now = [0.0]
    table = LeaseTable(lease_s=10, clock=lambda: now[0])
    table.add(Lease("a", None, 2, 1, 100, table.new_deadline(), token_digest="da", model_fingerprint="m"))
    table.add(Lease("b", None, 3, 0, 50, table.new_deadline(), token_digest="db", model_fingerprint="m"))
    table.add(Lease("c", None, 1, 0, 10, table.new_deadline(), token_digest="dc", model_fingerprint="m"))
    assert table.held() == (3, 6, 1, 160)
    assert table.claim("a", pull_timeout_s=30, token_digest="da", model_fingerprint="m").transfer_id == "a"
    assert _refused(table, "a", pull_timeout_s=30) == 410  # replay
    assert _refused(table, "zzz", pull_timeout_s=30) == 410
    assert _refused(table, "c", pull_timeout_s=30, token_digest="da", model_fingerprint="m") == 409  # relabelled
    assert _refused(table, "c", pull_timeout_s=30, token_digest="dc", model_fingerprint="m") == 410  # and ended
    now[0] = 11.0
    assert sorted(x.transfer_id for x in table.pop_expired()) == ["b", "c"]  # "a" is claimed: 30 s to pull
    assert _refused(table, "b", pull_timeout_s=30) == 410
    assert table.release("a") is not None and table.held() == (0, 0, 0, 0)


def test_prefill_role_refusal_leaves_nothing_behind(plugin, tiny_checkpoint):
    prefill = LLMEngine(
        _config(tiny_checkpoint("llama"), kv_transfer=KVTransferConfig(role="prefill", connector=plugin))
    )
    with pytest.raises(ValueError, match="maximum context length"):
        prefill.add_request(EngineRequest("long", [5] * 300, GREEDY, kv_transfer_params={"do_remote_decode": True}))
    with pytest.raises(ValueError, match="do_remote_decode"):
        prefill.add_request(EngineRequest("forged", [5] * 8, GREEDY, kv_transfer_params={"_offer": True}))
    with pytest.raises(ValueError, match="lease_s must be a positive number"):
        prefill.add_request(
            EngineRequest("lease", [5] * 8, GREEDY, kv_transfer_params={"do_remote_decode": True, "lease_s": -1})
        )
    assert not prefill.kv_transfer._offering and not prefill.has_unfinished()


def test_descriptor_last_token_rules_are_checked():
    """Both rules are read; the token count must match the rule and an adopted token must be a
    token id of the model (else the decode side refuses the descriptor and falls back)."""
    from runtime.kv_transfer.base import TransferError
    from runtime.kv_transfer.descriptor import build_descriptor, check_descriptor

    prompt, sig = [7, 8, 9, 10], {"vocab_size": 100}

    def desc(num_tokens, rule, **extra):
        d = build_descriptor(
            prompt_token_ids=prompt,
            num_tokens=num_tokens,
            rule=rule,
            page_size=16,
            num_pages=1,
            kv_dtype="float32",
            kv_wire="values",
            signature=sig,
            arrays=[],
        )
        return {**d, **extra}

    assert check_descriptor(desc(3, "prefill_n_minus_1"), prompt_token_ids=prompt, signature=sig) == 3
    assert check_descriptor(desc(4, "prefill_n_adopt", first_token=5), prompt_token_ids=prompt, signature=sig) == 4
    for bad, match in [
        (desc(4, "prefill_n_minus_1"), "expected N-1"),
        (desc(3, "prefill_n_adopt", first_token=5), "expected N"),
        (desc(4, "prefill_n_adopt"), "first_token None"),
        (desc(4, "prefill_n_adopt", first_token=100), "first_token 100"),
        (desc(4, "prefill_n_adopt", first_token=True), "first_token True"),
        (desc(4, "decode_recomputes"), "last-token rule"),
    ]:
        with pytest.raises(TransferError, match=match):
            check_descriptor(bad, prompt_token_ids=prompt, signature=sig)


def test_hooks_ask_the_engine_and_never_set_a_request_status():
    """The P/D hooks see the engine only through `EngineRequests` (which `LLMEngine` implements):
    no private attribute of it, nothing outside that interface, and no request status or finish
    reason set by the hooks themselves (the engine's `_finish` ends every request)."""
    import ast
    import inspect

    from runtime.kv_transfer import hooks

    allowed = {n for n, _ in inspect.getmembers(hooks.EngineRequests, inspect.isfunction) if not n.startswith("_")}
    assert allowed == {"check_fits", "admit", "has_scheduled", "finish_request", "adopt_token"}
    assert all(callable(getattr(LLMEngine, name, None)) for name in allowed)
    asked, assigned = set(), set()
    for node in ast.walk(ast.parse(inspect.getsource(hooks))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "engine":
            asked.add(node.attr)
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute):
                        assigned.add(leaf.attr)
    assert asked and asked <= allowed, asked - allowed
    assert not assigned & {"status", "finish_reason", "stop_reason"}


@pytest.mark.parametrize("kv_dtype", ["float32", "float8_e4m3fn"])
def test_repeated_kv_heads_travel_as_the_checkpoints_heads(tiny_checkpoint, kv_dtype):
    """A TP engine that repeats each KV head (fewer KV heads than chips: models/sharding.py) sends
    one copy of each, so its descriptor and arrays are a plain engine's, and repeats what it
    receives: verbatim pages (FP8 scales too) and, into another page size, token by token."""
    import jax.numpy as jnp

    from models.config import parse_config
    from models.safetensors_io import read_json
    from pallas_kernels.kv_cache import KVPages
    from runtime.kv_transfer.layout import expected_arrays, gather_request_state, write_request_state

    cfg = parse_config(read_json(tiny_checkpoint("llama") / "config.json"))
    H, D, r, num_pages = cfg.num_kv_heads, cfg.head_dim, 2, 8
    G = cfg.num_layers // cfg.layer_period()
    rng = np.random.default_rng(0)

    def caches(heads, page_size, filled=None):
        kv = []
        for j in range(cfg.layer_period()):
            pages = KVPages.create(G * num_pages, page_size, heads, D, jnp.dtype(kv_dtype))
            if filled is not None:  # the canonical pages' values, each head repeated heads // H times
                src = filled[j]
                rep = lambda x: jnp.repeat(x, heads // H, axis=1)
                pages = dataclasses.replace(
                    pages,
                    k=rep(src.k),
                    v=rep(src.v),
                    **({} if src.k_scale is None else {"k_scale": rep(src.k_scale), "v_scale": rep(src.v_scale)}),
                )
            kv.append(pages)
        n = cfg.layer_period()
        return {"kv": tuple(kv), "conv": (None,) * n, "rec": (None,) * n}

    shape = (G * num_pages, H, 16, D)
    canonical = caches(H, 16)
    canonical["kv"] = tuple(
        dataclasses.replace(
            p,
            k=jnp.asarray(rng.standard_normal(shape), p.k.dtype),
            v=jnp.asarray(rng.standard_normal(shape), p.v.dtype),
            **(
                {}
                if p.k_scale is None
                else {"k_scale": jnp.asarray(rng.uniform(0.5, 2, shape[:2]), jnp.float32), "v_scale": p.v_scale * 3}
            ),
        )
        for p in canonical["kv"]
    )
    prompt, kw = list(range(3, 43)), dict(num_tokens=37, state_slot=0, num_pages=num_pages, num_slots=2)
    sent = gather_request_state(canonical, cfg, prompt_token_ids=prompt, block_table=[3, 5, 1], page_size=16, **kw)
    sent_r = gather_request_state(
        caches(H * r, 16, canonical["kv"]), cfg, prompt_token_ids=prompt, block_table=[3, 5, 1], page_size=16, **kw
    )
    assert sent_r[1] == sent[1] and expected_arrays(sent[1], cfg) == sent[1]["arrays"]
    for a, b in zip(sent[0], sent_r[0]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kw.pop("num_tokens")
    for page_size, table in ((16, [2, 7, 4]), (32, [6, 1])):  # verbatim; token by token
        args = dict(block_table=table, page_size=page_size, opts=KernelOptions(), **kw)
        want = write_request_state(caches(H, page_size), list(sent[0]), sent[1], **args)
        got = write_request_state(caches(H * r, page_size), list(sent[0]), sent[1], **args)
        for w, g in zip(want["kv"], got["kv"]):
            for name in ("k", "v", "k_scale", "v_scale"):
                if getattr(w, name) is not None:
                    expected = np.repeat(np.asarray(getattr(w, name), np.float32), r, axis=1)
                    np.testing.assert_array_equal(np.asarray(getattr(g, name), np.float32), expected, name)
