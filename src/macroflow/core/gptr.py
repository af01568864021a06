"""Global pointers: names of objects and buffers in a context, valid everywhere.

A pointer carries the protocols its context can be reached by (Nexus's
protocol descriptors), so a sender that speaks several picks one it shares.
"""

from __future__ import annotations

from typing import Any, Tuple


class GlobalPointer:
    """Names an object or a buffer in one context; picklable, comparable, hashable.

    Attributes:
        context: the context that holds the thing named.
        kind: "object" (a persistent object) or "export" (anything registered
            with :func:`macroflow.export`).
        ident: its id inside that context.
        protocols: (name, address) pairs that reach the context.

    Example:
        >>> g = GlobalPointer(2, "export", (2, 7), (("local", "host:123"),))
        >>> g.context, g.kind, g.protocol_names()
        (2, 'export', ('local',))
    """

    __slots__ = ("context", "kind", "ident", "protocols")

    def __init__(self, context: int, kind: str, ident: Any, protocols: Tuple[Tuple[str, str], ...] = ()):
        self.context = context
        self.kind = kind
        self.ident = ident
        self.protocols = tuple(protocols)

    def protocol_names(self) -> Tuple[str, ...]:
        """The protocols that reach the pointer's context, best first.

        Example:
            >>> GlobalPointer(1, "object", (0, 4), (("local", "host:1"),)).protocol_names()
            ('local',)
        """
        return tuple(p[0] for p in self.protocols)

    @property
    def gid(self) -> Tuple[str, Any]:
        """``(kind, ident)``: what the pointer names inside its context.

        Example:
            >>> GlobalPointer(1, "export", (1, 9)).gid
            ('export', (1, 9))
        """
        return (self.kind, self.ident)

    def __reduce__(self):
        return (GlobalPointer, (self.context, self.kind, self.ident, self.protocols))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, GlobalPointer) and other.context == self.context
                and other.kind == self.kind and other.ident == self.ident)

    def __hash__(self) -> int:
        return hash((self.context, self.kind, self.ident))

    def __repr__(self) -> str:
        protos = ",".join(self.protocol_names())
        return f"GlobalPointer(ctx={self.context}, {self.kind}={self.ident}, via={protos})"
