"""The posteriordb benchmark's densities are Stan's (``benchmarks/bench_posteriordb.py``).

posteriordb is not on this machine (nothing downloads), so the files come from the benchmark's own
synthetic folder in posteriordb's layout. Each task's potential is compared with the log density
written independently from ``scipy.stats`` (Stan's model blocks, with the ``log σ`` Jacobian), by
differences between random points (the constants cancel); gradients and the σ priors' curvature
against central differences.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import bench_posteriordb as pdb  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return pdb.synthetic(tmp_path_factory.mktemp("posteriordb"))


def _data(task):
    X = np.concatenate([c.X for c in task.clients])
    y = np.concatenate([c.y for c in task.clients])
    return X, y


def stan_log_density(name, task, theta):
    """Stan's target in the unconstrained coordinates ``(…, u = log σ)``, up to a constant."""
    X, y = _data(task)
    coef, u = theta[:-1], theta[-1]
    sigma = np.exp(u)
    lik = stats.norm.logpdf(y, X @ coef, sigma).sum()
    if name == "kidiq-kidscore_interaction":
        prior = stats.halfcauchy.logpdf(sigma, scale=2.5)
    elif name.startswith("earnings-"):
        prior = 0.0
    else:  # brms: b ~ N(0, 1), Intercept ~ t3(8, 10), sigma ~ half-t3(0, 10)
        prior = (stats.norm.logpdf(coef[:-1]).sum() + stats.t.logpdf(coef[-1], 3, 8, 10)
                 + stats.t.logpdf(sigma, 3, 0, 10))
    return lik + prior + u  # + log|dσ/du|


@pytest.mark.parametrize("name", pdb.POSTERIORS)
def test_each_potential_is_stans_density(folder, name):
    task, names = pdb.task_of(folder, name)
    assert len(names) == task.dim and names[-1] == "log(sigma)" and len(task.clients) == pdb.CLIENTS
    rng = np.random.default_rng(1)
    ts = pdb.mode_of(task)
    points = ts + 0.05 * rng.normal(size=(4, task.dim)) * (1 + np.abs(ts))
    U = np.array([task.potential(t) for t in points])
    logp = np.array([stan_log_density(name, task, t) for t in points])
    assert np.allclose(U - U[0], -(logp - logp[0]), rtol=1e-9, atol=1e-7 * np.abs(logp).max())
    # the gradient the clients and the server's prior send, against central differences of the potential
    t, h = points[1], 1e-5 * (1 + np.abs(points[1]))
    fd = np.array([(task.potential(t + h[j] * e) - task.potential(t - h[j] * e)) / (2 * h[j])
                   for j, e in enumerate(np.eye(task.dim))])
    assert np.allclose(task.grad_potential(t), fd, rtol=1e-5, atol=1e-6 * np.abs(fd).max())


@pytest.mark.parametrize("df,scale", [(1.0, 2.5), (3.0, 10.0)])
def test_log_half_student_t_prior(df, scale):
    prior = pdb.LogHalfStudentTPrior(df, scale)
    u = np.array([-2.0, 0.3, 1.7, 4.0])
    ref = -(stats.t.logpdf(np.exp(u), df, 0, scale) + u)  # half-t: twice the density, a constant
    values = np.array([prior.value(np.array([x])) for x in u])
    assert np.allclose(values - values[0], ref - ref[0], rtol=1e-10)
    h = 1e-5
    assert np.allclose(prior.grad(u), [(prior.value(np.array([x + h])) - prior.value(np.array([x - h]))) / (2 * h)
                                       for x in u], rtol=1e-6, atol=1e-8)
    assert np.allclose(prior.curvature_diag(u), (prior.grad(u + h) - prior.grad(u - h)) / (2 * h), rtol=1e-5, atol=1e-8)
    assert np.all(prior.curvature_diag(u) > 0)  # convex in u, as log_concave declares


def test_reference_draws_are_read_in_the_tasks_coordinates(folder):
    name = "diamonds-diamonds"
    task, names = pdb.task_of(folder, name)
    ref = pdb.reference_of(folder, name, names)
    assert ref.shape == (10, 100, task.dim) and names[:2] == ["b[1]", "b[2]"] and names[-2] == "Intercept"
    raw = pdb._read_zip(folder / "posterior_database/reference_posteriors/draws/draws" / f"{name}.json.zip")
    assert np.allclose(ref[3, :, -1], np.log(raw[3]["sigma"])) and np.allclose(ref[3, :, 0], raw[3]["b[1]"])


def test_a_folder_without_posteriordb_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pdb, "SMOKE", "")
    assert pdb.main(["--posteriordb", str(tmp_path), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(tmp_path) in err and "stan-dev/posteriordb" in err
