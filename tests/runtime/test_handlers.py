"""Handler tables: `dispatch` runs the handler of a message's type and reports a type its
table lacks, and each role's table on each channel handles exactly the union of message
types the role declares for it."""

from __future__ import annotations

from typing import Any, get_args

import zmq.asyncio

from radixserve.protocol import Abort, TransferDone
from radixserve.runtime.links import LinkControl, LinkIdentity, LinkSet
from radixserve.runtime.service import Handlers, dispatch
from radixserve.runtime.worker_kvstore import WorkerFromKVStore
from radixserve.services.decode.settings import DecodeSettings
from radixserve.services.decode.worker import (
    DecodeFromKVStore,
    DecodeFromPrefill,
    DecodeInbound,
    DecodeWorker,
)
from radixserve.services.prefill.settings import PrefillSettings
from radixserve.services.prefill.worker import PrefillInbound, PrefillWorker
from tests.fake_engine import FakeEngine


def test_dispatch_runs_the_handler_of_the_message_type_only() -> None:
    seen: list[tuple[Any, Any]] = []
    table: Handlers = {Abort: lambda sender, msg: seen.append((sender, msg))}
    assert dispatch(table, "gateway", Abort("r1"))
    assert not dispatch(table, "gateway", TransferDone("r1"))
    assert seen == [("gateway", Abort("r1"))]


def test_each_role_handles_exactly_the_messages_it_declares_on_each_channel() -> None:
    decode = DecodeWorker(DecodeSettings(transfer_backend="zmq"), FakeEngine())
    prefill = PrefillWorker(PrefillSettings(transfer_backend="zmq"), FakeEngine())
    context = zmq.asyncio.Context()
    links = LinkSet(context, [], LinkIdentity("g", "gateway", 1, 1.0, 3.0), on_message=print)
    try:
        tables = [
            (decode.handlers(), DecodeInbound),
            (decode.kvstore_handlers(), DecodeFromKVStore),
            (decode.prefill_handlers, DecodeFromPrefill),
            (prefill.handlers(), PrefillInbound),
            (prefill.kvstore_handlers(), WorkerFromKVStore),
            (links.control, LinkControl),
        ]
        for table, union in tables:
            assert set(table) == set(get_args(union)), union
    finally:
        context.destroy(linger=0)
