"""Splits of a labelled dataset over ``b`` clients: lists of sorted ``int64`` index arrays.

Every split is a pure function of ``(y, b, seed, options)``. :func:`iid`, :func:`dirichlet`
and :func:`pathological` use flwr-datasets' partitioners on an in-memory
``datasets.Dataset.from_dict({"idx": ..., "label": y})`` (works offline); the rows are
first permuted with ``seed`` (IidPartitioner takes contiguous shards and
PathologicalPartitioner splits each class in row order, so without this the split would not
depend on the seed), and the partitioner gets the same ``seed``.

:func:`dominant_label` is the paper's "highly heterogeneous" MNIST split (S5.3), see its
docstring for how we read it. :func:`describe` gives a JSON-able per-client/per-label count
table to record with a run. :func:`make_partition` is the registry.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np


def _rng(seed: int, tag: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(tag)]))


def _check(y: np.ndarray, b: int) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-d array, got shape {y.shape}")
    if not isinstance(b, (int, np.integer)) or b < 1:
        raise ValueError(f"number of clients b must be a positive integer, got {b!r}")
    if b > len(y):
        raise ValueError(f"cannot split {len(y)} points over b={b} clients")
    return y


def _hf_partition(y: np.ndarray, seed: int, make_partitioner: Callable[[], Any], b: int):
    """Run a flwr-datasets partitioner on an in-memory dataset; return sorted index arrays."""
    import datasets

    perm = _rng(seed, 1).permutation(len(y))
    ds = datasets.Dataset.from_dict({"idx": perm.astype(np.int64),
                                     "label": np.asarray(y)[perm].astype(np.int64)})
    part = make_partitioner()
    part.dataset = ds
    out = []
    for i in range(b):
        idx = np.asarray(part.load_partition(i).with_format("numpy")["idx"], dtype=np.int64)
        out.append(np.sort(idx))
    return out


def iid(y: np.ndarray, b: int, seed: int = 0) -> list[np.ndarray]:
    """Uniformly random split into ``b`` shards whose sizes differ by at most one."""
    from flwr_datasets.partitioner import IidPartitioner

    y = _check(y, b)
    return _hf_partition(y, seed, lambda: IidPartitioner(num_partitions=b), b)


def dirichlet(y: np.ndarray, b: int, seed: int = 0, alpha: float = 0.5,
              min_partition_size: int = 1, self_balancing: bool = False) -> list[np.ndarray]:
    """Per-class proportions ``~ Dir(alpha·1_b)`` (Hsu et al. 2019; flwr's DirichletPartitioner).

    Small ``alpha`` means heterogeneous clients. Every point is assigned to exactly one client.
    flwr resamples (up to 10 times, then raises) while some client has fewer than
    ``min_partition_size`` points.
    """
    from flwr_datasets.partitioner import DirichletPartitioner

    y = _check(y, b)
    if not alpha > 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    return _hf_partition(y, seed, lambda: DirichletPartitioner(
        num_partitions=b, partition_by="label", alpha=float(alpha),
        min_partition_size=int(min_partition_size), self_balancing=bool(self_balancing),
        shuffle=True, seed=int(seed)), b)


def pathological(y: np.ndarray, b: int, seed: int = 0, classes_per_client: int = 2,
                 class_assignment_mode: str = "first-deterministic") -> list[np.ndarray]:
    """Each client sees only ``classes_per_client`` labels (McMahan et al. 2017 style).

    Each class is split evenly among the clients that hold it (flwr's PathologicalPartitioner).
    With the default ``"first-deterministic"`` mode client ``i`` always holds label
    ``i mod n_labels`` (so every label is used when ``b ≥ n_labels``) plus random others; in
    ``"random"`` mode labels held by no client are dropped (flwr warns), so the split may then
    not cover every point.
    """
    from flwr_datasets.partitioner import PathologicalPartitioner

    y = _check(y, b)
    n_labels = len(np.unique(y))
    if not 1 <= classes_per_client <= n_labels:
        raise ValueError(f"classes_per_client must be in [1, {n_labels}], got {classes_per_client}")
    return _hf_partition(y, seed, lambda: PathologicalPartitioner(
        num_partitions=b, partition_by="label", num_classes_per_partition=int(classes_per_client),
        class_assignment_mode=class_assignment_mode, shuffle=True, seed=int(seed)), b)


def dominant_label(y: np.ndarray, b: int = 20, seed: int = 0, dominant_frac: float = 0.4,
                   other_frac: float = 0.01, drop_remainder: bool = False) -> list[np.ndarray]:
    """The paper's heterogeneous split (S5.3): one dominant label per client.

    The paper: "each client has a dominant label representing 40% of the total amount in the
    training set and 1% of the other labels". We read it per label: with labels
    ``c_0 < c_1 < … < c_{L−1}``, client ``i``'s dominant label is ``c_{i mod L}``; for every
    label ``c`` with ``n_c`` training points,

    * each client *not* dominated by ``c`` gets ``other_frac · n_c`` points of ``c``;
    * each of the ``m_c`` clients dominated by ``c`` gets ``dominant_frac · n_c``;
      (fractional shares are rounded by largest remainders, so every count is within 1 of
      its exact share and the total is the rounded total share);
    * the remaining ``n_c − Σ`` points of ``c`` are split as evenly as possible among its
      ``m_c`` dominant clients (so no point is lost), or dropped if ``drop_remainder``.
      Where no client is dominated by ``c`` (``b < L``) they are split among all clients.

    The paper's case ``b = 20``, ten labels: two clients share each dominant label, each
    takes 40% of it, the 18 others take 1% each, and the remaining ~2% go half to each
    dominant client, so a dominant client holds ≈ 41% of its label (exactly 40% with
    ``drop_remainder=True``). Within a label the points are shuffled with ``seed``.
    Requires ``m_c·dominant_frac + (b − m_c)·other_frac ≤ 1`` for every label.
    """
    y = _check(y, b)
    if not (0 <= other_frac <= 1 and 0 <= dominant_frac <= 1):
        raise ValueError("dominant_frac and other_frac must lie in [0, 1]")
    labels = np.unique(y)
    n_lab = len(labels)
    dominant_of = np.array([i % n_lab for i in range(b)])  # label position per client
    rng = _rng(seed, 2)
    parts: list[list[np.ndarray]] = [[] for _ in range(b)]
    for pos, c in enumerate(labels):
        ix = rng.permutation(np.flatnonzero(y == c))
        n_c = len(ix)
        dom = np.flatnonzero(dominant_of == pos)
        m = len(dom)
        if m * dominant_frac + (b - m) * other_frac > 1 + 1e-12:
            raise ValueError(
                f"label {c!r}: {m} dominant clients × {dominant_frac} + {b - m} others × "
                f"{other_frac} exceeds 100% of the label")
        # exact shares apportioned by largest remainders: each count within 1 of its share
        shares = np.where(dominant_of == pos, dominant_frac, other_frac) * n_c
        counts = np.floor(shares + 1e-9).astype(np.int64)
        extra = min(n_c, int(round(shares.sum()))) - int(counts.sum())
        if extra > 0:
            order = np.argsort(-(shares - counts), kind="stable")
            counts[order[:extra]] += 1
        rem = n_c - int(counts.sum())
        if rem and not drop_remainder:
            targets = dom if m else np.arange(b)
            for k, extra in zip(targets, np.array_split(np.arange(rem), len(targets))):
                counts[k] += len(extra)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        for k in range(b):
            parts[k].append(ix[bounds[k]:bounds[k + 1]])
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def describe(partition: Sequence[np.ndarray], y: np.ndarray) -> dict:
    """A JSON-able summary: per-client sizes and counts per label (labels in sorted order)."""
    y = np.asarray(y)
    labels = np.unique(y)
    counts = [[int(np.sum(y[np.asarray(ix, dtype=np.int64)] == c)) for c in labels]
              for ix in partition]
    covered = np.concatenate([np.asarray(ix, dtype=np.int64) for ix in partition]) \
        if len(partition) else np.zeros(0, np.int64)
    return {
        "n_clients": len(partition),
        "labels": [l.item() for l in labels],
        "sizes": [int(len(ix)) for ix in partition],
        "counts": counts,  # counts[i][k]: points of labels[k] held by client i
        "n_points": int(len(y)),
        "n_assigned": int(len(covered)),
        "n_unassigned": int(len(y) - len(np.unique(covered))),
    }


PARTITIONS: dict[str, Callable[..., list[np.ndarray]]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "pathological": pathological,
    "dominant_label": dominant_label,
}
_ALIASES = {"dominant": "dominant_label", "heterogeneous": "dominant_label",
            "non_iid": "dirichlet", "shards": "pathological"}


def make_partition(name: str, y: np.ndarray, b: int, seed: int = 0, **kw: Any) -> list[np.ndarray]:
    """Split ``y``'s indices over ``b`` clients with the named scheme.

    Names: ``iid``, ``dirichlet`` (``alpha``), ``pathological`` (``classes_per_client``),
    ``dominant_label`` (``dominant_frac``, ``other_frac``). Unknown names or options raise
    ``ValueError`` listing the allowed ones.
    """
    import inspect

    key = str(name).strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in PARTITIONS:
        raise ValueError(f"unknown partition {name!r}; allowed: {', '.join(PARTITIONS)}")
    fn = PARTITIONS[key]
    allowed = [p for p in inspect.signature(fn).parameters if p not in ("y", "b", "seed")]
    bad = sorted(set(kw) - set(allowed))
    if bad:
        raise ValueError(f"partition {key!r} does not take option(s) {bad}; allowed: {allowed}")
    return fn(y, b, seed=seed, **kw)
