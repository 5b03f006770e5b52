"""The numpy backend's compiled helpers (:mod:`.numpy_backend`): a round's random draws for every
chain, and QSGD with exact code lengths over every active (chain, client) row."""

from __future__ import annotations

import numpy as np
from qlsd_flwr.jit import njit

from qlsd_flwr.compression.codec import elias_bits_float
from qlsd_flwr.compression.format import Encoding
from qlsd_flwr.compression.qsgd_nb import quantise_block_nb
from qlsd_flwr.core import rng

_PACKED, _ELIAS = int(Encoding.PACKED), int(Encoding.ELIAS)


@njit(cache=True)
def qsgd_rows(H, U, active, clients, s, packed, enc, g_hat, bits):
    """QSGD of every active (chain, client) row of ``H`` ``(C, b, d)`` with dither ``U``: ``ĝ`` into
    ``g_hat`` and the exact code length into ``bits`` (rows left untouched where inactive). The
    functions are the compiled twins the one-vector ``QSGD.quantise`` and the numba kernel call
    (bitwise equal to ``QSGD.quantise_batch`` / ``dequantise_batch`` / ``code_length_bits_batch``,
    tested in ``tests/test_vectorised.py``). Returns the :class:`QuantiseError` value of the first
    row that cannot be quantised (0: every row was)."""
    d = H.shape[2]
    lev = np.empty(d)
    nzpos = np.empty(d, np.int64)
    n32 = np.empty(1, np.float32)
    for c in range(H.shape[0]):
        for t in range(clients.shape[0]):
            i = clients[t]
            if not active[c, i]:
                continue
            e = quantise_block_nb(H[c, i], U[c, i], s[t], lev, g_hat[c, i], n32)
            if e != 0:
                return e
            bb = packed[t]
            if enc[t] != _PACKED:  # QSGD's sparse code, or the shorter of the two (auto)
                eb = elias_bits_float(lev, nzpos)
                bb = eb if enc[t] == _ELIAS else min(eb, bb)
            bits[c, i] = bb
    return 0


_PARTICIPATION = np.uint64(int(rng.Stream.PARTICIPATION))
_MINIBATCH = np.uint64(int(rng.Stream.MINIBATCH))
_DITHER = np.uint64(int(rng.Stream.DITHER))


@njit(cache=True)
def draw_round(seeds, k, p, sub, Ns, ns, dithered, active, sel, ties, U):
    """The round's random draws for every chain, from the compiled twins of :mod:`qlsd_flwr.core.rng`
    the numba kernel uses (tested bit for bit against the numpy functions in ``tests/test_vectorised.py``):

    * ``active[c, i]``: ``u < p_i`` with ``u`` the first uniform of ``(seed_c, PARTICIPATION, k, i)``,
      as :func:`qlsd_flwr.core.participation.active_mask`; not drawn where ``p_i ≥ 1`` (``u < 1``);
    * ``sel[t, c, :n]``: for the active chains of client ``sub[t]``, its minibatch, the
      ``n = ns[t]``-subset of ``[0, Ns[t])`` of :func:`qlsd_flwr.core.rng.subset` (ascending), with
      ``ties[t, c] = 1`` where two keys tie at the ``n``-th place (the caller then draws that
      client's subsets with ``rng.subset`` itself);
    * ``U[c, i]``: for active ``(c, i)`` with ``dithered[i]``, the QSGD dither, the first ``d``
      uniforms of ``(seed_c, DITHER, k, i)``.

    Nothing is drawn for inactive (chain, client) pairs: those numbers are never used."""
    C, b, d = U.shape
    nmax = max(1, Ns.max()) if Ns.shape[0] else 1
    keys = np.empty(nmax, np.int64)
    cand_i = np.empty(nmax, np.int64)
    cand_k = np.empty(nmax, np.int64)
    amb = np.empty(nmax, np.int64)
    row = np.empty(nmax, np.int64)
    ulo = np.empty(d, np.int64)
    for c in range(C):
        ksp = rng.key_seed_nb(seeds[c], _PARTICIPATION)
        for i in range(b):
            active[c, i] = True if p[i] >= 1.0 else rng.unif_nb(rng.key_rc_nb(ksp, k, i), 1) < p[i]
        ksm = rng.key_seed_nb(seeds[c], _MINIBATCH)
        for t in range(sub.shape[0]):
            i = sub[t]
            if active[c, i]:
                ties[t, c] = rng.subset_nb(rng.key_rc_nb(ksm, k, i), Ns[t], ns[t], keys, cand_i, cand_k, amb, row)
                for j in range(ns[t]):
                    sel[t, c, j] = row[j]
        ksd = rng.key_seed_nb(seeds[c], _DITHER)
        for i in range(b):
            if dithered[i] and active[c, i]:
                rng.dither_nb(rng.key_rc_nb(ksd, k, i), d, U[c, i], ulo)
