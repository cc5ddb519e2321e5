"""`bench/disk_promotion.py` at its smallest, on the tests' tiny model: each mode's loads
read every page of a prefix from disk (the bench asserts it per load: a lease of the
whole prefix, all of it from disk) and the table comes out. The ratio is the
benchmark's to report (bench/README.md), not this test's."""

from __future__ import annotations

from radixserve.bench.disk_promotion import main


def test_disk_promotion_bench_smallest(capsys, tiny_model: str, tmp_path) -> None:
    argv = ["--model", tiny_model, "--tokens", "64", "--prefixes", "3", "--rounds", "1",
            "--transport", "zmq", "--dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| disk read, then device read | overlapped |" in out
    assert "(n=2)" in out  # two disk loads per mode, the warm-up not counted
    assert list(tmp_path.iterdir()) == []  # its files removed
