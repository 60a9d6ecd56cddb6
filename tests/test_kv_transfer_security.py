"""P/D fails closed (issue 29): each test reproduces an attack on the loopback and checks the
instance refuses it, keeps serving, and gives back what it held.

A prefill-role and a decode-role engine in this process talk through the real connector
(`jax_transfer`: the control server over HTTP, arrays through `jax.experimental.transfer`) with
the internal token set. References are independent of the transfer path: a colocated engine
(role both) for tokens, the test's own sockets for "who dialed whom", and the engines' own
page / lease accounting for what was given back.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import threading
import time

import numpy as np
import pytest
from engine_testing import drain, small_engine_config

from models.fingerprint import checkpoint_fingerprint
from runtime.engine.llm_engine import LLMEngine
from runtime.kv_transfer import KVTransferConfig, TransferError
from runtime.kv_transfer.control import post_json
from runtime.kv_transfer.descriptor import check_descriptor, token_digest
from runtime.kv_transfer.jax_transfer import JaxTransferConnector
from runtime.kv_transfer.layout import expected_arrays
from runtime.types import EngineBusy, EngineRequest, SamplingParams

TOKEN = "test-kv-transfer-token-0123456789"
GREEDY = SamplingParams(max_tokens=5, temperature=0.0)


_config = small_engine_config


def _kv(role: str, **kw) -> KVTransferConfig:
    return KVTransferConfig(role=role, token=TOKEN, pull_timeout_s=2.0, control_timeout_s=1.0, **kw)


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


@dataclasses.dataclass
class Pair:
    prefill: LLMEngine
    decode: LLMEngine
    colocated: LLMEngine
    path: object
    runs: int = 0

    def run(self, engine, prompt, params=None, sampling=GREEDY):
        self.runs += 1
        rid = f"r{self.runs}"
        engine.add_request(EngineRequest(rid, prompt, sampling, kv_transfer_params=params))
        return drain(engine)[rid]

    def offer(self, prompt, **extra) -> dict:
        params = self.run(self.prefill, prompt, {"do_remote_decode": True, **extra}).kv_transfer_params
        assert params and params["do_remote_prefill"], params
        return params

    def tokens(self, engine, prompt, params=None) -> list[int]:
        return self.run(engine, prompt, params).outputs[0].token_ids


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    engines = Pair(
        LLMEngine(_config(path, kv_transfer=_kv("prefill"))),
        LLMEngine(_config(path, kv_transfer=_kv("decode"))),
        LLMEngine(_config(path)),
        path,
    )
    yield engines
    engines.prefill.kv_transfer.close()
    engines.decode.kv_transfer.close()


def _wait(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _assert_all_free(engine):
    s = engine.stats()
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"], s
    assert s.get("kv_transfer_requests_pulling", 0) == 0 and s.get("kv_transfer_bytes_staged", 0) == 0, s


def test_transfer_between_instances_is_exact_with_the_token(pair):
    prompt = _ids(1, 37)
    assert pair.tokens(pair.decode, prompt, pair.offer(prompt)) == pair.tokens(pair.colocated, prompt)
    assert (
        pair.decode.stats()["kv_transfer_transfers_completed"] + pair.prefill.stats()["kv_transfer_transfers_completed"]
        >= 1
    )
    _assert_all_free(pair.decode)


def test_offer_relabelled_as_another_prompt_is_refused_and_never_cached(pair):
    """Finding 1: a genuine offer for prompt A, its descriptor relabelled as prompt B (same
    length), used to be pulled and published as B's pages in the prefix cache."""
    a, b = _ids(2, 40), _ids(3, 40)
    params = pair.offer(a)
    forged = {**params, "descriptor": {**params["descriptor"], "token_digest": token_digest(b[:39])}}
    refused = pair.prefill.stats()["kv_transfer_claims_refused"]
    assert pair.tokens(pair.decode, b, forged) == pair.tokens(pair.colocated, b)
    assert pair.prefill.stats()["kv_transfer_claims_refused"] == refused + 1
    extended = b + _ids(4, 9)  # would start with B's poisoned pages from the decode side's prefix cache
    assert pair.tokens(pair.decode, extended) == pair.tokens(pair.colocated, extended)
    _wait(lambda: pair.prefill.stats()["kv_transfer_bytes_held"] == 0)  # the refused lease is drained
    _assert_all_free(pair.decode)


