"""The ``tcp`` protocol module: contexts on any hosts, over TCP.

A context's descriptor is ``("tcp", "host:port")``: every context listens on
a TCP socket (on 127.0.0.1 unless told otherwise) and connects to a peer when
it first has something to send there, at the address its directory gives for
that peer (:meth:`TcpTransport.add_peer`; the directory may grow while the
computation runs). It accepts the connections its peers make.

Frames travel exactly as on the ``local`` transport: :class:`TcpTransport` is
a :class:`~macroflow.transport.local.LocalTransport` whose connections are TCP
streams (TCP_NODELAY on, keepalive on), so framing, out-of-band buffers
received in place, pooled receive buffers, flow control, order per pair,
lost-peer reporting and spin-then-sleep polling are the ones the conformance
suite checks there. What this module adds is how a connection is admitted.

The handshake. No byte a peer sends is unpickled before both ends have
proved that they know the computation's secret (multiprocessing's authkey
scheme, both ways). Every handshake message is ``<4sBH`` (magic ``MFt1``,
kind, body length, at most 1024) and a body::

    connector                                   acceptor
      HELLO  major, minor, its id, the id it      CHALLENGE  major, minor,
             wants, nonce_c, computation id,                 nonce_a
             its own listening address
      PROOF  HMAC(secret, "connector" + T)  -->   checks it (compare_digest)
                                           <--    PROOF  HMAC(secret, "acceptor" + T)
      checks it; DONE                      -->

T is both bodies, byte for byte: the nonces, the ids, the versions and the
computation id are all authenticated, and neither proof can be replayed or
reflected (the roles are part of what is signed). The acceptor answers a
challenge only after the connector has proved itself, so it is nobody's
oracle. Then each end compares macroflow's major.minor version, and the
connection carries frames. A connection that fails, sends garbage, announces
an oversize message or stalls is closed and logged (logger
``macroflow.tcp``); the transport and its other connections go on.

Waiting. Connections being admitted live in a *lobby*, an epoll set of their
own whose descriptor sits in the transport's epoll set: the handshakes are a
non-blocking state machine stepped whenever the lobby is ready, so a slow or
hostile connector never holds up the frames of the others. A context that
sends to a peer it has no connection to waits for that handshake (serving
everything else meanwhile, as it does while a full peer drains), as long as
the connection stays up (``connect_timeout`` bounds it if given): a peer that
computes answers when it next waits, as a full peer drains when it next reads.
Connections of others that stall before they have authenticated themselves
are closed after ``handshake_timeout``; at most ``max_handshakes`` of them are
admitted at once, the others wait in the kernel's backlog.

Two contexts that connect to each other at the same moment both succeed:
each sends on the first connection it completes with the other and reads
from both, which keeps order per (sender, receiver) pair, as on ``local``.

Without TLS the frames cross the network in the clear and an attacker on the
path could hijack a connection after its handshake; pass ``ssl`` contexts
(``server_ssl`` and ``client_ssl``) on networks you do not trust.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import math
import os
import secrets
import select
import socket
import ssl
import stat
import struct
import time
from collections import deque
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from .local import LocalTransport, nofile_error
from .multi import GUEST_BASE

log = logging.getLogger("macroflow.tcp")

_MAGIC = b"MFt1"
_HS = struct.Struct("<4sBH")  # magic, kind, body length
_HS_MAX = 1024  # the longest handshake body accepted
HELLO, CHALLENGE, PROOF, REFUSE, DONE = 1, 2, 3, 4, 5
_KINDS = {HELLO: "HELLO", CHALLENGE: "CHALLENGE", PROOF: "PROOF", REFUSE: "REFUSE", DONE: "DONE"}
_HELLO = struct.Struct("<HHII32s")  # major, minor, connector id, acceptor id wanted, nonce
_CHALLENGE = struct.Struct("<HH32s")  # major, minor, nonce
_MAC = 32  # bytes of an HMAC-SHA256
# why an acceptor refused an authenticated connector (or one that failed to authenticate)
R_SECRET, R_NOT_ME, R_COMPUTATION, R_ID = 1, 2, 3, 4
_REFUSALS = {
    R_SECRET: "it does not know this context's secret (the contexts were given different secrets)",
    R_NOT_ME: "it is not the context this address was given for (a stale address?)",
    R_COMPUTATION: "it belongs to another computation",
    R_ID: "it does not accept this context's id (its own id, or a context it has lost)",
}
# states of a connection in the lobby
(_CONNECTING, _TLS, _START, _WAIT_HELLO, _WAIT_CHALLENGE, _WAIT_PROOF, _WAIT_DONE, _FLUSH,
 _FAILED) = range(9)
_WAITING = (_WAIT_HELLO, _WAIT_CHALLENGE, _WAIT_PROOF, _WAIT_DONE)
_DUE = {_WAIT_HELLO: HELLO, _WAIT_CHALLENGE: CHALLENGE, _WAIT_PROOF: PROOF, _WAIT_DONE: DONE}
_MIN_SECRET = 16  # bytes
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
_KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))


def _version() -> Tuple[int, int]:
    from .. import __version__
    major, minor = __version__.split(".")[:2]
    return int(major), int(minor)


# -- addresses and secrets ------------------------------------------------------
def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets.

    Example:
        >>> format_address("127.0.0.1", 5000), format_address("::1", 5000)
        ('127.0.0.1:5000', '[::1]:5000')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: Any, listening: bool = False) -> Tuple[str, int]:
    """Split ``"host:port"`` (IPv6: ``"[::1]:port"``) into ``(host, port)``.

    The port is 1..65535, or 0 (any free port) when ``listening``; anything
    else raises ValueError naming the address.

    Example:
        >>> parse_address("node7.cluster:5000"), parse_address("[::1]:80")
        (('node7.cluster', 5000), ('::1', 80))
        >>> parse_address("node7")
        Traceback (most recent call last):
        ...
        ValueError: a TCP address is 'host:port' (IPv6: '[::1]:port') with a port from 1 to 65535; got 'node7'
    """
    low = 0 if listening else 1
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 host without brackets: the port cannot be told apart
    if sep and host and port.isdigit() and low <= int(port) <= 65535:
        return host, int(port)
    raise ValueError(f"a TCP address is 'host:port' (IPv6: '[::1]:port') with a port from "
                     f"{low} to 65535; got {address!r}")


def load_secret(path: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> str:
    """The computation's secret, for every context that joins it over TCP.

    Taken from the file ``path`` if given, else from the MACROFLOW_SECRET
    environment variable, else from the file that MACROFLOW_SECRET_FILE
    names; else a new random one (64 hex digits) is made, which the program
    that starts the computation hands to the others (print it, or write it
    to a file only its user can read). Surrounding white space is dropped.
    A secret shorter than 16 characters raises ValueError; a file that other
    users may read is used, with a warning.

    Example:
        >>> load_secret(environ={"MACROFLOW_SECRET": "correct horse battery staple"})
        'correct horse battery staple'
        >>> len(load_secret(environ={}))
        64
        >>> load_secret(environ={"MACROFLOW_SECRET": "hunter2"})
        Traceback (most recent call last):
        ...
        ValueError: the MACROFLOW_SECRET environment variable holds a secret of 7 characters; use at least 16 (for instance 64 hex digits: python3 -c "import secrets; print(secrets.token_hex(32))")
    """
    env = os.environ if environ is None else environ
    if path is None and env.get("MACROFLOW_SECRET"):
        return _check_secret(env["MACROFLOW_SECRET"].strip(),
                             "the MACROFLOW_SECRET environment variable")
    if path is None:
        path = env.get("MACROFLOW_SECRET_FILE") or None
    if path is None:
        return secrets.token_hex(32)
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the secret from {path!r}: {e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the secret file %s may be read by other users (mode %o); "
                    "chmod 600 it", path, stat.S_IMODE(mode))
    return _check_secret(text, f"the file {path!r}")


def _check_secret(text: str, source: str) -> str:
    if len(text) < _MIN_SECRET:
        raise ValueError(
            f"{source} holds a secret of {len(text)} characters; use at least {_MIN_SECRET} "
            f"(for instance 64 hex digits: python3 -c \"import secrets; "
            f"print(secrets.token_hex(32))\")")
    return text


def _secret_bytes(secret: Any) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be str or bytes; got {type(secret).__name__}")
    if len(secret) < _MIN_SECRET:
        raise ValueError(f"secret must be at least {_MIN_SECRET} bytes; got {len(secret)} "
                         f"(load_secret() makes one)")
    return bytes(secret)


# -- sockets ------------------------------------------------------------------
def _tcp_options(sock: socket.socket) -> None:
    # Nagle would hold a small frame back until the previous one is acknowledged
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # a host that vanishes (no FIN, no RST) is found out within a couple of minutes
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:
                pass


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A non-blocking TCP socket listening on ``host:port`` (port 0: any free one).

    Raises OSError naming the address if it cannot be had (in use, not an
    address of this host), and LimitError when out of file descriptors.

    Example:
        >>> s = listen()
        >>> s.getsockname()[0], s.getsockname()[1] > 0
        ('127.0.0.1', True)
        >>> s.close()
    """
    where = format_address(host, port)
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {where}: {e}") from None
    try:
        s = socket.socket(family, kind, proto)
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise nofile_error(f"listen on {where}", e) from e
        raise
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(sockaddr)
        s.listen(1024)  # peers may all connect before this context accepts
    except OSError as e:
        s.close()
        raise OSError(e.errno, f"cannot listen on {where}: {e.strerror}") from None
    s.setblocking(False)
    return s


