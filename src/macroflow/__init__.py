"""macroflow: parallel objects and run-time macro dataflow for Python.

Layers, bottom up (see docs/guide.md):
  transport  protocol modules that move frames between contexts (local, inproc)
  core       contexts' progress engines, lightweight threads, futures,
             global pointers, remote service requests, marshalling, placement
  objects    Mentat's persistent and regular parallel objects and dataflow
  spmd       Tulip's SPMD runs: registered memory, get/put, remote actions,
             collectives that keep serving; pC++'s distributed collections
  launch     run / init / shutdown, and the `macroflow` command
Everything public is re-exported here (and named in ``__all__``); nothing else
lives in this file.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from .core.threads import install_quiet_finder as _install_quiet_finder  # noqa: I001 (first)

_install_quiet_finder()  # (numpy, imported by anyone later, starts BLAS threads that block signals)

from .core.errors import CallError as CallError
from .core.errors import CollectiveError as CollectiveError
from .core.errors import ContextLost as ContextLost
from .core.errors import DeadlockError as DeadlockError
from .core.errors import LimitError as LimitError
from .core.errors import MacroflowError as MacroflowError
from .core.errors import NoSuchMethod as NoSuchMethod
from .core.errors import ObjectDestroyed as ObjectDestroyed
from .core.errors import RemoteError as RemoteError
from .core.errors import RemoteTraceback as RemoteTraceback
from .core.errors import StaleReference as StaleReference
from .core.errors import Terminated as Terminated
from .core.errors import TimeoutError as TimeoutError
from .core.future import Future as Future
from .core.gptr import GlobalPointer as GlobalPointer
from .core.placement import Placement as Placement
from .core.rsr import export as export
from .core.rsr import rsr as rsr
from .core.rsr import unexport as unexport
from .launch import ContextInfo as ContextInfo
from .core.threads import poll as poll
from .launch import Session as Session
from .launch import add_contexts as add_contexts
from .launch import remove_context as remove_context
from .launch import contexts as contexts
from .launch import wait_contexts as wait_contexts
from .launch import init as init
from .launch import run as run
from .launch import shutdown as shutdown
from .objects.dataflow import ALL_COMPLETED as ALL_COMPLETED
from .objects.dataflow import FIRST_COMPLETED as FIRST_COMPLETED
from .objects.dataflow import FIRST_EXCEPTION as FIRST_EXCEPTION
from .objects.dataflow import as_completed as as_completed
from .objects.dataflow import context_id as context_id
from .objects.dataflow import gather as gather
from .objects.dataflow import num_contexts as num_contexts
from .objects.dataflow import stats as stats
from .objects.dataflow import wait as wait
from .objects.persistent import HandleInfo as HandleInfo
from .objects.persistent import PersistentHandle as PersistentHandle
from .objects.persistent import RegularHandle as RegularHandle
from .objects.persistent import destroy as destroy
from .objects.persistent import guard as guard
from .objects.persistent import info as info
from .objects.persistent import persistent as persistent
from .objects.persistent import regular as regular
from .objects.persistent import rtf as rtf

from .spmd.collectives import allgather as allgather
from .spmd.collectives import allreduce as allreduce
from .spmd.collectives import barrier as barrier
from .spmd.collectives import barrier_async as barrier_async
from .spmd.collectives import broadcast as broadcast
from .spmd.collectives import reduce as reduce
from .spmd.model import Handle as Handle
from .spmd.program import rank as rank
from .spmd.program import register_handler as register_handler
from .spmd.program import remote_action as remote_action
from .spmd.program import size as size
from .spmd.program import spmd as spmd

# Loaded when first asked for (PEP 562): their modules import numpy, which a
# program that makes no array need not pay for (60% of this package's import)
_LAZY = {
    "Collection": "spmd.collection",
    "shared_empty": "spmd.memory", "shared_full": "spmd.memory", "shared_zeros": "spmd.memory",
    "MemoryPointer": "spmd.onesided", "get": "spmd.onesided", "put": "spmd.onesided",
    "register": "spmd.onesided", "unregister": "spmd.onesided",
}
if _TYPE_CHECKING:
    from .spmd.collection import Collection as Collection
    from .spmd.memory import shared_empty as shared_empty
    from .spmd.memory import shared_full as shared_full
    from .spmd.memory import shared_zeros as shared_zeros
    from .spmd.onesided import MemoryPointer as MemoryPointer
    from .spmd.onesided import get as get
    from .spmd.onesided import put as put
    from .spmd.onesided import register as register
    from .spmd.onesided import unregister as unregister


def __getattr__(name: str) -> object:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'macroflow' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value  # (asked for once)
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

from .core.context import seal_opcodes as _seal_opcodes  # noqa: E402

_seal_opcodes()  # macroflow's own opcodes are registered by now: the rest are users'
from .core.errors import install_excepthook as _install_excepthook  # noqa: E402
_install_excepthook()  # an uncaught error is printed without the runtime's frames

# every name re-exported above ("from X import n as n"), and no submodule:
# what `from macroflow import *` gives
__all__ = sorted({n for n, v in list(globals().items())
                  if not n.startswith("_") and type(v).__name__ != "module"} | set(_LAZY))