MALFORMED = {
    "kv_dtype missing": lambda d: {k: v for k, v in d.items() if k != "kv_dtype"},
    "kv_dtype null": lambda d: {**d, "kv_dtype": None},
    "kv_dtype float64": lambda d: {**d, "kv_dtype": "float64"},
    "num_pages not a power of two": lambda d: {**d, "num_pages": 3},
    "num_pages too large": lambda d: {**d, "num_pages": 1 << 40},
    "page_size 3": lambda d: {**d, "page_size": 3},
    "page_size bool": lambda d: {**d, "page_size": True},
    "num_tokens string": lambda d: {**d, "num_tokens": "36"},
    "arrays garbage": lambda d: {**d, "arrays": [["kv0.k", "x", 1]]},
    "arrays huge": lambda d: {**d, "arrays": [[n, [1 << 40] + s[1:], t] for n, s, t in d["arrays"]]},
    "model missing": lambda d: {k: v for k, v in d.items() if k != "model"},
    "model a list": lambda d: {**d, "model": []},
    "kv_wire wrong": lambda d: {**d, "kv_wire": "bits"},
    "unknown field": lambda d: {**d, "pickle": "gASV"},
    "not an object": lambda d: ["descriptor"],
}


@pytest.fixture(scope="module")
def sample(pair):
    """(prompt, a genuine descriptor for it); the offer itself is released at once."""
    prompt = _ids(5, 37)
    params = pair.offer(prompt)
    _abort(pair, params)
    return prompt, params["descriptor"]


def _abort(pair, params):
    post_json(
        _control_url(pair) + "/kv_transfer/release",
        {"transfer_id": params["transfer_id"], "status": "abort"},
        2.0,
        token=TOKEN,
    )
    _wait(lambda: pair.prefill.stats()["kv_transfer_bytes_held"] == 0)


def test_the_genuine_sample_descriptor_passes(pair, sample):
    prompt, desc = sample
    assert check_descriptor(desc, prompt_token_ids=prompt, signature=pair.decode.kv_transfer.signature) == 36
    assert expected_arrays(desc, pair.decode.model.cfg) == desc["arrays"]


@pytest.mark.parametrize("case", list(MALFORMED))
def test_every_malformed_descriptor_is_a_transfer_error(pair, sample, case):
    """Finding 2 (unit): each is refused by check_descriptor / expected_arrays with a
    TransferError — not a KeyError or a trace-time failure."""
    prompt, desc = sample
    with pytest.raises(TransferError):
        bad = MALFORMED[case](desc)
        check_descriptor(bad, prompt_token_ids=prompt, signature=pair.decode.kv_transfer.signature)
        expected_arrays(bad, pair.decode.model.cfg)


def test_malformed_descriptors_fail_their_request_only(pair):
    """Finding 2 (engine): malformed descriptors arriving next to a genuine transfer and a plain
    request: each bad one is prefilled locally (exact), the others are served, the engine stays."""
    prompt = _ids(6, 37)
    genuine = pair.offer(prompt)
    desc = genuine["descriptor"]
    for i, mutate in enumerate(MALFORMED.values()):
        bad = {**genuine, "transfer_id": str(10**12 + i), "descriptor": mutate(desc)}
        pair.decode.add_request(EngineRequest(f"bad{i}", prompt, GREEDY, kv_transfer_params=bad))
    pair.decode.add_request(EngineRequest("genuine", prompt, GREEDY, kv_transfer_params=genuine))
    plain = _ids(7, 20)
    pair.decode.add_request(EngineRequest("plain", plain, GREEDY))
    done = drain(pair.decode)
    want = pair.tokens(pair.colocated, prompt)
    assert all(done[f"bad{i}"].outputs[0].token_ids == want for i in range(len(MALFORMED)))
    assert done["genuine"].outputs[0].token_ids == want
    assert done["plain"].outputs[0].token_ids == pair.tokens(pair.colocated, plain)
    _assert_all_free(pair.decode)


