"""The multi-process step channel's wire: who may connect, the handshake, and the frame format.

Process 0 (the leader) listens on the step channel; each follower dials it and both prove that
they hold `parallel.multihost.secret` (challenge-response, HMAC-SHA256) before a single step
travels. Handshake messages are u32-length-prefixed JSON objects of at most 1 KiB:

    follower -> leader   {"protocol", "process_id": P, "nonce": Nf}
    leader -> follower   {"nonce": Nl, "proof": HMAC(secret, "leader" Nl Nf P)}    or {"refused": why}
    follower -> leader   {"proof": HMAC(secret, "follower" Nl Nf P)}    (only if the leader's proof holds)
    leader -> follower   {"accepted": true}                                          or {"refused": why}

Both then key every later digest with the session key HMAC(secret, "session" Nl Nf P). Without a
secret (allowed only when every address is loopback) the same exchange runs with a fixed public
key: corruption is still caught, nobody is authenticated.

Frame (leader -> follower): u32 header length, JSON header {seq, op, args, body, mac}, then `body`
bytes of raw array data that `args` (JSON) describes. `mac` is blake2b keyed with the session key
over the blake2b hash of (seq, op, args, body): hashed once, keyed per follower. op "hb" is the
leader's heartbeat (seq not checked, nothing run). A follower answers each token-producing step
with a JSON line {"seq", "tokens"}: the keyed digest of its tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import struct
import threading
import time
from typing import NamedTuple

import numpy as np

from models.batch import ForwardBatch
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.steps.table_host import TableStep

log = logging.getLogger("jaxserve.multihost")

PROTOCOL = "jaxserve-step/1"
HEARTBEAT = "hb"
NONCE_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0  # one connection's whole handshake, however slowly its bytes trickle in
MAX_MESSAGE_BYTES = 1024
MAX_PENDING_HANDSHAKES = 32  # more concurrent unauthenticated connections are closed at once
NO_SECRET = b"jaxserve step channel without a secret (loopback only)"
KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}  # a vanished host: ~25 s
_DATACLASSES = {cls.__name__: cls for cls in (ForwardBatch, SamplingMetadata, TableStep)}


class DivergenceError(RuntimeError):
    """A follower received a step out of order, corrupted, or computed other tokens than the leader."""


class HandshakeError(RuntimeError):
    """A step channel peer did not complete the handshake: wrong secret, not a jaxserve peer of
    this launch, a refusal, or too slow."""


class InsecureLaunchError(ValueError):
    """A multi-process launch reachable from the network without a secret."""


@dataclasses.dataclass(frozen=True)
class Session:
    """One authenticated step channel connection."""

    sock: socket.socket
    process_id: int
    key: bytes  # keys the frame and token digests of this connection only


# ---- addresses and the secret -------------------------------------------------------------------
def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def step_address(multihost) -> tuple[str, int]:
    """(host, port) followers dial: the coordinator's host, `step_port` or the coordinator's port + 1."""
    host, port = _split(multihost.coordinator_address)
    return host, multihost.step_port or port + 1


def coordinator_bind_address(multihost) -> str:
    """HOST:PORT process 0's JAX coordinator binds: `coordinator_bind_address`, else `coordinator_address`."""
    return multihost.coordinator_bind_address or multihost.coordinator_address


def step_bind_address(multihost) -> tuple[str, int]:
    """(host, port) process 0's step channel binds: the coordinator's bind host, the step port."""
    return _split(coordinator_bind_address(multihost))[0], step_address(multihost)[1]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        return False


def check_secret(multihost) -> bool:
    """True when the step channel is authenticated (a secret is set). Without one, False for a
    launch whose addresses are all loopback; InsecureLaunchError for one that other machines reach."""
    if multihost.secret is not None:
        return True
    addresses = dict.fromkeys((multihost.coordinator_address, coordinator_bind_address(multihost)))
    exposed = [address for address in addresses if not is_loopback(_split(address)[0])]
    if exposed and multihost.num_processes > 1:
        raise InsecureLaunchError(
            f"parallel.multihost: the JAX coordinator and the step channel use {' and '.join(exposed)} (not "
            "loopback) and no secret is set, so whoever reaches those ports could join this launch or read its "
            "steps. Generate a secret once (python -c 'import secrets; print(secrets.token_urlsafe(32))') and "
            "give every process the same value in JAXSERVE_MULTIHOST_SECRET (or parallel.multihost.secret); "
            "docs/scaling.md, 'Deploying safely'"
        )
    return False


