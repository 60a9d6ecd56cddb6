"""The multi-process step protocol (runtime/parallel/multihost.py) without devices or processes.

A leader's wrapped executables and a follower talk over a socketpair (one session key on both
ends, as after the handshake); both sides run a hand-computable fake `StepExecutables` that
records every call. The follower must make exactly the leader's calls (same methods, same host
arguments, same order); a frame out of order or altered in flight, and a follower whose tokens
differ from the leader's, are fatal. The handshake and attacks on it: tests/test_multihost_security.py.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from models.batch import single_sequence_batch
from runtime.parallel.multihost import (
    DivergenceError,
    Follower,
    FollowerLost,
    LeaderChannel,
    LeaderExecutables,
    MultihostLeader,
)
from runtime.parallel.multihost_channel import Session, decode_frame, encode_frame, read_frame
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.types import SamplingParams

MULTIHOST = SimpleNamespace(
    process_id=1,
    num_processes=2,
    coordinator_address="127.0.0.1:1",
    step_port=2,
    heartbeat_timeout_s=30.0,
    step_timeout_s=30.0,
    secret=None,
    coordinator_bind_address=None,
)
KEY = bytes(range(32))  # the session key both ends derived in the handshake


class RecordingExecutables:
    """Fake executables: caches count calls, tokens are input ids + `offset` (hand-computable)."""

    def __init__(self, offset: int = 0):
        self.calls, self.offset = [], offset

    def _record(self, name, **host):
        self.calls.append(
            (
                name,
                json.dumps(
                    {
                        k: np.asarray(v).tolist() if isinstance(v, np.ndarray) else repr(v)
                        for k, v in sorted(host.items())
                    },
                    sort_keys=True,
                ),
            )
        )

    def run_backbone(self, params, caches, batch):
        self._record("run_backbone", ids=batch.input_ids, tables=batch.block_tables, n=batch.num_seqs)
        return caches + 1, batch.input_ids.astype(np.float32)

    def run_greedy_backbone(self, params, caches, batch):
        self._record("run_greedy_backbone", ids=batch.input_ids)
        return caches + 1, batch.input_ids[:2] + self.offset

    def run_sampler(self, params, hidden, meta, num_logprobs, all_greedy=False, bitmask=None, table=None):
        self._record(
            "run_sampler",
            hidden=hidden,
            t=meta.temperature,
            seeds=meta.seeds,
            lp=num_logprobs,
            greedy=all_greedy,
            mask=bitmask,
        )
        return SimpleNamespace(tokens=hidden[:2].astype(np.int32) + self.offset)

    def copy_states(self, caches, pairs):
        self._record("copy_states", pairs=np.asarray(pairs))
        return caches + 1


def _meta():
    params = [SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0.0)]
    return SamplingMetadata.from_params(
        params, [0, 2], [[], [4, 5]], [[1], [2]], pad_to=4, rng=np.random.default_rng(0)
    )


def _drive(leader_ex):
    """The engine's call pattern: backbone + sampler, a state copy, a fused greedy step."""
    batch = single_sequence_batch([5, 17, 300], 16, pad_to=8)
    caches, hidden = leader_ex.run_backbone("params", 0, batch)
    out = leader_ex.run_sampler("params", hidden, _meta(), 0, False, np.ones((4, 2), np.int32))
    caches = leader_ex.copy_states(caches, [(1, 2), (3, 4)])
    caches, tokens = leader_ex.run_greedy_backbone("params", caches, single_sequence_batch([7, 8], 16, pad_to=4))
    return out.tokens, tokens


def _pair(follower_offset: int = 0):
    """A leader (wrapping a recorder) and a follower (its own recorder) joined by a socketpair."""
    ours, theirs = socket.socketpair()
    leader = MultihostLeader({1: Session(ours, 1, KEY)}, MULTIHOST)
    lost = []
    leader._on_lost.append(lost.append)
    engine = SimpleNamespace(
        executables=RecordingExecutables(follower_offset), model=SimpleNamespace(params="p"), caches=0
    )
    follower = Follower(engine, MULTIHOST)
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("code", follower.replay(Session(theirs, 1, KEY))), daemon=True
    )
    thread.start()
    return leader, follower, thread, result, lost


