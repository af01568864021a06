"""The protocol-module interface: all that core asks of a transport.

A transport moves frames between numbered contexts and knows nothing of
objects, futures or calls. A frame is a list of buffers: the first is a small
pickled header, the rest are out-of-band payload buffers that the transport
must deliver byte-for-byte and in order per (sender, receiver) pair.

Adding a protocol (tcp, say) means writing one subclass and registering it in
:data:`REGISTRY`; the models never change.
"""

from __future__ import annotations

import abc
import os
import signal
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# deliver(src, buffers, load): a whole frame arrived from context src, whose
# queue length when it sent the frame was `load`.
Deliver = Callable[[int, List[object], int], None]
# lost(peer, how): the connection to peer is gone, with a human description.
Lost = Callable[[int, str], None]
# landing(src, head, nbytes): where a large payload buffer of a frame from src,
# whose first buffer is `head`, should be received: a writable memoryview of
# exactly nbytes bytes (a receive the engine posted, such as the caller's
# array of a get) or None for a buffer of the transport's own.
Landing = Callable[[int, object, int], Optional[memoryview]]


class Transport(abc.ABC):
    """One protocol module, as seen by one context.

    Example:
        >>> from macroflow.transport.base import REGISTRY
        >>> sorted(REGISTRY)
        ['inproc', 'local', 'mpi', 'tcp']
    """

    #: protocol name, as it appears in a GlobalPointer's protocol list
    name: str = ""

    def __init__(self) -> None:
        self.deliver: Optional[Deliver] = None
        self.lost: Optional[Lost] = None
        self.landing: Optional[Landing] = None

    def attach(self, deliver: Deliver, lost: Lost, landing: Optional[Landing] = None) -> None:
        """Tell the transport where incoming frames and lost peers go, and
        (optional) whom to ask where a large payload should land. A transport
        that receives payloads into buffers of its own asks ``landing`` first,
        so a reply the receiver posted a buffer for is received in place."""
        self.deliver = deliver
        self.lost = lost
        self.landing = landing

    @abc.abstractmethod
    def send(self, dest: int, parts: Sequence[object], load: int) -> int:
        """Send one frame to ``dest``; returns the number of bytes put on the wire.

        Flow control: while the peer's buffers are full, the sender waits
        for it to read, reading what arrives for itself meanwhile (so two
        contexts sending large frames to each other cannot deadlock); a
        peer that is alive but never reads holds the sender until it goes.
        A peer found gone raises ConnectionError (and is reported to
        ``lost``).
        """

    @abc.abstractmethod
    def poll(self, timeout: Optional[float]) -> bool:
        """Make progress, delivering whole frames; wait at most ``timeout`` seconds.

        ``timeout=0`` only looks; ``None`` waits for something to happen.
        Returns True if anything was delivered.
        """

    def queue(self, dest: int, parts: Sequence[object], load: int) -> int:
        """Like :meth:`send`, but the frame may wait for :meth:`flush`, so that
        the frames one dispatch round produces leave in one write. Order with
        :meth:`send` on the same destination is kept."""
        return self.send(dest, parts, load)

    def flush(self) -> None:
        """Push out every queued frame (a no-op where sends complete at once)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the transport's resources; peers see the connection close."""

    def fileno(self) -> Optional[int]:
        """A descriptor that becomes readable when frames arrive (for an event
        loop to watch), or None where there is none to watch. A watcher
        calls :meth:`nap` first."""
        return None

    def nap(self, on: bool) -> bool:
        """Say that this context will (``on``) or will no longer wait on
        :meth:`fileno` outside :meth:`poll`. Frames that do not pass through
        the descriptor (shared memory) make it readable while ``on``.
        Returns True when such a frame is already waiting: poll instead of
        waiting. Here, every frame passes through the descriptor: False."""
        return False

    def next_due(self) -> Optional[float]:
        """When (``time.monotonic``) this transport next has something to do
        that no descriptor announces (a handshake to time out, say): whoever
        sleeps on :meth:`fileno`, or waits in another module's :meth:`poll`,
        wakes by then and polls. None if nothing is due.

        Example:
            >>> from macroflow.transport.inproc import InprocTransport, World
            >>> InprocTransport(World(), 0).next_due() is None
            True
        """
        return None

    def settle(self, timeout: float) -> None:
        """Finish what is under way with peers (``timeout`` seconds at most)
        before this context stops polling for a while (a context added while
        running, before its ``init``). Nothing here: no peer waits for us."""

    def peers(self) -> Optional[List[int]]:
        """The contexts this one has a connection to now, or None where every
        context is reachable at no cost (a transport that connects on demand
        says which, so that a dying context does not connect to everyone)."""
        return None

    def address(self) -> Tuple[str, str]:
        """This context's protocol descriptor: (protocol name, address)."""
        return (self.name, "")


REGISTRY: Dict[str, str] = {
    "local": "macroflow.transport.local",
    "inproc": "macroflow.transport.inproc",
    "tcp": "macroflow.transport.tcp",
    "mpi": "macroflow.transport.mpi",
}


def describe_status(status: int) -> str:
    """Say how a process ended, from a ``waitpid`` status.

    Example:
        >>> describe_status(9)
        'killed by signal SIGKILL'
        >>> describe_status(256)
        'exited with code 1'
    """
    if os.WIFSIGNALED(status):
        n = os.WTERMSIG(status)
        try:
            name = signal.Signals(n).name
        except ValueError:
            name = str(n)
        return f"killed by signal {name}"
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    return f"ended with status {status}"


def ended_how(status: int) -> str:
    """:func:`describe_status` as a clause of its own: what a process whose
    ``waitpid`` status it is did.

    Example:
        >>> ended_how(9), ended_how(256)
        ('was killed by signal SIGKILL', 'exited with code 1')
    """
    how = describe_status(status)
    return f"was {how}" if os.WIFSIGNALED(status) else how


def process_fate(pid: int, status: int) -> str:
    """Say how process ``pid`` ended, as a context's loss gives it, from a
    ``waitpid`` status.

    Example:
        >>> process_fate(42, 9)
        'its process (pid 42) was killed by signal SIGKILL'
        >>> process_fate(42, 256)
        'its process (pid 42) exited with code 1'
    """
    return f"its process (pid {pid}) {ended_how(status)}"
