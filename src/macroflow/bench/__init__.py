"""macroflow's benchmark suite: one module per table, against hand-coded baselines.

  baselines  hand-coded socketpair ping-pong, bandwidth and fork start-up (no macroflow)
  micro      Mentat's Table I and II for macroflow, METG(50%), and the issue's bars

``macroflow bench micro [--quick] [--json FILE]`` runs :func:`main`.
"""

from __future__ import annotations

import sys
from typing import Optional

SUITES = ("micro", "baselines")


def main(suite: str = "micro", json_path: Optional[str] = None, quick: bool = False) -> int:
    """Run a benchmark suite, print its tables, and return an exit code.

    Args:
        suite: "micro" (Mentat's tables, METG, bars) or "baselines" (hand-coded only).
        json_path: also write every figure of the micro suite to this file.
        quick: far fewer iterations (a smoke run of well under a minute).

    Example:
        >>> main("nonesuch")
        2
    """
    if suite == "micro":
        from . import micro
        return micro.main(json_path=json_path, quick=quick)
    if suite == "baselines":
        from . import baselines
        baselines.main()
        return 0
    print(f"macroflow bench: unknown suite {suite!r}; choose one of {', '.join(SUITES)}",
          file=sys.stderr)
    return 2
