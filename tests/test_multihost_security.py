"""The multi-process step channel fails closed (runtime/parallel/multihost_channel.py), on loopback.

Each attack runs against a real `MultihostLeader.listen` (or a real follower's `connect`), driven
by raw sockets that speak as much of the protocol as the attacker can; the genuine follower is a
real `Follower` over a recording fake engine. Every test ends with process 0 serving the genuine
follower (a step reaches it and it replays it) or refusing cleanly within its deadline. The
protocol's proofs are recomputed here from the spec in the module docstring, not imported.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import os
import socket
import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import SecretStr

from configs import CONFIG_DIR, ConfigError, load_config
from configs.schema import MultihostConfig
from runtime.parallel.multihost import (
    EXIT_DIVERGED,
    EXIT_LEADER_LOST,
    Follower,
    FollowerLost,
    LeaderExecutables,
    MultihostLeader,
)
from runtime.parallel.multihost_channel import (
    HEARTBEAT,
    HandshakeError,
    InsecureLaunchError,
    Session,
    accept_followers,
    check_secret,
    encode_frame,
)

SECRET = "correct horse battery staple 42"
WRONG = "another launch's secret, 0123456"
PROTOCOL = b"jaxserve-step/1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return _free_port()


def _multihost(port: int, process_id: int = 0, secret: str | None = SECRET, **kw) -> MultihostConfig:
    return MultihostConfig(
        coordinator_address=f"127.0.0.1:{_free_port()}",
        num_processes=2,
        process_id=process_id,
        step_port=port,
        secret=secret,
        **kw,
    )


class Recorder:
    """The follower's fake executables: one state-copy method that records what it ran."""

    def __init__(self):
        self.calls = []

    def copy_states(self, caches, pairs):
        self.calls.append(np.asarray(pairs).tolist())
        return caches + 1


def _follower(port: int, secret: str | None = SECRET, **kw) -> Follower:
    engine = SimpleNamespace(executables=Recorder(), model=SimpleNamespace(params="p"), caches=0)
    return Follower(engine, _multihost(port, process_id=1, secret=secret, **kw))


class Listening:
    """`MultihostLeader.listen` on a thread: `wait()` is the leader, or re-raises what listen raised."""

    def __init__(self, multihost, timeout_s: float = 20.0, handshake_timeout_s: float = 10.0):
        self.outcome: dict = {}
        self.started = time.monotonic()
        self.thread = threading.Thread(
            target=self._listen, args=(multihost, timeout_s, handshake_timeout_s), daemon=True
        )
        self.thread.start()

    def _listen(self, multihost, timeout_s, handshake_timeout_s):
        try:
            self.outcome["leader"] = MultihostLeader.listen(multihost, timeout_s, handshake_timeout_s)
        except Exception as err:
            self.outcome["error"] = err
        self.outcome["elapsed"] = time.monotonic() - self.started

    def wait(self, timeout_s: float) -> MultihostLeader:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"MultihostLeader.listen still blocked after {timeout_s} s"
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["leader"]


def _dial(port: int, within_s: float = 10.0) -> socket.socket:
    deadline = time.monotonic() + within_s
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _send(sock: socket.socket, message) -> None:
    data = json.dumps(message).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _received(sock: socket.socket, within_s: float) -> list[dict]:
    """Every handshake message `sock` receives until the leader closes it (within `within_s`)."""
    sock.settimeout(within_s)
    data = bytearray()
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:  # closed with our bytes unread: a reset, the refusal may be lost
        pass
    messages = []
    while data:
        length = struct.unpack(">I", data[:4])[0]
        messages.append(json.loads(data[4 : 4 + length]))
        del data[: 4 + length]
    return messages