def _who(ctx: int) -> str:
    """How logs name this end: a context, or a worker still joining (whose id is a
    guest's, not a context's: see ``multi.GUEST_BASE``).

    Example:
        >>> _who(3), _who(1 << 31)
        ('context 3', 'a joining worker')
    """
    return "a joining worker" if ctx >= 1 << 31 else f"context {ctx}"


class _TlsSocket:
    """A TLS connection that behaves as the plain non-blocking socket that
    LocalTransport's framing drives.

    Would-block conditions become BlockingIOError and TLS failures
    ConnectionResetError (the connection is gone). A non-blocking receive
    takes every byte TLS has decrypted, because epoll sees only the bytes
    still in the kernel. ``sendmsg`` writes buffer by buffer: TLS takes a
    buffer whole or not at all, and a buffer it refused is offered again,
    the same, by the framing's retry (what OpenSSL requires).
    """

    __slots__ = ("tls", "timeout")

    def __init__(self, tls: ssl.SSLSocket):
        self.tls = tls
        self.timeout: Optional[float] = 0.0

    def fileno(self) -> int:
        return self.tls.fileno()

    def setblocking(self, flag: bool) -> None:
        self.tls.setblocking(flag)
        self.timeout = None if flag else 0.0

    def settimeout(self, value: Optional[float]) -> None:
        self.tls.settimeout(value)
        self.timeout = value

    def setsockopt(self, *args: Any) -> None:
        self.tls.setsockopt(*args)

    def getsockopt(self, *args: Any) -> Any:
        return self.tls.getsockopt(*args)

    def close(self) -> None:
        self.tls.close()

    def recv_into(self, mv: Any) -> int:
        tls = self.tls
        try:
            n = tls.recv_into(mv)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None
        except ssl.SSLError as e:
            raise ConnectionResetError(errno.ECONNRESET, f"TLS: {e}") from None
        if n == 0 or self.timeout != 0.0:
            return n
        size = len(mv)
        while n < size:
            try:
                k = tls.recv_into(mv[n:])
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except ssl.SSLError as e:
                raise ConnectionResetError(errno.ECONNRESET, f"TLS: {e}") from None
            if k == 0:
                break  # the end: the next receive says so
            n += k
        return n

    def send(self, data: Any) -> int:
        try:
            return self.tls.send(data)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None
        except ssl.SSLError as e:
            raise ConnectionResetError(errno.ECONNRESET, f"TLS: {e}") from None

    def sendmsg(self, buffers: List[Any]) -> int:
        sent = 0
        for b in buffers:
            try:
                n = self.tls.send(b)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                if sent:
                    return sent
                raise BlockingIOError from None
            except ssl.SSLError as e:
                raise ConnectionResetError(errno.ECONNRESET, f"TLS: {e}") from None
            sent += n
            if n < memoryview(b).nbytes:
                break
        return sent


