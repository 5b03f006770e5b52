"""The numba backend's kernel: blocks of rounds of toy-Gaussian or logistic chains, compiled.

On the toy Gaussian it runs the other engines' algorithm with the same floating-point operations
in the same order, so its chains are theirs bit for bit. On the logistic task its gradient
(:func:`_logistic_grad_rows`) sums the rows' products in its own order and takes libm's ``exp``
(the reference: BLAS and numpy's ``exp``), so its chains follow the reference's within float
rounding (``tests/test_numba_logistic.py``). Each piece it needs is the compiled twin that sits
beside its Python reference and is tested against it there: the random streams
(:mod:`qlsd_flwr.core.rng`), QSGD and numpy's pairwise norm (:mod:`qlsd_flwr.compression.qsgd`),
the exact Elias code length (:mod:`qlsd_flwr.compression.codec`). Only each task's oracle and the
loop are here; the loop's server step is :func:`qlsd_flwr.core.server_step.server_step` written
out per coordinate. Its inputs are the named tuples of :mod:`.kernel_arrays`."""

from __future__ import annotations

import math

import numpy as np
from qlsd_flwr.jit import njit

from qlsd_flwr.compression.codec import elias_bits_float
from qlsd_flwr.compression.format import HEADER_BYTES, Encoding, QuantiseError
from qlsd_flwr.compression.qsgd_nb import quantise_block_nb, sumsq_nb
from qlsd_flwr.core import rng
from qlsd_flwr.core.oracles import Oracle
from qlsd_flwr.engines.vectorised.kernel_arrays import LOGISTIC

# enum values as plain globals: numba freezes them into the compiled code
_PARTICIPATION = np.uint64(int(rng.Stream.PARTICIPATION))
_MINIBATCH_STREAM = np.uint64(int(rng.Stream.MINIBATCH))
_DITHER = np.uint64(int(rng.Stream.DITHER))
_NOISE = np.uint64(int(rng.Stream.NOISE))
_FULL, _MINIBATCH, _STAR, _SVRG = (int(o) for o in (Oracle.FULL, Oracle.MINIBATCH, Oracle.STAR, Oracle.SVRG))
_PACKED, _ELIAS = int(Encoding.PACKED), int(Encoding.ELIAS)
_IDENTITY_NON_FINITE = int(QuantiseError.IDENTITY_NON_FINITE)


@njit(cache=True)
def _minibatch_sum(i, kmini, y, yoff, Ns, ns, acc, keys, cand_i, cand_k, amb, sel):
    """``Σ_{j∈S_i} y_ij`` as ``y[idx].sum(axis=0)``: rows in ascending index order, from zero.
    Returns 1 on a subset boundary tie."""
    N = Ns[i]
    n = ns[i]
    d = acc.shape[0]
    off = yoff[i]
    acc[:] = 0.0
    if n >= N:
        for j in range(N):
            for q in range(d):
                acc[q] = acc[q] + y[off + j, q]
        return 0
    tie = rng.subset_nb(kmini, N, n, keys, cand_i, cand_k, amb, sel)
    for jj in range(n):
        row = off + sel[jj]
        for q in range(d):
            acc[q] = acc[q] + y[row, q]
    return tie


@njit(cache=True)
def _minibatch_rows(i, kmini, Ns, ns, keys, cand_i, cand_k, amb, sel):
    """The minibatch's rows of client ``i`` into ``sel[:n]`` (ascending), as
    :func:`qlsd_flwr.core.oracles.minibatch`; none drawn when ``n ≥ N`` (all rows, in order).
    Returns 1 on a subset boundary tie."""
    if ns[i] >= Ns[i]:
        return 0
    return rng.subset_nb(kmini, Ns[i], ns[i], keys, cand_i, cand_k, amb, sel)


