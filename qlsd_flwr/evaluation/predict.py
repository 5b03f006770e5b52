"""Predicting with a finished run's posterior: the public helpers for a user's own model.

* :func:`load_samples` — a run's kept draws as an array ``(chain, draw, d)``;
* :func:`posterior_predictive` — class probabilities for new inputs, averaged over the draws;
* :func:`load_draw` — one draw copied into a torch module's trainable parameters;
* :func:`predictive_metrics` — accuracy, nNLL, ECE and Brier of predicted probabilities.

All are importable from the package itself (``from qlsd_flwr import posterior_predictive``). The
numerics are numpy's; torch is imported only by :func:`load_draw`, and only when it is called.
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Any

import numpy as np

from qlsd_flwr.evaluation.evaluate import N_BINS, thin_samples
from qlsd_flwr.evaluation.evaluate import predictive_metrics as _metrics
from qlsd_flwr.outputs.recorder import load_samples as _read_samples

__all__ = ["load_samples", "posterior_predictive", "load_draw", "predictive_metrics"]


def load_samples(path: str | os.PathLike) -> np.ndarray:
    """The kept draws of a finished run, as written to its ``samples.nc``.

    Parameters
    ----------
    path : str or path-like
        A run folder (the one ``QLSDStrategy.run_dir`` or ``qlsd-flwr run`` names), or the
        ``samples.nc`` file inside one.

    Returns
    -------
    numpy.ndarray
        The posterior draws of θ, shape ``(chain, draw, d)`` (ArviZ's ``posterior.theta``): burn-in
        dropped and thinned as the run was configured, ``d`` the length of θ.

    Raises
    ------
    FileNotFoundError
        No ``samples.nc`` at ``path`` (the message names the file).
    ValueError
        ``path`` is a file not named ``samples.nc``.

    Examples
    --------
    >>> import qlsd_flwr                                                    # doctest: +SKIP
    >>> qlsd_flwr.load_samples("outputs/my-run").shape                      # doctest: +SKIP
    (4, 150, 275)
    """
    p = Path(path)
    if p.is_file() and p.name != "samples.nc":
        raise ValueError(f"path: {p} is a file not named samples.nc; give a run folder or its samples.nc")
    folder = p.parent if p.name == "samples.nc" and not p.is_dir() else p
    if not (folder / "samples.nc").is_file():
        raise FileNotFoundError(f"path: {folder / 'samples.nc'}: no such file (give a run folder or its samples.nc)")
    return _read_samples(folder)


def _draws(samples: Any, ndims: tuple[int, ...]) -> np.ndarray:
    """``samples`` (an array, or a run folder / ``samples.nc`` path) as a float64 array, its rank checked."""
    if isinstance(samples, (str, os.PathLike)):
        samples = load_samples(samples)
    s = np.asarray(samples, dtype=np.float64)
    if s.ndim not in ndims or s.shape[-1] < 1 or s.size == 0:
        shapes = " or ".join({3: "(chain, draw, d)", 2: "(n, d)"}[n] for n in ndims)
        raise ValueError(f"samples must be an array {shapes} with at least one draw, or a run folder; "
                         f"got shape {s.shape}")
    return s


def _index(value: Any, name: str, size: int, unit: str) -> int:
    """``value`` as an index in ``[0, size)``; one-line error naming ``name`` and the range."""
    try:
        i = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer in [0, {size - 1}] (samples has {size} {unit}); "
                        f"got {value!r}") from None
    if isinstance(value, bool) or not 0 <= i < size:
        raise IndexError(f"{name} must be an integer in [0, {size - 1}] (samples has {size} {unit}); got {value!r}")
    return i


def posterior_predictive(samples: Any, predictor: Any, inputs: Any, max_draws: int | None = None) -> np.ndarray:
    """The posterior predictive class probabilities of new inputs, averaged over the draws.

    ``p(y = k | x) ≈ (1/S) Σ_s softmax(model_{θ_s}(x))_k`` over the ``S`` draws ``θ_s`` kept.

    Parameters
    ----------
    samples : array_like or str or path-like
        The draws: ``(chain, draw, d)`` (as :func:`load_samples` returns them), ``(n, d)`` (one row
        a draw), or a run folder / its ``samples.nc``, read with :func:`load_samples`.
    predictor : object
        Anything with ``predict_proba(thetas, X)`` returning the class probabilities ``(n, K)`` of
        ``X`` averaged over the rows of ``thetas`` ``(S, d)``, e.g. a
        :class:`qlsd_flwr.potentials.TorchPotential` built on the model the run sampled (its data
        are not used here, only its model). Where it has a ``dim``, θ's length is checked against it.
    inputs : array_like
        The new inputs, as the model takes them (for a ``TorchPotential``: a numpy array or tensor
        whose first axis is the examples; it is cast to the model's dtype and device).
    max_draws : int, optional
        Use at most this many draws, evenly spaced within each chain, every chain keeping at least
        one (:func:`qlsd_flwr.evaluation.evaluate.thin_samples`). Default ``None``: all of them.

    Returns
    -------
    numpy.ndarray
        float64 ``(n, K)``: row ``i`` the predictive distribution of ``inputs[i]`` over the ``K``
        classes (rows sum to 1 up to rounding).

    Raises
    ------
    ValueError
        ``samples`` of another rank, θ's length not the predictor's ``dim``, or ``max_draws < 1``.
    TypeError
        ``predictor`` has no ``predict_proba``.

    Examples
    --------
    >>> from qlsd_flwr import posterior_predictive                          # doctest: +SKIP
    >>> from qlsd_flwr.potentials import TorchPotential                     # doctest: +SKIP
    >>> pot = TorchPotential(make_model(), X_train, y_train)                # doctest: +SKIP
    >>> probs = posterior_predictive("outputs/my-run", pot, X_new)          # doctest: +SKIP
    >>> probs.argmax(axis=1)                                                # doctest: +SKIP
    """
    if not callable(getattr(predictor, "predict_proba", None)):
        raise TypeError(f"predictor must have a predict_proba(thetas, X) method; got {type(predictor).__name__}")
    if max_draws is not None:
        try:
            ok = not isinstance(max_draws, bool) and operator.index(max_draws) >= 1
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"max_draws must be None or an integer >= 1; got {max_draws!r}")
    s = _draws(samples, (2, 3))
    dim = getattr(predictor, "dim", None)
    if dim is not None and s.shape[-1] != int(dim):
        raise ValueError(f"samples: draws of length {s.shape[-1]}, but the predictor's θ has d = {int(dim)}")
    return np.asarray(predictor.predict_proba(thin_samples(s, max_draws), inputs), dtype=np.float64)


def load_draw(module: Any, samples: Any, chain: int, draw: int) -> Any:
    """Copy one posterior draw into a torch module's trainable parameters, in place.

    θ's layout is :class:`qlsd_flwr.potentials.TorchPotential`'s: the parameters with
    ``requires_grad`` in ``module.named_parameters()`` order, each flattened row-major. Frozen
    parameters and buffers (batch norm's running statistics) are not part of θ and are left as
    they are, as is the module's train/eval mode: call ``module.eval()`` before predicting to get
    what ``TorchPotential`` computes (it evaluates in eval mode).

    Parameters
    ----------
    module : torch.nn.Module
        The network the run sampled (the same architecture; its current weights are overwritten).
    samples : array_like or str or path-like
        ``(chain, draw, d)``, ``(draw, d)`` (one chain), or a run folder / its ``samples.nc``.
    chain : int
        The chain, in ``[0, chain count)``.
    draw : int
        The draw within that chain, in ``[0, draw count)``.

    Returns
    -------
    torch.nn.Module
        ``module`` itself, its parameters holding the draw (cast to each parameter's dtype and
        device, as ``TorchPotential`` casts θ).

    Raises
    ------
    IndexError
        ``chain`` or ``draw`` out of range (the message names the argument and the range).
    TypeError
        ``chain`` or ``draw`` not an integer.
    ValueError
        θ's length ``d`` is not the module's number of trainable parameters, or ``samples`` of
        another rank.

    Examples
    --------
    >>> from qlsd_flwr import load_draw                                     # doctest: +SKIP
    >>> net = load_draw(make_model(), "outputs/my-run", chain=0, draw=149).eval()  # doctest: +SKIP
    >>> net(torch.as_tensor(X_new)).softmax(dim=1)                          # doctest: +SKIP
    """
    import torch

    s = _draws(samples, (2, 3))
    s = s[None] if s.ndim == 2 else s
    c = _index(chain, "chain", s.shape[0], "chains")
    k = _index(draw, "draw", s.shape[1], "draws per chain")
    params = [p for _, p in module.named_parameters() if p.requires_grad]
    n = sum(int(p.numel()) for p in params)
    if s.shape[2] != n:
        raise ValueError(f"samples: draws of length d = {s.shape[2]}, but the module has {n} trainable "
                         "parameters (named_parameters() with requires_grad)")
    theta, start = s[c, k], 0
    with torch.no_grad():
        for p in params:
            stop = start + int(p.numel())
            p.copy_(torch.as_tensor(theta[start:stop].reshape(p.shape), dtype=p.dtype, device=p.device))
            start = stop
    return module


def predictive_metrics(probs: Any, y: Any, n_bins: int = N_BINS) -> dict:
    """Accuracy, nNLL, ECE and Brier score of predicted class probabilities against the labels.

    Parameters
    ----------
    probs : array_like
        ``(n, K)`` predicted probabilities, e.g. :func:`posterior_predictive`'s.
    y : array_like
        ``(n,)`` integer labels in ``[0, K)``.
    n_bins : int, default 10
        Equal-width, right-closed confidence bins of the ECE.

    Returns
    -------
    dict
        ``accuracy`` (fraction with ``argmax_k p_k = y``), ``nnll`` (mean ``−log p_y``), ``ece``
        (expected calibration error of the top-1 confidence), ``brier`` (mean over points of
        ``Σ_k (p_k − 1{y = k})²``, summed over classes, no ``1/K``), ``n_test`` (``n``) and
        ``ece_bins`` (``n_bins``). Definitions: :mod:`qlsd_flwr.evaluation.metrics`.

    Raises
    ------
    ValueError
        ``probs`` not 2-D, ``y`` not of length ``n``, or ``n_bins < 1``.

    Examples
    --------
    >>> import numpy as np, qlsd_flwr
    >>> m = qlsd_flwr.predictive_metrics(np.array([[0.9, 0.1], [0.2, 0.8]]), np.array([0, 1]))
    >>> m["accuracy"], round(m["brier"], 3)
    (1.0, 0.05)
    """
    return _metrics(probs, y, n_bins=n_bins)
