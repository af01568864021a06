"""Separate hosts on one machine, for tests of what crosses a network.

:func:`hosts` makes network namespaces joined by veth pairs to a bridge-less
star: host 0 is the hub, every other host has a veth pair to it, numbered from
198.18.0.0/15 (the range set aside for benchmarking network devices, RFC 2544),
so no packet of a test can reach any real network. Each namespace has its own
loopback and its own abstract-socket namespace, as a real host would. Every
namespace and link is removed afterwards, and every process a test started in
them is killed.

Needs root and iproute2's ``ip``; :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from typing import Iterator, List, Optional

import psutil


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here, or None if they can.

    Example:
        >>> unavailable() is None or isinstance(unavailable(), str)
        True
    """
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    name = f"mfprobe{os.getpid()}"
    r = _ip("netns", "add", name)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", name)
    return None


class Host:
    """One namespace: ``name``, its address ``addr`` (on the link to the hub;
    the hub's is the first), and the processes started in it."""

    def __init__(self, name: str, addr: str) -> None:
        self.name = name
        self.addr = addr
        self.procs: List[subprocess.Popen] = []

    def popen(self, argv: List[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in this host's namespace (stdout and stderr piped, text)."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        p = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kw)
        self.procs.append(p)
        return p

    def python(self, *args: str, **kw) -> subprocess.Popen:
        """Start this interpreter with ``args`` in this host."""
        return self.popen([sys.executable, *args], **kw)


@contextlib.contextmanager
def hosts(n: int = 2) -> Iterator[List[Host]]:
    """``n`` hosts: the hub at 198.18.0.1, the others at 198.18.<i>.2, each
    linked to the hub whose end is 198.18.<i>.1 (for i = 1..n-1)."""
    tag = f"mf{os.getpid() % 100000}"
    made: List[Host] = []
    links: List[str] = []
    try:
        for i in range(n):
            h = Host(f"{tag}h{i}", "198.18.0.1" if i == 0 else f"198.18.{i}.2")
            r = _ip("netns", "add", h.name)
            if r.returncode != 0:
                raise RuntimeError(f"ip netns add {h.name}: {r.stderr.strip()}")
            made.append(h)
            _ip("-n", h.name, "link", "set", "lo", "up")
        hub = made[0]
        # the hub forwards between the other hosts, as a switch would
        subprocess.run(["ip", "netns", "exec", hub.name, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                       capture_output=True, timeout=20)
        for i, h in enumerate(made[1:], start=1):
            a, b = f"{tag}a{i}", f"{tag}b{i}"
            for cmd in (["link", "add", a, "type", "veth", "peer", "name", b],
                        ["link", "set", a, "netns", hub.name],
                        ["link", "set", b, "netns", h.name],
                        ["-n", hub.name, "addr", "add", f"198.18.{i}.1/24", "dev", a],
                        ["-n", h.name, "addr", "add", f"198.18.{i}.2/24", "dev", b],
                        ["-n", hub.name, "link", "set", a, "up"],
                        ["-n", h.name, "link", "set", b, "up"],
                        ["-n", h.name, "route", "add", "198.18.0.0/15", "via", f"198.18.{i}.1"]):
                r = _ip(*cmd)
                if r.returncode != 0:
                    raise RuntimeError(f"ip {' '.join(cmd)}: {r.stderr.strip()}")
            links.append(a)
            if i == 1:  # the hub answers on 198.18.0.1 too
                _ip("-n", hub.name, "addr", "add", "198.18.0.1/32", "dev", "lo")
        yield made
    finally:
        for h in made:
            for p in h.procs:
                _kill_tree(p)
        for h in made:
            _ip("netns", "del", h.name)  # removes its veth ends, and so their peers


def _kill_tree(p: subprocess.Popen) -> None:
    try:
        kids = psutil.Process(p.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    for k in kids:
        with contextlib.suppress(psutil.NoSuchProcess):
            k.kill()
    with contextlib.suppress(ProcessLookupError):
        p.kill()
    with contextlib.suppress(Exception):
        p.communicate(timeout=10)
