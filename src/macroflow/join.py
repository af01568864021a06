"""Workers that join a computation over TCP, from this host or others (Nexus's
dynamic node acquisition), and several protocols in one program.

The program that starts the computation listens::

    mf.init(contexts=4, listen="0.0.0.0:7000")        # or mf.run(main, ..., listen=...)

and any host that can reach it adds contexts::

    MACROFLOW_SECRET=... macroflow worker --connect node0:7000 -n 8

Every context started with the computation speaks two protocols: ``local``
to the contexts of its own host and computation, ``tcp`` to everyone else.
A worker's contexts speak ``local`` among themselves and ``tcp`` to the rest.
Each pair of contexts uses the best protocol both share
(:class:`~macroflow.transport.multi.MultiTransport`).

Joining, step by step:

1. the worker connects to context 0 as a *guest* (an id from
   :data:`~macroflow.transport.multi.GUEST_BASE` up) and both sides prove
   that they hold the computation's secret (HMAC challenge and response, both
   ways) before anything else is read;
2. it asks for ``n`` contexts, giving the TCP address each will listen on;
   context 0 answers with their ids, the computation's id and settings, and
   how to reach every context;
3. the worker forks its contexts; each connects to context 0 and reports in
   (JOINED); context 0 then tells every context how to reach it, and
   placement uses it from then on.

A worker that leaves or dies fails exactly the futures that depended on its
contexts (``ContextLost``), and the computation goes on.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import signal
import socket
import ssl
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from . import launch as _launch
from .core import context as _ctx
from .core import marshal
from .core.context import Engine
from .core.threads import fork
from .launch import ForkLauncher, node_name
from .transport.local import LocalTransport, Mesh
from .transport.multi import GUEST_BASE, MultiTransport
from .transport.base import ended_how

#: seconds a worker waits for context 0 to answer its request to join
JOIN_WAIT = 30.0


def tls_contexts(cert: Optional[str], key: Optional[str]) -> Tuple[Optional[ssl.SSLContext],
                                                                   Optional[ssl.SSLContext]]:
    """(server, client) TLS contexts from one certificate and its key, shared by
    every host of the computation (each side checks the other has it); (None,
    None) without a certificate.

    Example:
        >>> tls_contexts(None, None)
        (None, None)
        >>> tls_contexts("cert.pem", None)
        Traceback (most recent call last):
        ...
        ValueError: TLS needs a certificate and its key (--tls-cert and --tls-key; tls=(cert, key))
        >>> tls_contexts("no-such-cert.pem", "no-such-key.pem")
        Traceback (most recent call last):
        ...
        FileNotFoundError: TLS certificate file 'no-such-cert.pem' not found
    """
    if cert is None and key is None:
        return None, None
    if cert is None or key is None:
        raise ValueError("TLS needs a certificate and its key (--tls-cert and --tls-key; "
                         "tls=(cert, key))")
    for what, path in (("certificate", cert), ("key", key)):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"TLS {what} file {path!r} not found")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        server.load_cert_chain(cert, key)
    except ssl.SSLError as e:  # ("[SSL] PEM lib (_ssl.c:3905)" names neither file)
        raise ValueError(f"cannot use {cert!r} as a TLS certificate with {key!r} as its key: "
                         f"{e}; both must be PEM, the certificate first and its private key "
                         f"second") from None
    server.verify_mode = ssl.CERT_REQUIRED
    server.load_verify_locations(cert)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_cert_chain(cert, key)
    client.check_hostname = False  # hosts are named by the shared certificate, not DNS
    client.load_verify_locations(cert)
    return server, client


def listen_address(listen: Any) -> Tuple[str, int]:
    """Where context 0 listens for workers: "HOST:PORT", ":PORT" or a port
    number (loopback unless a host is given).

    Example:
        >>> listen_address(7000), listen_address(":7000"), listen_address("0.0.0.0:0")
        (('127.0.0.1', 7000), ('127.0.0.1', 7000), ('0.0.0.0', 0))
        >>> listen_address("7000x")
        Traceback (most recent call last):
        ...
        ValueError: listen must be "HOST:PORT", ":PORT" or a port number; got '7000x'
    """
    from .transport.tcp import parse_address
    if isinstance(listen, int) and not isinstance(listen, bool) and 0 <= listen <= 65535:
        return "127.0.0.1", listen
    if isinstance(listen, str):
        text = listen.strip()
        if text.startswith(":"):
            text = "127.0.0.1" + text
        try:
            return parse_address(text, listening=True)
        except ValueError:
            pass
    raise ValueError(f'listen must be "HOST:PORT", ":PORT" or a port number; got {listen!r}')


class TcpLauncher(ForkLauncher):
    """Contexts forked from this process as on ``local``, each reachable over
    TCP, and a door for workers of other hosts (see the module's documentation).

    With ``use_local`` (``mf.init(listen=...)``), the forked contexts talk to
    each other by the local path and TCP is for workers; without it (the
    ``tcp`` transport), every context talks TCP.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=2, listen="127.0.0.1:0",
        ...              secret="a secret of sixteen bytes or more") as s:
        ...     [p for p, _ in s.engine.transport.addresses()]
        ['local', 'tcp']
    """

    def __init__(self, session: Any, listen: Any, secret: str, tls: Tuple[Any, Any],
                 use_local: bool = True) -> None:
        super().__init__(session)
        self.host, self.port = listen_address(listen)
        self.secret = secret
        self.server_ssl, self.client_ssl = tls
        self.use_local = use_local
        self.tcp_listeners: Dict[int, socket.socket] = {}
        self.bound: Dict[int, Tuple[str, int]] = {}
        self.directory: Dict[int, Tuple[Tuple[str, str], ...]] = {}
        self.next_id = session.size
        self.workers: Dict[int, Dict[str, Any]] = {}  # first id of a worker -> what it said
        self.announce_secret = False  # made here: print it with the address

    # -- contexts started with the computation ---------------------------------
    def start(self, placement: Any, spin_us: float) -> Engine:
        from .transport.tcp import listen
        n = self.session.size
        try:
            self.tcp_listeners[0] = listen(self.host, self.port)
            for c in range(1, n):  # made here, so the directory is known before anyone runs
                self.tcp_listeners[c] = listen(self.host, 0)
        except BaseException:
            for s in self.tcp_listeners.values():
                s.close()
            raise
        self.bound = {c: ls.getsockname()[:2] for c, ls in self.tcp_listeners.items()}
        self.spin_us = spin_us
        self.placement = placement
        try:
            eng = super().start(placement, spin_us)
        finally:
            for s in self.tcp_listeners.values():
                s.close()
            self.tcp_listeners.clear()
        if self.use_local:
            marshal.main_by_value()  # workers did not fork from this program
        self.address = self.tcp_address(0)
        for c in range(n):
            self.directory[c] = self._descriptor(c, self.pid(c))
        eng.transport.control["join"] = self._on_join
        eng.on_joined = self._on_joined
        if self.use_local:
            secret = f"MACROFLOW_SECRET={self.secret} " if self.announce_secret else ""
            print(f"macroflow: listening for workers at {self.address}; join with: "
                  f"{secret}macroflow worker --connect {self.address} -n N", file=sys.stderr,
                  flush=True)
        return eng

    def protocols(self, ctx: int) -> Optional[Tuple[Tuple[str, str], ...]]:
        return self.directory.get(ctx)

    def tcp_address(self, ctx: int) -> str:
        from .transport.tcp import format_address
        host, port = self.bound[ctx]
        return format_address(socket.gethostname() if host in ("0.0.0.0", "::") else host, port)

    def _descriptor(self, ctx: int, pid: Any) -> Tuple[Tuple[str, str], ...]:
        tcp = ("tcp", self.tcp_address(ctx))
        if not self.use_local:
            return (tcp,)
        return (("local", f"{_node_key()}/{self.session.computation}:{pid}"), tcp)

    def _tcp(self, ctx: int, listener: socket.socket, spin_us: float, peers: Any = None) -> Any:
        from .transport.tcp import TcpTransport
        return TcpTransport(ctx, self.secret, self.session.computation, listener=listener,
                            spin_us=spin_us, server_ssl=self.server_ssl,
                            client_ssl=self.client_ssl, guests=ctx == 0, peers=peers)

    def forked(self, ctx: int) -> None:
        self.tcp_listeners.pop(ctx).close()  # its own now

    def own_sockets(self) -> List[socket.socket]:
        return list(self.tcp_listeners.values())

    def root_transport(self, socks: Dict[int, socket.socket], mesh: Any, spin_us: float) -> Any:
        tcp = self._tcp(0, self.tcp_listeners.pop(0), spin_us,
                        peers={c: self.tcp_address(c) for c in self.bound if c})
        if not self.use_local:
            for s in socks.values():
                s.close()  # each child connects to context 0 over TCP instead
            return MultiTransport(0, [tcp], self._first_directory(), spin_us=spin_us)
        local = LocalTransport(0, socks, spin_us, mesh=mesh)
        return MultiTransport(0, [local, tcp], self._first_directory(), spin_us=spin_us)

    def _first_directory(self) -> Dict[int, Tuple[Tuple[str, str], ...]]:
        # pids are not known before the fork; the local path needs only the rest
        return {c: self._descriptor(c, 0) for c in self.bound}

    def child_transport(self, ctx: int, sock: socket.socket, listener: socket.socket,
                        mesh: Any, spin_us: float) -> Any:  # pragma: no cover - in children
        from .transport.tcp import listen
        mine = self.tcp_listeners.pop(ctx, None)
        for s in self.tcp_listeners.values():
            s.close()  # the others' listeners: kept here, they would outlive their contexts
        self.tcp_listeners.clear()
        if mine is None:  # added while running: listens where context 0 does
            mine = listen(self.host, 0)
        peers = {c: self.tcp_address(c) for c in self.bound}
        tcp = self._tcp(ctx, mine, spin_us, peers=peers)
        if not self.use_local:
            sock.close()
            listener.close()
            tcp.connect(0, wait=False)  # context 0 hears at once when this one ends
            return MultiTransport(ctx, [tcp], self._first_directory(), spin_us=spin_us)
        local = LocalTransport(ctx, {0: sock}, spin_us, mesh=mesh, listener=listener)
        return MultiTransport(ctx, [local, tcp], self._first_directory(), spin_us=spin_us)

    def add(self, ids: List[int], init: Any) -> None:
        self.next_id = max(self.next_id, ids[-1] + 1)
        super().add(ids, init)

    # -- ending the computation ------------------------------------------------
    def _joined_open(self) -> List[int]:
        """The contexts of joined workers still connected: no process of ours."""
        eng = self.engine
        if eng is None or eng.transport is None:
            return []
        connected = set(eng.transport.peers() or ())
        return [c for w in self.workers.values() for c in w["ids"] if c in connected]

    def wait(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        super().wait(grace)
        # the workers' contexts leave as ours do (told to stop), unless they compute
        t = self.engine.transport if self.engine is not None else None
        while t is not None and self._joined_open():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            t.poll(min(left, 0.01))

    def stop(self) -> None:
        # what we would kill if they were ours: they end themselves when told
        # (a control frame, read even while a method computes there)
        eng = self.engine
        for c in self._joined_open():
            try:
                eng.transport.send_control(c, "end", None)  # type: ignore[union-attr]
            except Exception:
                pass
        if eng is not None and eng.transport is not None:
            try:
                eng.transport.flush()
            except Exception:
                pass
        super().stop()

    # -- workers joining -------------------------------------------------------
    def _on_join(self, guest: int, request: Any) -> None:
        eng = self.engine
        assert eng is not None
        multi = eng.transport
        try:
            n = int(request["n"])
            addresses = [str(a) for a in request["tcp"]]
            if n < 1 or len(addresses) != n:
                raise ValueError(f"asked for {n} contexts with {len(addresses)} addresses")
        except (KeyError, TypeError, ValueError) as e:
            multi.send_control(guest, "refused", f"a request to join that makes no sense: {e}")
            return
        theirs, ours = request.get("runtime"), runtime_versions()
        if theirs != ours:
            multi.send_control(guest, "refused", (
                f"the worker runs {_describe_runtime(theirs)}, and this computation "
                f"{_describe_runtime(ours)}: the classes and functions of the program's "
                f"__main__ travel by value, as Python code pickled by cloudpickle, which "
                f"another version of either may not read; run the worker with the same "
                f"versions"))
            return
        first = max(self.next_id, eng.size)
        ids = list(range(first, first + n))
        self.next_id = first + n
        for c, addr in zip(ids, addresses):
            multi.learn(c, (("tcp", addr),))
        self.workers[first] = {"node": request.get("node"), "ids": ids}
        directory = {c: self.directory.get(c) or tuple(eng.joined[c][0].protocols)
                     for c in eng.context_ids() if c in self.directory or c in eng.joined}
        multi.send_control(guest, "welcome", {
            "ids": ids, "computation": self.session.computation, "directory": directory,
            "placement": self.placement, "spin_us": self.spin_us, "size": self.next_id,
            "version": _launch_version()})
        multi.flush()

    def _on_joined(self, ctx: int) -> None:
        eng = self.engine
        assert eng is not None
        info, error = eng.joined[ctx]
        if ctx in eng.lost:
            # its end was seen before its report was read (an init that raised
            # ends the context at once): what it said stays in eng.joined for
            # add_contexts' error, but no one is to learn where a gone context was
            return
        protocols = tuple(info.protocols)
        self.directory[ctx] = protocols
        eng.grow(ctx + 1)
        multi = eng.transport
        multi.learn(ctx, protocols)
        members = eng.members()
        try:  # first: it learns which contexts left before it came
            eng.send(ctx, members)
        except ConnectionError:
            pass
        for c in eng.context_ids():
            if c in (0, ctx):
                continue
            try:
                multi.announce(c, ctx, protocols)  # it may hear of the new one any time now
                eng.send(c, members)
                if c in self.directory:
                    multi.announce(ctx, c, self.directory[c])  # and the new one of it
            except ConnectionError:
                pass


def runtime_versions() -> Dict[str, str]:
    """What a worker's code must share with the computation it joins: Python's
    major.minor (pickled code objects are Python's own) and cloudpickle's.

    Example:
        >>> sorted(runtime_versions())
        ['cloudpickle', 'python']
    """
    import cloudpickle
    return {"python": "%d.%d" % sys.version_info[:2],
            "cloudpickle": ".".join(cloudpickle.__version__.split(".")[:2])}


def _describe_runtime(versions: Any) -> str:
    if not isinstance(versions, dict):
        return "versions it did not say (an older macroflow)"
    return (f"Python {versions.get('python', '?')} with cloudpickle "
            f"{versions.get('cloudpickle', '?')}")


def _launch_version() -> str:
    from . import __version__
    return __version__


# -- the worker side ------------------------------------------------------------
def worker_main(connect: str, n: int = 1, secret: Optional[str] = None,
                tls: Tuple[Any, Any] = (None, None), bind: Optional[str] = None,
                out: Any = None) -> int:
    """Join the computation listening at ``connect`` with ``n`` contexts and
    serve until it ends; returns an exit code (0: the computation ended).

    ``bind`` is the address this host's contexts listen on (default: the one
    this host reaches ``connect`` from).

    Example:
        >>> worker_main("nowhere:1", n=0)
        Traceback (most recent call last):
        ...
        ValueError: n must be an int >= 1; got 0
    """
    from .transport.tcp import TcpTransport, format_address, listen, load_secret, parse_address
    out = out if out is not None else sys.stderr
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1; got {n!r}")
    # this process runs none of the program's script: what its __main__ defined
    # comes by value, and goes on by value (to a third context, say)
    marshal.main_by_value()
    host, port = parse_address(connect)
    secret = secret if secret is not None else load_secret()
    if bind is None:
        try:
            probe = socket.create_connection((host, port), timeout=10)
        except OSError as e:
            print(f"macroflow worker: cannot reach {connect}: {e}", file=out)
            return 1
        bind = probe.getsockname()[0]
        probe.close()
    listeners = [listen(bind, 0) for _ in range(n)]
    addresses = [format_address(bind, s.getsockname()[1]) for s in listeners]
    guest = GUEST_BASE + secrets.randbelow(1 << 30)
    door = TcpTransport(guest, secret, "", host=bind, port=0, server_ssl=tls[0],
                        client_ssl=tls[1], peers={0: connect}, connect_timeout=JOIN_WAIT)
    multi = MultiTransport(guest, [door])
    answer: List[Tuple[str, Any]] = []
    multi.control["welcome"] = lambda src, p: answer.append(("welcome", p))
    multi.control["refused"] = lambda src, p: answer.append(("refused", p))
    lost: List[str] = []
    multi.attach(lambda *a: None, lambda peer, how: lost.append(how))
    # a failed join is said once, below, with its reason: not by the door's log too
    tcp_log = logging.getLogger("macroflow.tcp")
    level = tcp_log.level
    tcp_log.setLevel(logging.CRITICAL)
    try:
        multi.learn(0, (("tcp", connect),))
        multi.send_control(0, "join", {"n": n, "tcp": addresses, "node": node_name(),
                                       "runtime": runtime_versions()})
        deadline = time.monotonic() + JOIN_WAIT
        while not answer and not lost and time.monotonic() < deadline:
            multi.poll(0.1)
    except ConnectionError as e:
        lost.append(str(e))
    finally:
        multi.close()
        tcp_log.setLevel(level)
    if not answer:
        for s in listeners:
            s.close()
        why = lost[0] if lost else f"no answer within {JOIN_WAIT:g} s"
        if tls[0] is None and "the connection failed:" in why:
            # (a computation that speaks TLS resets the connection, saying nothing)
            why += " (if the computation uses TLS, give --tls-cert and --tls-key)"
        print(f"macroflow worker: could not join the computation at {connect}: {why}", file=out)
        return 1
    kind, welcome = answer[0]
    if kind == "refused":
        print(f"macroflow worker: {connect} refused to let us join: {welcome}", file=out)
        return 1
    ids = welcome["ids"]
    print(f"macroflow worker: joined computation {welcome['computation']} at {connect} as "
          f"context{'s' if n > 1 else ''} {', '.join(map(str, ids))}", file=out, flush=True)
    return _serve_group(ids, listeners, welcome, secret, tls, out)


_LOST_MAIN = 3  # a worker's context left because context 0 was lost


def _ended_while_computing(src: int, payload: Any) -> None:  # pragma: no cover - ends the process
    """Context 0 ended the computation while this context computed (it did not
    leave when told to): end now, as context 0 ends the contexts it forked."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(0)