# -- the handshake ----------------------------------------------------------------
class _Refused(Exception):
    """A handshake ends: ``why`` is logged at ``level``."""

    def __init__(self, why: str, level: int = logging.WARNING):
        super().__init__(why)
        self.why = why
        self.level = level


class _Shake:
    """One connection in the lobby, being admitted."""

    __slots__ = ("sock", "fd", "connector", "dest", "where", "state", "inbuf", "outq", "deadline",
                 "mask", "background", "counted", "nonce", "hello", "challenge", "peer", "target", "peer_version",
                 "peer_computation", "peer_address", "failed", "tls")

    def __init__(self, sock: socket.socket, connector: bool, where: str, dest: int = -1):
        self.sock: Any = sock
        self.fd = sock.fileno()
        self.connector = connector
        self.dest = dest  # a connector: the context it wants
        self.where = where  # the other end's address, for messages
        self.state = _CONNECTING if connector else _START
        self.inbuf = bytearray()
        self.outq: deque = deque()
        self.deadline = 0.0
        self.mask = 0
        self.background = False  # a connector nobody waits for: its failure is only logged
        self.counted = False  # an acceptor counted against max_handshakes
        self.nonce = os.urandom(32)
        self.hello = b""
        self.challenge = b""
        self.peer = dest  # an acceptor: the context the hello says it is
        self.target = -1
        self.peer_version: Tuple[int, int] = (0, 0)
        self.peer_computation = b""
        self.peer_address = ""
        self.failed: Optional[str] = None
        self.tls = False


def _lp(data: bytes, pos: int) -> Tuple[bytes, int]:
    """A string of at most 255 bytes, prefixed by its length, at ``pos``."""
    if pos >= len(data) or pos + 1 + data[pos] > len(data):
        raise _Refused("garbage: a HELLO that ends too soon")
    n = data[pos]
    return data[pos + 1:pos + 1 + n], pos + 1 + n


