"""`bench/codec_speed.py` times every message it lists, each decoded back to itself."""

from __future__ import annotations

from bench.codec_speed import MESSAGES, timings


def test_every_message_is_timed_both_ways():
    rows = timings(repeats=1, calls=3)
    assert set(rows) == set(MESSAGES)
    for row in rows.values():
        assert row["encode_us"] > 0 and row["decode_us"] > 0 and row["frame_bytes"] > 16
