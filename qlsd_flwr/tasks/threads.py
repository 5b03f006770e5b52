"""Thread counts set on purpose in every process that computes gradients: numpy's BLAS, and torch's.

**numpy's BLAS: one thread, everywhere** (:func:`pin_blas`). OpenBLAS splits a matrix product among its
threads, and the split changes the last bits of the result: the logistic task's gradient and Hessian-vector
products differ by 3e-13 between 1 and 2 threads on the main job's data (measured). Ray's actors run BLAS on one thread (Ray sets
``OMP_NUM_THREADS`` to an actor's CPUs), the in-process, local and vectorised engines and the ServerApp on as
many as there are cores: the main job's ``λ_max`` then differed by 1.8e-7 between the Ray and the in-process
engine, and the chains, which round to QSGD's levels, diverged. With one thread in every process the engines
compute the same numbers on a machine, and a run is a function of its seed whatever the machine's core count
(another CPU's kernels may still round differently). The cost on 2 cores is measured in
``benchmarks/RESULTS.md`` ("One BLAS thread").

**torch:**

torch starts as many intra-op threads as the machine has cores, in every process. On Flower's
Ray engine each virtual client is an actor process, and several run at once (``cores /
client-cpus`` of them): left alone, each would start a thread per core, and a 64-example LeNet-5
pass took 119 ms instead of 4.5 ms on 2 cores (the threads spin-wait on one another). So:

* ``torch-threads = auto`` (the default): ``⌊client-cpus⌋`` threads, at least 1, under
  ``engine = ray`` (a Ray actor; also what a SuperNode gets under ``flwr run``, where the run
  config says ``ray``: set ``torch-threads`` to the node's cores there); one less than the cores
  this process may use (at least 1) on the ``inprocess``, ``local`` and ``vectorised`` engines,
  where one process computes every client's gradient in turn, and in the ServerApp's process (the
  held-out evaluation). One core is left because torch's threads spin-wait on each other: on 2
  cores with one other busy process, LeNet-5's backward pass took 177 ms with 2 threads (measured,
  cProfile) against 3 ms alone; idle, 2 threads were only 15 % faster than 1 (20 minibatch
  gradients: 59 against 69 ms);
* a number: that many threads everywhere.

Nothing is done in a process that has not imported torch (a numpy task never pays its import).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Mapping


def cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def torch_threads(config: Mapping, client: bool = True) -> int:
    """The thread count the rule above gives for a run config (raw keys, as parsed or as written);
    ``client``: a ClientApp's process (``False``: the ServerApp's or a local engine's)."""
    from qlsd_flwr.keys import parse

    setting = parse("torch-threads", config.get("torch-threads", "auto"))
    if setting != "auto":
        return max(1, int(setting))
    engine = str(config.get("engine", "ray")).strip().lower()
    if engine == "ray" and client:
        return max(1, math.floor(parse("client-cpus", config.get("client-cpus", 0.5))))
    return max(1, cores() - 1)


def pin_blas() -> None:
    """numpy's and scipy's BLAS to one thread in this process (module docstring). threadpoolctl reaches only the
    libraries loaded so far, and scipy's wheel brings its own OpenBLAS, so scipy's linear algebra is loaded first.
    Called where the threads are set (:func:`apply_threads`) and at each engine's and the preparation's start."""
    import scipy.linalg  # noqa: F401 (its BLAS loaded, so that the limit reaches it)
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


def apply_threads(config: Mapping, client: bool = True) -> int | None:
    """:func:`pin_blas`, then torch's intra-op threads by :func:`torch_threads` if torch is loaded; returns
    torch's count (``None`` without torch). Setting them again to the same values costs nothing."""
    pin_blas()
    if "torch" not in sys.modules:
        return None
    import torch

    n = torch_threads(config, client)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
