"""Exceptions that macroflow raises, in one place so every layer names them alike."""

from __future__ import annotations

import os
import sys
import types
from typing import Any, Callable, Optional, Tuple


class MacroflowError(Exception):
    """Base class of every error that macroflow itself raises.

    Example:
        >>> import macroflow as mf
        >>> try:
        ...     raise mf.ContextLost(2, "killed by signal SIGKILL")
        ... except mf.MacroflowError as e:
        ...     print(e)
        context 2 was lost: killed by signal SIGKILL
    """


class ContextLost(MacroflowError):
    """A context (a process) ended while something waited on it.

    ``context`` is the id of the lost context and ``how`` says how it ended
    (an exit code, a signal, or a closed connection); ``also``, what the
    call that raised it has to add (``mf.add_contexts``: which other new
    contexts failed, which are used), is said after ``how``.

    Example:
        >>> import macroflow as mf
        >>> e = mf.ContextLost(3, "exit code 1")
        >>> e.context, e.how
        (3, 'exit code 1')
        >>> str(mf.ContextLost(3, "exit code 1", also="; contexts [4] failed too"))
        'context 3 was lost: exit code 1; contexts [4] failed too'
    """

    def __init__(self, context: int, how: str, also: str = ""):
        super().__init__(context, how)
        self.context = context
        self.how = how
        self.also = also

    def __str__(self) -> str:
        return f"context {self.context} was lost: {self.how}{self.also}"

    def __reduce__(self) -> Any:
        # (its state too: the traceback it brought, its notes)
        state = {k: v for k, v in self.__dict__.items() if k not in ("context", "how")}
        return (_lost_here, (self.context, self.how), state or None)


def _lost_here(context: int, how: str) -> ContextLost:
    """A ContextLost that came from another context, said as this one saw
    the loss where it knows more: the sender may have seen its connection
    close only (or the process gone, reaped), where context 0 knows how the
    process ended.

    Example:
        >>> str(_lost_here(3, "connection closed"))   # nothing running here: as it came
        'context 3 was lost: connection closed'
    """
    if not _says_how(how):
        try:
            from .context import current_engine
            ours = current_engine().lost.get(context)
        except Exception:
            ours = None
        if ours and _says_how(ours):
            how = ours
    return ContextLost(context, how)


def _says_how(how: str) -> bool:
    return "killed by signal" in how or "exited with code" in how


class DeadlockError(MacroflowError, RuntimeError):
    """A wait that could never finish, reported instead of hanging.

    Raised when a persistent object's method waits on a call to that same
    object (the monitor is held by the waiter), or when nothing anywhere can
    make progress (inproc transport).

    Example:
        >>> import macroflow as mf
        >>> isinstance(mf.DeadlockError("x"), RuntimeError)
        True
    """


class RemoteTraceback(Exception):
    """Carries the formatted traceback of an exception raised in another context.

    It is attached as ``__cause__`` of the re-raised exception, so Python prints
    the remote traceback above the local one.

    Example:
        >>> import macroflow as mf
        >>> print(mf.RemoteTraceback("Traceback ...\\nValueError: bad"))
        <BLANKLINE>
        Traceback ...
        ValueError: bad
    """

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


class RemoteError(MacroflowError):
    """Stands in for a remote exception that could not be pickled back.

    ``type_name`` is the qualified name of the original exception type.

    Example:
        >>> import macroflow as mf
        >>> str(mf.RemoteError("mod.Weird", "it broke"))
        'mod.Weird: it broke'
    """

    def __init__(self, type_name: str, message: str):
        super().__init__(type_name, message)
        self.type_name = type_name
        self.message = message

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


class CallError(MacroflowError, TypeError):
    """A call that cannot be made: unknown method, wrong arity, unpicklable argument.

    Raised at the call site, before anything is sent.

    Example:
        >>> import macroflow as mf
        >>> issubclass(mf.CallError, TypeError)
        True
    """


class NoSuchMethod(CallError, AttributeError):
    """A handle's attribute that is not a method of its class: a
    :class:`CallError`, and an ``AttributeError``, so that ``hasattr`` and
    ``getattr(handle, name, default)`` answer as for any object.

    Example:
        >>> import macroflow as mf
        >>> @mf.persistent
        ... class P:
        ...     def get(self): return 1
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     p = P.create(on=1)
        ...     hasattr(p, "get"), hasattr(p, "missing")
        (True, False)
    """