class _Recorder:
    """A loopback listener of the test's own: counts every connection made to it."""

    def __init__(self, reply: bytes | None = None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._reply = reply
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            if self._reply is not None:
                conn.recv(65536)
                conn.sendall(self._reply)
                conn.close()
            else:
                self._held.append(conn)  # silent: accept and never answer

    def close(self):
        self._stop.set()
        self.sock.close()
        for conn in self._held:
            conn.close()


def _decode_connector(**kw) -> JaxTransferConnector:
    return JaxTransferConnector(KVTransferConfig(role="decode", pull_timeout_s=1.0, control_timeout_s=0.5, **kw))


def _wait_results(connector, keys, timeout_s=10.0) -> dict:
    results, deadline = {}, time.monotonic() + timeout_s
    while set(results) != set(keys):
        assert time.monotonic() < deadline, f"pulls did not end: {set(keys) - set(results)}"
        results.update({r.key: r for r in connector.poll()})
        time.sleep(0.02)
    return results


DESC = {"token_digest": "0" * 64, "model": {"fingerprint": "f"}}


def test_decode_side_dials_only_its_peers_without_a_token():
    """Finding 3: without a token, transfer parameters naming any other endpoint are refused
    before a connection is made (the test's own listener sees none)."""
    listener = _Recorder()
    connector = _decode_connector(peers=("127.0.0.1:1",))
    try:
        for url in (
            f"http://127.0.0.1:{listener.port}",
            f"http://localhost:{listener.port}/x",
            f"http://user:pw@127.0.0.1:{listener.port}",
            f"ftp://127.0.0.1:{listener.port}",
        ):
            with pytest.raises(TransferError, match="may dial"):
                connector.start_pull("k", {"transfer_id": "1", "control_url": url}, DESC, [])
        time.sleep(0.3)
        assert listener.connections == 0
    finally:
        connector.close()
        listener.close()


def test_no_redirect_is_followed():
    """Finding 3: an allowed peer answering with a redirect to another address is not followed."""
    target = _Recorder()
    redirect = (
        f"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:{target.port}/kv_transfer/claim\r\n"
        "Content-Length: 0\r\nConnection: close\r\n\r\n"
    ).encode()
    peer = _Recorder(reply=redirect)
    connector = _decode_connector(peers=(f"127.0.0.1:{peer.port}",))
    try:
        connector.start_pull("k", {"transfer_id": "1", "control_url": f"http://127.0.0.1:{peer.port}"}, DESC, [])
        result = _wait_results(connector, ["k"])["k"]
        assert result.arrays is None and "claim refused (307)" in result.error
        assert peer.connections >= 1 and target.connections == 0
    finally:
        connector.close()
        peer.close()
        target.close()


def test_silent_peers_cannot_hold_the_pull_workers():
    """Finding 3: 40 claims to a silent peer used to hold all 16 workers for 35 s each. Now
    each fails within its deadline and a later pull still starts at once."""
    silent = _Recorder()
    connector = _decode_connector(peers=(f"127.0.0.1:{silent.port}",), max_pulls_in_flight=64)
    try:
        started = time.monotonic()
        keys = [f"k{i}" for i in range(40)]
        for key in keys:
            connector.start_pull(key, {"transfer_id": "1", "control_url": f"http://127.0.0.1:{silent.port}"}, DESC, [])
        results = _wait_results(connector, keys, timeout_s=15)
        assert all(r.arrays is None for r in results.values())
        assert time.monotonic() - started < 8  # control_timeout_s 0.5 + pull_timeout_s 1, not 40 x 35 s
        assert connector.pending() == 0
    finally:
        connector.close()
        silent.close()


def test_pulls_in_flight_are_capped():
    silent = _Recorder()
    connector = _decode_connector(peers=(f"127.0.0.1:{silent.port}",), max_pulls_in_flight=2)
    try:
        params = {"transfer_id": "1", "control_url": f"http://127.0.0.1:{silent.port}"}
        connector.start_pull("a", params, DESC, [])
        connector.start_pull("b", params, DESC, [])
        with pytest.raises(TransferError, match="max_pulls_in_flight"):
            connector.start_pull("c", params, DESC, [])
        _wait_results(connector, ["a", "b"])
        connector.start_pull("d", params, DESC, [])  # room again
        _wait_results(connector, ["d"])
    finally:
        connector.close()
        silent.close()


def _control_url(pair) -> str:
    return f"http://127.0.0.1:{pair.prefill.kv_transfer.connector._control.port}"


def test_control_port_requires_the_token_and_the_claim_its_prompt(pair):
    """Finding 4: the control port was unauthenticated (any client could claim and never pull)."""
    prompt = _ids(8, 30)
    params = pair.offer(prompt)
    claim = {
        "transfer_id": params["transfer_id"],
        "token_digest": params["descriptor"]["token_digest"],
        "model_fingerprint": params["descriptor"]["model"]["fingerprint"],
    }
    url = _control_url(pair) + "/kv_transfer/claim"
    assert post_json(url, claim, 2.0)[0] == 401
    assert post_json(url, claim, 2.0, token="wrong-token-0123456789")[0] == 401
    assert post_json(url, {"transfer_id": params["transfer_id"]}, 2.0, token=TOKEN)[0] == 400  # digest required
    assert post_json(url, {**claim, "model_fingerprint": "another"}, 2.0, token=TOKEN)[0] == 409
    assert post_json(url, claim, 2.0, token=TOKEN)[0] == 410  # the mismatching claim ended the offer
    _wait(lambda: pair.prefill.stats()["kv_transfer_bytes_held"] == 0)


def test_claimed_but_unpulled_offer_frees_its_bytes(pair):
    """Finding 4: a lease claimed and never pulled dropped its references while the transfer
    server kept the arrays, and bytes_held read 0 all along. Now it counts until freed."""
    prompt = _ids(9, 50)
    params = pair.offer(prompt, lease_s=1)
    held = pair.prefill.stats()["kv_transfer_bytes_held"]
    assert held > 0
    claim = {
        "transfer_id": params["transfer_id"],
        "token_digest": params["descriptor"]["token_digest"],
        "model_fingerprint": params["descriptor"]["model"]["fingerprint"],
    }
    status, reply = post_json(_control_url(pair) + "/kv_transfer/claim", claim, 2.0, token=TOKEN)
    assert status == 200 and reply["transfer_address"]
    time.sleep(0.5)
    assert pair.prefill.stats()["kv_transfer_bytes_held"] == held  # claimed: still held, and said so
    _wait(lambda: pair.prefill.stats()["kv_transfer_bytes_held"] == 0)  # expired (1 s + pull 2 s): drained
    assert pair.prefill.stats()["kv_transfer_leases_held"] == 0


def test_offers_past_the_byte_cap_are_refused_then_served_again(pair):
    """Finding 4: nothing capped offered bytes. Past `max_held_bytes` a prefill request is a 503
    (EngineBusy) until the held state is pulled or expires."""
    connector = pair.prefill.kv_transfer.connector
    original = connector.config
    prompt = _ids(10, 30)
    try:
        params = pair.offer(prompt)
        connector.config = dataclasses.replace(original, max_held_bytes=connector.bytes_held())
        with pytest.raises(EngineBusy, match="max_held_bytes"):
            pair.prefill.add_request(
                EngineRequest("busy", prompt, GREEDY, kv_transfer_params={"do_remote_decode": True})
            )
        assert pair.tokens(pair.decode, prompt, params) == pair.tokens(pair.colocated, prompt)  # pulled: freed
        _wait(lambda: connector.bytes_held() == 0)
        again = pair.offer(prompt)  # room again
    finally:
        connector.config = original
    _abort(pair, again)
    _assert_all_free(pair.prefill)


def test_requests_pulling_count_as_waiting(pair):
    """Finding 4: parked requests skipped the server's 429 check (it reads num_waiting)."""
    silent = _Recorder()
    prompt = _ids(11, 30)
    genuine = pair.offer(prompt)
    params = {**genuine, "control_url": f"http://127.0.0.1:{silent.port}"}
    try:
        base = pair.decode.stats()["num_waiting"]
        pair.decode.add_request(EngineRequest("parked", prompt, GREEDY, kv_transfer_params=params))
        assert pair.decode.stats()["num_waiting"] == base + 1
        done = drain(pair.decode)  # the silent claim times out: prefilled locally
        assert done["parked"].outputs[0].token_ids == pair.tokens(pair.colocated, prompt)
    finally:
        silent.close()
        _abort(pair, genuine)
    _assert_all_free(pair.decode)


def test_fingerprint_tells_equal_shaped_checkpoints_apart(tiny_checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = tiny_checkpoint("llama")
    copy = shutil.copytree(path, tmp_path / "moved")
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(path) != ""
    (copy / "README.md").write_text("notes")
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(path)
    tuned = _fine_tune(path, tmp_path / "tuned", load_file, save_file)
    assert checkpoint_fingerprint(tuned) != checkpoint_fingerprint(path)


def _fine_tune(path, out, load_file, save_file):
    """A copy of `path` with every tensor nudged: equal names, shapes and dtypes."""
    out = shutil.copytree(path, out)
    for file in out.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({k: (v * 1.01).astype(v.dtype) for k, v in tensors.items()}, file, metadata={"format": "pt"})
    return out


def test_another_checkpoint_with_equal_shapes_is_refused(pair, tmp_path_factory):
    """Finding 7: the model signature covered shapes only, so a fine-tune's decode instance
    accepted the base model's state and answered with it. Now the fingerprint differs: the
    request is prefilled locally and equals the fine-tune's own answer."""
    from safetensors.numpy import load_file, save_file

    tuned = _fine_tune(pair.path, tmp_path_factory.mktemp("ft") / "tuned", load_file, save_file)
    decode = LLMEngine(_config(tuned, kv_transfer=_kv("decode")))
    try:
        prompt = _ids(12, 37)
        params = pair.offer(prompt)
        want = pair.tokens(decode, prompt)
        assert pair.tokens(decode, prompt, params) == want
        assert decode.stats()["kv_transfer_fallbacks"] == 1
        assert decode.stats()["kv_transfer_transfers_started"] == 0  # refused before any claim or pull
        _abort(pair, params)
    finally:
        decode.kv_transfer.close()