def _stop(leader, thread):
    leader.stop()
    thread.join(10)


def test_follower_replays_exactly_the_leaders_calls():
    leader, follower, thread, result, lost = _pair()
    recorder = RecordingExecutables()
    sampled, greedy = _drive(LeaderExecutables(recorder, leader))
    _stop(leader, thread)
    assert result["code"] == 0 and follower.steps == 5
    assert follower.engine.executables.calls == recorder.calls and len(recorder.calls) == 4
    assert follower.caches == 3  # backbone, copy, greedy backbone: the follower's own caches advanced
    assert sampled.tolist() == [5, 17] and greedy.tolist() == [7, 8]
    deadline = time.monotonic() + 5
    while leader._tokens and time.monotonic() < deadline:  # token digests of both sampling calls checked
        time.sleep(0.05)
    assert not leader._tokens and not lost


def test_executables_wrapped_at_construction_broadcast_once_the_followers_joined():
    """The leader's engine is built with `LeaderChannel.wrap` before the followers connect: a step
    before `connect` is refused (nothing ran), after it the follower replays every call."""
    channel = LeaderChannel()
    recorder = RecordingExecutables()
    wrapped = channel.wrap(recorder)
    with pytest.raises(FollowerLost, match="not connected"):
        wrapped.copy_states(0, [(1, 2)])
    assert recorder.calls == []
    leader, follower, thread, result, lost = _pair()
    channel.connect(leader)
    client = SimpleNamespace(mark_dead=lambda err: None, shutdown_hooks=[])
    channel.serve(client)
    assert client.shutdown_hooks == [leader.finish]
    sampled, greedy = _drive(wrapped)
    _stop(leader, thread)
    assert result["code"] == 0 and follower.engine.executables.calls == recorder.calls and len(recorder.calls) == 4
    assert sampled.tolist() == [5, 17] and greedy.tolist() == [7, 8] and not lost


def test_follower_with_other_tokens_is_a_divergence():
    leader, _follower, thread, _result, lost = _pair(follower_offset=1)
    LeaderExecutables(RecordingExecutables(), leader).run_greedy_backbone("p", 0, single_sequence_batch([7, 8], 16))
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and isinstance(lost[0], DivergenceError), lost
    with pytest.raises(FollowerLost):  # the next step is refused: the engine is dead
        LeaderExecutables(RecordingExecutables(), leader).copy_states(0, [])
    _stop(leader, thread)


def _split(frame: bytes):
    n = struct.unpack(">I", frame[:4])[0]
    return json.loads(frame[4 : 4 + n]), frame[4 + n :]


def test_frames_round_trip_and_refuse_reordering_or_tampering():
    batch = single_sequence_batch([5, 17, 300], 16, pad_to=8)
    frame = encode_frame(7, "run_scoring_backbone", {"batch": batch, "targets": np.arange(8, dtype=np.int32)})
    header, body = _split(frame.packed(KEY))
    op, args = decode_frame(header, body, expected_seq=7, key=KEY)
    assert op == "run_scoring_backbone"
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "num_seqs", "has_initial_state"):
        got, want = getattr(args["batch"], name), np.asarray(getattr(batch, name))
        assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all(), name
    assert args["batch"].num_seqs.shape == ()  # 0-d stays 0-d: the executables are compiled for int32[]
    with pytest.raises(DivergenceError, match="expected step 8"):
        decode_frame(header, body, expected_seq=8, key=KEY)
    tampered = bytearray(body)
    tampered[3] ^= 1
    with pytest.raises(DivergenceError, match="MAC"):
        decode_frame(header, bytes(tampered), expected_seq=7, key=KEY)
    for name, value in (("op", "run_backbone"), ("seq", 8), ("args", header["args"] + " ")):
        with pytest.raises(DivergenceError, match="MAC"):  # the MAC covers the header too
            decode_frame({**header, name: value}, body, expected_seq=header["seq"] if name != "seq" else 8, key=KEY)
    with pytest.raises(DivergenceError, match="MAC"):  # another session's key
        decode_frame(header, body, expected_seq=7, key=bytes(32))


