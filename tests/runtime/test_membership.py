"""Membership without processes: the kvstore's registry (register, replace, drop with the
connection, watchers) and a router's view of it applied to real link sets (joins,
draining, leaving only once down, a partial list after a kvstore restart cuts nothing,
static addresses stay)."""

from __future__ import annotations

import zmq.asyncio

from radixserve.protocol import MemberInfo, MemberList
from radixserve.runtime.links import LinkIdentity, LinkSet
from radixserve.runtime.membership import MemberView
from radixserve.services.kvstore.registry import MemberRegistry


def member(name: str, role: str = "decode", port: int = 1, gen: int = 1, draining: bool = False):
    return MemberInfo(name, role, f"tcp://127.0.0.1:{port}", gen, draining)  # type: ignore[arg-type]


def test_registry_lists_replaces_and_drops_members():
    reg = MemberRegistry(epoch=7)
    assert reg.register(member("d0", port=1), b"c1")
    assert not reg.register(member("d0", port=1), b"c1")  # the same again: no change
    assert reg.register(member("p0", "prefill", port=2), b"c2")
    reg.watch(b"w", ("prefill",))
    [(conn, listing)] = reg.watchers()
    assert conn == b"w" and [m.name for m in listing.members] == ["p0"]
    assert listing.epoch == 7
    # a restart of d0 (new generation, new port) replaces it; a late old one does not
    assert reg.register(member("d0", port=3, gen=2), b"c3")
    assert not reg.register(member("d0", port=1, gen=1), b"c1")
    assert [m.address for m in reg.listing(()).members if m.name == "d0"] == ["tcp://127.0.0.1:3"]
    # the old connection going silent takes nothing of the new incarnation
    assert reg.drop_connection(b"c1") == []
    assert not reg.deregister("d0", generation=1)
    version = reg.version
    assert reg.deregister("d0", generation=2)
    assert reg.version == version + 1
    assert reg.drop_connection(b"c2") == ["p0"]
    assert len(reg) == 0
    assert reg.drop_connection(b"w") == [] and reg.watchers() == []


def _links(context: zmq.asyncio.Context, static: list[str]) -> LinkSet:
    me = LinkIdentity("gw", "gateway", 1, interval_s=1.0, peer_timeout_s=5.0)
    return LinkSet(context, static, me, on_message=lambda link, msg: None)


def test_view_follows_the_list_but_drops_only_links_that_are_down():
    context = zmq.asyncio.Context()
    decodes = _links(context, ["tcp://127.0.0.1:9"])  # one static address
    view = MemberView({"decode": decodes})
    try:
        assert view.watch().roles == ("decode",)
        view.apply(MemberList(1, 1, (member("d1", port=11), member("p", "prefill", port=12))))
        assert {link.address for link in decodes.links} == {
            "tcp://127.0.0.1:9", "tcp://127.0.0.1:11",
        }  # fmt: skip
        d1 = decodes.by_address("tcp://127.0.0.1:11")
        assert d1 is not None and d1.discovered
        d1.up, d1.name, d1.generation = True, "d1", 1  # as if its hello was answered
        # listed as draining: nothing new goes there, at once
        view.apply(MemberList(1, 2, (member("d1", port=11, draining=True),)))
        assert d1.up and not d1.ready
        # a stale list (older version) changes nothing
        view.apply(MemberList(1, 1, ()))
        assert d1 in decodes.links
        # a new epoch (the kvstore restarted) lists nobody yet: the working link stays
        view.apply(MemberList(2, 1, ()))
        assert d1 in decodes.links
        # ... until it goes down while unlisted; the static one never goes
        d1.up = False
        view.link_down("decode", d1)
        assert [link.address for link in decodes.links] == ["tcp://127.0.0.1:9"]
        assert d1.channel.closed
        # an unlisted discovered link that is already down goes with the next list
        view.apply(MemberList(2, 2, (member("d2", port=13),)))
        view.apply(MemberList(2, 3, ()))
        assert [link.address for link in decodes.links] == ["tcp://127.0.0.1:9"]
        # a member already linked under another address (a static alias) is not doubled
        static = decodes.links[0]
        static.up, static.name = True, "d0"
        view.apply(MemberList(2, 4, (member("d0", port=14),)))
        assert len(decodes.links) == 1
    finally:
        for link in decodes.links:
            link.channel.close()
        context.term()