class ObjectDestroyed(MacroflowError):
    """A call reached a persistent object after ``destroy()`` or a failed constructor.

    Example:
        >>> import macroflow as mf
        >>> str(mf.ObjectDestroyed("Accumulator#0.3 was destroyed"))
        'Accumulator#0.3 was destroyed'
    """


class TimeoutError(MacroflowError, TimeoutError):  # noqa: A001 - deliberately a builtin subclass
    """``Future.result(timeout=...)`` ran out of time; the call itself goes on.

    Example:
        >>> import macroflow as mf
        >>> import builtins
        >>> issubclass(mf.TimeoutError, builtins.TimeoutError)
        True
    """


class StaleReference(MacroflowError, ValueError):
    """A handle, future or global pointer used outside the computation that made it.

    Each computation (one :func:`macroflow.run`, or one :func:`macroflow.init`
    session) has an id, and every reference it hands out carries that id; the
    contexts and objects it named are gone once it ends, and another
    computation reuses their numbers for other things. ``computation`` is the
    reference's computation, ``running`` the one running now (None if none).
    Like using a closed file, it is a :class:`ValueError`.

    Example:
        >>> import macroflow as mf
        >>> e = mf.StaleReference("handle <Box 0.1 @ctx1>", "1a2b3c4d", None)
        >>> print(e)
        handle <Box 0.1 @ctx1> belongs to computation 1a2b3c4d, which has ended (no computation is running)
        >>> e.running is None and isinstance(e, ValueError)
        True
    """

    def __init__(self, what: str, computation: str, running: "str | None"):
        super().__init__(what, computation, running)
        self.what = what
        self.computation = computation
        self.running = running

    def __str__(self) -> str:
        if self.running is None:
            return (f"{self.what} belongs to computation {self.computation}, which has ended "
                    f"(no computation is running)")
        return (f"{self.what} belongs to computation {self.computation}, not to the running "
                f"computation {self.running}: handles, futures and global pointers are valid "
                f"only in the computation that made them")


class LimitError(MacroflowError, OSError):
    """A limit of the operating system stops the computation from starting or growing.

    Raised instead of a bare ``OSError`` when macroflow runs out of file
    descriptors (``RLIMIT_NOFILE``) or processes (``RLIMIT_NPROC``); the
    message names the limit, its current values and how to raise it.
    ``limit`` is the name of the limit; the original ``OSError`` is the
    ``__cause__``.

    Example:
        >>> import macroflow as mf
        >>> e = mf.LimitError("RLIMIT_NOFILE", "too many open files")
        >>> e.limit, str(e), isinstance(e, OSError)
        ('RLIMIT_NOFILE', 'too many open files', True)
    """

    def __init__(self, limit: str, message: str):
        super().__init__(message)
        self.limit = limit
        self.message = message

    def __str__(self) -> str:
        return self.message


class CollectiveError(MacroflowError):
    """A collective operation of an SPMD run cannot complete as called.

    Raised in the contexts that wait in a collective (``mf.barrier``,
    ``mf.allreduce``, ...) when another context of the run will never join it
    (its function ended, or it failed), or joined a different collective at
    that place; ``missing`` lists the contexts that did not arrive, where known.

    Example:
        >>> import macroflow as mf
        >>> e = mf.CollectiveError("mf.barrier(): context 1 ended its function", missing=[1])
        >>> e.missing, isinstance(e, mf.MacroflowError)
        ([1], True)
    """

    def __init__(self, message: str, missing: "list | None" = None):
        super().__init__(message)
        self.missing = list(missing or [])

    def __reduce__(self):
        return (CollectiveError, (str(self), self.missing))


class Terminated(SystemExit):
    """Raised in the main thread of a program that was asked to end
    (SIGTERM) while it runs a computation whose contexts must be ended in
    order (see the guide's MPI section). A ``SystemExit``: unless caught, the
    computation closes and the process exits with its code (143).

    Example:
        >>> import macroflow as mf
        >>> e = mf.Terminated(143)
        >>> isinstance(e, SystemExit), e.code
        (True, 143)
    """


#: Set in a child forked while its process ran a computation (see
#: core.context.fork_away): ends the child, whose user code raised.
forked_end: Optional[Callable[[BaseException], None]] = None


