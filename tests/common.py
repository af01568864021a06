"""Parallel classes shared by several test files (module level: they travel by reference)."""

import os

import macroflow as mf


@mf.persistent
class Gate:
    """Calls to wait() are held until open() is called."""

    def __init__(self):
        self.is_open = False

    def open(self):
        self.is_open = True

    @mf.guard(lambda self: self.is_open)
    def wait(self, x=None):
        return x

    def pid(self):
        return os.getpid()


@mf.persistent
class Log:
    """Remembers what it is given, in order."""

    def __init__(self):
        self.items = []

    def add(self, x):
        self.items.append(x)

    def get(self):
        return self.items


class Ref:
    """Carries a future as a value: futures inside plain objects are not arcs."""

    def __init__(self, f):
        self.f = f


def our_processes(zombies=False):
    """This process's descendants that are alive, less MPI's process manager.

    The first time this process spawns MPI ranks, MPI starts its process
    manager (an ``mpiexec`` and its proxy) as a child of this process, and
    keeps it until the process ends; the ranks it spawns are below it, and
    are counted like any other process. With ``zombies``, this process's own
    children that it has not reaped are counted too (the ranks' are MPI's to
    reap).
    """
    import psutil
    from macroflow.transport.mpi import process_manager_pids
    manager = set(process_manager_pids())
    me = os.getpid()
    out = []
    for p in psutil.Process().children(recursive=True):
        if p.pid in manager:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE and not (zombies and p.ppid() == me):
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(p)
    return out


# The hot path, counted: Python-level calls per operation, cProfile's count
# (not a time, so not at the mercy of a shared machine); the transport's
# spin, which loops as long as a wait lasts, is left out.
SPIN = {"_rings", "_spin", "_progress", "glanced"}
_profile = []


def python_calls(profile, n):
    """Python-level calls per operation in ``profile`` (n operations), the spin left out."""
    import pstats
    st = pstats.Stats(profile)
    return sum(nc for (f, _, name), (_, nc, _, _, _) in st.stats.items()
               if f != "~" and name not in SPIN) / n


def profile_start():
    """Start counting in this context (run it there, by a remote action)."""
    import cProfile
    _profile[:] = [cProfile.Profile()]
    _profile[0].enable()


def profile_stop(n):
    """Stop counting here; Python-level calls per operation of ``n``."""
    _profile[0].disable()
    return python_calls(_profile[0], n)