def channel_secret(multihost) -> bytes:
    """The handshake key: the secret, or the fixed public key of a loopback-only launch."""
    if check_secret(multihost):
        return multihost.secret.get_secret_value().encode()
    log.warning(
        "step channel: no parallel.multihost.secret, so it is UNAUTHENTICATED (allowed: every address "
        "is loopback, but any local user can reach it); set JAXSERVE_MULTIHOST_SECRET"
    )
    return NO_SECRET


def configure(sock: socket.socket) -> None:
    """No Nagle delay on small frames; TCP keepalive, so a peer host that vanished is noticed."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


# ---- handshake ----------------------------------------------------------------------------------
def _proof(secret: bytes, role: bytes, leader_nonce: bytes, follower_nonce: bytes, process_id: int) -> str:
    message = PROTOCOL.encode() + b" " + role + leader_nonce + follower_nonce + process_id.to_bytes(4, "big")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _proof_holds(claimed, secret: bytes, role: bytes, *nonces_and_pid) -> bool:
    expected = _proof(secret, role, *nonces_and_pid)
    return isinstance(claimed, str) and hmac.compare_digest(claimed.encode(), expected.encode())


def _session_key(secret: bytes, leader_nonce: bytes, follower_nonce: bytes, process_id: int) -> bytes:
    return bytes.fromhex(_proof(secret, b"session", leader_nonce, follower_nonce, process_id))


def _nonce(value) -> bytes:
    try:
        nonce = bytes.fromhex(value)
    except (TypeError, ValueError):
        nonce = b""
    if len(nonce) != NONCE_BYTES:
        raise HandshakeError(f"malformed nonce {value!r:.80}")
    return nonce


def send_message(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_message(sock: socket.socket, deadline: float) -> dict:
    """One handshake message, read by `deadline` (time.monotonic) at the latest."""
    size = _recv_exact(sock, 4, deadline)
    if size is None:
        raise HandshakeError("the peer closed the connection during the handshake")
    length = struct.unpack(">I", size)[0]
    if length > MAX_MESSAGE_BYTES:
        raise HandshakeError(f"a {length}-byte handshake message (at most {MAX_MESSAGE_BYTES}): not a jaxserve peer")
    raw = _recv_exact(sock, length, deadline)
    if raw is None:
        raise HandshakeError("the peer closed the connection during the handshake")
    try:
        message = json.loads(raw)
    except ValueError:
        message = None
    if not isinstance(message, dict):
        raise HandshakeError(f"a handshake message that is not a JSON object: {raw[:80]!r}")
    if "refused" in message:
        raise HandshakeError(f"refused by the peer: {message['refused']!s:.200}")
    return message


def follower_handshake(
    sock: socket.socket, secret: bytes, process_id: int, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> Session:
    """Prove this follower to the leader and make the leader prove itself first."""
    deadline = time.monotonic() + timeout_s
    sock.settimeout(timeout_s)
    ours = os.urandom(NONCE_BYTES)
    send_message(sock, {"protocol": PROTOCOL, "process_id": process_id, "nonce": ours.hex()})
    challenge = recv_message(sock, deadline)
    theirs = _nonce(challenge.get("nonce"))
    if not _proof_holds(challenge.get("proof"), secret, b"leader", theirs, ours, process_id):
        raise HandshakeError(
            "the process on the step channel did not prove it holds the secret (another "
            "parallel.multihost.secret, or not this launch's process 0): none of its steps is run"
        )
    send_message(sock, {"proof": _proof(secret, b"follower", theirs, ours, process_id)})
    if recv_message(sock, deadline).get("accepted") is not True:
        raise HandshakeError("the leader did not accept this follower")
    return Session(sock, process_id, _session_key(secret, theirs, ours, process_id))


def leader_handshake(
    sock: socket.socket, secret: bytes, num_processes: int, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> Session:
    """Check one connection's hello and proof; the caller accepts it (or not) afterwards."""
    deadline = time.monotonic() + timeout_s
    sock.settimeout(timeout_s)
    hello = recv_message(sock, deadline)
    if hello.get("protocol") != PROTOCOL:
        raise HandshakeError(f"not a {PROTOCOL} hello: {json.dumps(hello)[:120]}")
    pid = hello.get("process_id")
    if type(pid) is not int or not 0 < pid < num_processes:
        raise HandshakeError(f"process_id {pid!r:.40} is not one of 1..{num_processes - 1}")
    theirs, ours = _nonce(hello.get("nonce")), os.urandom(NONCE_BYTES)
    send_message(sock, {"nonce": ours.hex(), "proof": _proof(secret, b"leader", ours, theirs, pid)})
    if not _proof_holds(recv_message(sock, deadline).get("proof"), secret, b"follower", ours, theirs, pid):
        raise HandshakeError(f"claims process {pid} but did not prove it holds the secret")
    return Session(sock, pid, _session_key(secret, ours, theirs, pid))


