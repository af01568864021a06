"""macroflow's benchmark suites: one module per table.

  baselines  hand-coded socketpair ping-pong, bandwidth and fork start-up (no macroflow)
  micro      Mentat's Table I and II for macroflow, METG(50%), and the performance bars
  peers      the same operations on macroflow, Ray, Dask, ProcessPoolExecutor and mpi4py

``macroflow bench SUITE [--quick] [--json FILE]`` runs :func:`main`.
"""

from __future__ import annotations

import sys
from typing import Optional

SUITES = ("micro", "peers", "baselines")


def main(suite: str = "micro", json_path: Optional[str] = None, quick: bool = False,
         peers: Optional[str] = None) -> int:
    """Run a benchmark suite, print its tables, and return an exit code.

    Args:
        suite: "micro" (Mentat's tables, METG, bars), "peers" (macroflow next to
            Ray, Dask, ProcessPoolExecutor and mpi4py) or "baselines" (hand-coded only).
        json_path: also write every figure of the micro or peers suite to this file.
        quick: far fewer iterations (a smoke run of well under a minute).
        peers: for the peers suite, the peers to try ("ray,dask,mpi4py"; default all).

    Example:
        >>> main("nonesuch")
        2
        >>> main("micro", peers="ray")
        2
    """
    if peers is not None and suite != "peers":
        print(f"macroflow bench: --peers applies to the peers suite only, not {suite!r}",
              file=sys.stderr)
        return 2
    if suite == "peers":
        from . import peers as peers_suite
        return peers_suite.main(json_path=json_path, quick=quick, peers=peers)
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
