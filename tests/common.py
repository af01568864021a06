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
