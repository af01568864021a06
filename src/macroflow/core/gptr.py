"""Global pointers: names of objects and buffers in a context, valid everywhere.

A pointer carries the protocols its context can be reached by (Nexus's
protocol descriptors), so a sender that speaks several picks one it shares,
and the id of the computation it belongs to: contexts are numbered afresh in
every computation, so a pointer kept from another one names nothing, and using
it raises :class:`macroflow.StaleReference`.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple


class GlobalPointer:
    """Names an object or a buffer in one context; picklable, comparable, hashable.

    Attributes:
        context: the context that holds the thing named.
        kind: "object" (a persistent object) or "export" (anything registered
            with :func:`macroflow.export`).
        ident: its id inside that context.
        protocols: (name, address) pairs that reach the context.
        computation: the id of the computation it belongs to; only that
            computation can use it (None: made by hand, not checked).

    Example:
        >>> import macroflow as mf
        >>> g = mf.GlobalPointer(2, "export", (2, 7), (("local", "host:123"),), "1a2b3c4d")
        >>> g.context, g.kind, g.protocol_names(), g.computation
        (2, 'export', ('local',), '1a2b3c4d')
    """

    # Kept on the pointer, not pickled: _sent, what mf.rsr() worked out for it
    # in a context, so that later requests skip it (a weak reference to the
    # engine, {(handler, thread): the frame's start}); _blob, its fields
    # pickled once (see macroflow.core.marshal)
    __slots__ = ("context", "kind", "ident", "protocols", "computation", "_sent", "_blob")

    def __init__(self, context: int, kind: str, ident: Any, protocols: Tuple[Tuple[str, str], ...] = (),
                 computation: Optional[str] = None):
        self.context = context
        self.kind = kind
        self.ident = ident
        self.protocols = tuple(protocols)
        self.computation = computation
        self._sent: Any = None
        self._blob: Optional[bytes] = None

    def protocol_names(self) -> Tuple[str, ...]:
        """The protocols that reach the pointer's context, best first.

        Example:
            >>> import macroflow as mf
            >>> mf.GlobalPointer(0, "export", (0, 1), (("local", "h:1"), ("tcp", "h:2"))).protocol_names()
            ('local', 'tcp')
        """
        return tuple(p[0] for p in self.protocols)

    @property
    def gid(self) -> Tuple[str, Any]:
        """``(kind, ident)``: what the pointer names inside its context.

        Example:
            >>> import macroflow as mf
            >>> mf.GlobalPointer(1, "export", (1, 9)).gid
            ('export', (1, 9))
        """
        return (self.kind, self.ident)

    def __reduce__(self):
        return (GlobalPointer, (self.context, self.kind, self.ident, self.protocols, self.computation))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, GlobalPointer) and other.context == self.context
                and other.kind == self.kind and other.ident == self.ident
                and other.computation == self.computation)

    def __hash__(self) -> int:
        return hash((self.context, self.kind, self.ident))

    def __repr__(self) -> str:
        protos = ",".join(self.protocol_names())
        return f"GlobalPointer(ctx={self.context}, {self.kind}={self.ident}, via={protos})"