def _proof(secret: str, role: bytes, leader_nonce: bytes, follower_nonce: bytes, pid: int) -> str:
    message = PROTOCOL + b" " + role + leader_nonce + follower_nonce + pid.to_bytes(4, "big")
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def _serves(leader: MultihostLeader, follower: Follower, session: Session) -> None:
    """A step reaches the genuine follower, which replays it and stops with exit code 0."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", follower.replay(session)), daemon=True)
    thread.start()
    try:
        LeaderExecutables(Recorder(), leader).copy_states(0, [(1, 2), (3, 4)])
        leader.stop()
        thread.join(10)
        assert result.get("code") == 0 and follower.engine.executables.calls == [[[1, 2], [3, 4]]]
        assert leader.lost is None
    finally:
        session.sock.close()
        for own in leader._sessions.values():
            own.sock.close()


def test_a_silent_connection_made_first_does_not_block_the_genuine_follower(port):
    listening = Listening(_multihost(port), handshake_timeout_s=5.0)
    silent = _dial(port)  # connected first, says nothing
    try:
        follower = _follower(port)
        session = follower.connect(timeout_s=10)
        leader = listening.wait(10)
        silent.setblocking(False)
        with pytest.raises(BlockingIOError):  # start-up finished while the silent handshake was still pending
            silent.recv(1)
        for sock in (session.sock, leader._sessions[1].sock):  # TCP keepalive: a vanished host is noticed
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        silent.setblocking(True)
        assert [m.keys() for m in _received(silent, 10)] == [{"refused"}]  # closed at its own deadline, no frame
        _serves(leader, follower, session)
    finally:
        silent.close()


def test_a_second_follower_claiming_a_taken_process_id_is_refused(port):
    listening = Listening(_multihost(port).model_copy(update={"num_processes": 3}))
    first, again = _follower(port), _follower(port)
    session = first.connect(timeout_s=10)
    with pytest.raises(HandshakeError, match="process 1 is already connected"):
        again.connect(timeout_s=10)
    second = _follower(port).multihost.model_copy(update={"process_id": 2, "num_processes": 3})
    other = Follower(SimpleNamespace(executables=Recorder(), model=None, caches=0), second).connect(timeout_s=10)
    leader = listening.wait(10)
    try:
        assert sorted(leader._sessions) == [1, 2] and leader._sessions[1].key == session.key
    finally:
        leader.stop()
        for sock in (session.sock, other.sock, *(own.sock for own in leader._sessions.values())):
            sock.close()


GARBAGE = {
    "http": b"GET / HTTP/1.1\r\nHost: jaxserve\r\n\r\n",
    "not json": struct.pack(">I", 8) + b"not json",
    "a json list": struct.pack(">I", 6) + b"[1, 2]",
    "truncated": struct.pack(">I", 100) + b"{",
    "no protocol": struct.pack(">I", 19) + b'{"process_id": 1}  ',
}
BAD_HELLOS = {
    "process id as a string": {"process_id": "1"},
    "process id true": {"process_id": True},
    "process id 0 (the leader)": {"process_id": 0},
    "process id out of range": {"process_id": 7},
    "short nonce": {"process_id": 1, "nonce": "00ff"},
}


def test_garbage_hellos_do_not_crash_process_0(port):
    listening = Listening(_multihost(port), handshake_timeout_s=2.0)
    refused = []
    for name, payload in GARBAGE.items():
        sock = _dial(port)
        sock.sendall(payload)
        if name == "truncated":
            sock.shutdown(socket.SHUT_WR)
        refused.append((name, _received(sock, 10)))
        sock.close()
    for name, hello in BAD_HELLOS.items():
        sock = _dial(port)
        _send(sock, {"protocol": PROTOCOL.decode(), "nonce": os.urandom(32).hex(), **hello})
        refused.append((name, _received(sock, 10)))
        sock.close()
    for name, messages in refused:  # each refused and closed, none got a challenge
        assert [m.keys() for m in messages] in ([{"refused"}], []), (name, messages)
    assert listening.thread.is_alive() and not listening.outcome  # process 0 still waiting, not crashed
    follower = _follower(port)
    session = follower.connect(timeout_s=10)
    _serves(listening.wait(10), follower, session)


def test_an_impostor_without_the_secret_is_refused_and_receives_no_step(port):
    listening = Listening(_multihost(port))
    impostors = [_dial(port), _dial(port)]  # both claim process 1 before the genuine follower connects
    try:
        challenges = []
        for sock in impostors:
            _send(sock, {"protocol": PROTOCOL.decode(), "process_id": 1, "nonce": os.urandom(32).hex()})
        # the first answers the challenge at once with a proof made without the secret
        first = _received_one(impostors[0])
        challenges.append(first)
        _send(impostors[0], {"proof": _proof(WRONG, b"follower", bytes.fromhex(first["nonce"]), bytes(32), 1)})
        follower = _follower(port)
        session = follower.connect(timeout_s=10)  # the second impostor's pending claim does not hold it up
        leader = listening.wait(10)
        challenges.append(_received_one(impostors[1]))
        _send(impostors[1], {"proof": "00" * 32})  # too late and wrong
        _serves(leader, follower, session)  # a step went out: neither impostor may have received it
        for sock, challenge in zip(impostors, challenges):
            assert set(challenge) == {"nonce", "proof"}
            rest = _received(sock, 10)
            assert [m.keys() for m in rest] == [{"refused"}], rest  # then closed: no frame, no token ids
        assert listening.outcome["elapsed"] < 10
    finally:
        for sock in impostors:
            sock.close()


def _received_one(sock: socket.socket) -> dict:
    sock.settimeout(10)
    length = struct.unpack(">I", _exactly(sock, 4))[0]
    return json.loads(_exactly(sock, length))


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "closed early"
        data += chunk
    return data


def test_a_wrong_secret_follower_is_refused_and_start_up_fails_cleanly(port):
    listening = Listening(_multihost(port), timeout_s=4.0)
    with pytest.raises(HandshakeError, match="the process on the step channel did not prove it holds the secret"):
        _follower(port, secret=WRONG).connect(timeout_s=10)
    # one that skips checking the leader and answers with its own (wrong) secret is refused by the leader
    sock = _dial(port)
    ours = os.urandom(32)
    _send(sock, {"protocol": PROTOCOL.decode(), "process_id": 1, "nonce": ours.hex()})
    theirs = bytes.fromhex(_received_one(sock)["nonce"])
    _send(sock, {"proof": _proof(WRONG, b"follower", theirs, ours, 1)})
    refusal = _received(sock, 10)
    sock.close()
    assert len(refusal) == 1 and "did not prove" in refusal[0]["refused"]
    with pytest.raises(TimeoutError, match=r"0 of 1 followers authenticated within 4 s \(missing process ids \[1\]\)"):
        listening.wait(15)
    assert listening.outcome["elapsed"] < 8


@pytest.mark.parametrize("attack", ["altered args", "another key", "replayed"])
def test_a_tampered_or_injected_frame_is_a_divergence(port, attack):
    server = socket.create_server(("127.0.0.1", port))
    accepted = {}
    thread = threading.Thread(
        target=lambda: accepted.update(accept_followers(server, SECRET.encode(), 2, 10)), daemon=True
    )
    thread.start()
    follower = _follower(port)
    session = follower.connect(timeout_s=10)
    thread.join(10)
    server.close()
    leader_end = accepted[1]
    try:
        assert leader_end.key == session.key  # both ends derived the same session key
        good = encode_frame(1, "copy_states", {"pairs": [[1, 2]]}).packed(leader_end.key)
        if attack == "altered args":
            frames = [good.replace(b"[[1, 2]]", b"[[1, 3]]")]
        elif attack == "another key":  # injected by someone without the session key
            frames = [encode_frame(1, "copy_states", {"pairs": [[1, 2]]}).packed(os.urandom(32))]
        else:
            frames = [good, good]
        assert attack == "replayed" or frames[0] != good
        for frame in frames:
            leader_end.sock.sendall(frame)
        result = {}
        replaying = threading.Thread(target=lambda: result.setdefault("code", follower.replay(session)), daemon=True)
        replaying.start()
        replaying.join(10)
        assert result.get("code") == EXIT_DIVERGED
        assert follower.engine.executables.calls == ([[[1, 2]]] if attack == "replayed" else [])
    finally:
        session.sock.close()
        leader_end.sock.close()


def _fake_leader(server: socket.socket, secret: str, seen: list) -> None:
    """Answers any hello with a proof made with `secret`, accepts whatever comes back, sends a step."""
    sock, _ = server.accept()
    with sock:
        sock.settimeout(10)
        hello = _received_one(sock)
        ours = os.urandom(32)
        _send(
            sock,
            {
                "nonce": ours.hex(),
                "proof": _proof(secret, b"leader", ours, bytes.fromhex(hello["nonce"]), hello["process_id"]),
            },
        )
        try:
            seen.append(_received_one(sock))  # the follower's proof: it must never come
        except (AssertionError, OSError):
            return
        _send(sock, {"accepted": True})
        sock.sendall(encode_frame(1, "copy_states", {"pairs": [[6, 6]]}).packed(bytes(32)))


@pytest.mark.parametrize("fake", ["another secret", "no handshake"])
def test_a_follower_refuses_a_fake_leader(port, fake):
    seen = []
    with socket.create_server(("127.0.0.1", port)) as server:
        if fake == "another secret":
            target = _fake_leader
        else:  # a validly framed step at once

            def target(server, secret, seen):
                sock, _ = server.accept()
                with sock:
                    sock.sendall(encode_frame(1, "copy_states", {"pairs": [[6, 6]]}).packed(bytes(32)))
                    time.sleep(1)

        faking = threading.Thread(target=target, args=(server, WRONG, seen), daemon=True)
        faking.start()
        follower = _follower(port)
        started = time.monotonic()
        with pytest.raises(
            HandshakeError,
            match="the process on the step channel did not prove" if fake == "another secret" else "malformed nonce",
        ):
            follower.connect(timeout_s=10)
        assert time.monotonic() - started < 5
        faking.join(15)
    assert seen == [] and follower.engine.executables.calls == []  # no proof given away, no step run


def test_without_a_secret_a_loopback_launch_runs_unauthenticated(port, caplog):
    listening = Listening(_multihost(port, secret=None))
    with pytest.raises(HandshakeError):  # a follower holding a secret refuses a leader without one
        _follower(port).connect(timeout_s=10)
    follower = _follower(port, secret=None)
    session = follower.connect(timeout_s=10)
    _serves(listening.wait(10), follower, session)
    assert "UNAUTHENTICATED" in caplog.text


def test_a_silent_leader_ends_the_follower_with_exit_1():
    """Idle serving sends heartbeats; once they stop for heartbeat_timeout_s the follower exits 1."""
    leader_end, follower_end = socket.socketpair()
    key = os.urandom(32)
    follower = _follower(1, heartbeat_timeout_s=1.0)
    result = {}
    session = Session(follower_end, 1, key)
    replaying = threading.Thread(target=lambda: result.setdefault("code", follower.replay(session)), daemon=True)
    try:
        leader_end.sendall(encode_frame(0, HEARTBEAT, {}).packed(key))
        started = time.monotonic()
        replaying.start()
        replaying.join(10)
        assert result.get("code") == EXIT_LEADER_LOST and time.monotonic() - started < 6
    finally:
        leader_end.close()
        follower_end.close()


def _send_heartbeats(sock: socket.socket) -> threading.Event:
    """A follower's heartbeat lines on `sock` every 0.1 s until the returned event is set."""
    done = threading.Event()

    def beat():
        while not done.wait(0.1):
            try:
                sock.sendall(b'{"hb": 1}\n')
            except OSError:
                return

    threading.Thread(target=beat, daemon=True).start()
    return done


