"""The kvstore's member registry: which services make up the cluster, and who to tell.

A member registers over its own connection (`Register`) and is listed until it
deregisters, its connection is lost (the kvstore's peer timeout), or a newer
registration of the same name replaces it (a restart: another generation or address).
Watchers (`WatchMembers`) are connections that get the listing of the roles they asked
for after every change. The registry is plain data; the kvstore service sends.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from radixserve.protocol import MemberInfo, MemberList


@dataclass
class _Entry:
    member: MemberInfo
    connection: bytes


class MemberRegistry:
    """Members by name, the connection each registered on, and the watchers."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.version = 0
        self._members: dict[str, _Entry] = {}
        self._watchers: dict[bytes, frozenset[str]] = {}

    def __len__(self) -> int:
        return len(self._members)

    def register(self, member: MemberInfo, connection: bytes) -> bool:
        """List ``member`` (registered on ``connection``); True if anything changed."""
        entry = self._members.get(member.name)
        if entry is not None and entry.member.generation > member.generation:
            return False  # a late message from an older incarnation
        if entry is not None and entry.member == member and entry.connection == connection:
            return False
        self._members[member.name] = _Entry(member, connection)
        self.version += 1
        return True

    def deregister(self, name: str, generation: int) -> bool:
        entry = self._members.get(name)
        if entry is None or entry.member.generation != generation:
            return False
        del self._members[name]
        self.version += 1
        return True

    def drop_connection(self, connection: bytes) -> list[str]:
        """Forget the members registered on ``connection`` and its watch; their names."""
        self._watchers.pop(connection, None)
        gone = [name for name, e in self._members.items() if e.connection == connection]
        for name in gone:
            del self._members[name]
        if gone:
            self.version += 1
        return gone

    def watch(self, connection: bytes, roles: tuple[str, ...]) -> None:
        self._watchers[connection] = frozenset(roles)

    def watchers(self) -> list[tuple[bytes, MemberList]]:
        """Every watcher with the listing it should have now."""
        return [(conn, self.listing(roles)) for conn, roles in self._watchers.items()]

    def listing(self, roles: frozenset[str] | tuple[str, ...]) -> MemberList:
        members = tuple(
            e.member for e in sorted(self._members.values(), key=lambda e: e.member.name)
            if not roles or e.member.role in roles
        )  # fmt: skip
        return MemberList(self.epoch, self.version, members)

    def stats(self) -> dict[str, int]:
        roles = Counter(f"members_{e.member.role}" for e in self._members.values())
        return {"members": len(self._members), "member_watchers": len(self._watchers), **roles}