def test_a_process_that_stalled_past_the_peer_timeout_takes_its_links_down_and_rejoins():
    """A SIGSTOP'd process finds, once resumed, only fresh-looking messages in its
    sockets, but its peers dropped it meanwhile (the kvstore unlisted it): each link
    goes down and says hello again, so ``on_up`` re-registers."""
    import asyncio
    import time

    from radixserve.protocol import AsyncChannel, Heartbeat, Hello, HelloAck

    async def scenario() -> tuple[list[str], int]:
        context = zmq.asyncio.Context()
        worker = AsyncChannel.open(context, zmq.ROUTER, "tcp://127.0.0.1:0", bind=True)
        address = worker.endpoint  # the port bound (no port probed and handed on)
        downs: list[str] = []
        ups = 0

        def up(link) -> None:
            nonlocal ups
            ups += 1

        me = LinkIdentity("w", "decode", 1, interval_s=0.05, peer_timeout_s=0.4)
        links = LinkSet(
            context, [address], me, on_message=lambda link, msg: None, on_up=up,
            on_down=lambda link, why: downs.append(why),
        )  # fmt: skip

        async def serve() -> None:  # a worker that answers hellos and beats back
            while True:
                got = await worker.recv_from()
                if got is None:
                    continue
                identity, msg = got
                reply = HelloAck("kv", "kvstore", 7) if isinstance(msg, Hello) else None
                await worker.send_to(identity, reply or Heartbeat("kv", 7))

        server = asyncio.ensure_future(serve())
        links.start()
        try:
            for _ in range(100):
                if ups:
                    break
                await asyncio.sleep(0.05)
            assert ups == 1 and not downs
            time.sleep(0.8)  # the whole process stops (the loop does not run)
            for _ in range(100):
                if ups == 2:
                    break
                await asyncio.sleep(0.05)
            return downs, ups
        finally:
            server.cancel()
            await links.close()
            worker.close()
            context.term()

    downs, ups = asyncio.run(scenario())
    assert len(downs) == 1 and "this process stalled for" in downs[0], downs
    assert ups == 2  # up again after a new hello


def test_view_of_several_kvstores_is_their_union_and_outlives_one():
    """A cluster with one kvstore per node: every kvstore lists every member; the view
    takes the union (the newest generation of a name, draining if that one's list says
    so), and a kvstore going down takes away its list but no member another lists."""
    context = zmq.asyncio.Context()
    decodes = _links(context, [])
    view = MemberView({"decode": decodes})
    a, b = "tcp://127.0.0.1:70", "tcp://127.0.0.1:71"
    try:
        view.apply(MemberList(1, 1, (member("d1", port=11),)), a)
        view.apply(MemberList(5, 1, (member("d1", port=11), member("d2", port=12))), b)
        assert {link.address for link in decodes.links} == {
            "tcp://127.0.0.1:11", "tcp://127.0.0.1:12",
        }  # fmt: skip
        d1 = decodes.by_address("tcp://127.0.0.1:11")
        assert d1 is not None
        d1.up, d1.name, d1.generation = True, "d1", 1
        # one kvstore says d1 drains: it gets nothing new
        view.apply(MemberList(5, 2, (member("d1", port=11, draining=True),
                                     member("d2", port=12))), b)  # fmt: skip
        assert not d1.ready
        # kvstore b goes down: d2, listed by b only and down, goes; d1 stays (a lists it)
        view.source_down(b)
        assert [link.address for link in decodes.links] == ["tcp://127.0.0.1:11"]
        # the last kvstore going down changes nothing: serving goes on as it was
        view.source_down(a)
        assert [link.address for link in decodes.links] == ["tcp://127.0.0.1:11"]
        # a's stale list (older version of its epoch) is ignored
        view.apply(MemberList(1, 0, ()), a)
        assert d1 in decodes.links
    finally:
        for link in decodes.links:
            link.channel.close()
        context.term()