def _refuse(sock: socket.socket, reason: str) -> None:
    try:
        sock.settimeout(1.0)
        send_message(sock, {"refused": reason[:200]})
    except OSError:
        pass
    sock.close()


def accept_followers(
    server: socket.socket,
    secret: bytes,
    num_processes: int,
    timeout_s: float,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> dict[int, Session]:
    """Accept connections on `server` until processes 1..num_processes-1 have each authenticated
    once, or raise TimeoutError after `timeout_s`. Each connection's handshake runs on its own
    thread under its own deadline: a silent, slow, garbled, wrong-secret or duplicate peer is
    refused (closed, logged) without holding up the others."""
    wanted = num_processes - 1
    sessions: dict[int, Session] = {}
    lock, everyone = threading.Lock(), threading.Event()
    accepting = [True]
    slots = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)

    def admit(sock: socket.socket, peer) -> None:
        try:
            session = leader_handshake(sock, secret, num_processes, handshake_timeout_s)
            with lock:
                pid = session.process_id
                if not accepting[0]:
                    raise HandshakeError("start-up is over")
                if pid in sessions:
                    raise HandshakeError(f"process {pid} is already connected")
                send_message(sock, {"accepted": True})
                sessions[pid] = session
                if len(sessions) == wanted:
                    everyone.set()
            log.info("follower %d authenticated from %s", pid, peer)
        except (HandshakeError, OSError) as err:
            log.warning("step channel: refused %s: %s", peer, err)
            _refuse(sock, str(err) if isinstance(err, HandshakeError) else "handshake failed")
        finally:
            slots.release()

    deadline = time.monotonic() + timeout_s
    server.settimeout(0.2)
    try:
        while not everyone.is_set() and time.monotonic() < deadline:
            try:
                sock, peer = server.accept()
            except TimeoutError:
                continue
            except OSError as err:  # e.g. out of file descriptors: keep serving the others
                log.warning("step channel: accept failed: %s", err)
                time.sleep(0.2)
                continue
            if not slots.acquire(blocking=False):
                log.warning("step channel: refused %s: %d handshakes already pending", peer, MAX_PENDING_HANDSHAKES)
                sock.close()
                continue
            configure(sock)
            threading.Thread(target=admit, args=(sock, peer), name="jaxserve-step-handshake", daemon=True).start()
    finally:
        with lock:
            accepting[0] = False
            complete = len(sessions) == wanted
            if not complete:
                for session in sessions.values():
                    session.sock.close()
    if not complete:
        host, port = server.getsockname()[:2]
        missing = sorted(set(range(1, num_processes)) - set(sessions))
        raise TimeoutError(
            f"step channel {host}:{port}: {len(sessions)} of {wanted} followers authenticated within "
            f"{timeout_s:g} s (missing process ids {missing}); every process needs the same "
            "parallel.multihost.secret (JAXSERVE_MULTIHOST_SECRET)"
        )
    return sessions


# ---- frames -------------------------------------------------------------------------------------
def _describe(value, chunks: list[bytes], offset: list[int]):
    """JSON description of a host value; array bytes are appended to `chunks`."""
    if isinstance(value, (np.ndarray, np.generic)):
        pass
    elif value is None or isinstance(value, (bool, int, float, str)):
        return {"json": value}
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (list, tuple, int)) for v in value):
        return {"json": [list(v) if isinstance(v, (list, tuple)) else v for v in value]}
    elif dataclasses.is_dataclass(value) and type(value).__name__ in _DATACLASSES:
        fields = {f.name: _describe(getattr(value, f.name), chunks, offset) for f in dataclasses.fields(value)}
        return {"dataclass": type(value).__name__, "fields": fields}
    array = np.asarray(value)
    data = array.tobytes()  # C order; keeps 0-d arrays 0-d (np.ascontiguousarray would not)
    chunks.append(data)
    offset[0] += len(data)
    return {"array": array.dtype.str, "shape": list(array.shape), "end": offset[0]}


