"""A fork server: the process that forks contexts added while the program runs.

Context 0 may be multithreaded by the time it wants more contexts (a progress
thread, the user's threads, a GUI), and ``fork()`` in a multithreaded process
copies only the calling thread, with every lock another thread held stuck
forever. So the ``local`` transport forks one small server when the
computation starts, while context 0 is still single-threaded, and asks it for
new contexts later. Each new context is a copy of context 0 as it was at
start-up (the same ``__main__`` snapshot as the first contexts).

The server talks to context 0 over a SOCK_SEQPACKET socketpair, one pickled
message per packet:

- context 0 sends ``("fork", ctx, blob)`` with one descriptor attached: the
  new context's end of its socketpair with context 0; ``blob`` (pickled by
  context 0, unpickled only in the new context) is its ``init`` function;
- the server answers ``("pid", ctx, pid)``, or ``("error", ctx, text)`` when
  ``fork()`` fails, and sends ``("exit", ctx, status)`` when a context it
  forked ends.

When context 0's end closes, the server kills the contexts it forked, reaps
them and exits; it also dies with context 0 (PR_SET_PDEATHSIG), and its
contexts die with it.
"""

from __future__ import annotations

import errno
import os
import pickle
import select
import signal
import socket
import time
from typing import Callable, Dict, List, Optional

from .core.threads import fork

_MAX_PACKET = 1 << 24
_INLINE_BLOB = 1 << 16  # a context's init larger than this goes in a memory file


def start(child_main: Callable[..., None], close_fds: List[socket.socket]) -> "ForkServer":
    """Fork the server now; ``child_main(ctx, sock, init_blob)`` is what a
    forked context runs (it never returns). ``close_fds`` are context 0's own
    sockets, closed in the server so that it does not keep them alive.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=2) as s:           # local: a server is running
        ...     s.launcher.server.pid > 0
        True
    """
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = fork(_end)  # (a Ctrl-C meanwhile is raised here, the server ended)
    if pid == 0:  # pragma: no cover - runs in the server
        code = 0
        try:
            mine.close()
            for s in close_fds:
                s.close()
            _serve(theirs, child_main)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    return ForkServer(pid, mine)


def _end(pid: int) -> None:
    """End a server forked as a Ctrl-C came (nobody will use it).

    Example:
        >>> pid = os.fork()
        >>> if pid == 0:
        ...     time.sleep(60); os._exit(0)
        >>> _end(pid)   # killed and reaped at once
    """
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass


class ForkServer:
    """Context 0's side of the fork server.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=2) as s:
        ...     type(s.launcher.server).__name__
        'ForkServer'
    """

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock
        self.pids: Dict[int, int] = {}  # context -> pid
        self.exits: Dict[int, int] = {}  # context -> wait status
        self.errors: Dict[int, str] = {}  # context -> why fork failed
        self.closed = False

    def fork(self, ctx: int, child_sock: socket.socket, blob: bytes) -> None:
        """Ask for context ``ctx``; :meth:`pid_of` tells when it is forked.
        RuntimeError if the server has ended (killed, say)."""
        fds = [child_sock.fileno()]
        big = None
        if len(blob) > _INLINE_BLOB:
            # (a packet holds what the socket's buffer holds, some 200 KB: an
            # init of a megabyte went "Message too long", said as the server's
            # end) in a memory file of its own, whatever its size
            big = os.memfd_create("macroflow-init", os.MFD_CLOEXEC)
            view = memoryview(blob)
            while view:
                view = view[os.write(big, view):]
            fds.append(big)
            blob = b""
        try:
            socket.send_fds(self.sock, [pickle.dumps(("fork", ctx, blob))], fds)
        except OSError as e:
            raise RuntimeError(self._ended(e)) from None
        finally:
            if big is not None:
                os.close(big)

    def _ended(self, e: BaseException) -> str:
        return (f"the fork server that makes this computation's new contexts (process "
                f"{self.pid}) has ended ({e}): no context can be added any more; the contexts "
                f"already running go on")

    def _read(self, timeout: float) -> bool:
        r, _, _ = select.select([self.sock], [], [], max(timeout, 0.0))
        if not r:
            return False
        data = self.sock.recv(_MAX_PACKET)
        if not data:
            raise ConnectionError("the fork server has ended")
        kind, ctx, value = pickle.loads(data)
        if kind == "pid":
            self.pids[ctx] = value
        elif kind == "exit":
            self.exits[ctx] = value
        else:
            self.errors[ctx] = value
        return True

    def pid_of(self, ctx: int, timeout: float = 10.0) -> int:
        """The process id of context ``ctx`` once forked; OSError if fork failed."""
        deadline = time.monotonic() + timeout
        while ctx not in self.pids:
            if ctx in self.errors:
                raise OSError(self.errors.pop(ctx))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fork server did not start context {ctx} in {timeout} s")
            try:
                self._read(deadline - time.monotonic())
            except ConnectionError as e:
                raise RuntimeError(self._ended(e)) from None
        return self.pids[ctx]

    def exit_status(self, ctx: int, timeout: float) -> Optional[int]:
        """Context ``ctx``'s wait status once it has ended, waiting at most
        ``timeout`` seconds; None if it still runs (or the server is gone)."""
        deadline = time.monotonic() + timeout
        try:
            while ctx not in self.exits:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._read(left)
        except (ConnectionError, OSError):
            return None
        return self.exits[ctx]

    def close(self) -> None:
        """End the server and every context it forked; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.sock.close()  # the server kills its contexts when it sees this
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _serve(sock: socket.socket, child_main: Callable[..., None]) -> None:  # pragma: no cover
    from .launch import _set_pdeathsig
    _set_pdeathsig()
    if os.getppid() == 1:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is context 0's to handle
    # SIGCHLD wakes the select below through this pipe, so ended contexts are
    # reported at once without polling
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: Dict[int, int] = {}  # pid -> context
    try:
        while True:
            try:
                r, _, _ = select.select([sock, rfd], [], [])
            except InterruptedError:
                continue
            if rfd in r:
                try:
                    os.read(rfd, 4096)
                except BlockingIOError:
                    pass
            _reap(sock, children)
            if sock not in r:
                continue
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_PACKET, 2)
            except ConnectionError:
                return
            if not data:
                return  # context 0 is gone
            _kind, ctx, blob = pickle.loads(data)
            if len(fds) > 1:  # a large init, in a memory file
                with os.fdopen(fds.pop(), "rb") as f:
                    f.seek(0)  # (the writer's offset: the file is shared)
                    blob = f.read()
            try:
                pid = os.fork()
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                try:
                    sock.send(pickle.dumps(("error", ctx, f"fork failed: {e}")))
                except OSError:
                    return
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(rfd)
                os.close(wfd)
                sock.close()
                child_main(ctx, socket.socket(fileno=fds[0]), blob)
            for fd in fds:
                os.close(fd)
            children[pid] = ctx
            try:
                sock.send(pickle.dumps(("pid", ctx, pid)))
            except OSError:
                return  # context 0 is gone (a Ctrl-C as it added contexts): so are they
    finally:
        from .launch import _kill
        for pid in children:
            _kill(pid)


def _reap(sock: socket.socket, children: Dict[int, int]) -> None:  # pragma: no cover
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        ctx = children.pop(pid, None)
        if ctx is not None:
            try:
                sock.send(pickle.dumps(("exit", ctx, status)))
            except OSError as e:
                if e.errno not in (errno.EPIPE, errno.ECONNRESET):
                    raise