def test_an_idle_leader_keeps_its_followers():
    """After a step, no steps for 3 x heartbeat_timeout_s: the leader's heartbeat frames keep the
    follower replaying (and the follower's keep the leader's watchdog content)."""
    leader_end, follower_end = socket.socketpair()
    key = os.urandom(32)
    follower = _follower(1, heartbeat_timeout_s=1.0)
    leader = MultihostLeader({1: Session(leader_end, 1, key)}, follower.multihost)
    beating = _send_heartbeats(follower_end)
    result = {}
    session = Session(follower_end, 1, key)
    replaying = threading.Thread(target=lambda: result.setdefault("code", follower.replay(session)), daemon=True)
    try:
        replaying.start()
        LeaderExecutables(Recorder(), leader).copy_states(0, [(1, 2)])
        time.sleep(3)
        assert replaying.is_alive() and not result and leader.lost is None, (result, leader.lost)
        leader.stop()
        replaying.join(10)
        assert result.get("code") == 0 and follower.steps == 2  # the step, then the stop frame
    finally:
        beating.set()
        leader_end.close()
        follower_end.close()


def test_a_follower_that_stops_reading_is_lost():
    """It still sends heartbeats but reads nothing: the leader's sends time out and mark it lost."""
    leader_end, follower_end = socket.socketpair()
    leader = MultihostLeader(
        {1: Session(leader_end, 1, bytes(32))},
        SimpleNamespace(heartbeat_timeout_s=2.0, step_timeout_s=600),
        send_timeout_s=1.0,
    )
    beating = _send_heartbeats(follower_end)
    raised = []

    def send_until_lost():
        try:
            for _ in range(50):
                leader.send("copy_states", {"pairs": np.zeros(1 << 20, np.uint8)})
        except FollowerLost as err:
            raised.append(err)

    sending = threading.Thread(target=send_until_lost, daemon=True)
    started = time.monotonic()
    try:
        sending.start()
        sending.join(20)
        assert raised and "sending step" in str(raised[0]), raised
        assert isinstance(leader.lost, FollowerLost) and time.monotonic() - started < 15
    finally:
        beating.set()
        leader_end.close()
        follower_end.close()