def _main_lost_while_busy(ctx: int, out: Any, how: str) -> None:  # pragma: no cover - ends the process
    """Context 0 was lost (killed, say) while a method computed here: leave
    now, as the contexts context 0 forked do, not when the method ends."""
    try:
        # one write: the worker's other contexts may be saying the same
        out.write(f"macroflow worker: context {ctx}: the computation's context 0 was lost "
                  f"({how}) while a method computed here; leaving\n")
        out.flush()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(_LOST_MAIN)


def _serve_group(ids: List[int], listeners: List[socket.socket], welcome: Dict[str, Any],
                 secret: str, tls: Tuple[Any, Any], out: Any) -> int:
    from .transport.tcp import TcpTransport
    computation = welcome["computation"]
    mesh = Mesh(f"{computation}-w{ids[0]}", max(ids) + 1)
    sys.stdout.flush()
    sys.stderr.flush()
    pids: Dict[int, int] = {}
    for i, ctx in enumerate(ids):
        mesh_listener = mesh.listen(ctx)
        # (a Ctrl-C meanwhile is raised here, the child noted to be stopped)
        pid = fork(lambda p: pids.__setitem__(ctx, p))
        if pid == 0:  # pragma: no cover - runs in the context's process
            code = 0
            eng = None
            try:
                _launch._set_pdeathsig()
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker's to handle
                for j, s in enumerate(listeners):
                    if j != i:
                        s.close()
                local = LocalTransport(ctx, {}, welcome["spin_us"], mesh=mesh,
                                       listener=mesh_listener)
                tcp = TcpTransport(ctx, secret, computation, listener=listeners[i],
                                   spin_us=welcome["spin_us"], server_ssl=tls[0],
                                   client_ssl=tls[1])
                multi = MultiTransport(ctx, [local, tcp], spin_us=welcome["spin_us"])
                multi.control["end"] = _ended_while_computing
                for c, protocols in welcome["directory"].items():
                    multi.learn(c, protocols)
                for c in ids:  # the others of this worker: by the local path
                    if c != ctx:
                        multi.learn(c, (("local", f"{_node_key()}/{mesh.computation}:0"),))
                eng = Engine(ctx, welcome["size"], multi, welcome["placement"].copy(),
                             computation=computation)
                eng.describe_lost = lambda peer: ""
                eng.main_lost_while_busy = functools.partial(_main_lost_while_busy, ctx, out)
                _ctx._state.default = eng
                if _launch.joined(eng, lambda: None):
                    eng.serve_forever()
                    if 0 in eng.lost:  # not told to stop: context 0 went away
                        print(f"macroflow worker: context {ctx}: the computation's context 0 "
                              f"was lost ({eng.lost[0]}); leaving", file=out, flush=True)
                        code = _LOST_MAIN
            except BaseException as e:
                text = _ctx.fatal_text(e)
                sys.stderr.write(text)
                if eng is not None:
                    eng.report_fatal(text)
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = ctx
        mesh_listener.close()
    for s in listeners:
        s.close()
    code = 0
    if threading.current_thread() is threading.main_thread():
        # the first Ctrl-C stops the contexts; one after it (a second, or the
        # computation's own interrupt reaching the group) is ignored from the
        # moment the first arrives: caught only in the handler below, it
        # could land before that took it, and end the worker with -2
        signal.signal(signal.SIGINT, _interrupted_once)
    try:
        while pids:
            pid, status = _wait_any()
            ctx = pids.pop(pid, None)
            if ctx is not None and status != 0:
                code = 1
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == _LOST_MAIN:
                    continue  # it said why
                print(f"macroflow worker: context {ctx} {ended_how(status)}", file=out,
                      flush=True)
    except KeyboardInterrupt:
        # (a second Ctrl-C, or the computation's own interrupt reaching the
        # group, must not cut the stopping short: it left a traceback)
        with _launch._sigint_ignored():
            for pid in pids:
                _launch._kill(pid)
            print("macroflow worker: interrupted; its contexts were stopped", file=out)
        return 130
    return code