@njit(cache=True)
def _logistic_grad_rows(X, labels, off, sel, n, all_rows, th, K, z, out):
    """``out = Σ_j [x_j, 1]ᵀ (softmax([x_j, 1] W) − e_{y_j})`` over the rows ``off + sel[:n]``
    (``off .. off + n − 1`` when ``all_rows``), ``W`` = ``th`` as a row-major ``(p+1)×K`` matrix:
    :meth:`qlsd_flwr.tasks.logistic.LogisticLocal.grad_sum` with its own summation order and
    libm's ``exp`` (equal to a few ulps, not bit for bit). ``z``: ``K`` scratch numbers."""
    p1 = X.shape[1]
    out[:] = 0.0
    for jj in range(n):
        row = off + (jj if all_rows else sel[jj])
        m = -np.inf
        for k in range(K):
            t = 0.0
            for q in range(p1):
                t += X[row, q] * th[q * K + k]
            z[k] = t
            m = max(m, t)
        tot = 0.0
        for k in range(K):
            z[k] = math.exp(z[k] - m)
            tot += z[k]
        for k in range(K):
            z[k] = z[k] / tot
        z[labels[row]] -= 1.0
        for q in range(p1):
            x = X[row, q]
            for k in range(K):
                out[q * K + k] += x * z[k]


@njit(cache=True)
def _logistic_full_grad(i, th, X, labels, yoff, Ns, K, z, sel, out, prior_flat, prior_w, prior_mean, prior_var):
    """``∇U_i(θ)``: all of client ``i``'s rows plus its share of the prior
    (:func:`qlsd_flwr.core.oracles.full_local_grad`)."""
    _logistic_grad_rows(X, labels, yoff[i], sel, Ns[i], True, th, K, z, out)
    for q in range(th.shape[0]):
        pg = 0.0 if prior_flat else (th[q] - prior_mean) / prior_var
        out[q] = out[q] + prior_w * pg


@njit(cache=True)
def _oracle_logistic(i, code, th, anchor, ag, X, labels, yoff, Ns, ns, sel, K, z, h, gb, prior_flat,
                     prior_w, prior_mean, prior_var):
    """``H_i(θ)`` of :func:`qlsd_flwr.core.oracles.oracle` for logistic client ``i`` (the same
    expression, on :func:`_logistic_grad_rows`); ``sel`` holds the round's minibatch."""
    d = th.shape[0]
    if code == _FULL:
        _logistic_full_grad(i, th, X, labels, yoff, Ns, K, z, sel, h, prior_flat, prior_w, prior_mean, prior_var)
        return
    N = Ns[i]
    n = min(ns[i], N)
    every = n >= N
    scale = np.float64(N) / np.float64(n)
    _logistic_grad_rows(X, labels, yoff[i], sel, n, every, th, K, z, h)
    if code == _MINIBATCH:
        for q in range(d):
            pg = 0.0 if prior_flat else (th[q] - prior_mean) / prior_var
            h[q] = scale * h[q] + prior_w * pg
        return
    _logistic_grad_rows(X, labels, yoff[i], sel, n, every, anchor, K, z, gb)
    for q in range(d):
        dp = 0.0 if prior_flat else (th[q] - prior_mean) / prior_var - (anchor[q] - prior_mean) / prior_var
        h[q] = scale * (h[q] - gb[q]) + prior_w * dp
    if code == _SVRG:
        for q in range(d):
            h[q] = h[q] + ag[q]


