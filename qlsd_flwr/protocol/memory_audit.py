"""The memory audit after a run: every client's own ``η_i`` against the server's mirror of it.

QLSD++'s memory terms live twice, on each client and mirrored on the server, and they agree bit
for bit only if both applied the same decoded increments in the same order. The audit compares
them once the rounds are over (the clients report from ``context.state``).

What travels (issue 37): each client first sends an 8-byte digest of each chain's ``η_i`` (:func:`digest`, 64 bits
where the whole vector was ``64 d``: 4.0e7 bits on the main job); only a client whose digest differs from its
mirror's is asked for the vector itself, so that the audit can say by how much. Equal digests stand for equal vectors
(a 64-bit digest: a chance of 2^-64 that two different ones agree), and the comparison then takes the mirror's.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np

from qlsd_flwr.protocol.wire import arr_to_bytes

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


def digest(eta) -> bytes:
    """The audit's 8 bytes for an ``η_i`` (BLAKE2b of its little-endian float64 values); ``b""`` where the client holds
    none."""
    if eta is None:
        return b""
    return hashlib.blake2b(arr_to_bytes(eta), digest_size=8).digest()


def differing(mirrors: list, digests: dict[int, dict[int, tuple[bytes, int]]]) -> dict[int, list[int]]:
    """``{client: [chain, ...]}`` whose reported digest is not the digest of the server's mirror ``mirrors[c][i]``
    (each chain's ``eta_i``)."""
    out: dict[int, list[int]] = {}
    for i, per_chain in digests.items():
        # a client that holds no η_i (never active) is a zero vector, as the full report reads it
        bad = [c for c, (dg, _) in per_chain.items()
               if c >= len(mirrors) or (dg or digest(np.zeros_like(mirrors[c][i]))) != digest(mirrors[c][i])]
        if bad:
            out[i] = bad
    return out


def reports_from(mirrors: list, digests: dict, bad: dict[int, list[int]], full: dict) -> dict:
    """The clients' ``{i: {c: (η_i, count)}}`` for :func:`memory_check`: an equal digest stands for the mirror's own
    vector, a differing one (``bad``, :func:`differing`) for the vector the client sent again (``full``), left out
    where it did not."""
    return {i: {c: full[i][c] if c in bad.get(i, ()) else (mirrors[c][i].copy(), n)
                for c, (_, n) in r.items() if c not in bad.get(i, ()) or c in full.get(i, {})}
            for i, r in digests.items()}
