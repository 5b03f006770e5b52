"""The θ* phase held to what the clients say later (QLSD*, LSD*).

The θ* optimisation phase asks every client for ``∇U_i(θ)`` and the server descends to where their
sum vanishes. A client can lie there (a constant offset of the size of an honest gradient is
invisible to any norm rule) and answer honestly afterwards: QLSD*'s messages are *differences*
``∇U_i(θ) − ∇U_i(θ*)``, in which a constant offset cancels, so the chain would sample a shifted
target (11.5 posterior sd in issue 21's probe) with nothing to see.

So the server asks for the claims at θ* before sampling (``c_i``; also with θ* in closed form; on
the Flower path each is held to what the client said at θ* in the descent:
:mod:`qlsd_flwr.flower.phases`), and the first sampling reply to θ* (``anchor`` in the message)
repeats ``a_i = ∇U_i(θ*)``, computed by the same function
(:func:`qlsd_flwr.core.oracles.full_local_grad`). An honest client gives the same numbers (bit for
bit on one machine; :data:`qlsd_flwr.robust.claims.RTOL` leaves room for a GPU's reduction order). A client whose two
answers differ cannot be trusted in either: it leaves the federation (not asked again, ``excluded``
in the summary, the reply counted as ``theta_star_mismatch``), and the step adds the sum of the
*other* clients' claims at θ*, ``r − c_i`` (``r`` the phase's whole sum, the prior's term included),
so that the control variate is exact again for the federation without the client: the chain then
targets the posterior of the other clients' data, whichever answer was the lie. The same term
corrects QLSD* after the norm guard excludes a client. (Exact under ``aggregation = unbiased``;
``active-fraction``'s weights ``b/|A_k|`` still count the excluded clients in ``b``.)

What it cannot see: a client that tells the same lie in both (a constant offset in every full
gradient it ever sends). That client is indistinguishable from one holding other data (its
potential plus a linear term). The norm guard judges QLSD*'s replies as ``c_i + ĝ_i``, the
estimate they make, as it judges every variant's; only a fixed ``norm-bound = B`` bounds such a lie
(:func:`qlsd_flwr.robust.claims.over_bound` holds the claims to it; ``docs/DEPLOYMENT.md`` §9b).
"""

from __future__ import annotations

import logging

import numpy as np

from qlsd_flwr.bases import whitening_of
from qlsd_flwr.outputs.checkpoint import CheckpointError
from qlsd_flwr.protocol.wire import ReplyError, bytes_to_arr
from qlsd_flwr.robust.claims import over_bound, relative_gap
from qlsd_flwr.robust.norm_guard import fixed_bound

log = logging.getLogger("qlsd_flwr")


def claims_over_bound(cfg, d: int, metric, claims) -> dict[int, str]:
    """QLSD*'s claims over a fixed ``norm-bound = B``, measured as its sampling replies will be judged
    (:func:`qlsd_flwr.robust.claims.over_bound`, in the coordinates the messages are quantised in,
    :func:`qlsd_flwr.bases.whitening_of`); nothing under ``auto`` or ``off``."""
    bound = fixed_bound(cfg.raw.get("norm-bound", "auto"))
    return {} if bound is None else over_bound(claims, bound, None if metric is None else whitening_of(cfg, d, metric))


class ThetaStarClaims:
    """Every client's ``∇U_i(θ*)`` from the θ* phase, and the step's correction (module docstring)."""

    def __init__(self, claims: np.ndarray, total: np.ndarray):
        self.claims = np.asarray(claims, dtype=np.float64)  # (b, d): c_i
        self.total = np.asarray(total, dtype=np.float64)  # r = Σ_i c_i (+ ∇U_0(θ*) on the server)
        self._whitened: np.ndarray | None = None  # Sᵀ c_i, once (base)

    @classmethod
    def restored(cls, a: dict, b: int, d: int) -> "ThetaStarClaims | None":
        """From a checkpoint's arrays (``None`` when it has none); :class:`CheckpointError` naming the field."""
        if "claims" not in a:
            return None
        c, t = a["claims"], a.get("claims_total")
        if t is None or c.shape != (b, d) or t.shape != (d,) or c.dtype.kind != "f" or t.dtype.kind != "f":
            raise CheckpointError(f"checkpoint: 'claims' must be {b} × {d} numbers with a {d}-vector 'claims_total'")
        return cls(c, t)

    def base(self, spec) -> np.ndarray:
        """The claims as the norm guard adds them to a reply: ``c_i``, or ``Sᵀ c_i`` when the replies are in the
        metric's coordinates (``compression-basis = metric``; computed once)."""
        if not getattr(spec, "whitened", False):
            return self.claims
        if self._whitened is None:
            self._whitened = spec.whitening.apply_root_t(self.claims)
        return self._whitened

    def arrays(self) -> dict:
        """For checkpoints."""
        return {"claims": self.claims, "claims_total": self.total}

    def differs(self, i: int, a: np.ndarray) -> float | None:
        """The relative difference of client ``i``'s sampling-time ``∇U_i(θ*)`` from its claim, when
        over :data:`RTOL`; ``None`` when they agree."""
        return relative_gap(a, self.claims[i])

    def broken(self, i: int, rep: dict, round_: int) -> bool:
        """Whether client ``i``'s reply to θ* (``rep``, parsed) gives another ``∇U_i(θ*)`` than its
        claim (logged, naming the client); :class:`ReplyError` when the field is missing or malformed."""
        try:
            a = bytes_to_arr(rep.get("anchor_grad", b""), self.claims.shape[1])
        except ValueError as exc:
            raise ReplyError(f"anchor_grad: {exc}") from None
        if not np.all(np.isfinite(a)):
            raise ReplyError("anchor_grad: non-finite values")
        gap = self.differs(i, a)
        if gap is not None:
            log.warning("client %d: its ∇U_i(θ*) differs from its θ* phase reply (relative %.3g): excluded from round "
                        "%d on; the chain now samples the posterior of the other clients' data (summary.json "
                        "'excluded')", i, gap, round_)
        return gap is not None

    def offset(self, excluded) -> np.ndarray | None:
        """What the step adds with the clients ``excluded`` gone: the others' claims' sum, ``None``
        (nothing: the paper's step) while nobody is excluded."""
        gone = sorted(int(i) for i in excluded)
        if not gone:
            return None
        return self.total - self.claims[gone].sum(axis=0)
