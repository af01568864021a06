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