class TcpTransport(LocalTransport):
    """Frames over TCP between contexts on any hosts, admitted by a mutual handshake.

    Args:
        ctx: this context's id.
        secret: the computation's secret (str or bytes, 16 bytes at least;
            see :func:`load_secret`); every context of the computation has it.
        computation: the computation's id; a connection from another
            computation is refused even if it knows the secret.
        host, port: where to listen (default 127.0.0.1, a free port);
            ignored when ``listener`` (from :func:`listen`) is given.
        peers: the directory to start with, ``{ctx: "host:port"}``; it grows
            with :meth:`add_peer`, and with the address each connector gives.
        spin_us: how long to poll before sleeping (see LocalTransport).
        server_ssl, client_ssl: ``ssl.SSLContext`` objects for the
            connections this context accepts and makes (both or neither).
        advertise: the host name peers should use to reach this context
            (default: the host it listens on; this host's name for a
            wildcard address such as 0.0.0.0).
        handshake_timeout: seconds a connection of another context may take
            for its next step before it has authenticated itself; then it is
            closed (default 10).
        connect_timeout: the same for the peer of a connection this context
            makes (default None: as long as the connection stays up, for the
            peer may be computing).
        max_handshakes: connections admitted at once; more wait in the
            kernel's backlog (default 64).
        guests: admit, besides contexts of this computation, workers asking
            to join it (ids from ``multi.GUEST_BASE`` up, no computation id
            yet), once they have proved that they know the secret.

    Example:
        >>> a = TcpTransport(0, "a secret of sixteen bytes or more", "c0ffee00")
        >>> b = TcpTransport(1, "a secret of sixteen bytes or more", "c0ffee00")
        >>> a.add_peer(1, b.address()[1])
        >>> got = []
        >>> b.attach(lambda src, bufs, load: got.append((src, bytes(bufs[0]))), None)
        >>> w = __import__("threading").Thread(target=lambda: a.send(1, [b"hello"], 0))
        >>> w.start()
        >>> while not got:
        ...     _ = b.poll(1.0)
        >>> w.join(); got
        [(0, b'hello')]
        >>> a.peers(), b.peers(), b.directory[0] == a.address()[1]
        ([1], [0], True)
        >>> a.close(); b.close()
    """

    name = "tcp"
    # receive errors that mean the connection (or the route to its host) is gone
    closed_errnos = (errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT, errno.EHOSTUNREACH,
                     errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.ECONNABORTED)

    def __init__(self, ctx: int, secret: Union[str, bytes], computation: str, *,
                 host: str = "127.0.0.1", port: int = 0, listener: Optional[socket.socket] = None,
                 peers: Optional[Mapping[int, str]] = None, spin_us: float = 0.0,
                 server_ssl: Optional[ssl.SSLContext] = None,
                 client_ssl: Optional[ssl.SSLContext] = None, advertise: Optional[str] = None,
                 handshake_timeout: float = 10.0, connect_timeout: Optional[float] = None,
                 max_handshakes: int = 64, guests: bool = False):
        if isinstance(ctx, bool) or not isinstance(ctx, int) or not 0 <= ctx < 2**32:
            raise ValueError(f"ctx must be an int from 0 to 2**32-1; got {ctx!r}")
        if not isinstance(computation, str) or len(computation.encode()) > 255:
            raise ValueError(f"computation must be a str of at most 255 bytes; got {computation!r}")
        for name, value in (("server_ssl", server_ssl), ("client_ssl", client_ssl)):
            if value is not None and not isinstance(value, ssl.SSLContext):
                raise TypeError(f"{name} must be an ssl.SSLContext or None; got {type(value).__name__}")
        if (server_ssl is None) != (client_ssl is None):
            raise ValueError("give both server_ssl and client_ssl, or neither: a context that "
                             "speaks TLS one way only cannot talk to the others")
        for name, value in (("handshake_timeout", handshake_timeout),
                            ("connect_timeout", connect_timeout)):
            if value is None and name == "connect_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0; got {value!r}")
        if isinstance(max_handshakes, bool) or not isinstance(max_handshakes, int) or max_handshakes < 1:
            raise ValueError(f"max_handshakes must be an int >= 1; got {max_handshakes!r}")
        secret_b = _secret_bytes(secret)
        if listener is None:
            parse_address(format_address(host, port), listening=True)
            listener = listen(host, port)
        super().__init__(ctx, {}, spin_us)
        self.secret = secret_b
        self.computation = computation
        self.computation_b = computation.encode()
        self.version = _version()
        self.server_ssl, self.client_ssl = server_ssl, client_ssl
        self.handshake_timeout = float(handshake_timeout)
        self.connect_timeout = None if connect_timeout is None else float(connect_timeout)
        self.max_handshakes = max_handshakes
        # admit guests: connectors with an id from GUEST_BASE up and no computation
        # yet (workers asking to join), once they have proved the secret
        self.guests = guests
        self.directory: Dict[int, str] = {}
        self.shaking: Dict[int, _Shake] = {}  # fd -> connection in the lobby
        self.dialing: Dict[int, _Shake] = {}  # peer -> the connection this end is making to it
        self.incoming = 0  # connections of others in the lobby, not authenticated yet
        self.handshakes_failed = 0
        self.fresh = False  # a connection admitted during this poll delivered frames
        self.tcp = listener
        self.tfd = listener.fileno()
        listener.setblocking(False)
        bound_host, bound_port = listener.getsockname()[:2]
        if advertise is None:
            wildcard = bound_host in ("0.0.0.0", "::")
            advertise = socket.gethostname() if wildcard else bound_host
        self._address = format_address(advertise, bound_port)
        if len(self._address.encode()) > 255:
            raise ValueError(f"advertise: the address {self._address!r} is longer than 255 bytes")
        # LocalTransport watches `listener` and calls _accept when it is ready:
        # here that is the lobby, where the listening socket and the
        # connections being admitted wait
        self.lobby = select.epoll()
        self.lobby.register(self.tfd, select.EPOLLIN)
        self.listener = self.lobby  # type: ignore[assignment]
        self.lfd = self.lobby.fileno()
        self.ep.register(self.lfd, select.EPOLLIN)
        for c, a in (peers or {}).items():
            self.add_peer(c, a)

    # -- the directory ----------------------------------------------------------
    def address(self) -> Tuple[str, str]:
        return ("tcp", self._address)

    def reaches(self, address: str) -> bool:
        """Any TCP address may be reached (the network decides)."""
        return True

    def add_peer(self, ctx: int, address: str) -> None:
        """Say where context ``ctx`` listens (``"host:port"``), for connecting to it.

        May be called at any time; a connection already made stays. Raises
        ValueError for a bad id or address, and for a context this transport
        has lost (ids are not reused).

        Example:
            >>> t = TcpTransport(0, "a secret of sixteen bytes or more", "c0ffee00")
            >>> t.add_peer(3, "node7.cluster:5000"); t.directory
            {3: 'node7.cluster:5000'}
            >>> t.add_peer(4, "node8")
            Traceback (most recent call last):
            ...
            ValueError: a TCP address is 'host:port' (IPv6: '[::1]:port') with a port from 1 to 65535; got 'node8'
            >>> t.close()
        """
        if isinstance(ctx, bool) or not isinstance(ctx, int) or not 0 <= ctx < 2**32:
            raise ValueError(f"a context id is an int from 0 to 2**32-1; got {ctx!r}")
        host, port = parse_address(address)
        if ctx in self.gone:
            raise ValueError(f"context {ctx} was lost; the id of a lost context is not reused")
        self.directory[ctx] = format_address(host, port)

    def connect(self, ctx: int, wait: bool = True) -> None:
        """Connect to context ``ctx`` now rather than at the first send.

        With ``wait``, return once the connection is admitted, serving
        everything else meanwhile; without, start the handshake and return
        (it goes on as the transport polls). Raises ConnectionError (and
        reports ``ctx`` lost) if it cannot be made.

        Example:
            >>> a = TcpTransport(0, "a secret of sixteen bytes or more", "c0ffee00")
            >>> a.connect(5, wait=False)
            Traceback (most recent call last):
            ...
            ConnectionError: context 5: no address is known for it (add_peer was not called for it)
            >>> a.close()
        """
        c = self.conns.get(ctx)
        if c is not None and not c.closed:
            return
        if wait:
            self._connect(ctx)
        elif ctx not in self.dialing:
            self._dial(ctx).background = True

    # -- connecting ----------------------------------------------------------------
    def _dial(self, dest: int) -> _Shake:
        """Start a connection to ``dest`` in the lobby."""
        if dest in self.gone or dest == self.ctx:
            raise ConnectionError(f"no connection to context {dest}")
        where = self.directory.get(dest)
        if where is None:
            self._report(dest, "no address is known for it (add_peer was not called for it)")
        host, port = parse_address(where)
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM)[0]
        except socket.gaierror as e:
            self._report(dest, f"cannot resolve its address {where}: {e}")
        try:
            s = socket.socket(family, kind, proto)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise nofile_error(f"connect context {self.ctx} to context {dest}", e) from e
            raise
        s.setblocking(False)
        _tcp_options(s)
        err = s.connect_ex(sockaddr)
        if err not in (0, errno.EINPROGRESS):
            s.close()
            self._report(dest, f"cannot connect to {where}: {os.strerror(err)}")
        e = _Shake(s, True, where, dest)
        self._enter(e)
        self.dialing[dest] = e
        return e

    def _connect(self, dest: int):
        """The connection to ``dest``, made now if there is none: wait for its
        handshake, serving everything else; ConnectionError if it fails."""
        if dest in self.gone or dest == self.ctx:
            raise ConnectionError(f"no connection to context {dest}")
        e = self.dialing.get(dest) or self._dial(dest)
        while True:
            c = self.conns.get(dest)
            if c is not None:
                if c.closed:
                    raise ConnectionError(f"no connection to context {dest}")
                return c
            if e.failed is not None and e.background:
                # made while nobody waited: the peer may have given up on us
                # while we were busy; try once more, as someone who answers
                e = self.dialing.get(dest) or self._dial(dest)
                continue
            if e.failed is not None or dest in self.gone:
                raise ConnectionError(f"context {dest}: {e.failed or 'lost'}")
            wait = max(0.0, min(1.0, e.deadline - time.monotonic()) + 1e-3)
            for fd, _ev in self.ep.poll(wait):
                self._event(fd)
            if self.shaking:
                self._expire()  # ours, if it stalled

    # -- the lobby -----------------------------------------------------------------
    def _enter(self, e: _Shake) -> None:
        self.shaking[e.fd] = e
        if not e.connector:
            e.counted = True
            self.incoming += 1
            if self.incoming >= self.max_handshakes:
                self.lobby.modify(self.tfd, 0)  # the others wait in the backlog
        e.mask = select.EPOLLIN | (select.EPOLLOUT if e.state == _CONNECTING else 0)
        self.lobby.register(e.fd, e.mask)
        self._progress(e)

    def _leave(self, e: _Shake) -> None:
        if self.shaking.get(e.fd) is not e:
            return
        del self.shaking[e.fd]
        if self.dialing.get(e.dest) is e:
            del self.dialing[e.dest]
        self._uncount(e)
        try:
            self.lobby.unregister(e.fd)
        except (OSError, ValueError):
            pass

    def _uncount(self, e: _Shake) -> None:
        if e.counted:
            e.counted = False
            self.incoming -= 1
            if self.incoming == self.max_handshakes - 1:
                try:
                    self.lobby.modify(self.tfd, select.EPOLLIN)  # accept again
                except (OSError, ValueError):
                    pass  # closed meanwhile

    def _stall_limit(self, e: _Shake) -> Optional[float]:
        """How long ``e`` may wait for the other end's next step (None: no limit)."""
        if e.connector:
            return self.connect_timeout
        if e.state == _WAIT_DONE:
            # The connector is authenticated, and it starts sending frames as
            # soon as it has sent DONE: giving up now could leave it with a
            # connection that only it believes in.
            return None
        return self.handshake_timeout

    def _progress(self, e: _Shake) -> None:
        limit = self._stall_limit(e)
        e.deadline = math.inf if limit is None else time.monotonic() + limit

    def _watch(self, e: _Shake, out: bool) -> None:
        mask = select.EPOLLIN | (select.EPOLLOUT if out else 0)
        if mask != e.mask and self.shaking.get(e.fd) is e:
            e.mask = mask
            self.lobby.modify(e.fd, mask)

    def _accept(self) -> bool:
        """Step the lobby: take new connections, advance handshakes, time out
        stalled ones. True if a connection admitted here delivered frames."""
        got = False
        try:
            events = self.lobby.poll(0)
        except (OSError, ValueError):
            return False  # closed
        for fd, _ev in events:
            if fd == self.tfd:
                self._take()  # what it admitted and read, self.fresh says
            else:
                e = self.shaking.get(fd)
                if e is not None:
                    got = self._step(e) or got
        if self.shaking:
            self._expire()
        return got or self.fresh

    def _take(self) -> None:
        while self.incoming < self.max_handshakes:
            try:
                s, addr = self.tcp.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    raise nofile_error(f"accept a connection to context {self.ctx}", e) from e
                if e.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                raise
            where = format_address(str(addr[0]), addr[1])
            try:
                s.setblocking(False)
                _tcp_options(s)
                if self.server_ssl is not None:
                    s = self.server_ssl.wrap_socket(s, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError) as err:
                log.warning("context %d: connection from %s dropped: %s", self.ctx, where, err)
                s.close()
                continue
            e = _Shake(s, False, where)
            if self.server_ssl is not None:
                e.state, e.tls = _TLS, True
            self._enter(e)
            self._step(e)  # the CHALLENGE goes at once

    def settle(self, timeout: float) -> None:
        """Finish the handshakes under way (``timeout`` seconds at most),
        before this context stops polling for a while: a context added while
        running does, before its ``init`` runs (a peer would otherwise take
        its silence for a stalled handshake after ``handshake_timeout``)."""
        deadline = time.monotonic() + timeout
        while self.shaking and time.monotonic() < deadline:
            self.poll(0.01)

    def _expire(self) -> Optional[float]:
        """Close the handshakes that stalled; seconds until the next may stall."""
        now = time.monotonic()
        for e in list(self.shaking.values()):
            if e.deadline <= now:
                self._step(e)  # what came last may still be there to read
                if self.shaking.get(e.fd) is e and e.deadline <= now:
                    self._fail(e, _Refused(f"it stalled in the handshake for more than "
                                           f"{self._stall_limit(e):g} s"))
        due = self.next_due()
        return None if due is None else due - now

    def next_due(self) -> Optional[float]:
        """When (``time.monotonic``) the next handshake under way may stall:
        a connection that sends nothing makes no descriptor readable, so
        whoever sleeps for this transport (another protocol's poll in a
        :class:`~macroflow.transport.multi.MultiTransport`, say) wakes by
        then and polls it, which closes it. None with no deadline pending.

        Example:
            >>> import socket, time
            >>> t = TcpTransport(0, "a secret of sixteen bytes or more", "c0ffee00",
            ...                  handshake_timeout=0.2)
            >>> t.next_due() is None
            True
            >>> s = socket.create_connection(t.address()[1].rsplit(":", 1))
            >>> while not t.shaking:
            ...     _ = t.poll(0.01)
            >>> t.next_due() - time.monotonic() <= 0.2
            True
            >>> while t.shaking:
            ...     _ = t.poll(None)  # it wakes up to close the silent stranger
            >>> t.next_due() is None, t.handshakes_failed
            (True, 1)
            >>> s.close(); t.close()
        """
        if not self.shaking:
            return None
        due = min(e.deadline for e in self.shaking.values())
        return None if due == math.inf else due

    def poll(self, timeout: Optional[float]) -> bool:
        # True when frames were delivered, however they came: a caller that
        # sleeps on False (MultiTransport) would leave them in the engine's
        # inbox until the next message came
        self.fresh = False
        if self.shaking:
            pending = len(self.shaking)
            due = self._expire()
            if len(self.shaking) < pending:
                timeout = 0  # a handshake ended here: return, without sleeping
            elif due is not None and (timeout is None or due < timeout):
                timeout = max(due, 0.0) + 1e-3  # wake up to time it out
        return LocalTransport.poll(self, timeout) or self.fresh

    def _step(self, e: _Shake) -> bool:
        """Advance one handshake as far as what has arrived allows; True if
        it finished and the connection delivered frames at once."""
        try:
            return self._advance(e)
        except _Refused as r:
            self._fail(e, r)
        except OSError as err:  # the connection broke
            self._fail(e, _Refused(f"the connection failed: {err}", logging.INFO))
        return False

    def _advance(self, e: _Shake) -> bool:
        if e.state == _CONNECTING:
            err = e.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise _Refused(f"cannot connect: {os.strerror(err)}", logging.INFO)
            try:
                e.sock.getpeername()
            except OSError:
                return False  # not connected yet
            self._progress(e)
            if self.client_ssl is not None:
                host = parse_address(e.where)[0]
                e.sock = self.client_ssl.wrap_socket(e.sock, server_side=False, server_hostname=host,
                                                     do_handshake_on_connect=False)
                e.state, e.tls = _TLS, True
            else:
                e.state = _START
        if e.state == _TLS:
            try:
                e.sock.do_handshake()
            except ssl.SSLWantReadError:
                self._watch(e, False)
                return False
            except ssl.SSLWantWriteError:
                self._watch(e, True)
                return False
            except ssl.SSLError as err:
                if isinstance(err, ssl.SSLEOFError) or \
                        getattr(err, "reason", None) == "UNEXPECTED_EOF_WHILE_READING":
                    # (as a plain connection that closes before a byte: a
                    # worker's probe of the route does, and nothing is amiss)
                    raise _Refused("it closed the connection during the TLS handshake",
                                   logging.INFO) from None
                raise _Refused(f"the TLS handshake failed: {err}") from None
            self._progress(e)
            e.state = _START
        if e.state == _START:
            self._begin(e)
        elif e.outq:
            self._push(e)
        while e.state in _WAITING:
            msg = self._receive(e)
            if msg is None:
                break
            self._on_message(e, *msg)
            self._progress(e)
        if e.state == _FLUSH:
            if e.outq:
                self._push(e)
            if not e.outq:
                return self._admit(e)
        return False

    def _begin(self, e: _Shake) -> None:
        """The first message: the connector's HELLO, the acceptor's CHALLENGE."""
        major, minor = self.version
        if e.connector:
            e.hello = (_HELLO.pack(major, minor, self.ctx, e.dest, e.nonce)
                       + bytes([len(self.computation_b)]) + self.computation_b
                       + bytes([len(self._address)]) + self._address.encode())
            e.state = _WAIT_CHALLENGE
            self._put(e, HELLO, e.hello)
        else:
            e.challenge = _CHALLENGE.pack(major, minor, e.nonce)
            e.state = _WAIT_HELLO
            self._put(e, CHALLENGE, e.challenge)

    def _put(self, e: _Shake, kind: int, body: bytes = b"") -> None:
        e.outq.append(_HS.pack(_MAGIC, kind, len(body)) + body)
        self._push(e)

    def _push(self, e: _Shake) -> None:
        while e.outq:
            head = e.outq[0]
            try:
                n = e.sock.send(head)
            except _WOULD_BLOCK:
                break
            except ssl.SSLError as err:
                raise _Refused(f"TLS error: {err}") from None
            if n < len(head):
                e.outq[0] = head[n:]  # a plain socket took part of it (TLS takes all or nothing)
            else:
                e.outq.popleft()
        self._watch(e, bool(e.outq))

    def _receive(self, e: _Shake) -> Optional[Tuple[int, bytes]]:
        """The next whole handshake message, or None until it has come."""
        while True:
            buf = e.inbuf
            need = _HS.size
            if len(buf) >= _HS.size:
                magic, kind, n = _HS.unpack_from(buf)
                if magic != _MAGIC:
                    tls = " (a TLS handshake: it uses TLS and this context does not)" \
                        if buf[:2] == b"\x16\x03" else ""
                    raise _Refused(f"garbage: it does not speak macroflow's TCP protocol "
                                   f"(it sent {bytes(buf)!r}){tls}")
                if n > _HS_MAX:
                    raise _Refused(f"oversize handshake message: {n} bytes announced, "
                                   f"at most {_HS_MAX}")
                need += n
                if len(buf) == need:
                    e.inbuf = bytearray()
                    return kind, bytes(buf[_HS.size:])
            try:
                # exactly what the message needs: bytes after the handshake are frames
                chunk = e.sock.recv(need - len(buf))
            except _WOULD_BLOCK:
                self._watch(e, bool(e.outq))
                return None
            except ssl.SSLError as err:
                raise _Refused(f"TLS error: {err}") from None
            if not chunk:
                raise _Refused("it closed the connection before the handshake finished",
                               logging.INFO)
            buf += chunk

    def _mac(self, e: _Shake, role: bytes) -> bytes:
        data = b"".join((b"macroflow-tcp ", role, struct.pack("<HH", len(e.hello), len(e.challenge)),
                         e.hello, e.challenge))
        return hmac.new(self.secret, data, hashlib.sha256).digest()

    def _refuse(self, e: _Shake, code: int, why: str) -> None:
        try:
            self._put(e, REFUSE, bytes([code]))
        except (_Refused, OSError):
            pass  # it goes anyway
        raise _Refused(why)

    def _on_message(self, e: _Shake, kind: int, body: bytes) -> None:
        if kind == REFUSE and e.connector and len(body) == 1:
            raise _Refused("it refused the connection: "
                           + _REFUSALS.get(body[0], f"reason {body[0]}"))
        due = _DUE[e.state]
        if kind != due:
            raise _Refused(f"garbage: a message of kind {kind} where a {_KINDS[due]} was due")
        if e.state == _WAIT_HELLO:
            self._on_hello(e, body)
            e.state = _WAIT_PROOF
        elif e.state == _WAIT_CHALLENGE:
            if len(body) != _CHALLENGE.size:
                raise _Refused(f"garbage: a CHALLENGE of {len(body)} bytes")
            major, minor, _nonce = _CHALLENGE.unpack(body)
            e.challenge, e.peer_version = body, (major, minor)
            e.state = _WAIT_PROOF
            self._put(e, PROOF, self._mac(e, b"connector"))
        elif e.state == _WAIT_PROOF and e.connector:
            if len(body) != _MAC or not hmac.compare_digest(body, self._mac(e, b"acceptor")):
                raise _Refused("it did not prove that it knows the secret: it is not a context "
                               "of this computation")
            self._check_version(e, e.dest)
            e.state = _FLUSH
            self._put(e, DONE)
        elif e.state == _WAIT_PROOF:
            if len(body) != _MAC or not hmac.compare_digest(body, self._mac(e, b"connector")):
                self._refuse(e, R_SECRET, "authentication failed: it does not know the secret")
            if e.target != self.ctx:
                self._refuse(e, R_NOT_ME, f"it wanted context {e.target}, and this is context "
                                          f"{self.ctx}")
            guest = self.guests and e.peer >= GUEST_BASE and e.peer_computation == b""
            if e.peer_computation != self.computation_b and not guest:
                self._refuse(e, R_COMPUTATION, f"it belongs to computation "
                                               f"{e.peer_computation.decode(errors='replace')!r}, "
                                               f"not {self.computation!r}")
            if e.peer == self.ctx or e.peer in self.gone:
                self._refuse(e, R_ID, f"it says it is context {e.peer}, "
                                      + ("this context's own id" if e.peer == self.ctx
                                         else "a context that was lost"))
            self._put(e, PROOF, self._mac(e, b"acceptor"))
            self._check_version(e, e.peer)
            e.state = _WAIT_DONE
            self._uncount(e)  # authenticated: max_handshakes is for strangers
        else:  # _WAIT_DONE
            if body:
                raise _Refused(f"garbage: a DONE of {len(body)} bytes")
            e.state = _FLUSH

    def _on_hello(self, e: _Shake, body: bytes) -> None:
        if len(body) < _HELLO.size:
            raise _Refused(f"garbage: a HELLO of {len(body)} bytes")
        major, minor, peer, target, _nonce = _HELLO.unpack_from(body)
        computation, pos = _lp(body, _HELLO.size)
        address, pos = _lp(body, pos)
        if pos != len(body):
            raise _Refused("garbage: bytes after the end of a HELLO")
        try:
            text = address.decode("ascii")
            if text:
                parse_address(text)
        except (UnicodeDecodeError, ValueError):
            raise _Refused(f"garbage: a HELLO with the address {address!r}") from None
        e.hello, e.peer, e.target = body, peer, target
        e.peer_version, e.peer_computation, e.peer_address = (major, minor), computation, text

    def _check_version(self, e: _Shake, peer: int) -> None:
        if e.peer_version != self.version:
            theirs = "%d.%d" % e.peer_version
            mine = "%d.%d" % self.version
            raise _Refused(
                f"{_who(peer)} runs macroflow {theirs} and {_who(self.ctx)} runs {mine}: "
                f"every context of a computation must run the same major.minor version",
                logging.ERROR)

    def _admit(self, e: _Shake) -> bool:
        """The handshake is done: the connection joins the others, for frames."""
        self._leave(e)
        peer = e.dest if e.connector else e.peer
        if peer in self.gone:  # lost while it was being admitted
            e.sock.close()
            return False
        sock = _TlsSocket(e.sock) if e.tls else e.sock
        c = self._add(peer, sock)
        if e.peer_address and peer not in self.directory:
            self.directory[peer] = e.peer_address
        log.debug("context %d: connection %s context %d at %s admitted", self.ctx,
                  "to" if e.connector else "from", peer, e.where)
        got = self._read(c)  # what came right behind the handshake
        self.fresh = self.fresh or got
        return got

    def _fail(self, e: _Shake, r: _Refused) -> None:
        self._leave(e)
        e.state = _FAILED
        e.failed = r.why
        try:
            e.sock.close()
        except OSError:
            pass
        if e.connector:
            text = f"connecting to it at {e.where} failed: {r.why}"
            log.log(r.level, "%s: %s (context %d)", _who(self.ctx), text, e.dest)
            e.failed = text
            live = any(not c.closed for c in self.links.get(e.dest, ()))
            if not live and not e.background and e.dest not in self.gone:
                self.gone.add(e.dest)
                if self.lost is not None:
                    self.lost(e.dest, text)
        else:
            self.handshakes_failed += 1
            log.log(r.level, "%s: connection from %s closed during the handshake: %s",
                    _who(self.ctx), e.where, r.why)

    def close(self) -> None:
        for e in list(self.shaking.values()):
            self._leave(e)
            try:
                e.sock.close()
            except OSError:
                pass
        super().close()  # closes the lobby too: it is the `listener` LocalTransport knows
        self.tcp.close()


def check_room(contexts: int, adding: bool = False) -> None:
    """Raise LimitError if this host cannot hold ``contexts`` forked contexts
    (as for the ``local`` transport: the launcher here forks them too).

    Example:
        >>> check_room(2)
    """
    from .local import check_room as local_check_room
    local_check_room(contexts, "local", adding)


def launcher(session: Any) -> Any:
    """The launcher of this transport: contexts forked from this process that
    talk TCP over the loopback interface, with a secret made for the computation.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=2, transport="tcp") as s:
        ...     type(launcher(s)).__name__, s.engine.transport.addresses()[0][0]
        ('TcpLauncher', 'tcp')
    """
    from ..join import TcpLauncher
    return TcpLauncher(session, "127.0.0.1:0", secrets.token_hex(32), (None, None),
                       use_local=False)
