"""The context: one address space's progress engine and dataflow.

This module is the hot path. A call becomes one frame (one pickle, one send);
on arrival it is matched with its argument tokens (Mentat's token matching, by
computation tag) and run in a pooled greenlet; its result is pickled once and
kept here, and sent only to the contexts that asked for it (arcs and
``result()``). Everything a model needs goes through :class:`Engine`.

The core knows no programming model. A model plugs in when it is imported:
its messages by opcode (:func:`register`), and the kinds of CALL it serves
with a :class:`Model` per engine (:func:`register_model`) whose
:class:`CallKind` objects decide where and when a call runs. The object model
(persistent, create and regular calls) lives in ``objects/hosting.py``.

Message opcodes (the first item of every header), all registered by the core
itself (CALL and VALUE are handled by the engine's loop, the others through
:data:`HANDLERS`):

========  ==============================================================
CALL      run a call: (op, fid, kind, target, method, args, kwargs, arcs, route,
          caller); ``kind`` names the CallKind that serves it (SYSTEM, the
          core's; the others a model's), and caller names the thread of
          control that issued it (the issuing invocation's fid, or the context
          id for its root): calls of one caller run on an object in the order
          issued. A future at the top of the arguments (no keywords) leaves None
          in its place and an arc (label, home, positions); one inside a
          container leaves an Arc there and an arc (label, home)
VALUE     a value for a label: a struct header (not a pickle: values are the
          commonest message), then the value's pickle and its buffers
FORWARD   send the value of fid, when known, to dest under label; the consumer
          of an arc sends it itself when the call arrives (pull), so the
          caller sends one message per call whatever its arguments
RELEASE   the issuer dropped these futures: (fid, arcs) pairs, where arcs is
          how many consumers were given the future and may still ask
RSR       remote service request: (op, gid, handler, args, thread); sent as
          a compact frame (see :func:`rsr_frame`), or pickled like the others
RSR_NOW   remote service request to run at once, even while a method computes
          here: (op, gid, handler, args); see SERVED_WHILE_BUSY
SHUTDOWN  leave the progress loop
READY     an eagerly routed value is too large to send unasked: ask for it
FATAL     the sender's engine failed (a bug of the runtime) and it is ending:
          (op, traceback text), so the loss is reported with its cause
PROBE     deadlock detection: (op, initiator fid, fid, path); follow what the
          call fid waits for, and report a cycle if the probe comes back to
          the initiator (edge chasing, after Chandy, Misra and Haas)
MEMBERS   contexts up to (op, size, gone, retiring) - 1 exist (contexts added while
          running); gone: {cid: (why, heir or None)} of those removed or lost,
          retiring: those being removed (a context added late knows neither)
JOINED    a context added while running reports in: (op, its description)
RETIRE    (op, cid, heir): context cid is being removed; to cid itself: take
          no new work, finish what you have, then hand over to heir
HANDOVER  (op, slots, models), from the retiring context to its heir: the
          values it holds, and what each model hands over (Model.hand_over)
RETIRED   (op, cid, heir, members), from the heir: send what was for cid to
          the heir from now on, after a RETIRE_ACK to cid
RETIRE_ACK  nothing more will come to the retiring context from the sender
LEFT      (op,): the retiring context is leaving, to context 0
BIG       (op, fid), from a value's home to its issuer: the value is large
          and nobody took it unasked: release its future at once, not in a batch
STATS     (op, fid): send this context's counters (mf.stats) as the value of
          fid, at once, even while a method computes here
========  ==============================================================

Opcodes 19..255 are free for models (:func:`register`).

The ``route`` field of a CALL packs (transfers << 2) | (eager << 1) | pinned.

Service while user code runs: a method that computes for seconds does not
hold its context's requests. The messages that need no user code (the
opcodes registered with ``served_while_busy``, :data:`SERVED_WHILE_BUSY`:
value requests and forwards, releases, at-once remote service requests) are
served by the context's service mechanism (:mod:`macroflow.core.threads`)
while the method runs; everything
else waits in the inbox, in arrival order, for the engine's own loop.
``Engine.user`` says when user code runs; the engine methods that user code
calls (see ``Engine._from_user``) keep the service mechanism out while they run.
"""

from __future__ import annotations

import array
import math
import numbers
import copy
import functools
import heapq
import itertools
import operator
import os
import pickle
import struct
import sys
import threading
import time
import traceback
import weakref
from collections import OrderedDict, deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

from . import errors, marshal
from .future import FINISHED, PENDING, Arrivals, CoroutineType, Future, run_coroutine, site_label, stale_future
from .threads import DONE, INTERRUPTS, PARKED, Pool, Waiter, Worker, getcurrent, numpy
from .stats import Counters

CALL, VALUE, FORWARD, RELEASE, RSR, SHUTDOWN, READY, FATAL, PROBE, MEMBERS, JOINED = range(11)
RSR_NOW = 11
RETIRE, HANDOVER, RETIRED, RETIRE_ACK, LEFT = range(12, 17)
BIG, STATS = 17, 18
_encode = marshal._encoder.dumps
_pdumps = pickle.dumps
_ploads = pickle.loads
_PLAIN = marshal.PLAIN  # the commonest results and arguments: the C pickler's

# the call kind the core serves itself: a function of the engine, by name
# (see SYSTEM_CALLS); models register theirs (see register_model)
SYSTEM = "s"
RELEASE_BATCH = 64
BIG_VALUE = 1 << 20  # futures of values this large are released without batching
BIG_MAX = 4096  # large values noted at their issuer (BIG) before their futures are dropped
EARLY_MAX = 4096  # unclaimed early values kept at most (their futures may be gone)
EAGER_MAX = 64 * 1024  # an eagerly routed value larger than this waits to be asked for
KEEP_MIN = 1 << 20  # a value this large pulled here a second time is kept (see _keep)
PULLED_MAX = 4096  # values whose pulls are counted here at most (the latest)
PINNED, EAGER = 1, 2
PROBE_AFTER = 0.5  # a wait this old sends a deadlock probe, and again as often while it lasts
PROBE_PATH_MAX = 256  # longer wait chains are not followed
ANY_NEST_MAX = 4  # a probe of a wait for any of several fans out at most this many waits like it deep
ANY_FAN_MAX = 64  # and into at most this many probes from one of the initiator's (see _fans)
CYCLES_SHOWN = 8  # a wait for any of several names at most this many ways back in its message
_AMONG = "waits for any of {} futures, among them"  # a hop through another such wait
_CLOSES = "closes"  # a probe's last hop: it came back to a wait for any of several on its way
ANY_PROBE_MAX = 8.0  # at most this long between rounds of probes of a wait for any of several
GLANCE_MIN_WAIT = 1e-3  # a wait with a shorter timeout parks at once (see _glance_for)
POLLER_SPIN = 2e-3  # for this long after a poller is added the engine does not sleep ...
POLLER_PERIOD = 50e-6  # ... then at most this long at a time while it has pollers
# VALUE headers: b"V" ok ctx seq  (label (fid, None)), b"W" ok ctx seq ctx seq (an arc)
_VGET = struct.Struct("<BBqq")
_VARC = struct.Struct("<BBqqqq")
_V, _W = ord("V"), ord("W")
# compact RSR frames: b"R" op thread 0 keylen, then the key (the pickled
# (gid, handler), the same bytes every time), then the arguments
# (marshal.dumps_args)
_RHEAD = struct.Struct("<BBBBI")
_R = ord("R")
_RSR_THREADS = ("inline", "new")
_RSR_KEYS_MAX = 4096
_rsr_keys: Dict[bytes, Tuple[Any, Any]] = {}  # key -> (gid, handler), decoded once
_TIMEOUT = object()
_INLINE_WAIT = ("a remote service request handler run inline or at once cannot wait; "
                "use thread='new'")
_MISSING = object()
#: What Model.resolve returns when a global pointer names nothing here.
MISSING = _MISSING


class Arc:
    """Placeholder for a future's value inside call arguments (a dataflow arc)."""

    __slots__ = ("fid",)

    def __init__(self, fid):
        self.fid = fid

    def __reduce__(self):
        return (Arc, (self.fid,))


class AnyOf:
    """What a method thread waits for when it waits for any of several
    futures (``mf.wait(return_when=...)``, ``mf.as_completed``), for the
    probes for wait cycles: each round probes every branch, and the wait is
    a deadlock when every branch of one round has come back to it.

    Example:
        >>> w = AnyOf(["f1", "f2"])
        >>> w.round, w.found
        (0, [])
    """

    __slots__ = ("fs", "round", "found", "next", "deferred")

    def __init__(self, fs: List[Any]):
        self.fs = fs
        self.round = 0
        self.found: List[list] = []  # the paths that came back, this round
        self.next = 0.0  # (time.monotonic) when the next round is due
        self.deferred = 0  # the round in which it found a knot and left it to another wait


class Call:
    """One invocation at the context that runs it (Mentat's computation instance)."""

    __slots__ = ("fid", "kind", "target", "method", "args", "kwargs", "arcs", "route",
                 "caller", "missing", "tokens", "obj", "answered", "order", "waiting")

    def __init__(self, fid, kind, target, method, args, kwargs, arcs, route, caller):
        self.fid = fid
        self.kind = kind
        self.target = target
        self.method = method
        self.args = args
        self.kwargs = kwargs
        self.arcs = arcs
        self.route = route
        self.caller = caller
        self.missing = 0
        self.tokens: Optional[Dict[Any, Any]] = None
        self.obj: Any = None  # what its kind runs it on (a hosted object), if anything
        self.answered = False  # rtf already gave the result
        self.order = 0  # arrival order where its kind queues it (at its object)
        self.waiting: Optional[Future] = None  # what its thread waits for (deadlock probes)


class Slot:
    """A result held at its home: pending, done (pickled once), or aliased elsewhere."""

    __slots__ = ("state", "ok", "data", "bufs", "subs", "alias", "keep", "released",
                 "served", "expect", "call", "returns")

    def __init__(self):
        self.state = PENDING
        self.ok = True
        self.data: Any = None
        self.bufs: List[Any] = []
        self.subs: List[Tuple[int, Any]] = []
        self.alias: Optional[Tuple[Any, int]] = None
        self.keep: Any = None
        self.released = False
        self.served = 0  # arc requests answered (or relayed)
        self.expect = 0  # arc requests the issuer announced when it released
        self.call: Optional[Call] = None  # the invocation computing it, while it runs here
        self.returns = 0  # times its call came back here after it was passed on


_CORE_DIR = os.path.dirname(os.path.abspath(__file__))
_get_ident = threading.get_ident
#: Files of models whose frames, like the core's, a remote traceback leaves
#: out when they called the user's code (a model adds its own: ``__file__``).
RUNTIME_FILES: set = set()


def _runtime_file(filename: str) -> bool:
    # the core's and the models' code: a remote traceback leaves its frames out
    return filename.startswith(_CORE_DIR) or filename in RUNTIME_FILES


def _pickled_size(data: Any, bufs: List[Any]) -> int:
    """Bytes of a value pickled here: the pickle and its out-of-band buffers.

    Example:
        >>> data, bufs = marshal.dumps(bytes(100_000))
        >>> _pickled_size(data, bufs) > 100_000
        True
    """
    size = len(data)
    for b in bufs:
        size += b.raw().nbytes
    return size


#: dropped remote service requests a context reports on stderr; the rest are counted
DROPS_SAID = 10


def handler_label(fn: Any) -> str:
    """How a remote service request's handler is named in reports.

    Example:
        >>> import functools
        >>> handler_label(len), handler_label(functools.partial(len, "abc"))
        ('builtins.len', 'functools.partial(builtins.len, ...)')
        >>> class Box:
        ...     def __call__(self): pass
        >>> handler_label(Box())
        'a Box instance'
    """
    if isinstance(fn, functools.partial):
        return f"functools.partial({handler_label(fn.func)}, ...)"
    name = getattr(fn, "__qualname__", None)
    if isinstance(name, str):
        module = getattr(fn, "__module__", None)
        return f"{module}.{name}" if module else name
    return f"a {type(fn).__qualname__} instance"


