"""How services find each other at run time: the kvstore's member registry, seen from
the processes that route.

Workers register with their kvstore (with every kvstore, when the cluster has one per
node: each keeps the whole membership, so it outlives the loss of any one); the
processes that route (the gateway, workers) watch it, or each (`WatchMembers`), and get
every member of the roles they route to (`MemberList`) on every change and every few
seconds. `MemberView` applies a list to
their link sets: a listed member without a link gets one; a member listed as draining
gets nothing new, at once; a discovered link whose member is no longer listed is
dropped once it is down. Static addresses are never dropped, and since only links that
are down are dropped, neither a kvstore that is down nor a restarted one (a new
``epoch``, filling as members register again) cuts a working link
(docs/architecture.md §10).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from radixserve.protocol import MemberInfo, MemberList, WatchMembers
from radixserve.runtime.links import Link, LinkSet

logger = logging.getLogger(__name__)


class MemberView:
    """The last member list of each kvstore (several: the cluster has one per node, each
    keeping the whole membership), applied as one to one link set per watched role."""

    def __init__(self, link_sets: Mapping[str, LinkSet], own: str = "") -> None:
        """``own``: this process's member name (it gets no link to itself)."""
        self._sets = dict(link_sets)
        self._own = own
        self._listed: dict[str, dict[str, MemberInfo]] = {role: {} for role in self._sets}
        self._lists: dict[str, MemberList] = {}  # by the kvstore that sent it

    def watch(self) -> WatchMembers:
        """The subscription to send a kvstore whenever the link to it comes up."""
        return WatchMembers(tuple(sorted(self._sets)))

    def apply(self, msg: MemberList, source: str = "") -> None:
        """Bring the link sets in line with ``msg`` from the kvstore ``source`` and the
        other kvstores' last lists (see the module notes)."""
        last = self._lists.get(source)
        if last is not None and msg.epoch == last.epoch and msg.version < last.version:
            return  # older than what we have
        self._lists[source] = msg
        self._sync()

    def source_down(self, source: str) -> None:
        """The kvstore ``source`` is down: its list no longer counts while another
        kvstore's does (with none left, the last lists stand: nothing changes)."""
        if source in self._lists and len(self._lists) > 1:
            del self._lists[source]
            self._sync()

    def _members(self) -> list[MemberInfo]:
        """Every member any list names, as of its newest registration (draining if any
        list of that generation says so)."""
        merged: dict[str, MemberInfo] = {}
        for listing in self._lists.values():
            for member in listing.members:
                known = merged.get(member.name)
                if (
                    known is None
                    or member.generation > known.generation
                    or (member.generation == known.generation and member.draining)
                ):
                    merged[member.name] = member
        return list(merged.values())

    def _sync(self) -> None:
        members = self._members()
        for role, links in self._sets.items():
            listed = {m.address: m for m in members
                      if m.role == role and m.name != self._own}  # fmt: skip
            self._listed[role] = listed
            for member in listed.values():
                self._add(links, member)
            for link in list(links.links):
                if link.discovered and link.address not in listed and not link.up:
                    links.remove(link, "left the cluster")

    def link_down(self, role: str, link: Link) -> None:
        """Call from the role's ``on_down``: a discovered link no longer listed goes."""
        links = self._sets.get(role)
        if links is not None and link.discovered and link.address not in self._listed[role]:
            links.remove(link, "left the cluster")

    @staticmethod
    def _add(links: LinkSet, member: MemberInfo) -> None:
        link = links.by_address(member.address)
        if link is None:
            if any(other.up and other.name == member.name for other in links.links):
                return  # already linked under another address (a static alias)
            logger.info("member %s (%s) at %s joined", member.name, member.role, member.address)
            link = links.add(member.address, discovered=True)
        if member.draining and link.up and link.generation == member.generation:
            link.load = dataclasses.replace(link.load, draining=True)
