"""The memory audit after a run: every client's own ``η_i`` against the server's mirror of it.

QLSD++'s memory terms live twice, on each client and mirrored on the server, and they agree bit
for bit only if both applied the same decoded increments in the same order. The audit compares
them once the rounds are over (the clients report from ``context.state``).
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("qlsd_flwr")


def memory_check(state, needs_resync: np.ndarray, eta_count: np.ndarray,
                 reports: dict[int, tuple[np.ndarray, int]]) -> dict:
    """Compare the server's mirrors (``state.eta_i``, ``state.eta``; ``eta_count`` updates per client)
    with the clients' own ``(η_i, update count)``: ``max_abs_eta_minus_sum`` = ``max |η − Σ_i η_i^{client}|``
    (when all reported) and ``max_abs_mirror_diff`` = ``max_i |η_i^{mirror} − η_i^{client}|``. A client
    still to be resynced (``needs_resync``) is listed, not compared."""
    st, b = state, len(needs_resync)
    # a client not heard from since a resume (or a restart) holds no η_i yet: not comparable
    pending = sorted(i for i in reports if needs_resync[i])
    got = {i: v for i, v in reports.items() if not needs_resync[i]}
    out: dict = {"clients_reported": sorted(got), "clients_pending_resync": pending,
                 "max_abs_eta": float(np.max(np.abs(st.eta))),
                 "eta_count_agrees": {str(i): bool(c == eta_count[i]) for i, (_, c) in sorted(got.items())}}
    if got:
        out["max_abs_mirror_diff"] = float(max(np.max(np.abs(st.eta_i[i] - e)) for i, (e, _) in got.items()))
    if len(got) == b:
        total = np.sum([got[i][0] for i in range(b)], axis=0)
        out["max_abs_eta_minus_sum"] = float(np.max(np.abs(st.eta - total)))
    if out.get("max_abs_mirror_diff", 0.0) > 1e-9 * (1.0 + float(np.max(np.abs(st.eta_i)))):
        log.warning("memory check: server mirrors and clients' η_i differ: %s", out)
    return out
