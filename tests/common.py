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