@njit(cache=True)
def _oracle_gauss(i, code, th, anchor, ag, acc, Ns, ns, ysum, h, prior_flat, prior_w, prior_mean,
            prior_var):
    """``H_i(θ)`` of :func:`qlsd_flwr.core.oracles.oracle` for Gaussian client ``i``, with the same
    float operations in the same order; ``acc`` is the minibatch sum of ``y``."""
    d = th.shape[0]
    N = Ns[i]
    if code == _FULL:  # full: (N θ − Σy) + w ∇U_0(θ)
        fN = np.float64(N)
        if prior_flat:
            for q in range(d):
                h[q] = (fN * th[q] - ysum[i, q]) + prior_w * 0.0
        else:
            for q in range(d):
                h[q] = (fN * th[q] - ysum[i, q]) + prior_w * ((th[q] - prior_mean) / prior_var)
        return
    n = min(ns[i], N)
    scale = np.float64(N) / np.float64(n)
    fn = np.float64(n)
    if code == _MINIBATCH:  # minibatch (QLSD#): (N/n)(n θ − Σ_S y) + w ∇U_0(θ)
        if prior_flat:
            for q in range(d):
                h[q] = scale * (fn * th[q] - acc[q]) + prior_w * 0.0
        else:
            for q in range(d):
                h[q] = scale * (fn * th[q] - acc[q]) + prior_w * ((th[q] - prior_mean) / prior_var)
        return
    # control variate at the anchor a = θ* (QLSD*) or ζ (QLSD++)
    if prior_flat:
        for q in range(d):
            h[q] = scale * ((fn * th[q] - acc[q]) - (fn * anchor[q] - acc[q])) + prior_w * (0.0 - 0.0)
    else:
        for q in range(d):
            dp = (th[q] - prior_mean) / prior_var - (anchor[q] - prior_mean) / prior_var
            h[q] = scale * ((fn * th[q] - acc[q]) - (fn * anchor[q] - acc[q])) + prior_w * dp
    if code == _SVRG:
        for q in range(d):
            h[q] = h[q] + ag[q]