def _interrupted_once(signum: int, frame: Any) -> None:
    """A worker's SIGINT handler: KeyboardInterrupt, once (SIGINT ignored
    from then on).

    Example:
        >>> previous = signal.signal(signal.SIGINT, _interrupted_once)
        >>> try:
        ...     os.kill(os.getpid(), signal.SIGINT); time.sleep(1)
        ... except KeyboardInterrupt:
        ...     print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
        ... finally:
        ...     _ = signal.signal(signal.SIGINT, previous)
        True
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


#: how long a context that failed stays a zombie before it is reaped: a
#: peer of this host that saw its connection close reads how it ended from
#: /proc meanwhile (it looks for 0.1 s); reaped at once, it read "has ended"
#: for a context killed by a signal, in 4 of 6 runs
ZOMBIE_HOLD = 0.5


def _wait_any() -> Tuple[int, int]:
    """Wait for a child to end and reap it: ``(pid, wait status)``, as
    :func:`os.wait`; one that failed is reaped :data:`ZOMBIE_HOLD` seconds
    after it ended.

    Example:
        >>> import subprocess, sys
        >>> p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        >>> pid, status = _wait_any()
        >>> pid == p.pid, os.waitstatus_to_exitcode(status)
        (True, 3)
        >>> p.returncode = 3  # (reaped here: Popen need not)
    """
    info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
    if info is not None and not (info.si_code == os.CLD_EXITED and info.si_status == 0):
        time.sleep(ZOMBIE_HOLD)
    return os.waitpid(info.si_pid if info is not None else -1, 0)


def _node_key() -> str:
    from .transport.local import node_key
    return node_key()