def _from_user_frames(tb: Any, runtime: Callable[[str], bool] = _runtime_file) -> Any:
    """``tb`` from the first frame that is not the runtime's (``runtime`` of
    its file name; its last frame at least): the runtime frames that called
    the user's code say nothing."""
    while tb is not None and tb.tb_next is not None and \
            runtime(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def fatal_text(exc: BaseException) -> str:
    """What a context says, and reports to the others (FATAL), when ``exc``
    ends its engine: the whole traceback of an internal error, but an
    interrupt raised in user code from the user's frames (the runtime's
    frames under a method say nothing to its author).

    Example:
        >>> try:
        ...     raise KeyboardInterrupt
        ... except KeyboardInterrupt as e:
        ...     fatal_text(e).splitlines()[-1]
        'KeyboardInterrupt'
    """
    tb = exc.__traceback__
    if isinstance(exc, KeyboardInterrupt):
        package = os.path.dirname(_CORE_DIR)  # (the launcher's frames too)
        tb = _from_user_frames(tb, lambda name: name.startswith(package))
    return "".join(traceback.format_exception(type(exc), exc, tb))


def format_remote(exc: BaseException, ctx: int) -> str:
    # start at the user's code, in the exceptions it was raised from too
    # (the sys.exit() that a method's error stands for, say); and, as the
    # excepthook prints a local error, without the frames of macroflow's own
    # code that the user's called (mf.rtf's, raising that it was called twice)
    full = os.environ.get("MACROFLOW_TRACEBACK", "").strip().lower() == "full"
    hidden = 0
    seen = {id(exc)}
    x: Optional[BaseException] = exc
    while x is not None:
        x.__traceback__ = _from_user_frames(x.__traceback__)
        if not full:
            x.__traceback__, n = errors.user_traceback(x.__traceback__)
            hidden += n
        x = x.__cause__ if x.__cause__ is not None else \
            (None if x.__suppress_context__ else x.__context__)
        if x is not None and id(x) in seen:
            break
        seen.add(id(x))
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if hidden:
        text += (f"({hidden} frame{'s' if hidden > 1 else ''} of macroflow's own code hidden: "
                 f"MACROFLOW_TRACEBACK=full shows {'them' if hidden > 1 else 'it'})\n")
    return f'Traceback from context {ctx}:\n{text}'


class _Stamp:
    """A timed wait's callback: when the value came (see Engine._wait_timed).
    It runs no user code, so a value may be given to a future that has only
    these wherever it is taken (see _plain_callbacks)."""

    __slots__ = ("came",)

    def __init__(self) -> None:
        self.came: List[float] = []

    def __call__(self, _f: Future) -> None:
        self.came.append(time.monotonic())


def _plain_callbacks(cbs: list) -> bool:
    """Whether a future's callbacks are only timed waits' stamps and the
    queues of waits for the first of several (:class:`Arrivals`), which run
    no user code and so may run anywhere: user callbacks run from the
    engine's loop."""
    for cb in cbs:
        t = type(cb)
        if t is not _Stamp and t is not Arrivals:
            return False
    return True


class Engine:
    """The progress engine of one context (the models' parts: ``models``).

    Users never build one: :func:`macroflow.run` and :func:`macroflow.init` do.
    ``current_engine()`` returns the one serving the running code.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     mf.context_id(), mf.num_contexts()
        (0, 1)
    """

    def __init__(self, ctx: int, size: int, transport: Any, placement: Any, root=None,
                 computation: str = ""):
        self.id = ctx
        # names the computation in errors: handles, futures and global pointers
        # carry it, so one kept from another computation is caught, not misused
        self.computation = computation
        self.closed = False  # the computation ended; its futures can no longer wait
        self.size = size
        self.transport = transport
        self.placement = placement
        self.root = root if root is not None else getcurrent()
        self.thread = threading.get_ident()
        self.pool = Pool(self, self.root)
        self.inbox: Deque[Tuple[int, List[Any], int]] = deque()
        self.ready: Deque[Any] = deque()
        self.timers: List[Tuple[float, int, Waiter]] = []
        #: callables the engine calls at each step while they return False
        #: (a model's requests that complete without a message, such as MPI's
        #: non-blocking collectives; see add_poller); while there are any it
        #: never sleeps longer than POLLER_PERIOD
        self.pollers: List[Callable[[], bool]] = []
        self.poller_spin_until = 0.0
        self.seq = itertools.count(1)
        self.slots: Dict[Any, Slot] = {}
        self.tokens: Dict[Any, Tuple[bool, Any]] = {}
        # arcs of calls that failed before these came (see _fail_early): their
        # values are dropped as they come
        self.unwanted: Set[Any] = set()
        self.awaiting: Dict[Any, Call] = {}
        # fid -> [home, label, labels...]: a value pulled here for the call of
        # label, which the calls of the other labels wait for too (see _on_call)
        self.pulls: Dict[Any, List[Any]] = {}
        # large values pulled here more than once, kept for the calls to come
        # (fid -> (_Shared, bytes)), least recently used first; the pulls
        # counted per value, the latest PULLED_MAX; see _keep
        self.kept: "OrderedDict[Any, Tuple[Any, int]]" = OrderedDict()
        self.kept_bytes = 0
        self.keep_max = keep_setting()
        self.pulled: "OrderedDict[Any, int]" = OrderedDict()
        self.asked: Dict[Any, Future] = {}  # futures waiting for a value from their home
        self.eager: Dict[Any, Any] = {}  # fid -> weakref of futures whose value comes unasked
        self.early: Dict[Any, Any] = {}  # values that came before anyone asked (rtf)
        self.adopted: Dict[Any, Any] = {}  # weak map fid -> Future for futures received by value
        # Frames from one context arrive in the order sent: `seen` holds the
        # highest call number received from each context, and `call_watch`
        # what a model wants told (once) when a later call comes from one
        # (the object model: a constructor that would have come by then)
        self.seen: Dict[int, int] = {}
        self.call_watch: Dict[int, Callable[[int], None]] = {}
        # removing contexts while running (see remove_context in launch)
        self.retiring: set = set()  # contexts being removed: no new work goes there
        self.heirs: Dict[int, int] = {}  # removed context -> who got what it held
        self.retire: Optional[Dict[str, Any]] = None  # this context is being removed
        self.relay_to: Optional[int] = None  # handed over: pass every message on
        self.left: set = set()  # removed contexts that have left (context 0)
        self.exports: Dict[Any, Any] = {}  # global pointers to plain objects and buffers
        self.releases: List[Any] = []  # (home, fid, arcs) of futures dropped here
        # fids of live futures whose homes said their values are large (BIG):
        # released at once when dropped
        self.big: set = set()
        self.n_releases = 0
        self.lost: Dict[int, str] = {}
        self.fatal: Dict[int, str] = {}  # peers that reported an internal error before ending
        self.lost_queue: List[int] = []  # lost peers whose futures and calls are not failed yet
        # method threads waiting on a future: fid -> (call, future, waiter, since)
        self.blocked: Dict[Any, Tuple[Call, Future, Waiter, float]] = {}
        self.blocked_version = 0  # changes whenever a wait starts or ends
        self.next_probe = 0.0
        self.timed_wait = False  # main waits with a timeout: start no regular call here
        # inproc: leave the inbox for later once this says so (a waiter in this
        # thread is due, or context 0 has something to take)
        self.stop_when: Optional[Callable[[], bool]] = None
        self.loads = [0] * size
        # contexts added while running, as they report in: id -> their description
        self.joined: Dict[int, Any] = {}
        self.on_joined: Optional[Callable[[int], None]] = None  # the launcher's, on context 0
        self.active = 0  # calls received here and not finished: the local load
        self.base_load = 1 if ctx == 0 else 0  # context 0 runs main
        self.stopping = False
        self.dispatching = False
        self.in_inline = False
        self.in_guard: Optional[Tuple[str, str]] = None  # (object, method) whose guard runs
        self._kept: Any = ()  # what serve_arrived leaves for the engine, in this round
        self.interrupted_call: Optional[Call] = None  # whose thread an interrupt ended
        # service while user code runs (see SERVED_WHILE_BUSY): `user` is True
        # while this context's thread runs user code, `epoch` counts the times
        # it started to, `serving` is the thread serving now (0: none)
        self.user = False
        self.epoch = 0
        self.serving = 0
        self.service: Any = None
        self.glance: Optional[Callable[[Callable[[], bool]], None]] = None
        self.served_busy = 0  # messages served while user code ran
        #: results kept here whose large buffers are still views of the
        #: method's own objects: copied before any user code runs (see kept_copies)
        self.undetached: List[Tuple[Any, Slot, List[Any]]] = []
        self.serving_forever = False
        self.big_dropped = False  # a large value's future was dropped: release it at once
        self.service_cpu = 0.0  # CPU seconds the service mechanism spent serving
        self._scanned: Any = None  # the last inbox entry the service looked at
        self._in_serve = False
        self.stats = Counters()
        self.driver: Any = self  # inproc replaces this with its world
        self.describe_lost: Callable[[int], str] = lambda peer: "connection closed"
        # called when context 0 is lost while one of this context's methods
        # computes (heard by the service mechanism): a process that nothing
        # else ends with context 0 (a joined worker's) ends itself there
        self.main_lost_while_busy: Optional[Callable[[str], None]] = None
        # the programming models' parts of this engine (see register_model):
        # the kinds of CALL each serves, and the global pointer kinds it resolves
        self.call_kinds: Dict[str, CallKind] = {SYSTEM: SystemCalls(self)}
        #: the kinds whose targets a sender shrinks and a receiver makes whole
        #: again (see CallKind.outgoing)
        self.shrinks: set = set()
        self.pointer_kinds: Dict[str, Model] = {}
        self.models: Dict[str, Model] = {}
        for name, factory in MODELS.items():
            model = self.models[name] = factory(self)
            taken = [k for k in model.kinds if k in self.call_kinds] + \
                [k for k in model.pointers if k in self.pointer_kinds or k == "export"]
            if taken:
                raise ValueError(f"model {name!r} serves kinds {taken} that another model "
                                 f"(or the core) serves already")
            self.call_kinds.update(model.kinds)
            self.shrinks.update(k for k, v in model.kinds.items() if v.outgoing is not None)
            for kind in model.pointers:
                self.pointer_kinds[kind] = model
        #: models whose memory others may write without running code here
        #: (see Model.exposed)
        self.exposers = [m for m in self.models.values() if m.has_exposed]
        if transport is not None:
            transport.attach(self.deliver, self.peer_lost, self.land)
            #: the transport's look before a thread parks (see wait_future), if any
            self.glance = getattr(transport, "glance", None)
            if transport.fileno() is not None:  # inproc: nothing runs while a method does
                from .threads import start_service
                self.service = start_service(self)
                # one call from user code into the engine, not three (see _from_user)
                self._from_user = self.service.run_engine

    # ------------------------------------------------------------------ sending
    def load(self) -> int:
        return self.active + self.base_load

    def context_ids(self) -> List[int]:
        """The ids of every context of the computation that has not left, this
        one included."""
        return [c for c in range(self.size) if c not in self.lost]

    def grow(self, size: int) -> None:
        """Contexts up to id ``size - 1`` exist: ids are given out in order, so
        hearing of one (a frame from it, a MEMBERS message) is enough."""
        if size > self.size:
            self.loads.extend([0] * (size - len(self.loads)))
            self.size = size

    def members(self) -> tuple:
        """The MEMBERS message that tells a context which contexts exist: a
        context added while running must also learn which ones left before
        it came (removed: to whom what they held went), and which are
        leaving, or it would send them work."""
        gone = {c: (how, self.heirs.get(c)) for c, how in self.lost.items()}
        return (MEMBERS, self.size, gone, sorted(self.retiring))

    def learn_members(self, size: int, gone: Optional[dict] = None,
                      retiring: Sequence[int] = ()) -> None:
        """What a MEMBERS message says (see :meth:`members`); what this
        context knows already stays as it is."""
        self.grow(size)
        for c, (how, heir) in (gone or {}).items():
            if c == self.id or c in self.lost:
                continue
            self.lost[c] = how
            if heir is not None:
                self.heirs[c] = heir
            self.retiring.discard(c)
        self.retiring.update(c for c in retiring if c not in self.lost and c != self.id)

    def send(self, dest: int, header: tuple) -> None:
        data, bufs = marshal.dumps(header)
        self.send_frame(dest, [data, *bufs])

    def send_frame(self, dest: int, parts: List[Any], urgent: bool = False) -> None:
        # While the engine dispatches a batch of messages, what it sends is
        # queued and leaves in one write per peer when the batch is done;
        # calls made by user code (urgent) leave at once, so a method that
        # calls out and then computes does not hold its calls back. Nor does
        # the batch's last message (nothing left in the inbox): its reply or
        # request leaves at once, not after the bookkeeping that ends the
        # batch, since nothing else would share the write.
        if dest in self.heirs:
            dest = self.heirs[dest]  # removed: what it held, its heir holds now
        if dest == self.id:
            # call-by-value holds for calls to one's own context too
            self.inbox.append((dest, [bytes(parts[0])] + [bytearray(_raw(p)) for p in parts[1:]],
                               self.load()))
            return
        if dest in self.lost:
            return
        try:
            if self.dispatching and not urgent and self.inbox:
                n = self.transport.queue(dest, parts, self.active + self.base_load)
            else:
                n = self.transport.send(dest, parts, self.active + self.base_load)
        except ConnectionError:
            return  # peer_lost has been (or will be) called with the reason
        st = self.stats
        st.messages_sent += 1
        st.bytes_sent += n

    def land(self, src: int, head: Any, nbytes: int) -> Optional[memoryview]:
        """Where a large payload of a frame from ``src`` should be received:
        what the landing registered for the frame's opcode says (see
        :func:`register`), or None."""
        fn = LANDINGS.get(_peek_op(head))
        return None if fn is None else fn(self, src, head, nbytes)

    def deliver(self, src: int, bufs: List[Any], load: int) -> None:
        st = self.stats
        st.messages_received += 1
        if len(bufs) == 1:
            st.bytes_received += 16 + len(bufs[0])
            if not self.inbox and not self.dispatching and bufs[0][0] == _V \
                    and self.relay_to is None and self._take_value(src, bufs[0], load):
                return
        else:
            n = 8 + 8 * len(bufs)
            for b in bufs:
                n += len(b)
            st.bytes_received += n
        self.inbox.append((src, bufs, load))

    def _heard(self, src: int, load: int) -> None:
        """Note the load a frame from ``src`` reported."""
        try:
            self.loads[src] = load
        except IndexError:  # a context added while running, before its MEMBERS
            self.grow(src + 1)
            self.loads[src] = load

    def _take_value(self, src: int, b0: Any, load: int) -> bool:
        """The commonest frame, a small value someone here asked for, taken as
        it is read rather than queued for the engine's loop: nothing was
        read before it that waits, so the order is the same. False (queue
        it) for anything less plain: an error, a future with callbacks."""
        _, ok, a0, a1 = _VGET.unpack_from(b0)
        f = self.asked.get((a0, a1))
        if f is None or not ok or (f._callbacks and not _plain_callbacks(f._callbacks)):
            return False
        eng = getattr(getcurrent(), "engine", None)
        if eng is not None and eng is not self:
            # another context's method is sending it (every context in one
            # process): unpickled here, the futures and handles inside would
            # be that context's (current_engine looks at the thread first)
            return False
        try:
            self.loads[src] = load  # _heard, inline: the commonest path of all
        except IndexError:
            self._heard(src, load)
        prev, _state.current = _state.current, self  # what the value's pickle may need
        try:
            data = memoryview(b0)[_VGET.size:]
            # _on_value's commonest case, inline: a small value, one future
            slow = bool(f._callbacks) or f._state == FINISHED or len(b0) >= BIG_VALUE
            if not slow:
                try:
                    value = _ploads(data)
                except Exception:
                    slow = True  # (_on_value says why)
            if slow:
                self._on_value(((a0, a1), None), True, data, [])
                return True
        finally:
            _state.current = prev
        fid = (a0, a1)
        self.asked.pop(fid, None)
        if self.eager:
            self.eager.pop(fid, None)
        f._value = value  # f._set(True, value), inline
        f._state = FINISHED
        if f._waiters:
            waiters, f._waiters = f._waiters, []
            for w in waiters:
                w.wake(None)
        return True

    # ------------------------------------------------------------------ issuing
    def new_fid(self):
        return (self.id, next(self.seq))

    def issue(self, kind: str, target: Any, method: Optional[str], args: tuple, kwargs: dict,
              dest: int, site: Any = None, oid: Any = None, pinned: bool = False,
              fid: Any = None) -> Future:
        """Send a call to ``dest`` and return its future at once."""
        if self.user and self.serving != _get_ident():
            return self._from_user(self.issue, kind, target, method, args, kwargs, dest, site,
                                   oid, pinned, fid)
        if self.big_dropped:
            # before the call, not at the next step: a large value's home
            # frees it before the call runs there (no copy kept for its sake:
            # see kept_copies)
            self.flush_releases()
        if fid is None:
            fid = (self.id, next(self.seq))
        if dest in self.heirs and oid is None and getattr(self.call_kinds.get(kind), "moves",
                                                           False):
            # a call that may run anywhere (a stateless object's, pinned to a
            # context since removed) runs where that context's work went
            while dest in self.heirs and self.heirs[dest] != dest:
                dest = self.heirs[dest]
        arcs = None
        plain = not kwargs
        top = False  # futures among the arguments, none inside a container
        if plain:
            for v in args:  # marshal.plain(args), inline
                t = type(v)
                if t not in _PLAIN:
                    if t is Future:
                        top = True
                        continue
                    plain = top = False
                    break
        if top:
            # the commonest dataflow call (a chain's): arcs by position, so
            # the message stays plain (the C pickler's, no Arc to reduce)
            args, arcs, plain = self._top_arcs(args, fid, dest)
        elif not plain and ((args and _has_future(args))
                            or (kwargs and _has_future(kwargs.values()))):
            args, kwargs, arcs = self._make_arcs(args, kwargs, fid, dest)
        eager = site is not None and site.strict >= 2
        # the caller's manager placed it: that decision is the first of transfer_limit moves
        route = (1 << 2) | (EAGER if eager else 0) | (PINNED if pinned else 0)
        running = getattr(getcurrent(), "call", None)
        caller = self.id if running is None else running.fid
        # a call to this very context, of plain values only, is queued as it is
        # (see _process): nothing in it can change, so call-by-value holds
        # without the pickle and its decoding
        queued = plain and arcs is None and dest == self.id and self.relay_to is None \
            and _shareable(target)
        sent = target
        if not queued and kind in self.shrinks and dest not in self.lost:
            sent = self.call_kinds[kind].outgoing(target, dest)  # type: ignore[attr-defined]
        msg = (CALL, fid, kind, sent, method, args, kwargs, arcs, route, caller)
        try:
            if queued:
                data = bufs = None
            # arguments of plain values only: the C pickler, as for a plain result
            # (the target is a model's tuple of ids, or a class the encoder must see)
            elif plain and (type(sent) is tuple and len(sent) == 1 and type(sent[0]) is tuple
                            and len(sent[0]) == 2 and type(sent[0][0]) is int
                            and type(sent[0][1]) is int or _plain_target(sent)):
                # (an object's id, the commonest target, without the call)
                data, bufs = _pdumps(msg, 5), None
            else:
                data, bufs = _encode(msg)
        except BaseException as e:
            if sent is not target:  # not sent after all: the kind forgets it was
                self.call_kinds[kind].unsent(sent, dest)  # type: ignore[attr-defined]
            if isinstance(e, errors.StaleReference) or not isinstance(e, Exception):
                raise  # a future of another computation inside the arguments: as it is
            # (a __reduce__ may raise anything)
            raise errors.CallError(f"cannot send the arguments of {site_label(site) or method}: "
                                   f"{type(e).__name__}: {e}") from e
        fut = Future(self, fid, dest, oid, site)
        if dest in self.lost:
            if dest in self.heirs and oid is not None:
                fut._set(False, errors.ObjectDestroyed(
                    f"{site_label(site) or method}: its object was on context {dest}, "
                    f"which was removed"))
            else:
                fut._set(False, errors.ContextLost(dest, self.lost[dest]))
            return fut
        if eager:
            fut._eager = True
            self.eager[fid] = weakref.ref(fut)
        self.stats.calls_issued += 1
        if dest != self.id:
            if dest >= self.size:
                self.grow(dest + 1)
            self.loads[dest] += 1
        else:
            self.active += 1  # queued here already: the next placement must see it
        if queued:
            self.inbox.append((dest, msg, self.load()))
        else:
            self.send_frame(dest, [data, *bufs] if bufs else [data], urgent=True)
        return fut

    def issue_plain(self, kind: str, target: tuple, method: str, args: tuple, dest: int,
                    site: Any, oid: Any) -> Future:
        """:meth:`issue` of a call without keyword arguments whose target is
        ids only (``(oid,)``, a persistent object's): the commonest call, in
        one function where nothing unusual is in the way (plain arguments,
        another context, no context lost or removed); anything else goes
        to :meth:`issue`. What it sends is what issue would send.

        Example:
            >>> import macroflow as mf
            >>> @mf.persistent
            ... class Adder:
            ...     def add(self, a, b): return a + b
            >>> with mf.init(contexts=2, transport="inproc"):
            ...     oid = mf.info(Adder.create(on=1)).id
            ...     current_engine().issue_plain("p", (oid,), "add", (2, 3), 1,  # "p": persistent
            ...                                  None, oid).result()
            5
        """
        # (each test here is one that issue makes too, and is seldom true)
        if self.lost or self.heirs or self.big_dropped or dest == self.id \
                or self.relay_to is not None or kind in self.shrinks \
                or (self.user and self.serving != _get_ident()):
            return self.issue(kind, target, method, args, {}, dest, site, oid)
        for v in args:
            if type(v) not in _PLAIN:
                return self.issue(kind, target, method, args, {}, dest, site, oid)
        fid = (self.id, next(self.seq))
        eager = site is not None and site.strict >= 2
        running = getcurrent()
        running = getattr(running, "call", None)
        data = _pdumps((CALL, fid, kind, target, method, args, {}, None,
                        (1 << 2) | EAGER if eager else 1 << 2,
                        self.id if running is None else running.fid), 5)
        fut = Future(self, fid, dest, oid, site)
        if eager:
            fut._eager = True
            self.eager[fid] = weakref.ref(fut)
        st = self.stats
        st.calls_issued += 1
        if dest >= self.size:
            self.grow(dest + 1)
        self.loads[dest] += 1
        try:  # send_frame, inline (a call made by the user's code leaves at once)
            n = self.transport.send(dest, [data], self.active + self.base_load)
        except ConnectionError:
            return fut  # peer_lost has been (or will be) called with the reason
        st.messages_sent += 1
        st.bytes_sent += n
        return fut

    def _top_arcs(self, args: tuple, fid, dest: int):
        """``args`` (plain values and futures) with None where a future's value
        will go, the arcs ``(label, home, positions)`` that fill them in, and
        whether what is left is plain. A future already here with its value
        is passed as that value."""
        for x in args:  # before anything is counted or sent for the others
            if type(x) is Future and x._engine.closed:
                raise stale_future(x)
        out = list(args)
        arcs: List[Any] = []
        where: Dict[Any, int] = {}
        passed: set = set()
        plain = True
        for i, x in enumerate(args):
            if type(x) is not Future:
                continue
            if x._state == FINISHED and x._exc is None:
                v = out[i] = _value_passed(x, passed)
                if type(v) not in _PLAIN:
                    plain = False
                continue
            out[i] = None
            afid = x._fid
            k = where.get(afid)
            if k is not None:  # the same future again: one arc, two places
                label, home, at = arcs[k]
                arcs[k] = (label, home, at + (i,))
                continue
            where[afid] = len(arcs)
            label = (afid, fid)
            arcs.append((label, self._arc_home(x, label, dest), (i,)))
        return tuple(out), (tuple(arcs) if arcs else None), plain

    def _arc_home(self, f: Future, label: Any, dest: int) -> int:
        """Make ``f`` (not finished, or failed) an arc of the call to ``dest``
        under ``label``; returns where the consumer finds its value."""
        if f._state == FINISHED:  # finished with an exception: send it as a token
            self.send_error(dest, label, f._exc)
            return self.id
        if f._site is not None and not f._asked:
            f._site.strict = 0  # this site's futures feed other calls: route lazily
        f._arcs += 1  # its home keeps the value until this consumer has asked
        return f._home

    def _make_arcs(self, args, kwargs, fid, dest):
        found: Dict[Any, Future] = {}
        passed: set = set()

        def arc(x):
            if x._engine.closed:
                raise stale_future(x)
            if x._state == FINISHED and x._exc is None:
                return _value_passed(x, passed)
            found[x._fid] = x
            return Arc(x._fid)

        args = _replace(args, Future, arc)
        kwargs = _replace(kwargs, Future, arc)
        arcs = []
        for afid, f in found.items():
            label = (afid, fid)
            arcs.append((label, self._arc_home(f, label, dest)))
        return args, kwargs, tuple(arcs)

    def send_forward(self, home: int, fid: Any, dest: int, label: Any,
                     trail: Any = None) -> None:
        """Ask ``home`` to send the value of ``fid`` to ``dest`` under ``label``
        (a FORWARD: ids only, so the C pickler writes it as the runtime's
        encoder would). ``trail``: where a request passed on along aliases
        has been (see :meth:`_on_forward`)."""
        msg = (FORWARD, fid, dest, label) if trail is None else (FORWARD, fid, dest, label, trail)
        self.send_frame(home, [_pdumps(msg, 5)])

    def forward(self, f: Future, dest: int, label: Any) -> None:
        if f._home in self.lost and f._home not in self.heirs:
            self.send_error(dest, label, errors.ContextLost(f._home, self.lost[f._home]))
            return
        if f._home == self.id:
            self._on_forward(f._fid, dest, label)
        else:
            self.send_forward(f._home, f._fid, dest, label)

    def request_value(self, f: Future) -> None:
        """Ask a future's home for its value (once)."""
        if self.user and self.serving != _get_ident():
            return self._from_user(self.request_value, f)
        if f._engine.closed:
            raise stale_future(f)
        if threading.get_ident() != self.thread:
            if threading.get_ident() == self.serving:
                raise errors.DeadlockError(_INLINE_WAIT)
            raise RuntimeError(wrong_thread("a macroflow future was used", self))
        if f._asked or f._state == FINISHED:
            return
        f._asked = True
        if self.early:
            hit = self.early.pop(f._fid, None)
            if hit is not None:
                f._set(*hit)
                return
        site = f._site
        if site is not None and site.strict < 8:
            site.strict += 1
        self.asked[f._fid] = f
        if f._eager and not f._ready_remote:
            return  # the value is on its way unasked
        self.forward(f, self.id, (f._fid, None))

    def release(self, f: Future) -> None:
        if f._home in self.lost and f._home not in self.heirs:
            return
        # one append, whole: the service mechanism may flush between any two
        # bytecodes here (a future dropped by a method that computes)
        self.releases.append((f._home, f._fid, f._arcs))
        if f._big or (self.big and f._fid in self.big):
            self.big.discard(f._fid)
            # the home holds large buffers for it: free them at the next step
            # (not from here: __del__ may run in the middle of anything)
            self.n_releases = max(self.n_releases, RELEASE_BATCH)
            self.big_dropped = True
        if self.early:
            self.early.pop(f._fid, None)
        self.n_releases += 1

    def flush_releases(self) -> None:
        # Values are reclaimed in batches: one RELEASE per RELEASE_BATCH dropped
        # futures (or at once for a large value) keeps a sync call at two messages.
        if self.n_releases < RELEASE_BATCH:
            return
        self.n_releases = 0
        self.big_dropped = False
        pending = self.releases
        n = len(pending)
        rel = pending[:n]
        del pending[:n]  # (one step each: what is appended meanwhile stays for the next)
        by_home: Dict[int, List[Any]] = {}
        for home, fid, arcs in rel:
            fids = by_home.get(home)
            if fids is None:
                fids = by_home[home] = []
            fids.append((fid, arcs))
        for home, fids in by_home.items():
            if home == self.id:
                self._on_release(fids)
            else:
                self.send(home, (RELEASE, _pack_release(fids)))

    def adopt_future(self, fid, home, target) -> Future:
        f = self.adopted.get(fid)
        if f is not None:
            f = f()
        if f is None:
            f = Future(self, fid, home, target)
            self.adopted[fid] = weakref.ref(f)
        return f

    # ------------------------------------------------------------------ waiting
    def wait_future(self, f: Future, timeout: Optional[float], stamped: bool = False) -> None:
        if self.user and self.serving != _get_ident():
            return self._from_user(self.wait_future, f, timeout)
        if timeout is not None:
            timeout = check_timeout(timeout)
        self.request_value(f)
        if f._state == FINISHED:
            return
        if timeout is not None and not stamped:
            return self._wait_timed(f, timeout)
        if self.in_inline:
            # before the worker's case: an at-once handler may run on top of a method
            raise errors.DeadlockError(_INLINE_WAIT)
        if self.in_guard is not None:
            self.guard_waits(f"for {f!r}")
        w = getcurrent()
        if isinstance(w, Worker):
            call = w.call
            eng = w.engine
            if eng.glance is not None and (timeout is None or timeout >= GLANCE_MIN_WAIT):
                # the answer is often a few microseconds away: look for it
                # before parking (two switches and a pass of the engine's loop)
                eng._glance_for(f)
                if f._state == FINISHED:
                    return
            if call is not None:
                kind = eng.call_kinds[call.kind]
                if kind.checks_waits:
                    kind.check_wait(call, f)  # a wait that can never end raises
            eng.stats.threads_parked += 1
            waiter = Waiter(eng, w)
            f._waiters.append(waiter)
            if timeout is not None:
                eng.add_timer(timeout, waiter)
            if call is not None:  # eng._block(call, f, waiter), inline
                call.waiting = f
                now = time.monotonic()
                if not eng.blocked:
                    eng.next_probe = now + PROBE_AFTER
                eng.blocked[call.fid] = (call, f, waiter, now)
                eng.blocked_version += 1
            try:
                r = eng.root.switch(PARKED)  # eng.park()
            finally:
                if call is not None:  # eng._unblock(call), inline
                    call.waiting = None
                    eng.blocked.pop(call.fid, None)
                    eng.blocked_version += 1
            if r is _TIMEOUT and f._state != FINISHED:
                try:
                    f._waiters.remove(waiter)
                except ValueError:
                    pass
                raise errors.TimeoutError(f"{f!r} not ready after {timeout} s")
            if type(r) is errors.DeadlockError:
                try:
                    f._waiters.remove(waiter)
                except ValueError:
                    pass
                raise r
            return
        if timeout is None and self.driver is self:
            if self.glance is not None:
                self._glance_for(f)  # (the transport's spin makes system calls)
            step = self.step
            while f._state != FINISHED:  # the common wait, without a predicate call per step
                step(None)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        timed, self.timed_wait = self.timed_wait, deadline is not None
        try:
            done = self.driver.run_until(lambda: f._state == FINISHED, deadline)
        finally:
            self.timed_wait = timed
        if not done:
            raise errors.TimeoutError(f"{f!r} not ready after {timeout} s")

    def _wait_timed(self, f: Future, timeout: float) -> None:
        # A value that came only after the deadline is late too, as a
        # handle's is: the engine may have been busy past the deadline (a
        # method of this very context that computed), and the wait then
        # ends with the value there. The same on every transport.
        stamp = _Stamp()
        due = time.monotonic() + timeout
        f._callbacks.append(stamp)
        try:
            self.wait_future(f, timeout, True)
        finally:
            try:
                f._callbacks.remove(stamp)
            except ValueError:
                pass
        came = stamp.came
        if came and came[0] > due:
            raise errors.TimeoutError(f"{f!r} not ready after {timeout} s (it came "
                                      f"{came[0] - due:.3g} s after that)")

    def wait_arrival(self, arrivals: "Arrivals", timeout: Optional[float],
                     fs: Any = ()) -> bool:
        """Wait until ``arrivals`` (a callback of the futures ``fs``) has seen
        one of them finish here, or ``timeout`` seconds pass; True if one has.

        What ``mf.wait(return_when=...)`` and ``mf.as_completed`` wait with.
        A method that waits only for calls that can never start (to its own
        object) is refused, as ``result()`` refuses one; the engine's probes
        for wait cycles between contexts follow each future still to come,
        and the wait fails with :class:`DeadlockError` when each leads back
        to it (one that can end may end it).
        """
        if self.user and self.serving != _get_ident():
            return self._from_user(self.wait_arrival, arrivals, timeout, fs)
        if arrivals.queue:
            return True
        if self.in_inline:
            raise errors.DeadlockError(_INLINE_WAIT)
        if self.in_guard is not None:
            self.guard_waits("for futures")
        w = getcurrent()
        if isinstance(w, Worker):
            eng = w.engine
            call = w.call
            if call is not None and fs:
                kind = eng.call_kinds[call.kind]
                if kind.checks_waits:
                    first = None
                    for f in fs:
                        if f._state == FINISHED:
                            continue
                        try:
                            kind.check_wait(call, f)
                        except errors.DeadlockError as e:
                            first = first or e
                        else:  # this one may end: the wait may
                            first = None
                            break
                    if first is not None:
                        raise first
            eng.stats.threads_parked += 1
            waiter = arrivals.waiter = Waiter(eng, w)
            if timeout is not None:
                eng.add_timer(timeout, waiter)
            # a wait for one future still to come is that future's wait, for
            # the probes for wait cycles (as result()'s); a wait for any of
            # several is probed along each, and is a cycle only when each
            # leads back to it (one that can end ends it)
            pending = [f for f in fs if f._state != FINISHED] if call is not None else []
            if len(pending) == 1:
                eng._block(call, pending[0], waiter)
            elif pending:
                eng._block(call, AnyOf(pending), waiter)
            try:
                r = eng.root.switch(PARKED)
            finally:
                arrivals.waiter = None
                if pending:
                    eng._unblock(call)
            if type(r) is errors.DeadlockError:
                raise r
            return bool(arrivals.queue)
        deadline = None if timeout is None else time.monotonic() + timeout
        # as in a wait with a timeout, context 0 starts no regular call that
        # could run elsewhere: one would hold back every other answer
        timed, self.timed_wait = self.timed_wait, True
        try:
            return self.driver.run_until(lambda: bool(arrivals.queue), deadline)
        finally:
            self.timed_wait = timed

    def _block(self, call: Call, f: Any, waiter: Waiter) -> None:
        """``call``'s thread waits for ``f`` (a Future, or an :class:`AnyOf`):
        the probes for wait cycles follow it from here (wait_future does the
        same inline: its path is hot). A wait for any of several is not
        followed by others' probes (``call.waiting`` stays None): one that
        reaches it cannot tell whether another branch will end it."""
        if type(f) is Future:
            call.waiting = f
        now = time.monotonic()
        if not self.blocked:
            self.next_probe = now + PROBE_AFTER
        self.blocked[call.fid] = (call, f, waiter, now)
        self.blocked_version += 1

    def _unblock(self, call: Call) -> None:
        call.waiting = None
        self.blocked.pop(call.fid, None)
        self.blocked_version += 1

    def _glance_for(self, f: Future) -> None:
        # Only with nothing else to do here, and nothing that completes without
        # a message (a poller: the look would not see it). What arrives
        # meanwhile is taken as the engine's own poll takes it (a value for f
        # at once; anything else queued, which ends the look).
        def glanced() -> bool:  # (counted with the spin, not the call: tests/common.SPIN)
            return f._state == FINISHED or bool(self.inbox or self.ready or self.lost_queue
                                                or self.pollers)

        if glanced():
            return
        # A wait whose answer the glance catches returns without a step: the
        # step's chores are done here, or left to the step when one is due.
        if self.n_releases >= RELEASE_BATCH:
            self.flush_releases()
            self.transport.flush()
        if self.timers or self.blocked:
            if self.next_due() <= time.monotonic():  # type: ignore[operator]
                return
        dispatching, self.dispatching = self.dispatching, False
        try:
            self.glance(glanced)
        finally:
            self.dispatching = dispatching

    def park(self) -> Any:
        """Switch from a worker back to the engine until a Waiter wakes it."""
        if self.in_guard is not None:
            self.guard_waits("")
        return self.root.switch(PARKED)

    def guard_waits(self, what: str) -> None:
        """Raise the error of a guard that waits (``what``: for what). A guard
        is evaluated while its object looks for its next call: were it to
        wait, the object would look again meanwhile (with the guard half
        evaluated), or the engine would step inside the guard."""
        raise errors.DeadlockError(
            f"the guard of {'.'.join(self.in_guard)}() waits{' ' + what if what else ''}: a guard is "
            f"evaluated while its object looks for its next call, and must not wait. Keep "
            f"what it needs in the object's state (a method can fetch it)")

    def add_timer(self, timeout: float, waiter: Waiter) -> None:
        heapq.heappush(self.timers, (time.monotonic() + timeout, id(waiter), waiter))

    # ------------------------------------------------------------------ the loop
    def run_until(self, pred: Callable[[], bool], deadline: Optional[float] = None,
                  whole_rounds: bool = False) -> bool:
        # (whole_rounds matters to a driver of several engines: see inproc's)
        if self.in_guard is not None and not pred():
            self.guard_waits("")
        stepped = False
        while not pred():
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    if stepped:
                        return pred()
                    left = 0.0  # a wait of 0 s (a poll) still looks once: it never got anything
            else:
                left = None
            self.step(left)
            stepped = True
        return True

    def serve_forever(self) -> None:
        self.serving_forever = True  # no user code of its own follows a step here
        try:
            while not self.stopping:
                self.step(None)
        finally:
            self.serving_forever = False

    def busy(self) -> bool:
        return bool(self.inbox or self.ready or self.lost_queue)

    def step(self, timeout: Optional[float]) -> None:
        if self.n_releases >= RELEASE_BATCH:
            self.flush_releases()
        if self.blocked and time.monotonic() >= self.next_probe:
            self.probe_blocked()
        if self.inbox or self.ready or self.lost_queue:
            self.process()
            return
        if self.timers or self.blocked:  # next_due(), inline: usually neither
            due = self.timers[0][0] if self.timers else None
            if self.blocked and (due is None or self.next_probe < due):
                due = self.next_probe
            left = max(0.0, due - time.monotonic())  # type: ignore[operator]
            timeout = left if timeout is None else min(timeout, left)
        pollers = self.pollers
        if pollers:
            # something completes without a message (an MPI request): look
            # often, and at first without sleeping (as MPI's own waits do)
            nap = 0.0 if time.monotonic() < self.poller_spin_until else POLLER_PERIOD
            timeout = nap if timeout is None else min(timeout, nap)
            self.transport.poll(timeout)
            self.run_pollers()
        else:
            self.transport.poll(timeout)
        # (a value taken as it was read, the commonest arrival, leaves nothing to process)
        if self.inbox or self.ready or self.lost_queue or self.timers or self.retire is not None:
            self.process()

    def add_poller(self, fn: Callable[[], bool], spin: float = POLLER_SPIN) -> None:
        """Call ``fn()`` at every step until it returns True (see ``pollers``);
        for ``spin`` seconds from now the engine does not sleep at all."""
        self.pollers.append(fn)
        if spin > 0:
            self.poller_spin_until = max(self.poller_spin_until, time.monotonic() + spin)

    def next_due(self) -> Optional[float]:
        """When (time.monotonic) the engine next has something to do unasked:
        a timer, or deadlock probes of its waiting method threads; None if never."""
        due = self.timers[0][0] if self.timers else None
        if self.blocked and (due is None or self.next_probe < due):
            due = self.next_probe
        return due

    def process(self) -> None:
        prev, _state.current = _state.current, self
        self.dispatching = True
        try:
            self._process()
            while self.lost_queue:
                self._on_lost(self.lost_queue.pop(0))
                if self.inbox or self.ready:
                    self._process()
            if self.retire is not None and self.relay_to is None and self.active == 0 \
                    and not self.ready and not self.inbox:
                self._hand_over()  # retiring, and done with what it had
        except INTERRUPTS as e:
            if self.id == 0 and self.interrupted_call is not None:
                # a method of context 0, interrupted: the interrupt goes on
                # to main, and the call fails with it (main may catch it and
                # go on: nothing must wait for that call for ever)
                self.interrupted(e)
            raise
        finally:
            self.dispatching = False
            _state.current = prev
            self.transport.flush()
            if self.undetached and not self.serving_forever:
                self.kept_copies()  # whoever called may be user code (main, on context 0)

    def _process(self) -> None:
        inbox = self.inbox
        stop = self.stop_when
        while True:
            while inbox:
                if stop is not None and stop():
                    break  # (inproc) the rest can wait: see stop_when
                src, bufs, load = inbox.popleft()
                try:
                    self.loads[src] = load
                except IndexError:  # _heard's case, inline: the commonest path of all
                    self._heard(src, load)
                if type(bufs) is tuple:  # a call this context made to itself (see issue)
                    if self.relay_to is None:
                        if bufs[0] == CALL:
                            self._on_call(src, bufs)
                        else:  # (another message to itself: ask_stats)
                            self.dispatch(src, bufs)
                        continue
                    data, more = _encode(bufs)  # relayed: it leaves as any frame does
                    bufs = [data, *more]
                b0 = bufs[0]
                if self.relay_to is not None:
                    op = _peek_op(b0)
                    if op not in (RETIRE_ACK, RETIRED):
                        if op == CALL and self.shrinks:
                            bufs = self._whole_call(src, bufs)
                        self._relay_frame(bufs)
                        continue
                if self.undetached and (b0[0] == _V or b0[0] == _W):
                    self.kept_copies()  # a value may wake user code (a callback, a guard)
                if b0[0] == _V:
                    _, ok, a0, a1 = _VGET.unpack_from(b0)
                    data = bufs[1] if len(bufs) > 1 else memoryview(b0)[_VGET.size:]
                    self._on_value(((a0, a1), None), ok, data, bufs[2:])
                    continue
                if b0[0] == _W:
                    _, ok, a0, a1, c0, c1 = _VARC.unpack_from(b0)
                    data = bufs[1] if len(bufs) > 1 else memoryview(b0)[_VARC.size:]
                    self._on_value(((a0, a1), (c0, c1)), ok, data, bufs[2:])
                    continue
                try:
                    msg = _rsr_msg(bufs) if b0[0] == _R else _ploads(b0, buffers=bufs[1:])
                except Exception as e:
                    msg = self._undecodable(src, bufs, e)
                    if msg is None:
                        continue
                op = msg[0]
                if self.undetached and op not in _NO_USER_CODE:
                    self.kept_copies()
                if op == CALL:
                    self._on_call(src, msg)
                elif op == RSR and HANDLERS.get(RSR) is _serve_rsr:
                    self._on_rsr(msg)  # the next commonest, without the dispatch
                else:
                    self.dispatch(src, msg)
            while self.lost_queue:
                # after the frames read before the loss, and before the threads
                # resume: one that polls (mf.poll()) sees the loss too, not only
                # one that waits for a future
                self._on_lost(self.lost_queue.pop(0))
            ready = self.ready
            if ready and self.undetached:
                self.kept_copies()
            while ready:
                w = ready.popleft()
                g = w.g
                if g.switch(w.value) is DONE:  # self.resume(g, value), inline
                    self.pool.put(g)
            if not self.timers:
                return
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, w = heapq.heappop(self.timers)
                w.wake(_TIMEOUT)
            if not ready:
                return
            # a thread woken by a timer: once more, from the top (a loop, not a
            # call: a thread that polls in a loop is woken again and again)

    def resume(self, g, value) -> None:
        r = g.switch(value)
        if r is DONE:
            self.pool.put(g)

    def spawn(self, fn, *args) -> None:
        pool = self.pool
        g = pool.free.pop() if pool.free else pool.get()
        if getcurrent() is not self.root:
            # from a worker (a thread's handler that opened a guard, say): the
            # new thread's end and its waits switch to the root, not back
            # here, so it starts from the engine's next step instead
            Waiter(self, g).wake([fn, args])
            return
        # a list, which the worker empties: see Worker._loop
        if g.switch([fn, args]) is DONE and len(pool.free) < pool.keep:
            pool.free.append(g)  # pool.put(g)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, src: int, msg: tuple) -> None:
        # CALL, the commonest, is handled in _process before this
        handler = HANDLERS.get(msg[0])
        if handler is not None:
            if msg[0] in _FOREIGN:
                self.run_foreign(handler, src, msg)
            else:
                handler(self, src, msg)
        else:
            print(f"macroflow: context {self.id} got a message with opcode {msg[0]!r} from "
                  f"context {src}, which nothing registered; dropped", file=sys.stderr)

    def run_foreign(self, handler: Handler, src: int, msg: tuple) -> Any:
        """Run the handler of an opcode registered outside macroflow: what
        it raises is said on stderr and the message dropped; the context
        serves on (an error of macroflow's own handlers ends the context, as
        a bug of the runtime)."""
        try:
            return handler(self, src, msg)
        except INTERRUPTS:
            raise
        except BaseException as e:
            if isinstance(e, errors.Terminated):
                raise
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            print(f"macroflow: context {self.id}: the handler of opcode {msg[0]} "
                  f"({_OWNERS.get(msg[0])}) raised on a message from context {src}; the "
                  f"message was dropped and the context serves on:\n{tb}", file=sys.stderr,
                  end="")
            self.stats.handler_errors += 1
            return None

    def _undecodable(self, src: int, bufs: List[Any], e: BaseException) -> Optional[tuple]:
        """A message that could not be unpickled here (a class this process
        cannot import, a ``__setstate__`` that raises). A call is still run,
        as a call that fails with the reason, so its future does not wait
        forever; anything else is reported on stderr and dropped."""
        msg = marshal.salvage(bufs[0], bufs[1:])
        if not (type(msg) is tuple and len(msg) == 10 and msg[0] == CALL):
            print(f"macroflow: context {self.id} could not decode a message from "
                  f"context {src}: {e!r}", file=sys.stderr)
            return None
        _, fid, kind, target, method, _args, _kw, _arcs, route, caller = msg
        number = None
        if kind in self.shrinks and type(target) is tuple and target \
                and type(target[0]) is tuple and len(target[0]) == 2:
            # a class sent with the number its later calls name it by (see
            # CallKind.outgoing): what stands for it here is kept under it
            number, cls = target[0]
            target = (cls,) + target[1:]
        what = f"the arguments of {method}()" if method else "the constructor's arguments"
        undecoded = [x is marshal.StandIn or isinstance(x, marshal.StandIn)
                     for x in (target if type(target) is tuple else ())]
        if any(undecoded):
            what = f"the class or {what}"  # (one message: which part failed is not known)
        err = errors.CallError(f"context {self.id} could not unpickle {what}, sent by "
                               f"context {src}: {type(e).__name__}: {e}")
        if any(undecoded):
            # a class this process cannot import or rebuild (sent by value,
            # by another version of cloudpickle, say), in a persistent
            # object's target or a regular one's: one whose methods fail
            # with the reason, the target's shape kept (a regular one's was
            # cut to three items, which ended the context)
            target = tuple(_Unreadable.of(err) if u else x for x, u in zip(target, undecoded))
        if number is not None:
            target = ((number, target[0]),) + target[1:]
        return self.failing((CALL, fid, kind, target, method, None, None, None, route, caller),
                            err)

    def _on_call(self, src, msg) -> None:
        if msg[2] in self.shrinks:  # (before anything may pass it on)
            msg = self.call_kinds[msg[2]].incoming(msg, src)  # type: ignore[attr-defined]
        if self.retire is not None:
            kind = self.call_kinds.get(msg[2])
            if kind is not None:
                msg = kind.refuse(msg)
        _, fid, kind, target, method, args, kwargs, arcs, route, caller = msg
        call = Call(fid, kind, target, method, args, kwargs, arcs, route, caller)
        slot = self.slots.get(fid)
        if slot is None:
            slot = self.slots[fid] = Slot()
        elif slot.alias is not None and slot.keep is None:
            self._came_back(slot)
        slot.call = call
        if src == fid[0] and fid[1] > self.seen.get(src, 0):
            self.seen[src] = fid[1]
            if self.call_watch and src in self.call_watch:
                self.call_watch.pop(src)(src)
        try:
            handler = self.call_kinds[kind]
        except KeyError:
            self._unknown_kind(call, src)
            return
        if handler.moves and handler.arrived(call, msg, src):
            return  # passed on to another context
        if src != self.id:
            self.active += 1
        if arcs:
            tokens = self.tokens
            failed = None
            for arc in arcs:  # (label, home), or (label, home, positions)
                label, home = arc[0], arc[1]
                tok = tokens.get(label)
                if tok is not None:  # (an exception its issuer sent ahead of the call)
                    if not tok[0]:
                        failed = tok[1]
                    continue
                if self.kept and home != self.id:
                    kept = self.kept.get(label[0])
                    if kept is not None:  # pulled here before: a copy of it (see _keep)
                        self.kept.move_to_end(label[0])
                        tokens[label] = (True, kept[0])
                        self.stats.values_reused += 1
                        # its home counts the arc served all the same
                        self.send_forward(home, label[0], -1, label)
                        continue
                if home in self.lost and home not in self.heirs:
                    failed = errors.ContextLost(home, self.lost[home])
                    tokens[label] = (False, failed)
                    continue
                self.awaiting[label] = call
                call.missing += 1
                # pull the argument straight from its producer
                if home == self.id:
                    self._on_forward(label[0], self.id, label)
                else:
                    # (a call that may run elsewhere, a stateless one, moves
                    # only as it arrives, or once it has every argument:
                    # never with a pull outstanding, so it may share one)
                    pull = self.pulls.get(label[0])
                    if pull is not None and pull[0] == home:
                        # the value is on its way here for another call: it
                        # comes once, for both (200 calls of one 8 MB future
                        # fetched 200 copies, and held them while they
                        # waited); the home counts this arc as served
                        pull.append(label)
                        self.send_forward(home, label[0], -1, label)
                    else:
                        self.pulls[label[0]] = [home, label]
                        self.send_forward(home, label[0], self.id, label)
                        if self.keep_max:
                            self._count_pull(label[0])
            if failed is not None and call.missing:
                self._fail_early(call, failed)
        handler.accept(call)

    def _unknown_kind(self, call: Call, src: int) -> None:
        # no model here serves it: fail it rather than leave its caller waiting
        if src != self.id:
            self.active += 1
        self._finish(call, False, errors.CallError(
            f"context {self.id} serves no call kind {call.kind!r} (for {call.method!r}); "
            f"it serves {sorted(self.call_kinds)}"))

    def _move(self, call: Call, dest: int, frame: tuple) -> None:
        """Hand ``call`` (received here, not started) to ``dest`` as ``frame``:
        its value will be there, and requests for it here are passed on."""
        slot = self.slots[call.fid]
        slot.call = None
        if dest >= self.size:
            self.grow(dest + 1)
        self.loads[dest] += 1
        self.stats.calls_transferred += 1
        for arc in call.arcs or ():
            # an argument that came before the call (an exception its issuer
            # sent) goes ahead of it: its new context would ask the issuer,
            # who does not hold it, and wait for ever
            tok = self.tokens.pop(arc[0], None)
            if tok is not None:
                self.send_value(dest, arc[0], *self._pickle_value(*_claimed(tok)))
        self.send(dest, frame)
        self._alias(call.fid, slot, call.fid, dest, None)
        if call.route & EAGER:
            # the new home sends the value to the caller unasked; should it be
            # lost first, this context tells the caller
            slot.subs.append((call.fid[0], (call.fid, None)))

    def _came_back(self, slot: Slot) -> None:
        # A call passed on from here has come back (transfer_limit allows it
        # to revisit a context). Its value will be here again: were the alias
        # kept, a request arriving from now on would be relayed around the
        # aliases, which lead back here, for ever, and never answered. What
        # was relayed meanwhile follows the aliases back here and is answered
        # (and counted) when it arrives, so it is forgotten now rather than
        # answered twice.
        slot.alias = None
        slot.subs = []
        slot.served = 0
        slot.returns += 1  # an alias it gets next is another one (see _on_forward)

    def _invoke(self, fn, call: Call, *pre) -> None:
        if fn is None:
            self._finish(call, False, errors.CallError(f"no method {call.method!r}"))
            return
        if call.arcs:
            try:
                args, kwargs = self._args(call)
            except BaseException as e:
                # an argument that failed, whatever its exception: one that
                # was interrupted failed with the interrupt (see interrupted),
                # which is no interrupt of this call's context
                self.stats.calls_executed += 1
                self._finish(call, False, e)
                return
        else:
            args, kwargs = call.args, call.kwargs
        try:
            if pre:
                args = pre + tuple(args)
            svc = self.service
            if svc is None:
                value = fn(*args, **kwargs) if kwargs else fn(*args)
                if type(value) is CoroutineType:  # an async def method: run it here
                    value = run_coroutine(value)
            else:  # the method's own code: the context serves meanwhile
                value = svc.run_user(fn, args, kwargs)
                if type(value) is CoroutineType:
                    value = svc.run_user(run_coroutine, (value,), None)
        except INTERRUPTS:
            raise  # Ctrl-C ends the program, it is not the call's exception
        except BaseException as e:
            self.stats.calls_executed += 1
            if not getattr(self.call_kinds.get(call.kind), "keeps_exit", False):
                e = errors.exited(f"{self._call_label(call)} on context {self.id}", e)
            self._finish(call, False, e)
            return
        st = self.stats
        st.calls_executed += 1
        fid = call.fid
        if type(value) in _PLAIN and call.route & EAGER and fid[0] != self.id \
                and not call.answered and not self.inbox and not self.heirs and not self.lost:
            # _finish's commonest case, inline: a small plain value its caller
            # waits for, sent to it in one buffer, kept here until released
            data = _pdumps(value, 5)
            slot = self.slots.get(fid)
            if len(data) <= EAGER_MAX and slot is not None and not slot.subs \
                    and not slot.released:
                self.active -= 1
                call.tokens = None
                call.answered = True
                slot.call = None
                st.values_sent += 1
                self.send_frame(fid[0], [_VGET.pack(_V, True, fid[0], fid[1]) + data])
                slot.state = FINISHED
                slot.ok, slot.data = True, data
                return
        self._finish(call, True, value)

    def _args(self, call: Call):
        if not call.arcs:
            return call.args, call.kwargs
        args = self._fill(call.args, call)
        kwargs = self._fill_kw(call)
        return args, kwargs

    def _fill_kw(self, call: Call):
        if not call.arcs or not call.kwargs:
            return call.kwargs
        return {k: _subst(v, call, self) for k, v in call.kwargs.items()}

    def _fill(self, args, call: Call):
        arcs = call.arcs
        if not arcs:
            return args
        if len(arcs[0]) == 3:  # by position (see _top_arcs)
            out = list(args)
            for label, _home, at in arcs:
                for i in at:
                    ok, v = call_token(call, label[0], self)
                    if not ok:
                        raise v
                    out[i] = v
            return out
        return tuple(_subst(a, call, self) for a in args)

    # ------------------------------------------------------------------ results
    def _pickle_value(self, ok: bool, value: Any, call: Optional[Call] = None):
        if ok and type(value) in _PLAIN:
            return True, _pdumps(value, 5), []  # the commonest: the C pickler's
        if ok:
            try:
                data, bufs = _encode(value)
                return True, data, bufs
            except Exception as e:  # a __reduce__ may raise anything
                shown = value
                if call is not None:
                    whose = f"the result of {self._call_label(call)} on context {self.id}"
                    # a model may wrap what the user's code returned (an SPMD run's)
                    unwrap = getattr(self.call_kinds.get(call.kind), "user_result", None)
                    if unwrap is not None:
                        shown = unwrap(value)
                else:
                    whose = "the result"
                value = errors.CallError(
                    f"{whose} ({type(shown).__name__}) could not be pickled: {e}")
        value = _portable_exception(value, self.id)
        try:
            data, bufs = _encode(value)
            # Exceptions are rare and many pickle but cannot be rebuilt (a
            # constructor with other arguments than it gives Exception): try
            # here, where the type and the message are still known.
            marshal.loads(data, bufs)
        except Exception:
            data, bufs = marshal.dumps(_stand_in(value))
        return False, data, bufs

    def send_error(self, dest: int, label, exc: BaseException) -> None:
        self.send_value(dest, label, *self._pickle_value(False, exc))

    def send_value(self, dest: int, label, ok: bool, data: Any, bufs: List[Any]) -> None:
        if dest < 0:
            return  # a request that only counts: nobody waits for its answer
        a, c = label
        if dest == self.id and c is None and self.relay_to is None:
            f = self._future_of(a)
            if f is not None and (not f._callbacks or _plain_callbacks(f._callbacks)):
                # a result for a future here is taken now, as the frame to
                # itself would be when read (its buffers copied: call-by-
                # value), not behind the calls queued here: results of this
                # context's calls to itself reach their futures in the order
                # the calls ended, whatever their type
                self._on_value(label, ok, data, [bytearray(_raw(b)) for b in bufs])
                return
        if c is None:
            head = _VGET.pack(_V, ok, a[0], a[1])
        else:
            head = _VARC.pack(_W, ok, a[0], a[1], c[0], c[1])
        if bufs:
            self.send_frame(dest, [head, data, *bufs])
        else:  # the common small value: one buffer, the transport's fast path
            self.send_frame(dest, [head + data])

    def answer(self, call: Call, value: Any) -> None:
        """Give ``call`` its result now (return-to-future); the method goes on."""
        if self.user and self.serving != _get_ident():
            return self._from_user(self.answer, call, value)
        self._finish(call, True, value, keep_running=True)  # (mf.rtf refuses a second)

    def _finish(self, call: Call, ok: bool, value: Any, keep_running: bool = False) -> None:
        slot = self.slots.get(call.fid)
        if not keep_running:
            self.active -= 1
            if call.tokens:
                call.tokens = None
            if slot is not None:
                slot.call = None
            if not ok and call.arcs:
                # the arguments it never took (it failed at an earlier one):
                # nothing else ever will
                for arc in call.arcs:
                    self.tokens.pop(arc[0], None)
        if call.answered:
            if not ok:  # nobody waits for it any more: said here, with whose it is
                print(f"macroflow: {self._call_label(call)} on context {self.id} raised after "
                      f"it had answered (rtf); its caller has its value:\n"
                      f"{format_remote(value, self.id)}", end="", file=sys.stderr)
            return
        call.answered = True
        fid = call.fid
        if slot is None:
            slot = self.slots[fid] = Slot()
        if ok and type(value) is Future:
            if value._state == FINISHED:
                ok, value = (value._exc is None), (value._value if value._exc is None else value._exc)
            elif value._fid == fid:
                # its value would be itself: every request for it would be
                # passed on to itself for ever
                ok, value = False, errors.DeadlockError(
                    f"{self._call_label(call)} returned its own future: its value would be "
                    f"itself, which nothing can ever produce")
            else:
                if call.route & EAGER:
                    slot.subs.append((fid[0], (fid, None)))
                self._alias(fid, slot, value._fid, value._home, value)
                return
        if ok and call.route & EAGER and not keep_running:
            # the common case, _pickle_value, _send_eager and send_value in
            # one: a small value its caller waits for goes straight to it in
            # one buffer (about 1 us a pipelined call, measured)
            try:
                if type(value) in _PLAIN:
                    data, bufs = _pdumps(value, 5), []
                else:
                    data, bufs = _encode(value)
            except Exception:
                pass  # _pickle_value below says why
            else:
                if fid[0] == self.id and not bufs and type(value) in _PLAIN and self.relay_to is None \
                        and self._local_value(fid, value, len(data) >= BIG_VALUE):
                    pass
                elif bufs or len(data) > EAGER_MAX:
                    self._send_eager(call, True, data, bufs)
                else:
                    st = self.stats
                    st.values_sent += 1
                    dest = fid[0]
                    if dest == self.id:
                        self.send_value(dest, (fid, None), True, data, [])  # (see there)
                    else:  # send_value, inline
                        frame = [_VGET.pack(_V, True, dest, fid[1]) + data]
                        if self.inbox or self.heirs or self.lost:
                            self.send_frame(dest, frame)
                        else:  # and send_frame's commonest case too (the batch's last reply)
                            try:
                                n = self.transport.send(dest, frame,
                                                        self.active + self.base_load)
                            except ConnectionError:
                                pass  # peer_lost has been (or will be) called with the reason
                            else:
                                st.messages_sent += 1
                                st.bytes_sent += n
                if slot.subs or slot.released:
                    self._complete(fid, slot, True, data, bufs)
                else:  # _complete, inline: nobody else asked, not released yet
                    slot.state = FINISHED
                    slot.ok, slot.data, slot.bufs = True, data, bufs
                if bufs:
                    self._keep_copy(fid, slot, bufs)
                return
        if ok and type(value) in _PLAIN and not keep_running and not slot.released:
            # a plain value nobody waits for unasked (a chain's link): kept,
            # and sent to whoever asked already, in one buffer each
            # (_pickle_value and _complete in one)
            data = _pdumps(value, 5)
            slot.state = FINISHED
            slot.ok, slot.data, slot.bufs = True, data, []
            if len(data) >= BIG_VALUE:
                self._big_value(fid)  # (see below)
            if slot.subs:
                subs, slot.subs = slot.subs, []
                st = self.stats
                for dest, label in subs:
                    st.values_sent += 1
                    self.send_value(dest, label, True, data, [])
            return
        ok, data, bufs = self._pickle_value(ok, value, call)
        # rtf: the caller is waiting while the method goes on, so the value
        # goes to it now, unasked, and leaves before the method continues
        if call.route & EAGER or keep_running:
            self._send_eager(call, ok, data, bufs)
        elif not slot.released and _pickled_size(data, bufs) >= BIG_VALUE:
            # a large value its issuer will not fetch (an argument of other
            # calls, say): its future's release is to come at once, or the
            # value would stay here until 63 more futures were dropped there
            self._big_value(fid)
        self._complete(fid, slot, ok, data, bufs)
        if bufs:
            self._keep_copy(fid, slot, bufs, at_once=keep_running)
        if keep_running:
            self.transport.flush()

    def _future_of(self, fid) -> Optional[Future]:
        """The future here that waits for the value of call ``fid``: one
        asked for, or one whose site is routed eagerly (held weakly); None."""
        f = self.asked.get(fid)
        if f is None:
            ref = self.eager.get(fid)
            f = None if ref is None else ref()
        return f

    def _local_value(self, fid, value: Any, big: bool) -> bool:
        """Give a plain (immutable) result of a call this context made to
        itself straight to its future, as :meth:`_take_value` does for one
        that came from elsewhere: no frame to itself, no decoding, no pass of
        the engine's loop (a local null call 26 -> 21 us, measured). False
        (send it as any value) when the future has user callbacks, which run
        from the engine's loop, not from the thread of the method that returned."""
        f = self._future_of(fid)
        if f is None:
            return False
        if f._callbacks and not _plain_callbacks(f._callbacks):
            return False
        self.asked.pop(fid, None)
        self.eager.pop(fid, None)
        if big:
            f._big = True  # its pickle, kept here, is released at once (see _on_value)
        f._set(True, value)
        return True

    def _keep_copy(self, fid, slot: Slot, bufs: List[Any], at_once: bool = False) -> None:
        # A result's large buffers are views of the method's objects, and the
        # value is kept until its caller asks for it (see _detached). They are
        # copied before the next user code runs here, not now: by then the
        # value has usually been asked for, sent and released (a 16 MB result
        # returned to a caller that waits for it), and nothing is copied at all.
        # (Sending copies them out at once, on every transport: what was sent
        # already needs nothing.)
        if self.slots.get(fid) is not slot:
            return  # sent and released already
        if at_once or self.service is None or (
                self.exposers and any(m.exposed(bufs) for m in self.exposers)):
            # the method goes on at once (rtf); or one thread runs every
            # context (inproc), and the next user code runs without this
            # engine knowing; or the result is (in) memory that other contexts
            # write without running code here (mf.put)
            slot.bufs = _detached(bufs)
            self.stats.results_copied += 1
        else:
            self.undetached.append((fid, slot, bufs))

    def kept_copies(self) -> None:
        """Copy the large buffers of the results kept here that are still views
        of their methods' objects (see :func:`_detached`): called before user
        code runs on this context (a method starts or resumes, a callback or a
        handler runs, main goes on), so that no later change of those objects
        changes a value already returned."""
        pending, self.undetached = self.undetached, []
        slots = self.slots
        for fid, slot, bufs in pending:
            if slots.get(fid) is slot and slot.bufs is bufs:
                slot.bufs = _detached(bufs)
                self.stats.results_copied += 1

    def _send_eager(self, call: Call, ok: bool, data, bufs) -> None:
        if _pickled_size(data, bufs) <= EAGER_MAX or (
                call.fid[0] == self.id and self._future_of(call.fid) is not None):
            # (a large one to a future here too: see send_value)
            self.stats.values_sent += 1
            self.send_value(call.fid[0], (call.fid, None), ok, data, bufs)
        else:
            self.send(call.fid[0], (READY, call.fid))

    def _complete(self, fid, slot: Slot, ok, data, bufs) -> None:
        slot.state = FINISHED
        slot.ok, slot.data, slot.bufs = ok, data, bufs
        if slot.subs:
            subs, slot.subs = slot.subs, []
            for dest, label in subs:
                self._send_value(dest, label, slot)
        if slot.released:
            self._maybe_drop(fid, slot)

    def _send_value(self, dest: int, label, slot: Slot) -> None:
        if dest < 0:
            return  # a request that only counts (see Engine._on_call's sharing)
        self.stats.values_sent += 1
        self.send_value(dest, label, slot.ok, slot.data, slot.bufs)

    def _alias(self, fid, slot: Slot, to_fid, home: int, keep: Any) -> None:
        # Elaboration and transfer: the value will come from elsewhere; pass
        # every request for it on, so no thread here waits for it.
        slot.alias = (to_fid, home)
        slot.keep = keep
        subs, slot.subs = slot.subs, []
        for dest, label in subs:
            self._relay(slot, to_fid, home, dest, label)
        self._maybe_drop(fid, slot)

    def _relay(self, slot: Slot, to_fid, home, dest, label, trail: Any = None) -> None:
        if home == self.id:
            self._on_forward(to_fid, dest, label)
        elif home in self.lost and home not in self.heirs:
            self.send_error(dest, label, errors.ContextLost(home, self.lost[home]))
        else:
            # remembered: if home is lost before it answers, the requester is told
            if dest >= 0:
                slot.subs.append((dest, label))
            self.send_forward(home, to_fid, dest, label, trail)

    def _on_forward(self, fid, dest, label, trail: Any = None) -> None:
        # A loop, not recursion: a chain of aliases (a method returning a call
        # that returns a call ...) may be as long as the computation is deep.
        #
        # A request following aliases keeps a trail, (mark, steps, power),
        # for Brent's cycle finding, and carries it when it is passed on to
        # another context: a request that comes back to an alias it followed
        # (futures, on one context or several, that resolve to one another)
        # meets its mark within a few rounds of the cycle, however long the
        # chain before it, in a message of constant size. Another request
        # for the same future starts its own trail.
        slots = self.slots
        while True:
            slot = slots.get(fid)
            if slot is None:
                slot = slots[fid] = Slot()  # the call itself has not arrived yet
            if label[1] is not None:
                slot.served += 1
            alias = slot.alias
            if alias is None:
                if dest < 0:
                    # an arc the consumer shares with another one's value:
                    # counted, nothing sent (see Engine._on_call)
                    if slot.state == FINISHED:
                        self._maybe_drop(fid, slot)
                    return
                if slot.state == FINISHED:
                    self._send_value(dest, label, slot)
                    self._maybe_drop(fid, slot)
                else:
                    slot.subs.append((dest, label))
                return
            to_fid, home = alias
            # (a call passed on may come back and be passed on again: a request
            # chasing it meets this alias again, a new one, which is no cycle)
            here = (self.id, fid, slot.returns)
            if trail is None:
                trail = (here, 0, 1)
            else:
                mark, steps, power = trail
                if mark == here:
                    # no value can ever come, and following them would never end
                    self.send_error(dest, label, _alias_cycle(fid))
                    self._maybe_drop(fid, slot)
                    return
                steps += 1
                trail = (here, 0, 2 * power) if steps == power else (mark, steps, power)
            if home != self.id:
                self._relay(slot, to_fid, home, dest, label, trail)
                self._maybe_drop(fid, slot)
                return
            self._maybe_drop(fid, slot)
            fid = to_fid

    def _maybe_drop(self, fid, slot: Slot) -> None:
        if slot.released and slot.served >= slot.expect:
            self.slots.pop(fid, None)
            if self.undetached:  # (its views would keep the object's memory alive)
                self.undetached = [e for e in self.undetached if e[1] is not slot]
            alias = slot.alias
            if alias is not None and slot.keep is None and alias[1] != self.id:
                # a transferred call: its value lives where the call moved to
                slot.alias = None
                if alias[1] not in self.lost or alias[1] in self.heirs:
                    self.send(alias[1], (RELEASE, _pack_release([(alias[0], slot.expect)])))

    def _big_value(self, fid) -> None:
        """Tell ``fid``'s issuer that its value here is large (see BIG)."""
        if fid[0] == self.id:
            self._on_big(fid)
        elif fid[0] not in self.lost or fid[0] in self.heirs:
            self.send(fid[0], (BIG, fid))

    def _on_big(self, fid) -> None:
        if any(r[1] == fid for r in self.releases):
            self.n_releases = max(self.n_releases, RELEASE_BATCH)  # dropped already
            self.big_dropped = True
        elif len(self.big) < BIG_MAX:
            self.big.add(fid)  # noted on the future when it is dropped (release)

    def ask_stats(self, dest: int) -> Future:
        """A future of context ``dest``'s counters (see :meth:`snapshot`).

        ``dest`` answers at once, even while a method computes there (on
        ``inproc``, where nothing runs beside a method, when it is its turn).
        """
        if self.user and self.serving != _get_ident():
            return self._from_user(self.ask_stats, dest)
        fid = (self.id, next(self.seq))
        f = Future(self, fid, dest, None, None)
        f._escaped = True  # its home keeps nothing: nothing to release
        f._asked = True
        self.asked[fid] = f
        if dest == self.id:
            # after what this context sent itself before (remote service
            # requests, calls): they are counted then
            self.inbox.append((self.id, (STATS, fid), self.load()))
        else:
            self.send(dest, (STATS, fid))
        return f

    def _on_release(self, items) -> None:
        slots = self.slots
        for fid, arcs in items:
            slot = slots.get(fid)
            if slot is None:
                if not arcs and fid[1] <= self.seen.get(fid[0], 0):
                    continue  # its call was served here, its value dropped already
                # consumers will still ask for it, or its call is read but not
                # taken yet (a release served while a method computes passes
                # the calls queued behind the method): kept for it, released
                slot = slots[fid] = Slot()
            if slot.state == FINISHED and not arcs and slot.alias is None \
                    and not self.undetached:
                del slots[fid]  # _maybe_drop's commonest case, inline: a value nobody else asks for
                continue
            slot.released = True
            slot.expect = arcs
            if slot.state == FINISHED or slot.alias is not None:
                self._maybe_drop(fid, slot)

    def _on_value(self, label, ok, data, bufs) -> None:
        try:
            value = _ploads(data, buffers=bufs)  # marshal.loads
        except Exception as e:
            ok, value = False, errors.CallError(f"{self._value_label(label)} could not be "
                                                f"unpickled on context {self.id}: {e!r}")
        if not ok:
            value = _restore_exception(value)
        if label[1] is None:
            fid = label[0]
            f = self.asked.pop(fid, None)
            ref = self.eager.pop(fid, None)
            if f is None and ref is not None:
                f = ref()
            if f is not None:
                # (large bytes or str travel in band, arrays out of band).
                # A value with out-of-band buffers, however small, is
                # released at once too: its home keeps views of the method's
                # objects, which it would copy before its next user code if
                # the release came after the next call (see kept_copies). A
                # release costs less than that copy from 64 KiB up (one
                # measured pass-and-return loop: 256 KiB 520 -> 245 us).
                if bufs or len(data) >= BIG_VALUE:
                    f._big = True
                f._set(ok, value)
            elif ref is None:
                # sent before it was asked for (rtf): keep it for when it is
                if len(self.early) >= EARLY_MAX:
                    del self.early[next(iter(self.early))]
                self.early[fid] = (ok, value)
            return
        call = self.awaiting.pop(label, None)
        if ok and self.pulled and self.pulled.get(label[0], 0) > 1:
            self._keep(label[0], value, data, bufs)
        if self.pulls:
            pull = self.pulls.get(label[0])
            if pull is not None and pull[1] == label:
                del self.pulls[label[0]]
                if len(pull) > 2:
                    self._share(call, pull[1:], ok, value)
                    return
        if call is None and label in self.unwanted:
            self.unwanted.discard(label)  # its call failed already (see _fail_early)
            return
        self.tokens[label] = (ok, value)
        if call is not None:
            call.missing -= 1  # self._token_arrived(call, label, ok, value), inline
            if not call.missing:
                self.call_kinds[call.kind].arguments_ready(call)
            elif not ok:
                self._fail_early(call, value)
                self.call_kinds[call.kind].arguments_ready(call)

    def _count_pull(self, fid) -> None:
        pulled = self.pulled
        pulled[fid] = pulled.pop(fid, 0) + 1
        if len(pulled) > PULLED_MAX:
            pulled.popitem(last=False)

    def _keep(self, fid, value: Any, data: Any, bufs: List[Any]) -> None:
        """Keep a copy of ``value``, the value of ``fid`` pulled here a second
        time, if it is large: the calls of this context that take it from
        now on get a copy of that (each its own, as by value), and its home
        sends it no more. Without it, one 8 MB array given to 1,000 calls
        placed on three contexts crossed 667 times (5.3 GB). At most
        ``keep_max`` bytes are kept (MACROFLOW_KEEP_MB), the least recently
        used dropped first; a value is a future's for good, so what is kept
        is never stale, only perhaps no longer wanted."""
        if fid in self.kept:
            return
        n = len(data)
        for b in bufs:
            n += memoryview(b).nbytes
        if n < KEEP_MIN or n > self.keep_max:
            return
        try:
            copy = _copy_value(value)  # (the value itself goes to the calls waiting now)
        except Exception:
            return
        self.kept[fid] = (_Shared(copy, 1 << 62), n)  # (never its last user: copies only)
        self.kept_bytes += n
        while self.kept_bytes > self.keep_max:
            _, (_, m) = self.kept.popitem(last=False)
            self.kept_bytes -= m

    def _value_label(self, label) -> str:
        """Whose value a VALUE frame under ``label`` carries, in the user's
        terms: "the result of Store.load (computed on context 1)", "an
        argument of Box.take"."""
        fid, consumer = label
        if consumer is None:
            f = self._future_of(fid)
            name = site_label(f._site) if f is not None else None
            if name is not None:
                return f"the result of {name} (computed on context {f._home})"
            return "a value"
        call = self.awaiting.get(label)
        if call is not None:
            return f"an argument of {self._call_label(call)}"
        return "a value"

    def _share(self, call: Optional[Call], labels: List[Any], ok: bool, value: Any) -> None:
        """One value pulled for the calls of ``labels`` (the first's is ``call``):
        each takes a copy of its own, the last the value itself (see call_token)."""
        tok = (True, _Shared(value, len(labels))) if ok else (False, value)
        for i, label in enumerate(labels):
            c = call if i == 0 else self.awaiting.pop(label, None)
            if c is not None:
                self._token_arrived(c, label, *tok)
            else:
                self.unwanted.discard(label)  # (see _fail_early)
                if ok:
                    tok[1].left -= 1  # (a call that is gone takes none)

    def _token_arrived(self, call: Call, label, ok, value) -> None:
        self.tokens[label] = (ok, value)
        call.missing -= 1
        if call.missing:
            if ok:
                return
            self._fail_early(call, value)
        self.call_kinds[call.kind].arguments_ready(call)

    def _fail_early(self, call: Call, exc: BaseException) -> None:
        """An argument of ``call`` failed while others are still to come:
        the call can never run, so it takes that error for each of them now
        and is ready (it fails when its model starts it), rather than wait
        for values it will not use (a computation of minutes, or the end of
        a wait for a context that was lost). What comes for them is dropped."""
        awaiting, tokens = self.awaiting, self.tokens
        for arc in call.arcs:
            label = arc[0]
            if awaiting.get(label) is call:
                del awaiting[label]
                tokens[label] = (False, exc)
                self.unwanted.add(label)
        call.missing = 0

    def _on_ready(self, fid) -> None:
        ref = self.eager.pop(fid, None)
        f = ref() if ref is not None else None
        if f is None or f._state == FINISHED:
            return
        f._ready_remote = True
        if f._asked:
            self.forward(f, self.id, (fid, None))

    # ------------------------------------------------------------------ removal
    # Removing context c (launch.remove_context, on context 0, which is the heir):
    # RETIRE to every context (no new work goes to c); c finishes what it has
    # and refuses what comes, then sends HANDOVER (its values, its objects'
    # labels) to the heir; the heir sends RETIRED to every context, which
    # answers c with RETIRE_ACK and from then on sends what was for c to the
    # heir. c passes on what still comes until every ack is in, then LEFT.
    def remove(self, cid: int, heir: int = 0) -> None:
        """Start removing context ``cid`` (see launch.remove_context)."""
        self.retiring.add(cid)
        for c in self.context_ids():
            if c != self.id:
                self.send(c, (RETIRE, cid, heir))
        self.transport.flush()

    def _on_retire(self, cid: int, heir: int) -> None:
        self.retiring.add(cid)
        if cid == self.id and self.retire is None:
            self.retire = {"heir": heir, "members": None, "acks": set()}
            for model in self.models.values():
                model.retiring()

    def failing(self, msg: tuple, error: BaseException) -> tuple:
        """The CALL ``msg`` made into one that fails with ``error`` when its
        turn comes (its arguments raise it), in its place among its caller's
        calls. For call kinds refusing calls, and for calls that could not be
        unpickled."""
        _, fid, kind, target, method, _args, _kw, _arcs, route, caller = msg
        return (CALL, fid, kind, target, method, _Unreadable.of(error)(), {}, (),
                route | PINNED, caller)

    def _hand_over(self) -> None:
        heir = self.retire["heir"]
        slots = []
        for fid, slot in self.slots.items():
            data = slot.data
            slots.append((fid, slot.state, slot.ok,
                          None if data is None else bytes(_raw(data)),
                          [bytes(_raw(b)) for b in slot.bufs], slot.subs, slot.alias,
                          slot.released, slot.served, slot.expect))
        models = {name: m.hand_over() for name, m in self.models.items()}
        self.relay_to = heir
        self.send(heir, (HANDOVER, slots, models))
        self.transport.flush()

    def _on_handover(self, cid: int, slots: list, models: dict) -> None:
        for fid, state, ok, data, bufs, subs, alias, released, served, expect in slots:
            slot = self.slots.get(fid)
            if slot is not None and slot.state == FINISHED:
                continue  # it is here already
            new = self.slots[fid] = Slot()
            new.alias, new.released, new.served, new.expect = alias, released, served, expect
            new.subs = (slot.subs if slot is not None else []) + list(subs)
            if state == FINISHED and alias is None:
                self._complete(fid, new, ok, data, bufs)  # answers who asked meanwhile
            else:
                new.state, new.ok, new.data, new.bufs = state, ok, data, bufs
        for name, data in models.items():
            if data is not None and name in self.models:
                self.models[name].take_over(cid, data)
        members = [c for c in self.context_ids() if c != cid]
        for c in members:
            if c != self.id:
                self.send(c, (RETIRED, cid, self.id, None))
        self.send(cid, (RETIRED, cid, self.id, members))
        self._mark_removed(cid, self.id)
        self.transport.flush()

    def _on_retired(self, cid: int, heir: int, members: Optional[list]) -> None:
        if cid == self.id:  # the heir's own ack, with whom else to wait for
            self.retire["members"] = set(members)
            self._on_retire_ack(heir)
            return
        self.send(cid, (RETIRE_ACK,))  # before what follows goes to the heir
        self._mark_removed(cid, heir)

    def _mark_removed(self, cid: int, heir: int) -> None:
        # lost, for everything that counts live contexts; but what is sent
        # there goes to the heir (send_frame), and nothing of it fails
        self.lost.setdefault(cid, "removed by mf.remove_context")
        self.heirs[cid] = heir
        self.retiring.discard(cid)

    def _on_retire_ack(self, src: int) -> None:
        r = self.retire
        if r is None:
            return
        r["acks"].add(src)
        members = r["members"]
        if members is not None and all(c in r["acks"] or c in self.lost for c in members):
            self.send(0, (LEFT,))
            self.transport.flush()
            self.stopping = True

    def _whole_call(self, src: int, bufs: List[Any]) -> List[Any]:
        """A CALL frame to relay to the heir, with the target its sender may
        have shrunk for this context made whole (see CallKind.outgoing): the
        heir could not make it whole itself."""
        try:
            msg = _ploads(bufs[0], buffers=bufs[1:])
        except Exception:
            return bufs  # (the heir says what is wrong with it)
        if msg[2] not in self.shrinks:
            return bufs
        data, more = _encode(self.call_kinds[msg[2]].incoming(msg, src))  # type: ignore
        return [data, *more]

    def _relay_frame(self, bufs: List[Any]) -> None:
        # received buffers may be reused once this returns: copies go on
        self.send_frame(self.relay_to, [bytes(_raw(b)) for b in bufs])

    # ------------------------------------------------------------------ RSR
    def _on_rsr(self, msg) -> None:
        _, gid, handler, args, thread = msg
        target = self.resolve(gid)
        if target is _MISSING:
            self._hold_rsr(gid, handler, args, thread)
            return
        if thread == "inline":
            self.in_inline = True
            try:
                self._run_rsr(gid, handler, target, args)
            finally:
                self.in_inline = False
        else:
            self.spawn(self._run_rsr, gid, handler, target, args)

    def _run_rsr(self, gid, handler, target, args) -> None:
        try:
            r = handler(target, *args)
            if type(r) is CoroutineType:  # an async def handler: run it, as a method is
                run_coroutine(r)
        except (Exception, SystemExit):  # (an exit in a handler ends nothing: reported)
            self._rsr_raised(handler)
        if handler is not look_again:
            self.stats.rsr_executed += 1
        model = self.pointer_kinds.get(gid[0])
        if model is not None and model.notes_served:
            model.served(gid[0], gid[1])  # the handler may have changed its target

    def _hold_rsr(self, gid, handler, args, thread: str) -> None:
        # what the pointer names may not exist yet (an object whose
        # constructor is on its way, or waits for its arguments): its model
        # keeps the request and runs it once it does
        model = self.pointer_kinds.get(gid[0])
        if model is None and gid[0] != "export":
            self._rsr_dropped(gid, handler, f"no model here serves pointers of kind "
                                            f"{gid[0]!r} (it serves {sorted(self.pointer_kinds)})")
        elif model is None:
            self._rsr_dropped(gid, handler)
        elif not model.hold(gid[0], gid[1], functools.partial(
                self._run_held_rsr, gid, handler, args, thread)):
            why = model.why_not(gid[0], gid[1])
            if why:
                self._rsr_dropped(gid, handler, why)
            else:
                self._rsr_dropped(gid, handler)

    def _run_held_rsr(self, gid, handler, args, thread: str, target: Any) -> bool:
        # a model's release of a held request; True: it starts a thread later
        if target is _MISSING:
            self._rsr_dropped(gid, handler, "its object was never made (its constructor "
                                            "failed, or never came)")
            return False
        if thread == "new":
            self.spawn(self._run_rsr, gid, handler, target, args)
            return True
        self._run_inline(handler, target, args)
        return False

    def _run_inline(self, handler, target, args) -> None:
        # a handler that must not wait (in_inline makes a wait raise), run
        # where the engine, or the service mechanism, stands
        inline, self.in_inline = self.in_inline, True
        try:
            r = handler(target, *args)
            if type(r) is CoroutineType:  # run to its end: one that awaits a pending future fails
                run_coroutine(r)
        except (Exception, SystemExit):  # (an exit in a handler ends nothing: reported)
            self._rsr_raised(handler)
        finally:
            self.in_inline = inline
        if handler is not look_again:
            self.stats.rsr_executed += 1

    def _rsr_raised(self, handler) -> None:
        # nobody waits for a request: its exception is reported here, saying
        # where and which handler (a handler sent by value has no file name),
        # from the handler's frames on
        print(f"macroflow: context {self.id}: remote service request handler "
              f"{handler_label(handler)} raised:", file=sys.stderr)
        print(errors.format_user(sys.exc_info()[1]), end="", file=sys.stderr)

    def _rsr_dropped(self, gid, handler,
                     why: str = "nothing is there (unexported, or its object destroyed)") -> None:
        self.stats.rsr_dropped += 1
        n = self.stats.rsr_dropped
        if n > DROPS_SAID:
            return  # (counted: a loop of requests to a pointer gone would flood stderr)
        ident = gid[1]
        shown = f"{ident[0]}.{ident[1]}" if type(ident) is tuple and len(ident) == 2 else repr(ident)
        more = (" (further requests dropped here are counted in mf.stats()'s rsr_dropped, "
                "not said)" if n == DROPS_SAID else "")
        print(f"macroflow: context {self.id}: remote service request "
              f"{handler_label(handler)} for {gid[0]} {shown} was not run: {why}{more}",
              file=sys.stderr)

    def _on_rsr_now(self, src: int, msg: tuple) -> None:
        # run as it arrives, by the engine or by the service mechanism while a
        # method computes: like an interrupt, it must not wait
        _, gid, handler, args = msg
        target = self.resolve(gid)
        if target is _MISSING:
            self._hold_rsr(gid, handler, args, "now")
            return
        self._run_inline(handler, target, args)
        model = self.pointer_kinds.get(gid[0])
        if model is not None:
            # the handler may have changed its target; with self._in_serve,
            # nothing may start from here (a method computes, or called mf.poll())
            model.served(gid[0], gid[1])

    # ------------------------------------------------------------------ service while busy
    def _from_user(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the engine method ``fn`` for user code (a method issuing a call,
        waiting, answering): while it runs, the service mechanism, which may
        run whenever user code does, stays out of the engine. The methods that
        user code calls start with ``if self.user and self.serving != _get_ident()``.
        An engine with a service has the service's ``run_engine`` here instead
        (an attribute of the instance), which does the same in one call."""
        return self.service.run_engine(fn, *args)

    def post(self, dest: int, header: tuple) -> None:
        """Send one message on behalf of user code (a remote service request)."""
        if self.user and self.serving != _get_ident():
            return self._from_user(self.post, dest, header)
        self.send(dest, header)

    def post_frame(self, dest: int, parts: List[Any]) -> None:
        """Send one encoded frame on behalf of user code (see :func:`rsr_frame`)."""
        if self.user and self.serving != _get_ident():
            return self._from_user(self.send_frame, dest, parts)
        self.send_frame(dest, parts)

    def poll(self) -> int:
        """Serve the messages that have arrived and need no user code (see
        SERVED_WHILE_BUSY); the others stay queued. Returns how many were served."""
        if self.user and self.serving != _get_ident():
            return self._from_user(self.poll)
        return self.serve_arrived()

    def poll_user(self) -> int:
        """What ``mf.poll()`` does for user code: serve what needs no user code
        and, from a call of a kind that yields on poll, let the engine run what
        has arrived for one round. Returns how many messages were served."""
        served = self.poll()
        g = getcurrent()
        call = getattr(g, "call", None)
        if call is None:
            if g is self.root and not self.dispatching and not self.in_guard:
                # main computing: one round of what a wait would serve (remote
                # service requests run inline or in new threads, calls to
                # this context's objects), as main's compute loop expects
                served += self._one_round()
            return served
        kind = self.call_kinds.get(call.kind)
        if (self.inbox or self.lost_queue or self.driver is not self) \
                and getattr(kind, "yields_on_poll", False):
            if self.inbox or self.lost_queue:  # (a lost context: its futures fail)
                self.yield_now()
            elif self.driver.pending():
                # inproc: the other contexts share this thread; they run only if it yields
                self.yield_now(after_round=True)
        if kind is not None:
            kind.polled(call)
        return served

    def _one_round(self) -> int:
        """From main (the engine's root, not dispatching): let every context
        this thread drives run what has arrived, once; how many messages
        this context took."""
        before = len(self.inbox)
        if self.driver is self:
            if self.inbox or self.ready or self.lost_queue:
                self.process()
        elif self.driver.pending():
            once = iter((False, True))  # (inproc: the others share this thread)
            self.driver.run_until(lambda: next(once, True), whole_rounds=True)
        return max(0, before - len(self.inbox))

    def run_pollers(self) -> bool:
        """Call every poller once, dropping those that return True; True if any did."""
        done = False
        pollers = self.pollers
        for fn in list(pollers):
            if fn():
                pollers.remove(fn)
                done = True
        return done

    def yield_now(self, after_round: bool = False) -> None:
        """From a lightweight thread: let the engine serve what has arrived,
        for one round, then go on (elsewhere, nothing happens). With
        ``after_round``, the driver shared with other engines (inproc) lets
        them all have a turn first."""
        if self.user and self.serving != _get_ident():
            return self._from_user(self.yield_now, after_round)
        if self.in_guard is not None:
            self.guard_waits("(it polls)")
        w = getcurrent()
        if isinstance(w, Worker) and w.engine is self:
            if after_round:
                self.driver.after_round(Waiter(self, w))
            else:
                # a timer due now, not the ready queue: the engine may be resuming
                # ready threads, and would resume this one before the inbox; its
                # timers come after both
                self.add_timer(0.0, Waiter(self, w))
            self.park()

    def serve_arrived(self) -> int:
        """Take what the transport has received; serve, in arrival order, the
        messages that need no user code, and leave the others in the inbox in
        their order. The caller keeps the engine's own loop out meanwhile
        (it runs in user code's stead, or the engine is in user code)."""
        if self._in_serve:
            return 0  # mf.poll() from an at-once handler
        self._in_serve = True
        inbox = self.inbox
        try:
            if self.transport is not None:
                self.transport.poll(0)
            # only entries not looked at before: a long computation may have
            # thousands of calls queued behind it
            seen = self._scanned
            served = 0
            for _ in range(SERVE_ROUNDS):
                fresh = []
                while inbox and inbox[-1] is not seen:
                    fresh.append(inbox.pop())
                if not fresh:
                    break
                before = len(inbox)
                kept = self._kept = []  # (_call_queued looks here too)
                try:
                    while fresh:
                        entry = fresh.pop()
                        if self._serve_one(entry):
                            served += 1
                        else:
                            kept.append(entry)
                finally:
                    # what a handler served here sent to this context meanwhile
                    # came after what waits: it goes after it, looked at in the
                    # next round (among it, taken for looked at, it waited for
                    # the method's end, and came before messages that arrived
                    # first); and nothing is lost if something raised
                    self._kept = ()
                    sent = [inbox.pop() for _ in range(len(inbox) - before)][::-1]
                    kept.extend(reversed(fresh))
                    if kept:
                        inbox.extend(kept)
                        seen = kept[-1]
                    inbox.extend(sent)
            self._scanned = seen
            self.served_busy += served
            if self.n_releases >= RELEASE_BATCH:
                # futures of large values dropped while user code runs (or a
                # full batch): their homes free them now, not when the code
                # next waits, which may be long after
                self.flush_releases()
            if self.transport is not None:
                # also what the engine queued before the method started: its
                # batch ends when the method does
                self.transport.flush()
            return served
        finally:
            self._in_serve = False

    def _serve_one(self, entry) -> bool:
        src, bufs, load = entry
        if type(bufs) is tuple:  # a call to itself, queued decoded: not served while busy
            return False
        b0 = bufs[0]
        served = SERVED_WHILE_BUSY.get(_peek_op(b0))
        if served is None:
            return False
        self._heard(src, load)
        try:
            msg = _rsr_msg(bufs) if b0[0] == _R else marshal.loads(b0, bufs[1:])
        except Exception as e:
            print(f"macroflow: context {self.id} could not decode a message from "
                  f"context {src}: {e!r}", file=sys.stderr)
            return True
        if _peek_op(b0) in _FOREIGN:
            return self.run_foreign(served, src, msg) is not False
        return served(self, src, msg) is not False  # False: it waits for its turn

    def _call_queued(self, fid: Any) -> bool:
        """Whether the call ``fid`` waits in the inbox (while busy: calls
        wait for the method that computes, and what is served meanwhile
        passes them)."""
        for _src, bufs, _load in itertools.chain(self._kept, self.inbox):
            if type(bufs) is tuple:  # a call to itself, queued decoded
                msg = bufs
            elif _peek_op(bufs[0]) == CALL:
                try:
                    msg = marshal.loads(bufs[0], bufs[1:])
                except Exception:
                    continue
            else:
                continue
            if msg[0] == CALL and msg[1] == fid:
                return True
        return False

    def resolve(self, gid) -> Any:
        kind, ident = gid
        if kind == "export":
            return self.exports.get(ident, _MISSING)
        model = self.pointer_kinds.get(kind)
        if model is not None:
            return model.resolve(kind, ident)
        return _MISSING  # a kind no model here serves: it names nothing

    # ------------------------------------------------------------------ deadlocks
    def probe_blocked(self, force: bool = False) -> None:
        """Send a deadlock probe for every method thread that has waited at
        least PROBE_AFTER seconds (every one, with ``force``); nothing is sent
        while waits are short."""
        now = time.monotonic()
        self.next_probe = now + PROBE_AFTER
        for fid, (call, f, _, since) in list(self.blocked.items()):
            if force or now - since >= PROBE_AFTER:
                if type(f) is AnyOf:
                    if not force and now < f.next:
                        continue
                    # a round sends a probe per future: the rounds of a long
                    # wait for any of many (a method's as_completed) grow
                    # apart, up to ANY_PROBE_MAX seconds
                    f.next = now + min(ANY_PROBE_MAX, PROBE_AFTER * 2 ** f.round)
                    # a new round: what came back before may have changed
                    # since (a wait on a branch timed out), so it is not kept
                    f.round += 1
                    f.found = []
                    label = self._call_label(call)
                    for i, g in enumerate(f.fs):
                        self._probe(fid, g._fid, g._home,
                                    [(fid, label, self.id, "waits for", i, f.round)])
                    continue
                path = [(fid, self._call_label(call), self.id, "waits for")]
                self._probe(fid, f._fid, f._home, path)

    def _probe(self, init, fid, home: int, path: list) -> None:
        if home == self.id:
            self._on_probe(init, fid, path)
        elif home not in self.lost and len(path) < PROBE_PATH_MAX:
            self.send(home, (PROBE, init, fid, path))

    def _on_probe(self, init, fid, path: list) -> None:
        # Follow what the call `fid` waits for, in a loop over the calls of this
        # context; each edge leaving it goes on as a message.
        todo = [(fid, path)]
        visited = set()
        while todo:
            fid, path = todo.pop()
            while fid not in visited:
                visited.add(fid)
                slot = self.slots.get(fid)
                if slot is None:
                    # a call without a result slot (a remote action's handler,
                    # whose value goes back unasked) is found by its waiting thread
                    entry = self.blocked.get(fid)
                    if entry is None:
                        break
                    call = entry[0]
                else:
                    if slot.state != FINISHED and slot.alias is not None:
                        to_fid, home = slot.alias
                        if home != self.id:
                            self._probe(init, to_fid, home, path)
                            break
                        fid = to_fid
                        continue
                    # (a finished one's method may still run: it answered
                    # early, with mf.rtf, and what is queued behind it waits
                    # for it all the same)
                    call = slot.call
                    if call is None:
                        break
                if call.fid == init:
                    self._cycle(init, path)
                    break
                if len(path) >= PROBE_PATH_MAX:
                    break
                label = self._call_label(call)
                f = call.waiting
                if f is not None:  # its thread waits for a future
                    path = path + [(call.fid, label, self.id, "waits for")]
                    if f._home != self.id:
                        self._probe(init, f._fid, f._home, path)
                        break
                    fid = f._fid
                    continue
                if call.missing:  # it waits for arguments: follow each producer
                    path = path + [(call.fid, label, self.id, "waits for an argument from")]
                    for arc in call.arcs or ():
                        lab, home = arc[0], arc[1]
                        if self.awaiting.get(lab) is call:
                            if home == self.id:
                                todo.append((lab[0], path))
                            else:
                                self._probe(init, lab[0], home, path)
                    break
                if len(path[0]) >= 6:
                    # a probe of a wait for any of several (its first hop says
                    # which branch and round) reached another such wait: that
                    # one holds only if every one of its branches does, so the
                    # probe follows each (the initiator weighs them: see
                    # _any_cycle); back at one it passed, that branch ends there
                    entry = self.blocked.get(call.fid)
                    if entry is not None and type(entry[1]) is AnyOf:
                        if any(p[0] == call.fid for p in path):
                            self._probe(init, init, path[0][2],
                                        path + [(call.fid, label, self.id, _CLOSES)])
                        elif _fans(path, len(entry[1].fs)):
                            fs = entry[1].fs
                            among = _AMONG.format(len(fs))
                            for j, g in enumerate(fs):
                                self._probe(init, g._fid, g._home,
                                            path + [(call.fid, label, self.id, among, j, len(fs))])
                        break
                kind = self.call_kinds.get(call.kind)
                ahead = kind.queued_behind(call) if kind is not None else None
                if ahead is None:
                    break  # it computes, a guard that does not hold, or about to run
                path = path + [(call.fid, label, self.id, "is queued behind")]
                fid = ahead.fid

    def _call_label(self, call: Call) -> str:
        kind = self.call_kinds.get(call.kind)
        return kind.label(call) if kind is not None else str(call.method)

    def running(self, call: Optional[Call]) -> str:
        """What user code ``call`` runs, for an error saying where something
        was done ("method Counter.add on context 1").

        Example:
            >>> import macroflow as mf
            >>> with mf.init(contexts=1, transport="inproc"):
            ...     current_engine().running(None)
            'a method on context 0'
        """
        if call is None:
            return f"a method on context {self.id}"
        kind = self.call_kinds.get(call.kind)
        runs = getattr(kind, "runs", "method")
        return f"{runs + ' ' if runs else ''}{self._call_label(call)} on context {self.id}"

    def _cycle(self, init, path: list) -> None:
        # Every waiter of a cycle probes, and every probe that comes back finds
        # the same cycle: only the waiter with the highest id fails, so exactly
        # one does and the others go on once it has.
        entry = self.blocked.get(init)
        if entry is not None and type(entry[1]) is AnyOf:
            self._any_cycle(init, entry, path)
            return
        waiters = [p[0] for p in path if p[3] == "waits for"]
        if entry is None or init != max(waiters):
            return
        text = _cycle_text(path)
        err = errors.DeadlockError(f"wait cycle: {text}; this wait fails so that the others can "
                                   f"go on")
        err.cycle = [(p[1], p[2]) for p in path]
        err.cycles = [err.cycle]  # as a wait for any of several's error has
        entry[2].wake(err)

    def _any_cycle(self, init, entry: tuple, path: list) -> None:
        # A probe of a wait for any of several came back. Others' probes stop
        # at such a wait, so only its own find a cycle through it, and it
        # alone fails: once every branch of this round has come back, and
        # through each other such wait on the way, every branch of that one.
        # Such waits probe each other: of those in a knot, the one with the
        # highest id fails, so exactly one does.
        w: AnyOf = entry[1]
        first = path[0]
        if len(first) < 6 or first[5] != w.round:
            return  # an earlier round's
        w.found.append(path)
        if not _all_back([(p[0][4], p[1:]) for p in w.found], len(w.fs)):
            return
        if w.deferred == 0 and any(_among(q) and q[0] > init for p in w.found for q in p[1:]):
            # another such wait in the knot fails (it finds it too), unless
            # its probes cannot (beyond ANY_FAN_MAX from there): if this one
            # finds the knot again in a later round, it fails itself
            w.deferred = w.round
            self.blocked_version += 1  # (inproc probes again only when waits change)
            return
        if w.deferred == w.round:
            return  # (more of the round in which it was left to the other)
        # each way once: futures of calls queued behind the same one (k
        # calls to its own object) come back as the same way in words
        paths, texts = [], []
        for p in sorted(w.found, key=_branches):
            text = _cycle_text(p, 1)
            if text not in texts:
                paths.append(p)
                texts.append(text)
        if any(_among(q) or q[3] == _CLOSES for p in paths for q in p[1:]):
            how = "and each way leads back to it or to a wait like it on the way"
        else:
            how = "and each leads back to it"
        shown = "; ".join(texts[:CYCLES_SHOWN])
        if len(texts) > CYCLES_SHOWN:
            shown += f"; and {len(texts) - CYCLES_SHOWN} more ways (the error's cycles)"
        err = errors.DeadlockError(
            f"wait cycle: {first[1]} (context {first[2]}) waits for any of {len(w.fs)} futures, "
            f"{how}: {shown}; this wait fails so that the others can go on")
        err.cycle = [(q[1], q[2]) for q in paths[0] if q[3] != _CLOSES]
        err.cycles = [[(q[1], q[2]) for q in p if q[3] != _CLOSES] for p in paths]
        entry[2].wake(err)

    # ------------------------------------------------------------------ lost peers
    def peer_lost(self, peer: int, how: str, describe: bool = True) -> None:
        """``peer`` is lost, ``how`` (``describe``: unless the launcher can say
        better: a process's fate)."""
        if peer in self.lost or self.stopping:
            return
        if describe:
            how = self.describe_lost(peer) or how
        if peer in self.fatal:
            how = f"{how} {_after_fatal(self.fatal[peer])}"
        self.lost[peer] = how
        self.stats.contexts_lost += 1
        if peer == 0 and self.id != 0:
            # The main program is gone: nothing is left to serve.
            self.stopping = True
            if self.user and self.main_lost_while_busy is not None:
                self.main_lost_while_busy(how)  # the method would hold us until it ends
            return
        # The transport may say so from inside a send, in the middle of handling
        # a message or in a method's thread: failing futures and running calls
        # from there would run code twice or switch threads under it. Marked
        # lost now (nothing more is sent there), handled at the next step.
        self.lost_queue.append(peer)

    def _on_lost(self, peer: int) -> None:
        if peer in self.fatal and self.fatal[peer] not in self.lost[peer]:
            # its FATAL was read in the same poll as its end, and dispatched since
            self.lost[peer] = f"{self.lost[peer]} {_after_fatal(self.fatal[peer])}"
        exc = errors.ContextLost(peer, self.lost[peer])
        self.call_watch.pop(peer, None)
        for model in self.models.values():
            model.lost(peer)
        for fid, ref in list(self.eager.items()):
            f = ref()
            if f is None or f._home == peer:
                del self.eager[fid]
                if f is not None:
                    f._set(False, exc)
        for fid, f in list(self.asked.items()):
            if f._home == peer:
                del self.asked[fid]
                f._set(False, exc)
        for fid, pull in list(self.pulls.items()):
            if pull[0] == peer:
                del self.pulls[fid]  # (its calls fail below: their arcs name peer)
        for label, call in list(self.awaiting.items()):
            if self.awaiting.get(label) is not call:
                continue  # failed already, for another of its arguments
            if any(label == a[0] and a[1] == peer for a in (call.arcs or ())):
                del self.awaiting[label]
                self._token_arrived(call, label, False, exc)
        for fid, slot in list(self.slots.items()):
            if slot.alias is not None and slot.alias[1] == peer:
                # requests passed on to the lost context: it will never answer them
                subs, slot.subs = slot.subs, []
                for dest, label in subs:
                    if dest != peer:
                        self.send_error(dest, label, exc)
            elif slot.subs:
                slot.subs = [(d, l) for d, l in slot.subs if d != peer]

    def report_fatal(self, text: str) -> None:
        """Tell every reachable context that this engine failed, and why, before
        the process ends (best effort: the connections may be broken too)."""
        self.stopping = True
        peers = self.transport.peers()
        for c in range(self.size) if peers is None else peers:
            if c != self.id and c not in self.lost:
                try:
                    self.send(c, (FATAL, text))
                except Exception:
                    pass
        try:
            self.transport.flush()
        except Exception:
            pass

    def internal_error(self, call: Optional[Call], exc: BaseException) -> None:
        """A bug of the runtime while it ran ``call``: fail the call (so nobody
        waits for it) and free its object, rather than leave both stuck."""
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        if call is None:
            return
        err = errors.MacroflowError(
            f"internal error of macroflow on context {self.id} while running "
            f"{self._call_label(call)}: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        self._end_call(call, err)

    def _end_call(self, call: Call, err: BaseException) -> None:
        """Fail ``call``, whose thread ended without finishing it, with
        ``err`` (unless its value was given already), and free what it held."""
        slot = self.slots.get(call.fid)
        if not call.answered or (slot is not None and slot.state != FINISHED and slot.alias is None):
            if call.answered:  # it failed in the middle of answering: counted finished already
                call.answered = False
                self.active += 1
            try:
                self._finish(call, False, err)
            except Exception:
                traceback.print_exc()
        kind = self.call_kinds.get(call.kind)
        if kind is not None:
            kind.abandon(call)  # free what the call held (its object)

    def interrupted(self, exc: BaseException) -> None:
        """An interrupt (``exc``) ended the thread of the call it was raised
        in, and goes on to the main program in this process (inproc): that
        call fails with it, and its object is free for the next call."""
        call, self.interrupted_call = self.interrupted_call, None
        if call is not None:
            self._end_call(call, exc)
            self.transport.flush()

    # ------------------------------------------------------------------ queries
    def snapshot(self) -> Dict[str, Any]:
        d = self.stats.as_dict()
        for model in self.models.values():
            model.snapshot(d)
        d.update(values_held=len(self.slots),
                 served_while_busy=self.served_busy,
                 tokens_waiting=len(self.tokens), greenlets_created=self.pool.created,
                 load=self.load(), pid=os.getpid())
        pool = getattr(self.transport, "pool", None)
        if pool is not None:
            d.update(buffers_reused=pool.reused, buffer_pool_bytes=pool.held)
        bulk = getattr(self.transport, "bulk_counts", None)
        if bulk is not None:
            d.update(bulk())
        counters = getattr(self.transport, "counters", None)
        st = self.stats
        # messages and bytes per protocol: one protocol carries everything unless
        # the transport is made of several
        d["protocols"] = counters() if counters is not None else {self.transport.name: {
            "messages_sent": st.messages_sent, "bytes_sent": st.bytes_sent,
            "messages_received": st.messages_received, "bytes_received": st.bytes_received}}
        return d


def as_int(value: Any) -> Optional[int]:
    """``value`` as an int when it is an integer (a numpy integer too, not a
    bool), else None: context ids and counts computed with numpy are taken.

    Example:
        >>> import numpy as np
        >>> as_int(3), as_int(np.int64(3)), as_int(True), as_int(3.0), as_int("3")
        (3, 3, None, None, None)
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def positive_count(value: Any, what: str) -> int:
    """``value`` as an int >= 1 (a numpy integer too): a TypeError names what
    is no integer (a bool, a float, a str), a ValueError one below 1.

    Example:
        >>> positive_count(2, "n")
        2
        >>> positive_count("2", "mf.spmd(): n")
        Traceback (most recent call last):
        ...
        TypeError: mf.spmd(): n must be a positive int; got '2'
        >>> positive_count(0, "contexts")
        Traceback (most recent call last):
        ...
        ValueError: contexts must be a positive int; got 0
    """
    k = as_int(value)
    if k is None:
        raise TypeError(f"{what} must be a positive int; got {value!r}")
    if k < 1:
        raise ValueError(f"{what} must be a positive int; got {value!r}")
    return k


def check_timeout(timeout: Any) -> Optional[float]:
    """A timeout in seconds as a float, None for none (``math.inf`` too);
    anything else is refused with an error that names it.

    Example:
        >>> check_timeout(2), check_timeout(math.inf), check_timeout(1e300), check_timeout(0)
        (2.0, None, None, 0.0)
        >>> check_timeout(-1)
        Traceback (most recent call last):
        ...
        ValueError: timeout must be a number of seconds >= 0, or None; got -1
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, or None; got {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, or None; got {timeout!r}")
    # beyond ~30 years no clock or poll() can count: that is no timeout
    return None if timeout > 1e9 else float(timeout)


def _pack_release(items) -> bytes:
    # (fid, arcs) pairs as flat int64s: one bytes object, nothing for the
    # pickler to memoize (a memo that grows makes every later message dearer)
    flat = array.array("q")
    for (ctx, seq), arcs in items:
        flat.extend((ctx, seq, arcs))
    return flat.tobytes()


def _unpack_release(data) -> List[Tuple[Tuple[int, int], int]]:
    flat = array.array("q")
    flat.frombytes(data)
    return [((flat[i], flat[i + 1]), flat[i + 2]) for i in range(0, len(flat), 3)]


# ---------------------------------------------------------------------- the registry
# Messages are dispatched by opcode (the first item of a pickled header; VALUE
# and CALL, the commonest, are handled inline by the engine's loop before it
# looks here). The core registers its own opcodes below; a programming model
# registers its messages the same way, and its kinds of CALL with
# register_model.

Handler = Callable[["Engine", int, tuple], None]

#: Every registered opcode's handler(engine, src, msg), for the engine's loop.
HANDLERS: Dict[int, Handler] = {}

#: The messages a context serves even while user code runs there, by opcode:
#: handler(engine, src, msg). Derived from the registrations (see register):
#: do not add to it directly. A handler here must not run user code that may
#: wait, switch lightweight threads or start a method; it may run in the
#: service thread (see macroflow.core.threads). The engine's own loop
#: dispatches these opcodes to the same handlers, unless one was registered
#: for these times (FORWARD's); one that returns False leaves its message in
#: the inbox, in order.
SERVED_WHILE_BUSY: Dict[int, Handler] = {}

_OWNERS: Dict[int, str] = {}  # opcode -> who registered it, for errors
_FOREIGN: set = set()  # opcodes whose handlers are not macroflow's (Engine.run_foreign)
_SEALED = False  # set once `import macroflow` has registered macroflow's own


def seal_opcodes() -> None:
    """Every opcode registered from now on is a user's (see
    :meth:`Engine.run_foreign`); ``import macroflow`` calls it last.

    Example:
        >>> import macroflow
        >>> from macroflow.core import context
        >>> context._SEALED, context.FATAL in context._FOREIGN
        (True, False)
    """
    global _SEALED
    _SEALED = True

#: Where the large payload buffers of a message land, by opcode:
#: landing(engine, src, head, nbytes) -> a writable memoryview of nbytes, or
#: None (see register). Called by the transport as the buffer arrives, before
#: the message is handled, possibly in the service thread.
LANDINGS: Dict[int, Callable[["Engine", int, Any, int], Optional[memoryview]]] = {}


def register(opcode: int, handler: Handler, served_while_busy: Any = False,
             landing: Optional[Callable[["Engine", int, Any, int], Optional[memoryview]]]
             = None) -> None:
    """Make the engine of every context run ``handler(engine, src, msg)`` for
    each message whose header (a tuple sent with ``engine.send``) starts with
    ``opcode``; ``served_while_busy`` also serves it while a method of that
    context computes (see "Service while a context computes" in the guide):
    True, by ``handler``, or by a handler of its own for those times (one
    that returns False leaves the message in the inbox, in its order).

    ``landing(engine, src, head, nbytes)``, if given, is asked where each
    large out-of-band buffer of such a message should be received (``head``
    is the message's first buffer, still pickled): a writable memoryview of
    exactly ``nbytes`` bytes that the receiver posted (a get's result array),
    or None for a buffer of the transport's own. Stream and MPI transports
    then receive the bytes straight into it (a rendezvous: no copy after
    the kernel's or MPI's own); the handler finds that view in the message.

    Opcodes are small ints (0..255) taken by one handler each: the core's own
    are ``CALL`` to ``STATS`` (0..18). Register when the module is imported, so that
    every context (a forked or spawned process imports it too) knows it.

    Raises:
        TypeError: ``opcode`` is not an int, or ``handler`` (or
            ``served_while_busy``, if not a bool) is not callable.
        ValueError: ``opcode`` is out of range or already registered (the
            error names what holds it; :func:`unregister` frees it).

    Example:
        >>> import macroflow as mf
        >>> from macroflow.core import context
        >>> def on_hello(engine, src, msg):
        ...     print(f"context {engine.id} got {msg[1]!r} from context {src}")
        >>> context.register(200, on_hello)
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     eng = context.current_engine()
        ...     eng.send(0, (200, "hello"))
        ...     eng.process()
        context 0 got 'hello' from context 0
        >>> context.register(200, on_hello)
        Traceback (most recent call last):
        ...
        ValueError: opcode 200 is already registered (to on_hello); unregister it first
        >>> context.unregister(200)
    """
    if isinstance(opcode, bool) or not isinstance(opcode, int):
        raise TypeError(f"opcode must be an int; got {opcode!r}")
    if not 0 <= opcode < 256:
        raise ValueError(f"opcode must be in 0..255 (the engine reads it from the header "
                         f"without unpickling it); got {opcode}")
    if not callable(handler):
        raise TypeError(f"handler must be callable as handler(engine, src, msg); "
                        f"got {type(handler).__name__}")
    if opcode in HANDLERS or opcode == CALL:
        raise ValueError(f"opcode {opcode} is already registered (to {_OWNERS[opcode]}); "
                         f"unregister it first")
    if served_while_busy not in (False, True) and not callable(served_while_busy):
        raise TypeError(f"served_while_busy must be True, False or a handler; "
                        f"got {type(served_while_busy).__name__}")
    if landing is not None and not callable(landing):
        raise TypeError(f"landing must be callable as landing(engine, src, head, nbytes); "
                        f"got {type(landing).__name__}")
    HANDLERS[opcode] = handler
    _OWNERS[opcode] = getattr(handler, "__qualname__", repr(handler))
    if _SEALED:
        _FOREIGN.add(opcode)
    if served_while_busy:
        SERVED_WHILE_BUSY[opcode] = handler if served_while_busy is True else served_while_busy
    if landing is not None:
        LANDINGS[opcode] = landing


def unregister(opcode: int) -> None:
    """Forget the handler registered for ``opcode`` (see :func:`register`).

    Raises:
        ValueError: nothing is registered for it, or it is ``CALL``, which
            the engine handles itself.

    Example:
        >>> from macroflow.core import context
        >>> context.register(201, lambda engine, src, msg: None, served_while_busy=True)
        >>> 201 in context.SERVED_WHILE_BUSY
        True
        >>> context.unregister(201)
        >>> 201 in context.HANDLERS, 201 in context.SERVED_WHILE_BUSY
        (False, False)
    """
    if opcode == CALL or opcode not in HANDLERS:
        raise ValueError(f"opcode {opcode!r} is not registered (registered: {sorted(HANDLERS)})")
    if opcode not in _FOREIGN:
        raise ValueError(f"opcode {opcode} is macroflow's own ({_OWNERS[opcode]}): every "
                         f"computation needs it; only opcodes registered outside macroflow "
                         f"can be unregistered")
    _FOREIGN.discard(opcode)
    del HANDLERS[opcode]
    del _OWNERS[opcode]
    SERVED_WHILE_BUSY.pop(opcode, None)
    LANDINGS.pop(opcode, None)


class CallKind:
    """How the context that receives a CALL of one kind serves it.

    The ``kind`` field of a CALL names one; each engine has one instance per
    kind (``engine.call_kinds``), made by the model that serves it (see
    :class:`Model`). The engine does what every call needs (its result slot,
    its arguments asked from their producers, its load counted) and asks the
    kind the rest: where it runs, and how it is described. Run a call with
    ``engine.spawn(fn, call)`` and, in ``fn``, ``engine._invoke(function, call)``
    (which runs it and sends its result).

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     kind = current_engine().call_kinds[SYSTEM]
        ...     isinstance(kind, CallKind), kind.queued_behind(None)
        (True, None)
    """

    #: True if :meth:`arrived` may pass calls on (the engine asks only then)
    moves = False
    #: ``outgoing(target, dest)``, if the kind has one: what a caller sends to
    #: ``dest`` in place of a call's target (a smaller form, say); the kind's
    #: ``incoming(msg, src)`` then gives back the CALL message with the target
    #: whole, before anything else sees it. Frames between two contexts
    #: arrive in the order sent, so the two sides can keep state in step; and
    #: ``unsent(sent, dest)`` is told of a form that was not sent after all.
    outgoing: Optional[Callable[[Any, int], Any]] = None
    #: True if ``mf.poll()`` from a call of this kind lets the engine run, for
    #: one round, the calls that have arrived (Tulip's Poll); else it serves
    #: only what needs no user code
    yields_on_poll = False
    #: whether the kind has a :meth:`check_wait` of its own (set for each
    #: subclass: a wait does not call the base's, which checks nothing)
    checks_waits = False
    #: True if the caller of a call of this kind makes a ``sys.exit()`` in it
    #: an error of its own; else the engine does (see errors.exited), so that
    #: the exit fails the call, not the caller's program
    keeps_exit = False
    #: what its :meth:`label` names, for errors that say where user code
    #: ran ("was called inside method Counter.add"); "" if the label says it
    runs = "method"

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.checks_waits = cls.check_wait is not CallKind.check_wait

    def __init__(self, eng: "Engine"):
        self.eng = eng

    def arrived(self, call: Call, msg: tuple, src: int) -> bool:
        """Before the call is counted or its arguments asked for: return True
        if the kind passed it on elsewhere (``engine._move``). Asked only if
        :attr:`moves` is True."""
        return False

    def accept(self, call: Call) -> None:
        """The call is here, its arguments asked for (``call.missing`` of
        them still to come): start it, or queue it."""
        raise NotImplementedError

    def arguments_ready(self, call: Call) -> None:
        """The last missing argument of an accepted call has arrived."""
        raise NotImplementedError

    def label(self, call: Call) -> str:
        """What the call is, in errors and deadlock reports."""
        return str(call.method)

    def check_wait(self, call: Call, future: Future) -> None:
        """The running ``call`` is about to wait for ``future``: raise
        DeadlockError if that wait can never end."""

    def polled(self, call: Call) -> None:
        """The running ``call`` called ``mf.poll()`` (after it served what had
        arrived): raise to end it, if what it belongs to cannot go on."""

    def queued_behind(self, call: Call) -> Optional[Call]:
        """The call this one waits behind, not started (deadlock probes):
        None if it runs, may run, or waits for nothing the kind knows."""
        return None

    def abandon(self, call: Call) -> None:
        """An internal error ended the running ``call``: free what it held."""

    def refuse(self, msg: tuple) -> tuple:
        """The CALL ``msg`` reached this context after it began to retire
        (``mf.remove_context``): return what to serve in its place. By
        default the call itself (it runs); a kind may return
        ``engine.failing(msg, error)``, or let :meth:`arrived` pass it on."""
        return msg


class Model:
    """A programming model's part of one engine: the kinds of CALL it serves,
    the kinds of global pointer it resolves, and its share of the engine's
    events. Registered with :func:`register_model`; every engine made after
    that makes one, ``engine.models[name]``.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     m = current_engine().models["objects"]
        ...     isinstance(m, Model), m.pointers
        (True, ('object',))
    """

    name = "model"
    #: the kinds of global pointer (GlobalPointer.kind) this model resolves
    pointers: Tuple[str, ...] = ()
    #: whether the model has a :meth:`served` of its own (set for each
    #: subclass: a request's end does not call the base's, which does nothing)
    notes_served = False
    #: whether the model has an :meth:`exposed` of its own (set for each subclass)
    has_exposed = False

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.notes_served = cls.served is not Model.served
        cls.has_exposed = cls.exposed is not Model.exposed

    def __init__(self, eng: "Engine"):
        self.eng = eng
        #: call kind -> its CallKind, for the kinds of CALL this model serves
        self.kinds: Dict[str, CallKind] = {}

    def resolve(self, kind: str, ident: Any) -> Any:
        """What the global pointer (kind, ident) names here, or MISSING."""
        return MISSING

    def served(self, kind: str, ident: Any) -> None:
        """A remote service request ran on what (kind, ident) names: it may
        have changed it. With ``engine._in_serve`` nothing may start from here."""

    def hold(self, kind: str, ident: Any, release: Callable[[Any], bool]) -> bool:
        """(kind, ident) names nothing here yet, but may soon (an object whose
        constructor is on its way): keep ``release`` and call it once, with
        the target when it exists or with MISSING when it never will, before
        anything else runs on that target. ``release`` returns True when it
        started a thread that should run first. Returns False when nothing
        will ever be there (the request is then reported as dropped)."""
        return False

    def why_not(self, kind: str, ident: Any) -> Optional[str]:
        """Why what ``(kind, ident)`` names is not here to serve a request
        (its :meth:`hold` said no), for the message that says it was not
        run; None: the engine's own words (nothing is there)."""
        return None

    def lost(self, peer: int) -> None:
        """Context ``peer`` is lost (called before its futures fail)."""

    def exposed(self, bufs: List[Any]) -> bool:
        """Whether any of ``bufs`` (a result's out-of-band buffers, about to be
        kept here until asked for) lies in memory that other contexts may
        write without any code running here (memory registered for one-sided
        puts): such a result is copied at once, not before the next user code."""
        return False

    def snapshot(self, d: Dict[str, Any]) -> None:
        """Add this model's figures to ``mf.stats()``'s dict ``d``."""

    def retiring(self) -> None:
        """This context has begun to be removed: it takes no new calls of its
        own kinds from here on (see :meth:`CallKind.refuse`); what it holds
        that only a new call could let go on should fail now."""

    def hand_over(self) -> Any:
        """This context is being removed and has finished its calls: return
        what its heir must know (picklable; None for nothing). What it hosts
        takes no new work from here on."""
        return None

    def take_over(self, cid: int, data: Any) -> None:
        """This context is the heir of removed context ``cid``, which handed
        over ``data`` (see :meth:`hand_over`)."""


#: name -> factory(engine) -> Model, for every registered model
MODELS: Dict[str, Callable[["Engine"], Model]] = {}


def register_model(name: str, factory: Callable[["Engine"], Model]) -> None:
    """Make every engine created from now on build ``factory(engine)``, a
    :class:`Model`, and serve the call kinds and global pointer kinds it
    declares. A model registers when it is imported (``import macroflow``
    imports every model before any engine starts).

    Raises:
        ValueError: ``name``, or a call kind the model declares, is taken
            (found when an engine is made).

    Example:
        >>> import macroflow as mf
        >>> class Echo(CallKind):
        ...     def accept(self, call):
        ...         if not call.missing:
        ...             self.arguments_ready(call)
        ...     def arguments_ready(self, call):
        ...         self.eng.spawn(self.eng._invoke, lambda x: ("echo", x), call)
        >>> class Toy(Model):
        ...     def __init__(self, eng):
        ...         super().__init__(eng)
        ...         self.kinds = {"toy": Echo(eng)}
        >>> register_model("toy", Toy)
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     current_engine().issue("toy", None, "echo", (5,), {}, 1).result()
        ('echo', 5)
        >>> unregister_model("toy")
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a model's name must be a non-empty str; got {name!r}")
    if name in MODELS:
        raise ValueError(f"a model named {name!r} is already registered")
    if not callable(factory):
        raise TypeError(f"factory must be callable as factory(engine); got {factory!r}")
    MODELS[name] = factory


def unregister_model(name: str) -> None:
    """Forget the model registered as ``name``; engines made before keep it.

    Example:
        >>> register_model("nothing", Model)
        >>> unregister_model("nothing")
        >>> "nothing" in MODELS
        False
    """
    if name not in MODELS:
        raise ValueError(f"no model named {name!r} (registered: {sorted(MODELS)})")
    del MODELS[name]


class SystemCalls(CallKind):
    """SYSTEM calls: a function of the engine, by name (see SYSTEM_CALLS).

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     current_engine().issue(SYSTEM, "ping", "ping", (7,), {}, 1).result()
        7
    """

    def accept(self, call: Call) -> None:
        if call.missing == 0:
            self.eng.spawn(self._run_free, call)

    def arguments_ready(self, call: Call) -> None:
        self.eng.spawn(self._run_free, call)

    def _run_free(self, call: Call) -> None:
        eng = self.eng
        g = getcurrent()
        g.call = call
        eng._invoke(SYSTEM_CALLS.get(call.method), call, eng)


# the core's own opcodes (CALL and VALUE are handled by the engine's loop)
def _alias_cycle(fid: Any) -> errors.DeadlockError:
    """The error of a request for ``fid``, a future that resolves to itself
    through the futures methods returned."""
    return errors.DeadlockError(
        f"the future {fid[0]}.{fid[1]} resolves to a future that resolves to it again: "
        f"methods returned each other's futures")


def _serve_forward(eng: Engine, src: int, msg: tuple) -> None:
    eng._on_forward(msg[1], msg[2], msg[3], msg[4] if len(msg) > 4 else None)


#: rounds of one look at the inbox while a method computes: a request that a
#: handler served then sends to its own context is served in the next round
SERVE_ROUNDS = 16


def _serve_forward_busy(eng: Engine, src: int, msg: tuple) -> Optional[bool]:
    # While a method computes: a request that would follow the alias left by
    # a call passed on, when that call has come back and waits in the inbox
    # (placement lets a call revisit a context), waits for its turn. Followed
    # now, the stale alias sends it round the contexts the call went through,
    # and back here, where it looks like a cycle of futures.
    slot = eng.slots.get(msg[1])
    if slot is not None and slot.alias is not None and slot.keep is None \
            and eng._call_queued(msg[1]):
        return False
    _serve_forward(eng, src, msg)
    return None


def _serve_retiring_busy(eng: Engine, msg: tuple, on: Callable[..., None]) -> Optional[bool]:
    # While a method computes: another context's removal is noted, and acked,
    # at once (what the method sends there from then on goes to the heir);
    # or the removal of an idle context waited for the longest method
    # anywhere. The retiring context's own, in its turn: it ends its calls.
    if msg[1] == eng.id:
        return False
    on(*msg[1:])
    return None


def _serve_release(eng: Engine, src: int, msg: tuple) -> None:
    eng._on_release(_unpack_release(msg[1]))


def _serve_big(eng: Engine, src: int, msg: tuple) -> None:
    eng._on_big(tuple(msg[1]))


def _serve_stats(eng: Engine, src: int, msg: tuple) -> None:
    fid = tuple(msg[1])
    if src == eng.id:  # asked by this context itself (see ask_stats)
        f = eng.asked.pop(fid, None)
        if f is not None:
            f._set(True, eng.snapshot())
        return
    eng.send_value(src, (fid, None), *eng._pickle_value(True, eng.snapshot()))


class _Unreadable:
    """Arguments (and, for a stateless object, its class) that could not be
    unpickled: iterating them, constructing one, or looking up a method
    raises the reason, which fails the call."""

    error: BaseException
    __mf_new__ = object.__new__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # (made with a regular call's constructor arguments: its methods fail)

    @classmethod
    def of(cls, error: BaseException) -> type:
        return type("NotDecoded", (cls,), {"error": error})

    def __iter__(self):
        raise self.error

    def __getattr__(self, name: str) -> Any:
        error = self.error

        def fail(*args: Any, **kwargs: Any) -> Any:
            raise error
        return fail


def _serve_rsr(eng: Engine, src: int, msg: tuple) -> None:
    eng._on_rsr(msg)


def look_again(target: Any) -> None:
    """The handler of an inline remote service request that runs nothing: a
    model queues one, to itself, so that the engine's loop calls its
    ``served`` hook for the target again, where the service mechanism could
    not start what the target may now run. Not counted as a request run.

    Example:
        >>> look_again(None) is None
        True
    """


def _serve_rsr_now(eng: Engine, src: int, msg: tuple) -> None:
    eng._on_rsr_now(src, msg)


def _serve_ready(eng: Engine, src: int, msg: tuple) -> None:
    eng._on_ready(msg[1])


def _serve_shutdown(eng: Engine, src: int, msg: tuple) -> None:
    eng.stopping = True


def _serve_fatal(eng: Engine, src: int, msg: tuple) -> None:
    eng.fatal[src] = msg[1]


def _serve_probe(eng: Engine, src: int, msg: tuple) -> None:
    eng._on_probe(msg[1], msg[2], msg[3])


def _serve_members(eng: Engine, src: int, msg: tuple) -> None:
    eng.learn_members(*msg[1:])


def _serve_joined(eng: Engine, src: int, msg: tuple) -> None:
    eng.joined[src] = msg[1]
    if eng.on_joined is not None:
        eng.on_joined(src)


_OWNERS[CALL] = "the engine's loop"
register(FORWARD, _serve_forward, served_while_busy=_serve_forward_busy)
register(RELEASE, _serve_release, served_while_busy=True)
register(RSR, _serve_rsr)
register(RSR_NOW, _serve_rsr_now, served_while_busy=True)
register(READY, _serve_ready)
register(SHUTDOWN, _serve_shutdown)
register(FATAL, _serve_fatal)
register(PROBE, _serve_probe)
register(MEMBERS, _serve_members)
register(JOINED, _serve_joined)

#: the engine's own messages that run no user code: a result kept here
#: needs no copy of its buffers before these (see Engine.kept_copies)
_NO_USER_CODE = frozenset((FORWARD, RELEASE, BIG, STATS, READY, PROBE, SHUTDOWN))
register(RETIRE, lambda eng, src, msg: eng._on_retire(msg[1], msg[2]),
         served_while_busy=lambda eng, src, msg: _serve_retiring_busy(eng, msg, eng._on_retire))
register(HANDOVER, lambda eng, src, msg: eng._on_handover(src, msg[1], msg[2]))
register(RETIRED, lambda eng, src, msg: eng._on_retired(msg[1], msg[2], msg[3]),
         served_while_busy=lambda eng, src, msg: _serve_retiring_busy(eng, msg, eng._on_retired))
register(RETIRE_ACK, lambda eng, src, msg: eng._on_retire_ack(src))
register(LEFT, lambda eng, src, msg: eng.left.add(src))
register(BIG, _serve_big, served_while_busy=True)
register(STATS, _serve_stats, served_while_busy=True)


def _after_fatal(trace: str) -> str:
    """How a context whose engine ended with ``trace`` (a FATAL) was lost.

    Example:
        >>> _after_fatal("Traceback ...\\nKeyboardInterrupt\\n").splitlines()[0]
        'after KeyboardInterrupt, raised in its user code (an interrupt ends the context it is raised in):'
        >>> _after_fatal("Traceback ...\\nRecursionError: deep\\n").splitlines()[0]
        'after an internal error of its engine:'
    """
    last = trace.rstrip().rsplit("\n", 1)[-1]
    if last.startswith("KeyboardInterrupt"):
        return (f"after KeyboardInterrupt, raised in its user code (an interrupt ends the "
                f"context it is raised in):\n{trace}")
    return f"after an internal error of its engine:\n{trace}"


_PROTO, _FRAME, _MARK, _BININT1 = 0x80, 0x95, 0x28, 0x4B


def _peek_op(b0) -> int:
    """The opcode of a message from its first buffer, without unpickling it
    (-1 if it is not a pickled header that starts with a small int).

    Example:
        >>> _peek_op(marshal.dumps((FORWARD, (0, 1), 2, ((0, 1), None)))[0]) == FORWARD
        True
        >>> _peek_op(marshal.dumps((SHUTDOWN,))[0]) == SHUTDOWN, _peek_op(b"V...")
        (True, -1)
    """
    if len(b0) < 4 or b0[0] != _PROTO:
        return b0[1] if len(b0) >= _RHEAD.size and b0[0] == _R else -1
    i = 2
    if b0[i] == _FRAME:
        i += 9
    if i < len(b0) and b0[i] == _MARK:
        i += 1
    if i + 1 < len(b0) and b0[i] == _BININT1:
        return b0[i + 1]
    return -1


def rsr_frame(op: int, gid: Any, handler: Any, thread: str, fresh: bool = False) -> bytes:
    """The start of a compact RSR frame to ``gid`` with ``handler``: the same
    for every request of that pair, so a sender keeps it; the arguments'
    pickle follows it (see :func:`_rsr_msg`). A receiver keeps what it
    decoded from it, unless ``fresh`` (a handler with state of its own,
    see :func:`macroflow.core.marshal.stateless`: decoded each time).

    Example:
        >>> head = rsr_frame(RSR, ("export", (1, 2)), len, "new")
        >>> data, bufs = marshal.dumps_args(("x", 3))
        >>> _rsr_msg([head + data, *bufs])
        (4, ('export', (1, 2)), <built-in function len>, ('x', 3), 'new')
        >>> _peek_op(head) == RSR
        True
    """
    key, bufs = marshal.dumps((gid, handler))
    if bufs:  # a pointer or handler that pickles a large buffer: not worth a key
        raise ValueError(f"remote service request handler {handler!r} pickles large buffers")
    code = 0 if op == RSR_NOW else _RSR_THREADS.index(thread)
    return _RHEAD.pack(_R, op, code, 1 if fresh else 0, len(key)) + key


def _rsr_msg(bufs: List[Any]) -> tuple:
    """The message a compact RSR frame carries, as its pickled form would be."""
    b0 = bufs[0]
    _, op, code, fresh, n = _RHEAD.unpack_from(b0)
    end = _RHEAD.size + n
    key = bytes(b0[_RHEAD.size:end])
    known = None if fresh else _rsr_keys.get(key)
    if known is None:
        known = marshal.loads(key)
        if not fresh:
            if len(_rsr_keys) >= _RSR_KEYS_MAX:
                del _rsr_keys[next(iter(_rsr_keys))]
            _rsr_keys[key] = known
    args = marshal.loads_args(memoryview(b0)[end:], bufs[1:]) if len(b0) > end else ()
    if op == RSR_NOW:
        return (RSR_NOW, known[0], known[1], args)
    return (op, known[0], known[1], args, _RSR_THREADS[code])


def _among(hop: tuple) -> bool:
    """Whether a hop of a probe's path is a wait for any of several that the
    probe fanned out at: ``(fid, label, ctx, how, branch, k)``, where other
    hops have 4 fields (a path's first, its initiator, has 6 too).

    Example:
        >>> _among(("b", "B.x", 2, _AMONG.format(2), 0, 2)), _among(("b", "B.x", 2, "waits for"))
        (True, False)
    """
    return len(hop) == 6


def _branches(path: list) -> list:
    """The branch taken at each wait for any of several along a probe's
    path: how the paths of one round are ordered (see Engine._any_cycle)."""
    return [p[4] for p in path if _among(p)]


def _fans(path: list, k: int) -> bool:
    """Whether a probe on ``path`` that reached a wait for any of ``k``
    futures follows each: at most ANY_NEST_MAX such waits deep, and into at
    most ANY_FAN_MAX probes from each of its initiator's, so that a round
    of a wait for many, through waits for many, costs a bounded number of
    messages (a knot beyond the bounds is not found, as before them).

    Example:
        >>> among = ("b", "B.x", 2, _AMONG.format(8))
        >>> _fans([("a", "A.x", 1, "waits for", 0, 1)], 8), _fans([("a",), among + (0, 8)], 8)
        (True, True)
        >>> _fans([("a",), among + (0, 8)], 9), _fans([("a",)] + [among + (0, 1)] * 4, 1)
        (False, False)
    """
    width, depth = k, 0
    for p in path[1:]:
        if _among(p):
            width *= p[5]
            depth += 1
    return depth < ANY_NEST_MAX and width <= ANY_FAN_MAX


def _all_back(ways: list, k: int) -> bool:
    """Whether the probes that came back, ``ways`` (branch, hops after it),
    show every one of ``k`` branches of a wait for any of several held by
    the waits it probed: a branch is held if one of its ways came back with
    no other such wait on it, or through one whose every branch is held.

    Example:
        >>> among = ("b", "B.x", 2, _AMONG.format(2))
        >>> _all_back([(0, []), (1, [])], 2), _all_back([(0, [])], 2)
        (True, False)
        >>> _all_back([(0, []), (1, [among + (0, 2)])], 2)
        False
        >>> _all_back([(0, []), (1, [among + (0, 2)]), (1, [among + (1, 2), ("b", "B.x", 2, _CLOSES)])], 2)
        True
    """
    by: Dict[int, list] = {}
    for b, hops in ways:
        by.setdefault(b, []).append(hops)
    if len(by) < k:
        return False
    for b in range(k):
        held = False
        deeper: Dict[Any, list] = {}
        for hops in by.get(b, ()):
            at = next((i for i, q in enumerate(hops) if _among(q)), None)
            if at is None:
                held = True  # back, with no such wait on the way
                break
            q = hops[at]
            deeper.setdefault((q[0], q[5]), []).append((q[4], hops[at + 1:]))
        if not held:
            held = any(_all_back(sub, n) for (_, n), sub in deeper.items())
        if not held:
            return False
    return True


def _cycle_text(path: list, start: int = 0) -> str:
    """A wait cycle's probe path in words, from its hop ``start``, back to
    its first.

    Example:
        >>> path = [((0, 1), "A.start", 1, "waits for"), ((0, 2), "B.bounce", 2, "waits for")]
        >>> _cycle_text(path)
        'A.start (context 1) waits for B.bounce (context 2), which waits for A.start (context 1)'
        >>> _cycle_text(path, 1)
        'B.bounce (context 2), which waits for A.start (context 1)'
    """
    end = path[0]
    if path[-1][3] == _CLOSES:  # back at a wait on the way, not at the first
        path, end = path[:-1], path[-1]
    hops = [f"{p[1]} (context {p[2]})" for p in path] + [f"{end[1]} (context {end[2]})"]
    return hops[start] + "".join(f"{', which' if i else ''} {path[i][3]} {hops[i + 1]}"
                                 for i in range(start, len(path)))


def _detached(bufs: List[Any]) -> List[Any]:
    """Copies of a result's out-of-band buffers (its large arrays): pickled,
    they are views of the method's own objects, and the value is kept until
    it is asked for (a large one always: its caller is told it is ready,
    then asks). A method that returned ``self.a`` and then changed it, or a
    later call that did, changed the value its caller got.

    Example:
        >>> import numpy as np
        >>> a = np.zeros(8)
        >>> (kept,) = _detached([pickle.PickleBuffer(a)])
        >>> a += 1; bytes(kept.raw()) == bytes(8 * 8)
        True
    """
    out = []
    for b in bufs:
        raw = _raw(b)
        # (numpy's memory: no zeroing, and huge pages, which fault far less;
        # bytearray(raw) took 13 ms for 16 MB here, this 2 to 5 ms; kept a
        # PickleBuffer, as the rest expects)
        copy = numpy().empty(raw.nbytes, "u1")
        memoryview(copy)[:] = raw
        out.append(pickle.PickleBuffer(copy))
    return out


def _raw(p) -> memoryview:
    return p.raw() if isinstance(p, pickle.PickleBuffer) else memoryview(p).cast("B")


# Futures are searched for in arguments inside these containers, their
# subclasses (namedtuples, OrderedDict, defaultdict, ...) included; other
# objects travel as they are (a future inside one is pickled with it: escaped).
_CONTAINERS = (list, tuple, dict, set, frozenset)
_ATOMS = frozenset((int, float, str, bytes, bool, type(None), complex))
_DEEP = 50  # nesting beyond this is searched without recursion (it may be a cycle)


def _shareable(target) -> bool:
    """Whether a call's target holds nothing that can change, so that a call
    to one's own context may be queued without a copy: a name, None, or a
    tuple of ids, classes, and tuples of plain values (a regular object's
    constructor arguments) with an empty dict beside them.

    Example:
        >>> _shareable(((0, 3),)), _shareable((int, (1, "a"), {}, b"key", 9)), _shareable("stats")
        (True, True, True)
        >>> _shareable((int, ([1],), {})), _shareable((int, (), {"x": 1}))
        (False, False)
    """
    if target is None or type(target) is str:
        return True
    if type(target) is not tuple:
        return False
    for t in target:
        tt = type(t)
        if tt is tuple:
            for v in t:
                if type(v) not in _PLAIN:
                    return False
        elif tt is dict:
            if t:
                return False
        elif tt not in _PLAIN and not isinstance(t, type):
            return False
    return True


def _plain_target(target) -> bool:
    """Whether a call's target, as sent, is a tuple of plain values, tuples
    of them and dicts of them by name (an object's id; a regular call's
    class number and constructor arguments), which the C pickler writes as
    the runtime's encoder would.

    Example:
        >>> _plain_target(((0, 3),)), _plain_target((2, (1, "a"), {}, None, 0))
        (True, True)
        >>> _plain_target((int, (), {})), _plain_target("stats"), _plain_target((1, [2]))
        (False, False, False)
    """
    if type(target) is not tuple:
        return False
    for t in target:
        k = type(t)
        if k in _PLAIN:
            continue
        if k is tuple:
            for x in t:
                if type(x) not in _PLAIN:
                    return False
        elif k is dict:
            for name, x in t.items():
                if type(name) is not str or type(x) not in _PLAIN:
                    return False
        else:
            return False
    return True


def _has_future(xs, depth: int = 0) -> bool:
    for x in xs:
        t = type(x)
        if t is Future:
            return True
        if t in _ATOMS:
            continue
        if t is list or t is tuple:
            pass
        elif t is dict:
            x = x.values()
        elif isinstance(x, _CONTAINERS):
            x = x.values() if isinstance(x, dict) else x
        else:
            continue
        if depth >= _DEEP:
            return _holds_deep(x, Future)
        if _has_future(x, depth + 1):
            return True
    return False


def _holds_deep(xs, leaf: type) -> bool:
    seen = set()
    stack = [iter(xs)]
    while stack:
        for x in stack[-1]:
            if type(x) is leaf:
                return True
            if isinstance(x, _CONTAINERS) and id(x) not in seen:
                seen.add(id(x))
                stack.append(iter(x.values() if isinstance(x, dict) else x))
                break
        else:
            stack.pop()
    return False


def _replace(x, leaf: type, fn: Callable[[Any], Any], depth: int = 0):
    """``x`` with every ``leaf`` inside its containers replaced by ``fn(leaf)``;
    containers without one are returned as they are (not copied)."""
    t = type(x)
    if t is leaf:
        return fn(x)
    if t in _ATOMS or not isinstance(x, _CONTAINERS):
        return x
    if depth > _DEEP:
        if not _holds_deep((x,), leaf):
            return x  # deep, maybe cyclic, and nothing to replace: pickle copes
        raise errors.CallError("a future nested more than 50 containers deep (or inside a "
                               "container that contains itself) cannot be an argument")
    d = depth + 1
    if t is list:
        return [_replace(v, leaf, fn, d) for v in x] if _holds(x, leaf) else x
    if t is tuple:
        return tuple([_replace(v, leaf, fn, d) for v in x]) if _holds(x, leaf) else x
    if t is dict:
        return {k: _replace(v, leaf, fn, d) for k, v in x.items()} if _holds(x.values(), leaf) else x
    if not _holds(x.values() if isinstance(x, dict) else x, leaf):
        return x
    if isinstance(x, dict):
        y = copy.copy(x)  # keeps the subclass and its state (defaultdict's factory, ...)
        for k in list(y):
            y[k] = _replace(y[k], leaf, fn, d)
        return y
    items = [_replace(v, leaf, fn, d) for v in x]
    if isinstance(x, tuple) and hasattr(t, "_make"):
        return t._make(items)  # a namedtuple
    if isinstance(x, list):
        y = copy.copy(x)
        y[:] = items
        return y
    if isinstance(x, set):
        y = copy.copy(x)
        y.clear()
        y.update(items)
        return y
    return t(items)  # tuple and frozenset subclasses


def _holds(xs, leaf: type) -> bool:
    if leaf is Future:
        return _has_future(xs)
    return True  # arcs: the receiver substitutes wherever the sender put one


def _subst(x, call: Call, eng):
    def value(arc):
        ok, v = call_token(call, arc.fid, eng)
        if not ok:
            raise v
        return v
    return _replace(x, Arc, value)


class _Shared:
    """A value pulled once for several calls of this context (Engine._share):
    each call takes a copy of its own, the last one the value itself, so that
    none sees what another's method did to its argument."""

    __slots__ = ("value", "left")

    def __init__(self, value: Any, users: int):
        self.value = value
        self.left = users

    def take(self) -> Any:
        self.left -= 1
        if self.left <= 0:
            v, self.value = self.value, None
            return v
        return _copy_value(self.value)


def _claimed(tok: Tuple[bool, Any]) -> Tuple[bool, Any]:
    """A token as one call takes it: a shared value's copy of its own."""
    return (True, tok[1].take()) if type(tok[1]) is _Shared else tok


def call_token(call: Call, afid, eng):
    """The value of one arc of ``call``: the token itself at its first use, a
    copy at every later one (the same future twice in a call, or a guard that
    read the arguments before the method), so call-by-value holds."""
    label = (afid, call.fid)
    if call.tokens is None:
        call.tokens = {}
    tok = call.tokens.get(label)
    if tok is None:
        tok = eng.tokens.pop(label, None)
        if tok is None:
            raise RuntimeError(f"internal: token {label} missing")
        tok = call.tokens[label] = _claimed(tok)
        return tok
    ok, v = tok
    if not ok:
        return tok
    return True, _copy_value(v)


def _value_passed(f: Future, passed: set) -> Any:
    """The value of ``f``, finished here, as an argument of a call: the
    value itself, or a copy of its own if ``f`` is in ``passed`` (given to
    the same call already), so that each parameter gets its own."""
    v = f._value
    if type(v) not in _PLAIN:
        if f._fid in passed:
            return _copy_value(v)
        passed.add(f._fid)
    return v


def keep_setting() -> int:
    """Bytes of large pulled values a context keeps (see Engine._keep):
    MACROFLOW_KEEP_MB, in MiB (0: none), 256 unless set.

    Example:
        >>> import os
        >>> os.environ["MACROFLOW_KEEP_MB"] = "64"
        >>> keep_setting()
        67108864
        >>> os.environ["MACROFLOW_KEEP_MB"] = "lots"
        >>> keep_setting()
        Traceback (most recent call last):
        ...
        ValueError: MACROFLOW_KEEP_MB must be a number of MiB >= 0 (0: keep no pulled values); got 'lots'
        >>> del os.environ["MACROFLOW_KEEP_MB"]
    """
    raw = os.environ.get("MACROFLOW_KEEP_MB")
    if raw is None:
        return 256 << 20
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not (0 <= mb < float("inf")):
        raise ValueError(f"MACROFLOW_KEEP_MB must be a number of MiB >= 0 (0: keep no pulled "
                         f"values); got {raw!r}")
    return int(mb * (1 << 20))


def _copy_value(v: Any) -> Any:
    """A copy of ``v`` as a call receives it (pickled and unpickled), so
    that the same value passed twice is two values, as by value.

    Example:
        >>> a = [1, [2]]
        >>> b = _copy_value(a)
        >>> b == a, b is a, b[1] is a[1]
        (True, False, False)
    """
    data, bufs = marshal.dumps(v)
    return marshal.loads(data, [bytearray(b.raw()) for b in bufs])


def _portable_exception(exc: BaseException, ctx: int) -> BaseException:
    try:
        tb = getattr(exc, "__mf_tb__", None)
        if tb is None:
            exc.__mf_tb__ = format_remote(exc, ctx)
        elif getattr(exc, "__mf_tb_seen__", None) != id(exc.__traceback__):
            # an error from elsewhere that user code here let through (a
            # function that waited for it): its frames here, after the others
            exc.__mf_tb__ = tb + _passed_through(exc, ctx)
            exc.__mf_tb_seen__ = id(exc.__traceback__)
    except Exception:
        pass
    return exc


def _passed_through(exc: BaseException, ctx: int) -> str:
    """The user's frames that ``exc`` passed through in this context, from the
    first to the last (the runtime's around them left out), as text to add to
    the traceback it brought from another; "" if none.

    Example:
        >>> def user():
        ...     raise ValueError("from elsewhere")
        >>> try:
        ...     user()
        ... except ValueError as e:
        ...     text = _passed_through(e, 0)
        >>> text.splitlines()[1], "in user" in text
        ('Then raised in context 0 (most recent call last):', True)
    """
    entries = traceback.extract_tb(exc.__traceback__)
    user = [i for i, fs in enumerate(entries) if not _runtime_file(fs.filename)]
    if not user:
        return ""
    frames = traceback.format_list(entries[user[0]:user[-1] + 1])
    return "\nThen raised in context %d (most recent call last):\n%s" % (ctx, "".join(frames))


def _stand_in(exc: BaseException) -> errors.RemoteError:
    """A RemoteError that says what ``exc`` was, for an exception that cannot
    travel as itself; its remote traceback is the original's."""
    try:
        message = str(exc)
    except Exception:
        message = object.__repr__(exc)
    t = type(exc)
    err = errors.RemoteError(f"{t.__module__}.{t.__qualname__}", message)
    err.__mf_tb__ = getattr(exc, "__mf_tb__", "")
    return err


def _restore_exception(exc: Any) -> BaseException:
    if not isinstance(exc, BaseException):
        return errors.RemoteError(type(exc).__name__, repr(exc))
    tb = getattr(exc, "__mf_tb__", None)
    if tb and exc.__cause__ is None:
        exc.__cause__ = errors.RemoteTraceback(tb)
    return exc


# -- system calls: run on any context by name (stats, ping, exit for tests) --
def _sys_stats(eng: Engine):
    return eng.snapshot()


def _sys_ping(eng: Engine, x=None):
    return x


def _sys_exit(eng: Engine, code: int = 0):
    sys.stdout.flush()
    os._exit(code)


def _sys_pid(eng: Engine):
    return os.getpid()


SYSTEM_CALLS: Dict[str, Callable[..., Any]] = {
    "stats": _sys_stats, "ping": _sys_ping, "exit": _sys_exit, "pid": _sys_pid,
}


class _State:
    default: Optional[Engine] = None  # context 0's engine in this process
    current: Optional[Engine] = None  # the engine processing messages right now
    forked_from: Optional[int] = None  # a child forked while that process ran a computation


_state = _State()


def forked_text(ppid: int, usage: Optional[str] = None) -> str:
    """What every use of a computation says in a child forked from a process
    that runs it (``ppid``), with ``usage``, how a computation starts.

    Example:
        >>> forked_text(7)[:56]
        'macroflow is not running in this process: it was forked '
    """
    return (f"macroflow is not running in this process: it was forked (os.fork, "
            f"multiprocessing's fork) from process {ppid}, whose computation it cannot use; "
            f"return values to the parent, or start a computation of its own: "
            + (usage or "mf.run(main, contexts=N) or 'with mf.init(contexts=N):'"))


_PACKAGE_DIR = os.path.dirname(_CORE_DIR) + os.sep
_SERVE_CODE = Engine.serve_forever.__code__


class ForkedAway:
    """The transport of an engine in a child forked (``os.fork``) while its
    process ran the engine (in a method, say): the rings, sockets and MPI
    are the parent's, so nothing here may touch them. A use from the child's
    own code raises RuntimeError; once that code (a method, a handler) has
    returned or raised into the engine, the child ends there, with its
    status (``os._exit``: not the parent's exit handlers either).

    Example:
        >>> t = ForkedAway(7)
        >>> try:
        ...     t.send(1, [b"x"], 0)  # from here, this code: the child's own
        ... except RuntimeError as e:
        ...     print(str(e)[:31])
        macroflow is not running in thi
    """

    def __init__(self, ppid: int) -> None:
        self.ppid = ppid

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._use

    def _use(self, *args: Any, **kwargs: Any) -> Any:
        f = sys._getframe(1)
        while f is not None:
            code = f.f_code
            if code is _SERVE_CODE:
                break  # the engine's own loop, below which nothing is the child's
            if code.co_name == "__del__":
                return None  # a future dropped: the parent releases its own
            if not code.co_filename.startswith(_PACKAGE_DIR):
                raise RuntimeError(forked_text(self.ppid))
            f = f.f_back
        _end_forked_child(sys.exc_info()[1])


def _end_forked_child(exc: Optional[BaseException]) -> None:
    """End a child forked from a process that runs a computation, whose code
    (a method that forked it) came back to the engine having raised ``exc``
    (None: it returned): its status is that of a program that did so."""
    code = 0
    if isinstance(exc, SystemExit):
        if isinstance(exc.code, int):
            code = exc.code
        elif exc.code is not None:
            print(exc.code, file=sys.stderr)
            code = 1
    elif exc is not None:
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass  # (closed by the child's code: nothing more to say)
    os._exit(code & 0xFF)  # (as an exit status: sys.exit(-1) is 255)


def fork_away(engines: List[Any], ppid: int) -> None:
    """In a child forked from process ``ppid``: every engine of it (one, or
    inproc's all) gets a :class:`ForkedAway` transport, and nothing of the
    parent's (its look at the rings, its pollers, its service thread) runs.

    Example:
        >>> class Eng:  # what fork_away touches of an engine
        ...     transport = glance = service = None
        ...     pollers = [print]
        >>> pid = os.fork()
        >>> if pid == 0:  # the child: ends here, saying what it found
        ...     e = Eng()
        ...     fork_away([e], os.getppid())
        ...     os._exit(10 + (type(e.transport) is ForkedAway and not e.pollers))
        >>> os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        11
    """
    for eng in engines:
        eng.transport = ForkedAway(ppid)
        eng.glance = None
        eng.pollers = []
        svc = eng.service
        if svc is not None:
            svc.stopped = True  # its thread, its timer are the parent's
            if getattr(svc, "busy", False):
                svc.busy = False
    if isinstance(getcurrent(), Worker):
        # forked in a method: its code that raises into the engine (sys.exit
        # in the child) ends the child (a new computation there undoes it)
        errors.forked_end = _end_forked_child


def wrong_thread(what: str, eng: Any) -> str:
    """The error for ``what`` done in a thread other than the one that runs
    context ``eng.id`` (one thread does, and its service thread while a
    method computes): on context 0 the program's own, elsewhere the one that
    runs the methods.

    Example:
        >>> class E: id = 1
        >>> print(wrong_thread("macroflow was called", E())[:64])
        macroflow was called from a thread other than context 1's, which
    """
    if eng.id == 0:
        return (f"{what} from a thread other than the one that started the computation; "
                f"do it from that thread")
    return (f"{what} from a thread other than context {eng.id}'s, which runs its methods: "
            f"do it in the method itself (a thread the method starts can hand its work back "
            f"through a queue.Queue, say)")


def current_engine(usage: Optional[str] = None) -> Engine:
    """The engine of the context running this code; raises if none is running.

    ``usage`` is what the error says to do instead (a model's functions name
    the way their programs start); by default, mf.run or mf.init.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     current_engine().id
        0
    """
    g = getcurrent()
    eng = getattr(g, "engine", None)
    if eng is not None:
        if type(eng.transport) is ForkedAway:  # (a child forked in a method of it)
            raise RuntimeError(forked_text(eng.transport.ppid, usage))
    else:
        eng = _state.current or _state.default
        if eng is None:
            if _state.forked_from is not None:
                raise RuntimeError(forked_text(_state.forked_from, usage))
            raise RuntimeError("macroflow is not running: " + (
                usage or "use mf.run(main, contexts=N) or 'with mf.init(contexts=N):'"))
        me = threading.get_ident()
        if me != eng.thread and me != eng.serving:
            # one thread runs a context's engine (and the service thread for
            # the requests it serves while a method computes): another would corrupt it
            raise RuntimeError(wrong_thread("macroflow was called", eng))
    return eng
