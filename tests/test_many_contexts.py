"""Many contexts: hundreds of processes under the default descriptor limit,
connections between contexts made on demand, and clear errors at real limits."""

import errno
import os
import re
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

import macroflow as mf
from common import Gate, Log, our_processes
from macroflow.core.context import SYSTEM, current_engine

pytestmark = pytest.mark.timeout(120)


def _python(body, timeout=110):
    """Run a script in a fresh interpreter (its resource limits are its own)."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(body)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


FAN_OUT = """
import os, resource, psutil
import macroflow as mf

N = 256

@mf.regular
class Hop:
    def ctx(self):
        return mf.context_id()

    def via(self, nxt):
        # a call from one non-zero context to another: a connection made on demand
        return mf.context_id(), Hop.create(on=nxt).ctx().result()

def main():
    pinned = mf.gather([Hop.create(on=c).ctx() for c in range(N)])
    h = Hop()
    spread = mf.gather([h.ctx() for _ in range(N)])
    ring = mf.gather([Hop.create(on=c).via(c % (N - 1) + 1) for c in range(1, N)])
    return pinned, spread, ring, len(os.listdir("/proc/self/fd"))

hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
pinned, spread, ring, fds = mf.run(main, contexts=N)
assert pinned == list(range(N)), pinned
assert len(spread) == N and len(set(spread)) > N // 2, sorted(set(spread))
assert ring == [(c, c % (N - 1) + 1) for c in range(1, N)], ring
print("fds", fds)
print("left", len(psutil.Process().children(recursive=True)))
"""


def test_256_contexts_fan_out_under_1024_descriptors():
    out = _python(FAN_OUT).split()
    fds = int(out[out.index("fds") + 1])
    assert fds < 300  # one per context in context 0, not one per pair
    assert out[out.index("left") + 1] == "0"


TOO_MANY = """
import resource, psutil
import macroflow as mf

hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
try:
    mf.run(lambda: None, contexts=100)
except mf.LimitError as e:
    print(type(e).__name__, e.limit)
    print(e)
print("left", len(psutil.Process().children(recursive=True)))
"""


def test_too_low_descriptor_limit_is_a_clear_error():
    out = _python(TOO_MANY)
    lines = out.splitlines()
    assert lines[0] == "LimitError RLIMIT_NOFILE"
    msg = lines[1]
    assert "too many open files" in msg and "of 100" in msg
    assert "soft limit 64" in msg and "ulimit -n" in msg and "resource.setrlimit" in msg
    assert lines[2] == "left 0"


def test_failed_fork_names_the_process_limit(monkeypatch):
    real_fork = os.fork
    forks = []

    def fork():
        if len(forks) == 2:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        forks.append(1)
        return real_fork()

    monkeypatch.setattr(os, "fork", fork)
    with pytest.raises(mf.LimitError) as info:
        mf.init(contexts=5)
    assert info.value.limit == "RLIMIT_NPROC"
    assert "context 3 of 5" in str(info.value) and "ulimit -u" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert our_processes(zombies=True) == []
    monkeypatch.undo()
    assert mf.run(lambda: mf.num_contexts(), contexts=2) == 2  # nothing left half-started


@mf.persistent
class Sender:
    def fire(self, log, tag, k):
        for i in range(k):
            log.add((tag, i))  # nobody waits: only the order of arrival counts
        return log.get().result()


def test_order_per_pair_when_both_ends_connect_at_once(run):
    def main():
        logs = [Log.create(on=c) for c in (1, 2)]
        senders = [Sender.create(on=c) for c in (1, 2)]
        # context 1 sends to context 2 while context 2 sends to context 1
        fa = senders[0].fire(logs[1], "a", 300)
        fb = senders[1].fire(logs[0], "b", 300)
        return fa.result(), fb.result()

    got_a, got_b = run(main, contexts=3)
    assert got_a == [("a", i) for i in range(300)]
    assert got_b == [("b", i) for i in range(300)]


@mf.regular
class Work:
    def echo(self, x):
        return x

    def pid_of(self, gate):
        return gate.pid().result()


def test_lost_context_is_seen_through_a_connection_made_on_demand():
    def main():
        g = Gate.create(on=1)
        w = Work.create(on=2)
        pid1 = w.pid_of(g).result()  # context 2 now has its own connection to context 1
        f = g.wait(1)  # never opens
        consumer = w.echo(f)  # context 2 depends on context 1
        os.kill(pid1, signal.SIGKILL)
        err = consumer.exception(timeout=30)
        # context 2's counters only: context 0 may not have noticed the loss yet
        at_2 = current_engine().issue(SYSTEM, "stats", "stats", (), {}, 2, pinned=True)
        return err, at_2.result()["contexts_lost"]

    err, lost_at_2 = mf.run(main, contexts=3)
    assert isinstance(err, mf.ContextLost) and err.context == 1
    # (seen by context 2 itself, which reads how the process ended)
    assert re.search(r"its process \(pid \d+\) (was killed by signal SIGKILL|has ended)", str(err)), err
    assert lost_at_2 == 1
