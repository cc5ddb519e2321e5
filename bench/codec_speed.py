"""Microseconds to encode and to decode the wire messages that go by most often: a
decode worker's `TokenChunk` (one a token of every stream), a `GenerateRequest` of a 2k-
token prompt and a `PrefillRequest` with its page ids. Hot (one process, the same
message again and again): the codec's own cost, without the caches a serving process
shares with the model's step.

    .venv/bin/python bench/codec_speed.py [--repeats 5] [--calls 2000]
"""

from __future__ import annotations

import argparse
import sys
import time

from radixserve.protocol.codec import decode, encode
from radixserve.protocol.messages import GenerateRequest, PrefillRequest, TokenChunk
from radixserve.protocol.sampling import SamplingSpec
from radixserve.protocol.wire import Message

MESSAGES: dict[str, Message] = {
    "token_chunk": TokenChunk(request_id="cmpl-5f0c2d1e9a8b4c7d", token_ids=(1234,),
                              text=" hello", prompt_tokens=2000, completion_tokens=17),
    "generate_request (2k tokens)": GenerateRequest(
        request_id="cmpl-5f0c2d1e9a8b4c7d", prompt_token_ids=tuple(range(1000, 3000)),
        sampling=SamplingSpec(max_tokens=64, temperature=0.7, top_p=0.9, seed=3)),
    "prefill_request (2k tokens)": PrefillRequest(
        request_id="cmpl-5f0c2d1e9a8b4c7d", token_ids=tuple(range(1000, 3000)),
        dst_page_ids=tuple(range(125)), sampling=SamplingSpec(max_tokens=64)),
}  # fmt: skip


def timings(repeats: int, calls: int) -> dict[str, dict[str, float]]:
    """Per message: the best of ``repeats`` means over ``calls`` calls, in microseconds,
    of encode and of decode (checking on the way that decode gives the message back)."""
    out = {}
    for name, msg in MESSAGES.items():
        frame = encode(msg)
        assert decode(frame) == msg
        best = {"encode_us": float("inf"), "decode_us": float("inf")}
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                encode(msg)
            middle = time.perf_counter()
            for _ in range(calls):
                decode(frame)
            end = time.perf_counter()
            best["encode_us"] = min(best["encode_us"], (middle - start) / calls * 1e6)
            best["decode_us"] = min(best["decode_us"], (end - middle) / calls * 1e6)
        out[name] = {**best, "frame_bytes": float(len(frame))}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if args.repeats < 1 or args.calls < 1:
        parser.error("--repeats and --calls must be at least 1")
    print("| message | frame bytes | encode (us) | decode (us) |\n|---|---|---|---|")
    for name, row in timings(args.repeats, args.calls).items():
        print(f"| {name} | {row['frame_bytes']:.0f} | {row['encode_us']:.1f} | "
              f"{row['decode_us']:.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