@njit(nogil=True, cache=True)
def chains_block(k0, R, prm, ch, out):
    """Rounds ``k0 .. k0+R-1`` of the chains in ``ch`` (a contiguous group), for every
    configuration ``v``; releases the GIL.

    ``prm``: :class:`KernelParams` (data, per-configuration settings, shared settings); ``ch``:
    :class:`ChainArrays` (each chain's state and running sums, updated in place); ``out``:
    :class:`BlockOutputs` (per-round counts and states of this block). Per (chain, round,
    client) the participation, minibatch sum, dither and noise are drawn once and shared by the
    configurations. Each chain works on private copies of its state (no false sharing with
    threads running other chains) and writes them back at the end of the block.
    """
    seeds, theta, zeta, agrad, eta_i, eta = ch.seeds, ch.theta, ch.zeta, ch.agrad, ch.eta_i, ch.eta
    s_th, s_th2, s_f, s_f2, kept, ties, err = ch.s_th, ch.s_th2, ch.s_f, ch.s_f2, ch.kept, ch.ties, ch.err
    noise, states, m_act, m_skip = out.noise, out.states, out.m_act, out.m_skip
    m_bits, m_bound, m_bytes = out.m_bits, out.m_bound, out.m_bytes
    p, Ns, ns, y, yoff, ysum = prm.p, prm.Ns, prm.ns, prm.y, prm.yoff, prm.ysum
    labels, K, task = prm.labels, prm.n_classes, prm.task
    oracle, memory, encoding, ell = prm.oracle, prm.memory, prm.encoding, prm.l
    s, packed, bound, alpha = prm.s, prm.packed, prm.bound, prm.alpha
    theta_star, star_prior = prm.theta_star, prm.star_prior
    active_fraction = prm.active_fraction
    burn_in = prm.burn_in
    thin = prm.thin
    prior_flat = prm.prior_flat
    prior_server = prm.prior_on_server
    noise_kernel = prm.noise_in_kernel
    need_mini = prm.need_minibatch
    need_dither = prm.need_dither
    prior_var = prm.prior_var
    prior_mean = prm.prior_mean
    prior_w = prm.prior_weight
    nc = theta.shape[0]
    V = theta.shape[1]
    d = theta.shape[2]
    b = Ns.shape[0]
    nmax = 1
    for i in range(b):
        nmax = max(nmax, Ns[i])
    record = states.shape[2] > 0
    wts = np.empty(b)
    for i in range(b):
        wts[i] = 1.0 / p[i]
    for c in range(nc):
        h = np.empty(d)
        gb = np.empty(d)  # the logistic oracle's gradient at the anchor
        zk = np.empty(K)  # its softmax
        acc = np.zeros(d)
        gh = np.empty(d)
        g = np.empty((V, d))
        u = np.empty(d)
        z = np.empty(d)
        lev = np.empty(d)
        nzpos = np.empty(d, dtype=np.int64)
        active = np.zeros(b, dtype=np.bool_)
        keys = np.empty(nmax, dtype=np.int64)
        cand_i = np.empty(nmax, dtype=np.int64)
        cand_k = np.empty(nmax, dtype=np.int64)
        amb = np.empty(nmax, dtype=np.int64)
        sel = np.empty(nmax, dtype=np.int64)
        bits_r = np.zeros(V, dtype=np.int64)
        bytes_r = np.zeros(V, dtype=np.int64)
        bound_r = np.zeros(V)
        n32 = np.empty(1, dtype=np.float32)
        th = theta[c].copy()
        zt = zeta[c].copy()
        ag = agrad[c].copy()
        et_i = eta_i[c].copy()
        et = eta[c].copy()
        sth = s_th[c].copy()
        sth2 = s_th2[c].copy()
        sf_ = s_f[c].copy()
        sf2_ = s_f2[c].copy()
        kept_c = kept[c]
        ties_c = ties[c]
        bad = False
        seed = seeds[c]
        ks_part = rng.key_seed_nb(seed, _PARTICIPATION)
        ks_mini = rng.key_seed_nb(seed, _MINIBATCH_STREAM)
        ks_dith = rng.key_seed_nb(seed, _DITHER)
        ks_noise = rng.key_seed_nb(seed, _NOISE)
        for r in range(R):
            k = k0 + r
            for v in range(V):  # ζ_k = θ_k every l rounds, and ∇U_i(ζ) for every client
                if oracle[v] == _SVRG and k % ell[v] == 0:
                    for q in range(d):
                        zt[v, q] = th[v, q]
                    for i in range(b):
                        if task == LOGISTIC:
                            _logistic_full_grad(i, zt[v], y, labels, yoff, Ns, K, zk, sel, ag[v, i],
                                                prior_flat, prior_w, prior_mean, prior_var)
                            continue
                        fN = np.float64(Ns[i])
                        for q in range(d):
                            pg = 0.0 if prior_flat else (zt[v, q] - prior_mean) / prior_var
                            ag[v, i, q] = (fN * zt[v, q] - ysum[i, q]) + prior_w * pg
            n_act = 0
            for i in range(b):
                if p[i] >= 1.0:
                    active[i] = True  # u < 1 always: the draw cannot change the outcome
                else:
                    active[i] = rng.unif_nb(rng.key_rc_nb(ks_part, k, i), 1) < p[i]
                n_act += 1 if active[i] else 0
            m_act[c, r] = n_act
            if active_fraction and n_act == 0:  # the rule is undefined: skip the round
                m_skip[c, r] = 1
            else:
                g[:, :] = 0.0
                bits_r[:] = 0
                bytes_r[:] = 0
                bound_r[:] = 0.0
                for i in range(b):
                    if not active[i]:
                        continue
                    if need_mini and task == LOGISTIC:
                        ties_c += _minibatch_rows(i, rng.key_rc_nb(ks_mini, k, i), Ns, ns, keys, cand_i,
                                                  cand_k, amb, sel)
                    elif need_mini:
                        ties_c += _minibatch_sum(i, rng.key_rc_nb(ks_mini, k, i), y, yoff, Ns, ns, acc,
                                                 keys, cand_i, cand_k, amb, sel)
                    if need_dither:
                        rng.dither_nb(rng.key_rc_nb(ks_dith, k, i), d, u, nzpos)
                    w = (np.float64(b) / np.float64(n_act)) if active_fraction else wts[i]
                    for v in range(V):
                        code = oracle[v]
                        if task == LOGISTIC:
                            _oracle_logistic(i, code, th[v], theta_star[v] if code == _STAR else zt[v], ag[v, i],
                                             y, labels, yoff, Ns, ns, sel, K, zk, h, gb, prior_flat, prior_w,
                                             prior_mean, prior_var)
                        else:
                            _oracle_gauss(i, code, th[v], theta_star[v] if code == _STAR else zt[v], ag[v, i],
                                          acc, Ns, ns, ysum, h, prior_flat, prior_w, prior_mean, prior_var)
                        if memory[v]:  # memory: send C(H_i − η_i)
                            for q in range(d):
                                h[q] = h[q] - et_i[v, i, q]
                        if prm.compressed[v]:
                            e = quantise_block_nb(h, u, s[v, i], lev, gh, n32)
                            if e != 0:
                                err[c, v] = e
                                bad = True
                                break
                            bits = packed[v, i]
                            if encoding[v] != _PACKED:  # QSGD's sparse code, or the shorter (auto)
                                eb = elias_bits_float(lev, nzpos)
                                bits = eb if encoding[v] == _ELIAS else min(eb, bits)
                            bytes_r[v] += HEADER_BYTES + (bits + 7) // 8
                        else:
                            for q in range(d):
                                if not math.isfinite(h[q]):
                                    err[c, v] = _IDENTITY_NON_FINITE
                                    bad = True
                                gh[q] = h[q]
                            if bad:
                                break
                            bits = packed[v, i]
                            bytes_r[v] += bits // 8
                        bits_r[v] += bits
                        bound_r[v] += bound[v, i]
                        for q in range(d):
                            g[v, q] = g[v, q] + w * gh[q]
                        if memory[v] and alpha[v, i] != 0.0:
                            ai = alpha[v, i]
                            for q in range(d):
                                et_i[v, i, q] = et_i[v, i, q] + ai * gh[q]
                    if bad:
                        break
                if bad:
                    break
                for v in range(V):
                    m_bits[c, v, r] = bits_r[v]
                    m_bound[c, v, r] = bound_r[v]
                    m_bytes[c, v, r] = bytes_r[v]
                    if memory[v]:  # g += η_k, then η_{k+1} = Σ_i η_i (rows in order, from zero)
                        for q in range(d):
                            g[v, q] = g[v, q] + et[v, q]
                            et[v, q] = 0.0
                        for i in range(b):
                            for q in range(d):
                                et[v, q] = et[v, q] + et_i[v, i, q]
                    if prior_server and not prior_flat:
                        for q in range(d):
                            t = (th[v, q] - prior_mean) / prior_var
                            if oracle[v] == _STAR:
                                t = t - star_prior[v, q]
                            g[v, q] = g[v, q] + t
                if noise_kernel:
                    rng.normal_row_nb(rng.key_rc_nb(ks_noise, k, 0), z)
                else:
                    for q in range(d):
                        z[q] = noise[c, r, q]
                for v in range(V):
                    gam = prm.gamma[v]
                    sq2 = prm.sqrt2gamma[v]
                    for q in range(d):
                        th[v, q] = th[v, q] - gam * g[v, q] + sq2 * z[q]
            if record:
                for v in range(V):
                    for q in range(d):
                        states[c, v, r, q] = th[v, q]
            j = k + 1
            if j > burn_in and (j - burn_in - 1) % thin == 0:
                for v in range(V):
                    for q in range(d):
                        x = th[v, q]
                        sth[v, q] += x
                        sth2[v, q] += x * x
                    f = math.sqrt(0.0 + sumsq_nb(th[v], 0, d))  # as np.sqrt(np.sum(θ², -1))
                    sf_[v] += f
                    sf2_[v] += f * f
                kept_c += 1
        theta[c] = th
        zeta[c] = zt
        agrad[c] = ag
        eta_i[c] = et_i
        eta[c] = et
        s_th[c] = sth
        s_th2[c] = sth2
        s_f[c] = sf_
        s_f2[c] = sf2_
        kept[c] = kept_c
        ties[c] = ties_c
