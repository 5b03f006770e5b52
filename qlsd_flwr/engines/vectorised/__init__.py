"""The vectorised engine: many independent chains at once, no Flower in the loop.

``engine = vectorised`` runs the *same* algorithm as the Flower strategy and the framework-free
loop (:func:`qlsd_flwr.engines.local.run_local`): the same participation rule, minibatches, oracles,
QSGD quantisation, memory rules and server step, drawing the same numbers from the same
counter-based streams (:mod:`qlsd_flwr.core.rng`). It adds independent chains run side by side.

Chains
------
Chain ``c`` (``0 ≤ c < num-chains``) uses seed ``seed + c`` and starts from the task's ``θ_0``.
Chain 0 is therefore, bit for bit, the single chain that the ``local``, ``inprocess`` and ``ray``
engines produce for the same config (``tests/test_vectorised.py`` checks it against
``run_local``). All chains share the data (``data-seed``), ``θ*`` and every setting.

Configurations side by side
---------------------------
:func:`run_side_by_side` runs several configurations that differ only in ``variant``, ``s``,
``gamma``, ``l``, ``alpha``, ``compressor`` and ``encoding`` (same data, seeds, chains, rounds,
participation and batch fraction). Their chain ``c`` draws the same participation, minibatch,
dither and Langevin noise (common random numbers: the streams are keyed by seed, round and
client only), so the numba backend computes those once per (chain, round, client) for all
configurations. Each configuration's chains are still exactly those of a run on its own.

Two backends
------------
* ``numba`` — the fast path for the toy Gaussian task (every client a
  :class:`~qlsd_flwr.tasks.gaussian.GaussianLocal`, one QSGD norm per vector). One compiled
  kernel (``nogil``) runs a block of rounds for a group of chains; the chains are split into
  one contiguous group per core, run by a thread pool. It re-implements SplitMix64, the subset
  draw, the oracles, QSGD quantise/dequantise, the exact code lengths and the server step with
  the same floating-point operations in the same order as the numpy reference, so the chains
  are bitwise equal. Summation orders matter and are reproduced: ``y[idx].sum(axis=0)`` and
  ``η = Σ_i η_i`` are sequential over rows from zero; the QSGD norm uses numpy's pairwise sum
  (8 accumulators, blocks of 128). No fused multiply-add is emitted (numba does not contract
  without ``fastmath``). The Langevin noise needs ``log1p`` and ``cos``: the kernel calls libm,
  and at first use checks on 2^17 draws that these equal numpy's bit for bit; if not (a numpy
  built with another math library, e.g. SVML on AVX-512) the noise comes from
  :func:`qlsd_flwr.core.rng.normal` in numpy, one block at a time.

  On request (``backend="numba"``; ``auto`` does not pick it) the same kernel runs the
  **logistic task** (every client a :class:`~qlsd_flwr.tasks.logistic.LogisticLocal`), with a
  compiled gradient over the minibatch's rows. That gradient sums in its own order and calls
  libm's ``exp``, where the reference calls BLAS and numpy's ``exp``: equal to a few ulps, not
  bit for bit. Everything else is the shared kernel, so the chains follow the reference's within
  float rounding (``tests/test_numba_logistic.py`` derives and checks both bounds). Against a
  JAX jit + vmap + scan version of the same step it measured 1.7-1.8× on breast_cancer, about
  1.0× on digits QLSD++ and 0.75× on digits LSD++, where the numpy backend measured 0.46-0.99×
  (``benchmarks/bench_logistic.py``; ``benchmarks/RESULTS.md``).
* ``numpy`` — any :class:`~qlsd_flwr.core.potential.Task` whose clients implement
  :class:`~qlsd_flwr.core.potential.LocalPotential`. Randomness, quantisation, code lengths and
  the server step are vectorised over chains and clients with the very functions the other
  engines call (``rng``, ``participation``, ``QSGD.quantise_batch``...); the gradient oracle
  is :func:`qlsd_flwr.core.oracles.oracle_batch_clients` over chains and clients when the
  potential has batched methods (the logistic task: bit for bit the per-client oracle, see
  ``LogisticLocal.grad_sum_batch``), :func:`qlsd_flwr.core.oracles.oracle` once per (chain,
  active client) otherwise (``NumpyGeneric(batched=False)`` keeps that path for any task).

``backend = "auto"`` picks ``numba`` when its chains are the reference's bit for bit (the toy
Gaussian), ``numpy`` otherwise.

Modules: :mod:`.driver` (the loop over blocks, outputs, checkpoints, divergence),
:mod:`.numpy_backend`, :mod:`.numba_backend` and its :mod:`.kernel`, :mod:`.results`.

One event can make the numba chain differ from the reference: two of a client's ``N_i``
minibatch keys (53-bit uniforms) tying exactly at the ``n_i``-th place, where numpy's
``argpartition`` may break the tie differently. Its chance is about ``N_i·2^-53`` per draw
(about 1e-5 over the whole toy figure); such ties are counted (``subset_ties`` in the summary).

Outputs
-------
With ``write=True`` the run folder is the one every engine writes (:class:`~qlsd_flwr.outputs.recorder.Recorder`
with ``num_chains`` chains: ``samples.nc`` with dims ``(chain, draw, theta_dim_0)``,
``metrics.csv``, ``config.json``, ``summary.json``). ``metrics.csv`` has one row per round whose
counts (active clients, bits, bytes) are **totals over the chains**; ``summary.json`` adds
``per_chain_round`` (the same divided by ``num_chains``). ``bits_exact`` is the length of the code
``QSGD.encode`` would produce (:meth:`~qlsd_flwr.compression.qsgd.QSGD.code_length_bits_batch`) and
``bytes_payload`` its payload size ``5 + ⌈bits/8⌉``; messages are not actually encoded (the
round trip ``decode(encode(q)) == q`` is tested with the compressor).

Checkpoints and divergence
--------------------------
With ``checkpoint-every = N`` (one configuration, writing) blocks end on multiples of ``N`` and
the engine saves ``checkpoint.npz`` there: every chain's state (θ, ζ, ``∇U_i(ζ)``, ``η_i``, ``η``),
the streamed statistics and the recorder's position. ``resume = <run folder>`` continues from it,
bitwise as if the run had never stopped (:mod:`qlsd_flwr.outputs.checkpoint`). A chain whose θ becomes
non-finite (or whose gradient overflows the codec) stops the run with
:class:`~qlsd_flwr.protocol.divergence.DivergenceError` (a ``ValueError``) naming the round and suggesting a
smaller ``gamma``; rounds before it are recorded and the run folder is closed cleanly.

Whether or not it writes, a run streams per-chain statistics of the kept draws (after burn-in,
on the thinning grid) in :class:`ChainStats`: sums of ``θ``, ``θ²``, ``f(θ) = ‖θ‖`` and ``f²``,
and per-chain bit counts, so long runs need no sample storage.
"""

from qlsd_flwr.engines.vectorised.driver import (
           SIDE_BY_SIDE_KEYS,
           backend_for,
           run_side_by_side,
           run_vectorised,
)
from qlsd_flwr.engines.vectorised.numba_backend import noise_in_kernel_ok
from qlsd_flwr.engines.vectorised.results import (
           ChainStats,
           VectorisedResult,
           chain_seeds,
)

__all__ = ["ChainStats", "VectorisedResult", "run_vectorised", "run_side_by_side", "chain_seeds",
           "backend_for", "noise_in_kernel_ok", "SIDE_BY_SIDE_KEYS"]