def _restore(spec, body: memoryview):
    if "json" in spec:
        return spec["json"]
    if "dataclass" in spec:
        cls = _DATACLASSES[spec["dataclass"]]
        return cls(**{name: _restore(field, body) for name, field in spec["fields"].items()})
    dtype, shape = np.dtype(spec["array"]), tuple(spec["shape"])
    end = spec["end"]
    start = end - int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return np.frombuffer(body[start:end], dtype=dtype).reshape(shape).copy()


def _content_digest(seq, op, args_json, body: bytes) -> bytes:
    head = json.dumps([seq, op, args_json]).encode()
    return hashlib.blake2b(struct.pack(">Q", len(head)) + head + body, digest_size=32).digest()


def _mac(key: bytes, digest: bytes) -> str:
    return hashlib.blake2b(digest, key=key, digest_size=32, person=b"jaxserve-frame").hexdigest()


class Frame(NamedTuple):
    seq: int
    op: str
    args_json: str
    body: bytes
    digest: bytes  # of everything above: one hash per step, one keyed MAC of it per follower

    def packed(self, key: bytes) -> bytes:
        header = json.dumps(
            {
                "seq": self.seq,
                "op": self.op,
                "args": self.args_json,
                "body": len(self.body),
                "mac": _mac(key, self.digest),
            }
        ).encode()
        return struct.pack(">I", len(header)) + header + self.body


def encode_frame(seq: int, op: str, args: dict) -> Frame:
    """One leader -> follower frame: op "stop", "hb", or a step method with its host args."""
    chunks: list[bytes] = []
    described = {name: _describe(value, chunks, [sum(map(len, chunks))]) for name, value in args.items()}
    body = b"".join(chunks)
    args_json = json.dumps(described, sort_keys=True)
    return Frame(seq, op, args_json, body, _content_digest(seq, op, args_json, body))


def decode_frame(header: dict, body: bytes, expected_seq: int, key: bytes) -> tuple[str, dict]:
    """(op, host args) of a frame; DivergenceError unless its MAC holds and it is step `expected_seq`
    (a heartbeat: any step)."""
    seq, op, args_json, mac = (header.get(name) for name in ("seq", "op", "args", "mac"))
    if not isinstance(mac, str) or not hmac.compare_digest(
        mac.encode(), _mac(key, _content_digest(seq, op, args_json, body)).encode()
    ):
        raise DivergenceError(
            f"step {expected_seq}: the frame's MAC does not match (altered, injected, or sent with another key)"
        )
    if op == HEARTBEAT:
        return op, {}
    if seq != expected_seq:
        raise DivergenceError(f"received step {seq}, expected step {expected_seq}")
    view = memoryview(body)
    return op, {name: _restore(spec, view) for name, spec in json.loads(args_json).items()}


def read_frame(sock: socket.socket) -> tuple[dict, bytes] | None:
    """(header, body), or None when the peer closed the connection."""
    size = _recv_exact(sock, 4)
    if size is None:
        return None
    raw = _recv_exact(sock, struct.unpack(">I", size)[0])
    if raw is None:
        return None
    try:
        header = json.loads(raw)
        length = header["body"]
    except (ValueError, TypeError, KeyError):
        raise DivergenceError(f"a malformed frame header: {raw[:80]!r}") from None
    if type(length) is not int or length < 0:
        raise DivergenceError(f"a malformed frame header: body {length!r:.40}")
    body = _recv_exact(sock, length) if length else b""
    return None if body is None else (header, body)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the handshake took too long")
            sock.settimeout(remaining)
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def tokens_digest(key: bytes, seq: int, tokens) -> str:
    """A follower's reply for step `seq`: the keyed digest of the tokens it sampled."""
    data = struct.pack(">Q", seq) + np.ascontiguousarray(np.asarray(tokens, np.int32)).tobytes()
    return hashlib.blake2b(data, key=key, digest_size=32, person=b"jaxserve-tokens").hexdigest()
