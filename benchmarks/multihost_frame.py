"""Host cost of the multi-process step channel (runtime/parallel/multihost_channel.py): frame size and the
time to encode + MAC (leader) and verify + decode (follower) one step's `ForwardBatch`, for the test config's
shapes and the v5p-16 config's (max_num_seqs 128, 512 blocks per sequence).

    python -m benchmarks.multihost_frame [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import struct
import time

import numpy as np

from models.batch import ForwardBatch
from runtime.parallel.multihost_channel import decode_frame, encode_frame

KEY = bytes(32)  # a session key (runtime/parallel/multihost_channel.py)
# name -> (token bucket T, max_num_seqs S, max_blocks_per_seq MB)
SHAPES = {"cpu-multihost test decode": (8, 4, 32), "v5p-16 decode": (128, 128, 512), "v5p-16 prefill": (8192, 128, 512)}


def _batch(T: int, S: int, MB: int) -> ForwardBatch:
    def i32(*shape):
        return np.zeros(shape, np.int32)

    return ForwardBatch(
        input_ids=i32(T),
        positions=i32(T),
        slot_mapping=i32(T),
        cu_q_lens=i32(S + 1),
        kv_lens=i32(S),
        block_tables=i32(S, MB),
        state_slot_ids=i32(S),
        has_initial_state=np.zeros(S, bool),
        num_seqs=np.array(S, np.int32),
        logits_indices=i32(S),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    for name, shape in SHAPES.items():
        batch = _batch(*shape)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            frame = encode_frame(1, "run_backbone", {"batch": batch}).packed(KEY)
        t1 = time.perf_counter()
        size = struct.unpack(">I", frame[:4])[0]
        header, body = json.loads(frame[4 : 4 + size]), frame[4 + size :]
        for _ in range(args.repeats):
            decode_frame(header, body, expected_seq=1, key=KEY)
        t2 = time.perf_counter()
        encode_ms, decode_ms = ((b - a) / args.repeats * 1e3 for a, b in ((t0, t1), (t1, t2)))
        print(
            f"{name:<28} T={shape[0]:<5} frame {len(frame) / 1024:7.1f} KiB   encode {encode_ms:6.3f} ms   "
            f"decode {decode_ms:6.3f} ms"
        )


if __name__ == "__main__":
    main()
