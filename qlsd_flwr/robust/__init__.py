"""The one home for the bounds on what a client sends (issue 36; the rest move here in issue 38).

Now here: the per-datum clamps and the caps on curvature reports (:mod:`qlsd_flwr.robust.reports`).
Still in their old homes: reply norms and exclusion (``protocol/norm_guard.py``), θ* claims
(``protocol/claims.py``), FSGLD's total precision (``core/fsgld.py``) and the LOO replies (``outputs/loo.py``).
"""