def test_read_frame_reports_a_closed_channel():
    a, b = socket.socketpair()
    a.sendall(encode_frame(1, "stop", {}).packed(KEY)[:5])
    a.close()
    assert read_frame(b) is None


def test_lost_follower_channel_marks_the_leader_lost():
    ours, theirs = socket.socketpair()
    leader = MultihostLeader({1: Session(ours, 1, KEY)}, MULTIHOST)
    lost = []
    leader._on_lost.append(lost.append)
    theirs.close()  # the follower process died
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and isinstance(lost[0], FollowerLost) and "closed its step channel" in str(lost[0])


def test_step_channel_address_and_process_id_flag():
    from configs import CONFIG_DIR, load_config
    from runtime.parallel.multihost import step_address
    from runtime.parallel.multihost_channel import coordinator_bind_address, step_bind_address
    from server.cli import _load, _parser

    multihost = load_config(CONFIG_DIR / "tpu-v5p-16-qwen3-next-80b-multihost.yaml").parallel.multihost
    assert step_address(multihost) == ("10.0.0.2", 8477)  # no step_port: the coordinator's port + 1
    # binds the coordinator's own address, not every interface
    assert (coordinator_bind_address(multihost), step_bind_address(multihost)) == ("10.0.0.2:8476", ("10.0.0.2", 8477))
    everywhere = multihost.model_copy(update={"coordinator_bind_address": "0.0.0.0:8476"})
    assert step_bind_address(everywhere) == ("0.0.0.0", 8477) and step_address(everywhere) == ("10.0.0.2", 8477)
    args = _parser().parse_args(["serve", "--config", str(CONFIG_DIR / "cpu-multihost-2x4.yaml"), "--process-id", "1"])
    config = _load(args).parallel.multihost
    assert (config.process_id, step_address(config)) == (1, ("127.0.0.1", 8477))


def test_a_dead_engine_answers_503_for_the_linger_then_exits_1():
    """`server.unhealthy_linger_s`: the server keeps answering /health 503 (so a load balancer sees
    it) before draining and returning 1 (what process 0 does when a follower is lost)."""
    import asyncio

    import aiohttp

    from configs.schema import ServerConfig
    from server.runner import serve_async
    from server.testing import FakeEngine, build_test_tokenizer

    engine = FakeEngine(build_test_tokenizer())
    port = socket.create_server(("127.0.0.1", 0))
    port_number = port.getsockname()[1]
    port.close()

    async def go():
        config = ServerConfig(host="127.0.0.1", port=port_number, unhealthy_linger_s=1.5)
        serving = asyncio.create_task(serve_async(engine, config, asyncio.Event()))
        await asyncio.sleep(0.5)
        engine.healthy = False
        died = time.monotonic()
        statuses = []
        async with aiohttp.ClientSession() as session:
            while not serving.done() and time.monotonic() - died < 1.2:
                async with session.get(f"http://127.0.0.1:{port_number}/health") as r:
                    statuses.append(r.status)
                await asyncio.sleep(0.1)
        return statuses, await asyncio.wait_for(serving, 10), time.monotonic() - died

    statuses, code, elapsed = asyncio.run(go())
    assert code == 1 and elapsed >= 1.5 and engine.shutdown_called
    assert len(statuses) >= 5 and set(statuses[2:]) == {503}, statuses  # 503 throughout the linger
