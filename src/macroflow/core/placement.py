"""Placement: Mentat's instantiation managers, one per context.

A call on a regular object (and the creation of a persistent object) is
placed by the caller's manager: it keeps the work if its own load is under the
*threshold* (the transfer policy), otherwise it sends it where the *location
policy* says. A manager that receives work while over its threshold may pass
it on again, at most *transfer_limit* moves in all. ``on=`` overrides
everything. Loads of other contexts are the most recent ones they reported
(every frame carries its sender's queue length), plus what this context has
sent them since.
"""

from __future__ import annotations

import random
import time
from typing import Any, Optional

POLICIES = ("round-robin", "random", "best-most-recently")


def _check(policy: Any, threshold: Any, transfer_limit: Any) -> None:
    """A placement's settings, or the error that says which one is wrong.

    Example:
        >>> _check("bogus", 2, 1)
        Traceback (most recent call last):
        ...
        ValueError: placement policy must be one of round-robin, random, best-most-recently; got 'bogus'
    """
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"placement policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    _check_int("placement threshold", threshold, 0, "")
    _check_int("transfer_limit", transfer_limit, 1,
               " (1: a call runs where its caller's manager put it)")


def _check_int(name: str, value: Any, least: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {least}, not {type(value).__name__}; got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be an int >= {least}{meaning}; got {value!r}")


LOOK_EVERY = 0.02  # seconds: see Placement._look


class Placement:
    """Transfer and location policy for one computation.

    Args:
        policy: "round-robin", "random" or "best-most-recently".
        threshold: an int >= 0; keep a call local while this context's load
            is below it. Context 0 counts the running main program as one, a
            context running a method counts that method: with the default of
            2, a call stays where it was made if nothing else is queued there
            (a sync call is then a local call), and a fan-out goes to the
            location policy from its second call on. 1 hands all work of a
            busy context to the policy, but a context that receives a call
            while idle keeps it. 0 never keeps a call on account of load:
            every call goes to the location policy (which may still pick this
            context), and a context that receives a call passes it on again
            whenever ``transfer_limit`` allows.
        transfer_limit: an int >= 1, how many times a call may move between
            contexts. The caller's manager placing the call counts as the
            first move, so 1 (the default) runs a call where its caller put
            it, and 2 lets the manager that receives it pass it on once more.
        seed: for the random policy, to make runs repeatable.

    Raises:
        ValueError: for an unknown policy or a number out of range.
        TypeError: for a threshold or transfer_limit that is not an int
            (bools included).

    Example:
        >>> import macroflow as mf
        >>> p = mf.Placement("random", threshold=2, transfer_limit=2, seed=1)
        >>> p.policy, p.threshold, p.transfer_limit
        ('random', 2, 2)
        >>> mf.Placement(threshold=0).threshold  # every call to the location policy
        0
        >>> mf.Placement(transfer_limit=0)
        Traceback (most recent call last):
        ...
        ValueError: transfer_limit must be an int >= 1 (1: a call runs where its caller's manager put it); got 0
        >>> mf.Placement(threshold=True)
        Traceback (most recent call last):
        ...
        TypeError: placement threshold must be an int >= 0, not bool; got True
    """

    def __init__(self, policy: str = "round-robin", threshold: int = 2,
                 transfer_limit: int = 1, seed: Optional[int] = None):
        _check(policy, threshold, transfer_limit)
        if seed is not None and type(seed) not in (int, float, str, bytes, bytearray):
            raise TypeError(f"placement seed must be an int (or a float, str or bytes), not "
                            f"{type(seed).__name__}; got {seed!r}")
        self.policy = policy
        self.threshold = threshold
        self.transfer_limit = transfer_limit
        self.rng = random.Random(seed)
        self.seed = seed
        self.next = 0
        self.look_at = 0.0  # (see _look)
        self._cands_for: Any = None  # what the candidates below were listed for (see choose)
        self._cands: list = []

    def __repr__(self) -> str:
        """What it was made with, as it would be made again.

        Example:
            >>> Placement("random", threshold=0, seed=1)
            Placement('random', threshold=0, transfer_limit=1, seed=1)
        """
        seed = "" if self.seed is None else f", seed={self.seed!r}"
        return (f"Placement({self.policy!r}, threshold={self.threshold}, "
                f"transfer_limit={self.transfer_limit}{seed})")

    @classmethod
    def make(cls, spec: Any) -> "Placement":
        """Accept a Placement, a policy name, or None (the default).

        Example:
            >>> import macroflow as mf
            >>> mf.Placement.make("best-most-recently").policy
            'best-most-recently'
        """
        if spec is None:
            return cls()
        if isinstance(spec, Placement):
            # (its attributes may have been set since it was made: checked
            # here, not in each context's copy, which said nothing useful)
            _check(spec.policy, spec.threshold, spec.transfer_limit)
            return spec
        if isinstance(spec, str):
            return cls(spec)
        raise TypeError(f"placement must be a policy name or mf.Placement; got {type(spec).__name__}")

    def copy(self) -> "Placement":
        """The same policy for another context, with a random generator of its own.

        Example:
            >>> import macroflow as mf
            >>> p = mf.Placement("random", threshold=3, seed=1)
            >>> q = p.copy()
            >>> q is p, (q.policy, q.threshold, q.transfer_limit)
            (False, ('random', 3, 1))
        """
        return Placement(self.policy, self.threshold, self.transfer_limit, self.rng.randrange(1 << 30))

    # -- decisions -----------------------------------------------------------
    def place_call(self, eng: Any) -> int:
        """Where a new regular call from this context runs.

        Example:
            >>> import macroflow as mf
            >>> from macroflow.core.context import current_engine
            >>> with mf.init(contexts=3, transport="inproc"):
            ...     eng = current_engine()         # context 0: its load is 1 (main)
            ...     mf.Placement(threshold=2).place_call(eng), mf.Placement(threshold=1).place_call(eng)
            (0, 1)
        """
        if eng.size == 1 or eng.load() < self.threshold:
            return eng.id
        self._look(eng)
        dest = self.choose(eng, exclude=None)
        return eng.id if dest is None else dest

    def place_object(self, eng: Any) -> int:
        """Where a new persistent object lives (never context 0 when there are others:
        context 0 runs main and serves objects only while main waits).

        Example:
            >>> import macroflow as mf
            >>> from macroflow.core.context import current_engine
            >>> with mf.init(contexts=3, transport="inproc"):
            ...     p = mf.Placement()
            ...     [p.place_object(current_engine()) for _ in range(4)]
            [2, 1, 2, 1]
        """
        if eng.size == 1:
            return 0
        self._look(eng)
        dest = self.choose(eng, exclude=0)
        return 0 if dest is None else dest

    def _look(self, eng: Any) -> None:
        # A context lost while this one ran user code (main's own loop, a
        # long method) is known only once the transport is looked at: until
        # then it would still be chosen, and the call fail with ContextLost.
        # Looked at before a choice, at most every LOOK_EVERY seconds (a
        # burst of calls pays for one look).
        now = time.monotonic()
        if now >= self.look_at and not eng.dispatching:
            self.look_at = now + LOOK_EVERY
            eng.poll()

    def choose(self, eng: Any, exclude: Optional[int]) -> Optional[int]:
        """The location policy: a context other than ``exclude``, not lost and
        not being removed, or None if there is none.

        Example:
            >>> import macroflow as mf
            >>> from macroflow.core.context import current_engine
            >>> with mf.init(contexts=3, transport="inproc"):
            ...     p = mf.Placement("round-robin")
            ...     [p.choose(current_engine(), exclude=None) for _ in range(4)]
            [1, 2, 0, 1]
        """
        # Listed again only when the membership changed: contexts are added
        # (size), lost or removed (lost only grows: ids are never reused) or
        # being removed (retiring). A fan-out's every call comes here.
        retiring = eng.retiring
        key = (eng.size, len(eng.lost), exclude, tuple(retiring) if retiring else None)
        if key == self._cands_for:
            cands = self._cands
        else:
            cands = self._cands = [c for c in range(eng.size)
                                   if c != exclude and c not in eng.lost and c not in retiring]
            self._cands_for = key
        if not cands:
            return None
        if self.policy == "random":
            return self.rng.choice(cands)
        if self.policy == "best-most-recently":
            loads = eng.loads
            best = min(loads[c] if c != eng.id else eng.load() for c in cands)
            cands = [c for c in cands if (loads[c] if c != eng.id else eng.load()) == best]
        self.next += 1
        return cands[self.next % len(cands)]
