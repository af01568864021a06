"""Per-context counters, reported by :func:`macroflow.stats`."""

from __future__ import annotations

from typing import Dict


class Counters:
    """Plain integer counters of one context; cheap to bump on the hot path.

    Example:
        >>> c = Counters(); c.messages_sent += 1; c.as_dict()["messages_sent"]
        1
    """

    __slots__ = ("bytes_sent", "bytes_received", "messages_sent", "messages_received",
                 "calls_executed", "calls_issued", "calls_transferred", "values_sent",
                 "instances_created", "rsr_executed", "contexts_lost", "guards_evaluated", "rsr_dropped",
                 "calls_examined", "threads_parked", "handler_errors", "results_copied",
                 "values_reused")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def as_dict(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}