def exited(what: str, e: BaseException) -> BaseException:
    """What an exception raised by user code that a computation runs (a
    method, a constructor, a remote action's handler: ``what``) fails its
    call with: ``e`` itself, but for ``sys.exit()`` an error of that call,
    which its caller gets, not the caller's own exit (``e`` is its cause).
    A ``Terminated`` (the process was asked to end) stays as it is.

    Example:
        >>> print(exited("method Acc.add on context 1", SystemExit(3)))
        method Acc.add on context 1 called sys.exit(3): code run by macroflow returns or raises; this call failed
        >>> exited("method Acc.add on context 1", KeyError("k"))
        KeyError('k')
    """
    if forked_end is not None:
        forked_end(e)  # in a child forked in user code: that code's end is the child's
    if not isinstance(e, SystemExit) or isinstance(e, Terminated):
        return e
    how = "sys.exit()" if e.code is None else f"sys.exit({e.code!r})"
    err = MacroflowError(f"{what} called {how}: code run by macroflow returns or raises; "
                         f"this call failed")
    err.__cause__ = e
    return err


# -- uncaught errors --------------------------------------------------------------

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_traceback(tb: Optional[types.TracebackType]) -> Tuple[Optional[types.TracebackType], int]:
    """``tb`` without the frames of macroflow's own code, and how many went;
    ``tb`` itself if no frame, or every frame, is macroflow's.

    Example:
        >>> def user():
        ...     raise ValueError("bad")
        >>> try:
        ...     user()
        ... except ValueError as e:
        ...     error = e
        >>> tb, hidden = user_traceback(error.__traceback__)
        >>> tb is error.__traceback__, hidden
        (True, 0)
    """
    frames = []
    t = tb
    while t is not None:
        frames.append(t)
        t = t.tb_next
    keep = [t for t in frames if not t.tb_frame.f_code.co_filename.startswith(_PACKAGE)]
    if not keep or len(keep) == len(frames):
        return tb, 0
    new = None
    for t in reversed(keep):
        new = types.TracebackType(new, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return new, len(frames) - len(keep)


def format_user(e: BaseException) -> str:
    """``e`` and its traceback as Python prints them, without the frames of
    macroflow's own code (as :func:`excepthook` prints an uncaught error;
    ``MACROFLOW_TRACEBACK=full`` keeps them): what a report of an error in
    user code that macroflow ran (a callback, a handler, an init) shows.

    Example:
        >>> try:
        ...     int("x")
        ... except ValueError as e:
        ...     print(format_user(e).splitlines()[-1])
        ValueError: invalid literal for int() with base 10: 'x'
    """
    import traceback
    tb = e.__traceback__
    if os.environ.get("MACROFLOW_TRACEBACK", "").strip().lower() != "full":
        tb, _ = user_traceback(tb)
    return "".join(traceback.format_exception(type(e), e, tb))


def excepthook(etype: type, value: BaseException, tb: Optional[types.TracebackType]) -> None:
    """``sys.excepthook`` while macroflow is imported (if nothing else replaced
    Python's): an uncaught error is printed without the frames of macroflow's
    own code between the user's (the calls of ``mf.run``, ``mf.spmd`` and
    ``result()`` down to where the error was raised again), with a note
    saying how many went; ``MACROFLOW_TRACEBACK=full`` prints every frame.

    Example:
        >>> import io, contextlib
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     excepthook(ValueError, ValueError("bad"), None)
        >>> err.getvalue()
        'ValueError: bad\\n'
    """
    if value is not None and value.__traceback__ is not tb:
        value.__traceback__ = tb
    if os.environ.get("MACROFLOW_TRACEBACK", "").strip().lower() != "full":
        hidden, seen = 0, set()
        x: Optional[BaseException] = value
        while x is not None and id(x) not in seen:
            seen.add(id(x))
            x.__traceback__, n = user_traceback(x.__traceback__)
            hidden += n
            x = x.__cause__ if x.__cause__ is not None else \
                (None if x.__suppress_context__ else x.__context__)
        tb = value.__traceback__
        if hidden and hasattr(value, "add_note"):
            value.add_note(f"({hidden} frame{'s' if hidden > 1 else ''} of macroflow's own code "
                           f"hidden: MACROFLOW_TRACEBACK=full shows {'them' if hidden > 1 else 'it'})")
    sys.__excepthook__(etype, value, tb)


def install_excepthook() -> None:
    """Install :func:`excepthook`, unless something replaced Python's own.

    Example:
        >>> install_excepthook()
        >>> sys.excepthook in (excepthook, sys.__excepthook__) or callable(sys.excepthook)
        True
    """
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = excepthook
