"""The transfer suite over NIXL (UCX), between this process and a spawned peer."""

from __future__ import annotations

from tests.transfer.peer_process import TransferSuite


class TestNixlTransfer(TransferSuite):
    backend = "nixl"
