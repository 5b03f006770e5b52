"""The QLSD family (Vono et al., AISTATS 2022, Algorithm 2) and its uncompressed twins.

Each round a client takes part with probability ``p_i`` and sends ``g_i = C(H_i − η_i)``; the server
steps ``θ_{k+1} = θ_k − γ g_{k+1} + √(2γ) Z_{k+1}`` (:func:`message`, whose ``H_i`` is
:func:`qlsd_flwr.core.oracles.oracle`; :func:`qlsd_flwr.core.server_step.langevin_step`). The samplers
differ in the estimator ``H_i``:

* QLSD: ``∇U_i(θ)``; QLSD#: a minibatch of it;
* QLSD*, LSD*: the minibatch difference at θ*, a control variate;
* QLSD++, LSD++: the difference at an anchor ζ refreshed every ``l`` rounds, plus ``∇U_i(ζ)``, with
  the memory ``η_i`` (QLSD++);
* SGLD: the centralised minibatch chain (Welling & Teh 2011), the data pooled into one client.
"""

from __future__ import annotations

from qlsd_flwr.core import oracles
from qlsd_flwr.core.server_step import langevin_step
from qlsd_flwr.samplers.base import Estimator, Sampler


def message(spec, pot, state, seed: int, round_: int, theta, local=None):
    """Client ``i``'s ``H_i(θ_k)`` (:func:`qlsd_flwr.core.oracles.oracle`) on the round's minibatch ``S_i``,
    the ``n_i``-subset of stream ``(seed, MINIBATCH, k, i)``; ``local`` is not used."""
    return oracles.oracle(spec, pot, state, theta, oracles.minibatch(seed, round_, spec, pot.n_data))


_UPDATES = {"message": message, "step": langevin_step, "batched": True}
FULL = Estimator("full", **_UPDATES)
MINIBATCH = Estimator("minibatch", minibatch=True, **_UPDATES)
STAR = Estimator("star", minibatch=True, cv_theta_star=True, measure="claim+difference", down=("anchor",),
                 up=("anchor_grad",), **_UPDATES)
SVRG = Estimator("svrg", minibatch=True, cv_zeta=True, down=("anchor", "eta"), **_UPDATES)

#: keys of the rivals' local steps, which no QLSD-family run reads
_LOCAL_KEYS = frozenset({"local-steps", "tau", "rho", "q"})
_PAPER = "Vono, Plassier, Durmus, Dieuleveut & Moulines, AISTATS 2022"

SAMPLERS = (
    Sampler("qlsd", "QLSD", FULL, compressed=True, memory=False, reference=_PAPER, not_applicable=_LOCAL_KEYS),
    Sampler("qlsd-sharp", "QLSD#", MINIBATCH, compressed=True, memory=False, reference=_PAPER,
            not_applicable=_LOCAL_KEYS),
    Sampler("qlsd-star", "QLSD*", STAR, compressed=True, memory=False, reference=_PAPER, not_applicable=_LOCAL_KEYS),
    Sampler("qlsd-pp", "QLSD++", SVRG, compressed=True, memory=True, reference=_PAPER, not_applicable=_LOCAL_KEYS),
    Sampler("lsd-star", "LSD*", STAR, compressed=False, memory=False, reference=_PAPER, not_applicable=_LOCAL_KEYS),
    Sampler("lsd-pp", "LSD++", SVRG, compressed=False, memory=True, reference=_PAPER, not_applicable=_LOCAL_KEYS),
    Sampler("sgld", "SGLD", MINIBATCH, compressed=False, memory=False, reference="Welling & Teh, ICML 2011",
            pooled=True, not_applicable=_LOCAL_KEYS),
)
