"""Tulip's SPMD model: every context runs one function, with global pointers
to registered memory, one-sided get and put, remote actions, and
collectives that keep serving requests while they wait.

Importing it registers the model with the core (``macroflow`` imports it).
"""

from . import model as _model  # noqa: F401  (registers the model and its messages)
