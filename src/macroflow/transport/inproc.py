"""The ``inproc`` protocol module: every context in this one process.

For debugging and fast tests. Frames are still copied (call-by-value holds),
but no process is started and a debugger sees every context. One root
greenlet drives all the engines; when none of them can make progress and the
awaited value has not come, the world raises :class:`DeadlockError` instead of
hanging.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

from ..core import errors
from .base import Transport


def _copy(p: object) -> bytearray:
    import pickle
    if isinstance(p, pickle.PickleBuffer):
        return bytearray(p.raw())
    return bytearray(memoryview(p).cast("B"))  # type: ignore[arg-type]


class InprocTransport(Transport):
    """Delivers frames to engines of the same process through their inboxes.

    Example:
        >>> w = World()
        >>> t0, t1 = InprocTransport(w, 0), InprocTransport(w, 1)
        >>> got = []
        >>> t1.attach(lambda src, bufs, load: got.append(bytes(bufs[0])), None)
        >>> t0.send(1, [b"hi"], 0)
        18
        >>> got
        [b'hi']
    """

    name = "inproc"

    def __init__(self, world: "World", ctx: int):
        super().__init__()
        self.world = world
        self.ctx = ctx
        world.transports[ctx] = self

    def send(self, dest: int, parts: Sequence[object], load: int) -> int:
        peer = self.world.transports.get(dest)
        if peer is None or peer.deliver is None:
            raise ConnectionError(f"no context {dest}")
        bufs: List[object] = [bytes(_copy(parts[0]))] + [_copy(p) for p in parts[1:]]
        peer.deliver(self.ctx, bufs, load)
        return 8 + 8 * len(bufs) + sum(len(b) for b in bufs)  # type: ignore[arg-type]

    def poll(self, timeout: Optional[float]) -> bool:
        return False  # delivery is immediate; the world does the stepping

    def close(self) -> None:
        self.world.transports.pop(self.ctx, None)

    def address(self):
        return ("inproc", f"world-{id(self.world):x}")


def _stop_rule(deadline: Optional[float],
               for_first: Optional[Callable[[], bool]]) -> Optional[Callable[[], bool]]:
    """When a context driven by :meth:`World.run_until` leaves the rest of
    its inbox for later: once ``deadline`` (time.monotonic) has passed, or
    once ``for_first()`` says context 0 has something to take; None: never.

    Example:
        >>> _stop_rule(None, None) is None, _stop_rule(0.0, None)()
        (True, True)
    """
    if deadline is None:
        return for_first
    if for_first is None:
        return lambda: time.monotonic() >= deadline
    return lambda: time.monotonic() >= deadline or for_first()


class World:
    """All the engines of an in-process computation, stepped by one loop.

    Example:
        >>> World().engines
        []
    """

    def __init__(self) -> None:
        self.transports: Dict[int, InprocTransport] = {}
        self.engines: List[object] = []
        self.probed: tuple = ()  # the waits last probed for a cycle when all stalled
        self.driving = 0  # run_until calls in progress
        self.yielded: List[object] = []  # Waiters of polling threads, woken after a round

    def pending(self) -> bool:
        """Whether some context has something to do now: messages, threads
        ready to go on, or a timer due. A polling loop yields to them.

        Example:
            >>> World().pending()
            False
        """
        now = time.monotonic()
        return any(e.busy() or (e.timers and e.timers[0][0] <= now)  # type: ignore[attr-defined]
                   for e in self.engines)

    def after_round(self, waiter) -> None:
        """Wake ``waiter`` once every context with something to do has had a
        turn: a polling thread would otherwise hold the one thread. Outside
        :meth:`run_until`, at the waiter's engine's next step.

        Example:
            >>> class Eng:
            ...     timers = []
            >>> class W:
            ...     engine = Eng()
            >>> World().after_round(W()); len(Eng.timers)
            1
        """
        if self.driving:
            self.yielded.append(waiter)
        else:
            import heapq
            heapq.heappush(waiter.engine.timers, (time.monotonic(), id(waiter), waiter))

    def _wake_yielded(self) -> None:
        waiters, self.yielded = self.yielded, []
        for w in waiters:
            w.wake(None)  # type: ignore[attr-defined]

    def run_until(self, pred, deadline: Optional[float] = None,
                  whole_rounds: bool = False) -> bool:
        """Drive every context until ``pred()`` holds (True) or ``deadline``
        (time.monotonic) has passed (``pred()`` then). Context 0, whose main
        program waits here (a method parks instead), is served first: once
        another context has sent it something (or ``pred()`` holds), that
        context takes no further message, and ``pred`` is asked again as
        soon as context 0 has taken it, so a wait for the first of several
        ends with the first, not after every call queued elsewhere.
        ``whole_rounds``: every context has its turn before ``pred`` is asked
        again (a poll's round).

        Example:
            >>> World().run_until(lambda: True)
            True
        """
        self.driving += 1
        try:
            return self._run_until(pred, deadline, whole_rounds)
        finally:
            self.driving -= 1
            self._wake_yielded()  # ready threads: whoever drives next resumes them

    def _run_until(self, pred, deadline: Optional[float], whole_rounds: bool) -> bool:
        polled = False
        first = self.engines[0] if self.engines else None

        def for_first() -> bool:  # (a value main waits for may go straight to its future)
            return first.busy() or pred()  # type: ignore[union-attr]

        while not pred():
            # every context shares this thread: a call that computes delays the
            # deadline by its length, but no new one starts once it has passed
            stop = deadline
            if deadline is not None and time.monotonic() >= deadline:
                if polled:
                    return pred()
                stop = None  # a wait of 0 s (a poll) serves what is queued, once
            polled = True
            progressed = False
            now = time.monotonic()
            for eng in self.engines:
                eng.flush_releases()  # type: ignore[attr-defined]
                # a timer that is due gets its turn too: a thread may poll forever
                if eng.busy() or (eng.timers  # type: ignore[attr-defined]
                                  and eng.timers[0][0] <= now):  # type: ignore[attr-defined]
                    eng.stop_when = _stop_rule(  # type: ignore[attr-defined]
                        stop, None if whole_rounds or eng is first else for_first)
                    try:
                        eng.process()  # type: ignore[attr-defined]
                    except KeyboardInterrupt as e:
                        eng.interrupted(e)  # type: ignore[attr-defined]
                        raise
                    finally:
                        eng.stop_when = None  # type: ignore[attr-defined]
                    progressed = True
                    if not whole_rounds:
                        if eng is first:
                            if pred():
                                return True
                        elif for_first():
                            break  # (see run_until: context 0 first)
            if self.yielded:
                self._wake_yielded()
                continue
            if progressed:
                continue
            # Stalled. Method threads that wait may be in a wait cycle: probe
            # them now rather than after a while (once per set of waits).
            waits = tuple(e.blocked_version for e in self.engines)  # type: ignore[attr-defined]
            if waits != self.probed and any(e.blocked for e in self.engines):  # type: ignore[attr-defined]
                self.probed = waits
                for eng in self.engines:
                    eng.probe_blocked(force=True)  # type: ignore[attr-defined]
                continue
            # what completes without a message (every engine's pollers)
            if any([eng.run_pollers() for eng in self.engines]):  # type: ignore[attr-defined]
                continue
            timers = [e.timers[0][0] for e in self.engines if e.timers]  # type: ignore[attr-defined]
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return pred()
            if timers:
                wake = min(timers + ([deadline] if deadline is not None else []))
                time.sleep(max(0.0, wake - now))
                for eng in self.engines:
                    try:
                        eng.process()  # type: ignore[attr-defined]
                    except KeyboardInterrupt as e:
                        eng.interrupted(e)  # type: ignore[attr-defined]
                        raise
                continue
            if deadline is not None:
                time.sleep(max(0.0, deadline - now))
                continue
            raise errors.DeadlockError(
                "no context can make progress and the awaited value has not arrived "
                "(inproc transport): a guard that never holds, or a wait cycle")
        return True


def check_room(contexts: int, adding: bool = False) -> None:
    """Raise LimitError if ``contexts`` in-process contexts do not fit in memory.

    Example:
        >>> check_room(2)
    """
    from .local import check_room as check
    check(contexts, "inproc", adding)


def launcher(session):
    """The launcher of this transport: every context in this process.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=2, transport="inproc") as s:
        ...     type(launcher(s)).__name__
        'InprocLauncher'
    """
    from ..launch import InprocLauncher
    return InprocLauncher(session)