# ---- the launch config ------------------------------------------------------------------------------
def test_the_secret_comes_from_the_environment_and_is_never_printed(monkeypatch, capsys):
    from server.cli import main

    path = CONFIG_DIR / "cpu-multihost-2x4.yaml"
    monkeypatch.setenv("JAXSERVE_MULTIHOST_SECRET", SECRET)
    assert load_config(path).parallel.multihost.secret.get_secret_value() == SECRET
    assert main(["config", "--config", str(path)]) == 0
    printed = capsys.readouterr().out
    assert SECRET not in printed and json.loads(printed)["parallel"]["multihost"]["secret"] == "**********"
    monkeypatch.setenv("JAXSERVE_MULTIHOST_SECRET", "short")
    with pytest.raises(ConfigError, match="parallel.multihost.secret: must be at least 16 characters"):
        load_config(path)


def test_a_launch_other_machines_reach_refuses_to_start_without_a_secret(monkeypatch):
    import jax

    from runtime.parallel.mesh import initialize_multihost

    # jax 0.10's initialize takes the coordinator's bind address (runtime/mesh.py passes it)
    assert "coordinator_bind_address" in inspect.signature(jax.distributed.initialize).parameters

    def bind(**kwargs):
        raise AssertionError(f"jax.distributed.initialize reached without a secret: {kwargs}")

    monkeypatch.setattr(jax.distributed, "initialize", bind)
    monkeypatch.delenv("JAXSERVE_MULTIHOST_SECRET", raising=False)
    tpu = load_config(CONFIG_DIR / "tpu-v5p-16-qwen3-next-80b-multihost.yaml")
    loopback = load_config(CONFIG_DIR / "cpu-multihost-2x4.yaml").parallel.multihost
    with pytest.raises(InsecureLaunchError, match="10.0.0.2:8476 .*JAXSERVE_MULTIHOST_SECRET"):
        initialize_multihost(tpu.parallel)  # before jax.distributed binds anything
    assert not jax.distributed.is_initialized()
    for where in (
        lambda: MultihostLeader.listen(tpu.parallel.multihost),
        lambda: Follower(SimpleNamespace(caches=0), tpu.parallel.multihost).connect(),
    ):
        with pytest.raises(InsecureLaunchError):
            where()
    assert check_secret(tpu.parallel.multihost.model_copy(update={"secret": SecretStr(SECRET)})) is True
    assert check_secret(loopback) is False  # loopback only: allowed, logged as unauthenticated
    everywhere = loopback.model_copy(update={"coordinator_bind_address": "0.0.0.0:8476"})
    with pytest.raises(InsecureLaunchError, match="0.0.0.0:8476"):
        check_secret(everywhere)
