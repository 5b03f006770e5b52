"""The one home for the rules that judge what a client sends (issue 36; issue 38 derives them anew).

Every bound below acts before any state changes: a reply or report over it is refused and counted,
or scaled down where that keeps the chain unbiased. "Per datum" means divided by the client's data
count ``N_i`` as :func:`~qlsd_flwr.robust.reports.clamped_counts` gives it (its handshake claim, at
least 1 and at most ``N_CLAIM_CAP`` times the lower median of the claims): one definition, used by
the reply guard and the report caps alike.

=================================  ==================================  =====================================
what a client sends                the rule and its constants          what it rests on (today)
=================================  ==================================  =====================================
sampling replies                   :mod:`.norm_guard`: FACTOR_PROBATION  honest maxima 24.64, 39.8, 7.1 × R over
                                   30, FACTOR_ROUND 100, FACTOR_STEADY   36 runs, 0 of 648,208 replies refused
                                   30 (a client's mean over its last     (``bench_byzantine.py --parts honest``
                                   16) × R, the median over clients of   → ``byzantine_honest*.json``)
                                   each one's largest reply per datum;
                                   WINDOW 32, OWN 16, OWN_MIN 8, POOL_MIN 3;
                                   STORM_SHARE 0.5: more refused over
                                   32 rounds stops the run (a chain
                                   standing still), naming the suspect
θ* claims and their repeats,       :mod:`.claims`: RTOL 1e-6 (the same   a GPU's reduction order; the fixed
VR-FALD*'s ref_grad                answer twice), ``norm-bound = B``,    ``B`` is the user's; honest maximum
                                   FACTOR_CLAIM 50 × the lower median    8.46 × (bench_honest_claims.py)
                                   per datum, POOL_MIN 3
Hessian-vector products of         :mod:`.products`: FACTOR_PRODUCT 50   honest maximum 12.2 ×
``gamma = auto``'s power iteration × the lower median per datum; each   (bench_honest_claims.py); γ shrinks
                                   client's part of the Rayleigh         ≤ 1 + a_i (3.2× for one of ten);
                                   quotient ≤ a_i = max(SHARE 1,         honest: parts over 1× had ≤ 10.3× per
                                   FACTOR_SHARE_DATUM 20 · N_i/N_{−i})   datum (``--shares``). Networks (not
                                   × the others' and the prior's;        log-concave): γ shrinks ≤ 301×, grows
                                   networks: SHARE_NETWORK 300 (|·|),    ≤ 4 λ_max/q(v₀); γ held no honest part
                                   below ¾ (SHARE_NETWORK_BELOW 3), no   (``--networks``)
                                   per-datum clip
curvature reports, products,       :mod:`.reports`: REPORT_CAP 10 × the  one client of ten moves M by at most
surrogate precisions               lower median per datum, REPORT_MAX    ~REPORT_CAP along the largest diagonal
                                   1e150; FSGLD's Λ held to 1/γ          entry;
                                   MAX_BLOCK 256 products a message      a client's cost per message
FSGLD's surrogate precisions       :mod:`.reports`: cap_surrogates,      one client widens any coordinate's
                                   SURROGATE_WIDEN 2: λ_i ≤ t_max/h,     variance by at most 2× (exact on the
                                   the largest excess whose widening     toy Gaussian: core.fsgld_widening;
                                   (core.fsgld_widening, its K local     ×9 gave no stationary variance, now
                                   steps) is 2 against c from the        1.20), save where it reports most of
                                   prior and the others' reports (C_MAX  a coordinate: there where a lie and
                                   0.8), never below 2× for an honest    the truth widen alike
                                   report; a clash: where both meet      (surrogate_bound); honest maxima:
                                                                         bench_honest_claims.py, fsgld_*
diagonal, dense and Kronecker      :mod:`.reports`: FACTOR_SHARE 150:    one client shrinks M along any direction
curvature reports (the metric)     ``P_0 + Σ H ⪯ (1 + 150 N_i/N_{−i})``  by at most 1 + 150 N_i/N_{−i} (17.7× for
                                   ``(P_0 + Σ_{k≠i} H_k)``; K-FAC: on    one of ten); honest maximum 60 N_i/N_{−i}
                                   ``G ⊗ Ā + λ_0 I`` whole               (``bench_honest_claims.py``)
the low-rank correction's          :mod:`.krylov`: FACTOR_SHARE 150,     one client moves ``M'`` by at most
Hessian-vector products            both ways, on each client's share of  1 + 150 N_i/N_{−i} either way in the
                                   the projected curvature ``T`` (the    correction's space; honest maximum
                                   others' PSD parts); a client scaled:  0.728 of it over 37 cases
                                   the correction again (CARRY 0.5,      (``bench_honest_claims.py``, worst
                                   PASSES 3: then without it)            digits 20 clients); main job 0.163
metric-block's block reports       core.kron_block with :mod:`.reports`: one client shrinks M along any
(K-FAC exact on its top inputs)    REPORT_CAP 10 on tr B_i / N_i, then   direction of S by at most
                                   FACTOR_SHARE 150 leave-one-out on S   1 + 150 N_i/N_{−i}; honest on the
                                   (cap_leave_one_out, as dense ones)    main job's split: trace 1.69 ×, 0.255
                                                                         of the allowance (bench_lowrank_
                                                                         exchanges.py --subspace); one split
LOO replies                        :mod:`.loo`: shape from ``N_i``,      sums of many points stay finite;
                                   finite, VALUE_MAX 1e150; at most the  a probability is at most 1, a
                                   model's ceiling (0; the Gaussian's    density at most its peak
                                   peak −(d/2) log 2π), LOG_P_MAX 1e-9
handshake facts                    :mod:`.handshake`: client in 0..b-1,  2^53: float64's exact integers
                                   ``d``, 1 ≤ N_i ≤ N_DATA_MAX 2^53;     a support too small harms only its
                                   the support ⌈d/8⌉ bytes, no padding   own gradient's point; too large
                                   bit, a coordinate at least            costs bits only
=================================  ==================================  =====================================

Nothing else in the package holds a bound on what a client sends.
"""
