"""The result of a reference sampler, and its on-disk cache keyed by the task's data and the
settings (see :mod:`qlsd_flwr.evaluation.reference`)."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

_CACHE_VERSION = 1  # bump when an algorithm changes: old cache files stop matching


# ----------------------------------------------------------------------------- result
@dataclass
class ReferenceResult:
    method: str
    samples: np.ndarray  # (chain, draw, dim)
    potentials: np.ndarray  # (chain, draw): U at each kept draw
    acceptance: np.ndarray  # (chain,): post-warm-up acceptance rate (nan for ULA)
    step_size: np.ndarray  # (chain,): the frozen step
    diagnostics: dict  # rhat, ess_bulk, ess_tail, ess_mean per coordinate (+ of the potential)
    settings: dict
    key: str = ""
    from_cache: bool = False
    path: str | None = None
    warmup_acceptance: np.ndarray | None = None  # (chain,)

    @property
    def rhat(self) -> np.ndarray | None:
        """Per-coordinate R-hat (``None`` when ``dim > max_diag_dim``; see ``rhat_potential``)."""
        return self.diagnostics.get("rhat")

    @property
    def ess(self) -> np.ndarray | None:
        """Per-coordinate bulk ESS (``None`` when ``dim > max_diag_dim``)."""
        return self.diagnostics.get("ess_bulk")

    def flat(self) -> np.ndarray:
        """All chains pooled: ``(chain·draw, dim)``."""
        return self.samples.reshape(-1, self.samples.shape[-1])

    @property
    def mean(self) -> np.ndarray:
        return self.flat().mean(axis=0)

    @property
    def var(self) -> np.ndarray:
        return self.flat().var(axis=0, ddof=1)


# ----------------------------------------------------------------------------- cache keys
class _Unfingerprintable(TypeError):
    pass


def _feed(h, obj: Any, depth: int = 0, seen: set | None = None) -> None:
    """Feed a canonical byte description of ``obj`` into hash ``h``."""
    seen = set() if seen is None else seen
    if depth > 12:
        raise _Unfingerprintable("object nesting too deep")
    if obj is None or isinstance(obj, (bool, int, str)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
        return
    if isinstance(obj, float):
        h.update(f"float:{obj.hex()};".encode())
        return
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        _feed(h, obj.item(), depth + 1, seen)
        return
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        h.update(f"ndarray:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes() if a.dtype != object else repr(a.tolist()).encode())
        return
    if isinstance(obj, (bytes, bytearray)):
        h.update(b"bytes:" + bytes(obj) + b";")
        return
    if isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__}[{len(obj)}];".encode())
        for x in obj:
            _feed(h, x, depth + 1, seen)
        return
    if isinstance(obj, dict):
        h.update(f"dict[{len(obj)}];".encode())
        for k in sorted(obj, key=repr):
            _feed(h, repr(k), depth + 1, seen)
            _feed(h, obj[k], depth + 1, seen)
        return
    mod = type(obj).__module__
    if mod.startswith("torch"):
        import torch

        if torch.is_tensor(obj):
            _feed(h, obj.detach().cpu().numpy(), depth + 1, seen)
            return
        if isinstance(obj, torch.nn.Module):
            # architecture + buffers; parameters are overwritten by θ before every use
            _feed(h, repr(obj), depth + 1, seen)
            _feed(h, {k: v for k, v in obj.named_buffers()}, depth + 1, seen)
            return
        if isinstance(obj, (torch.dtype, torch.device)):
            _feed(h, str(obj), depth + 1, seen)
            return
    if hasattr(obj, "cache_fingerprint"):
        fp = obj.cache_fingerprint()
        _feed(h, f"{type(obj).__qualname__}", depth + 1, seen)
        _feed(h, fp if isinstance(fp, (bytes, str)) else repr(fp), depth + 1, seen)
        return
    if id(obj) in seen:
        h.update(b"<cycle>;")
        return
    if hasattr(obj, "__dict__") and not callable(obj) or hasattr(obj, "__dataclass_fields__"):
        seen.add(id(obj))
        h.update(f"obj:{mod}.{type(obj).__qualname__};".encode())
        _feed(h, {k: v for k, v in vars(obj).items() if not k.startswith("__")}, depth + 1, seen)
        return
    raise _Unfingerprintable(f"cannot fingerprint {type(obj).__qualname__}")


def task_fingerprint(task) -> str:
    """SHA-256 of a task's data: name, dim, prior, every client's state (arrays included)."""
    h = hashlib.sha256()
    _feed(h, {"name": getattr(task, "name", type(task).__name__), "dim": getattr(task, "dim", None),
              "prior": getattr(task, "prior", None),
              "theta0": getattr(task, "theta0", None),
              "clients": list(getattr(task, "clients", []))})
    if not hasattr(task, "clients"):  # a bare target object
        _feed(h, task)
    return h.hexdigest()


def _cache_dir(cache_dir) -> Path:
    base = cache_dir or os.environ.get("QLSD_CACHE") or Path.home() / ".cache" / "qlsd_flwr"
    return Path(base) / "reference"


def cache_key(task, method: str, settings: dict) -> str:
    h = hashlib.sha256()
    _feed(h, {"version": _CACHE_VERSION, "method": method, "task": task_fingerprint(task),
              "settings": settings})
    return h.hexdigest()


def _json_settings(settings: dict) -> str:
    def conv(v):
        if isinstance(v, np.ndarray):
            return {"ndarray_sha256": hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest(),
                    "shape": list(v.shape)}
        if isinstance(v, (np.integer, np.floating)):
            return v.item()
        return v if isinstance(v, (int, float, str, bool, type(None), list)) else repr(v)
    return json.dumps({k: conv(v) for k, v in settings.items()}, sort_keys=True)


def _save(path: Path, res: ReferenceResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
    diag = {f"diag_{k}": np.asarray(v) for k, v in res.diagnostics.items() if v is not None}
    np.savez(tmp, samples=res.samples, potentials=res.potentials, acceptance=res.acceptance,
             step_size=res.step_size, warmup_acceptance=res.warmup_acceptance
             if res.warmup_acceptance is not None else np.full(len(res.step_size), np.nan),
             method=np.array(res.method), key=np.array(res.key),
             settings=np.array(_json_settings(res.settings)), **diag)
    os.replace(tmp, path)


def _load(path: Path, settings: dict) -> ReferenceResult:
    with np.load(path, allow_pickle=False) as z:
        diag = {k[5:]: z[k] for k in z.files if k.startswith("diag_")}
        return ReferenceResult(
            method=str(z["method"]), samples=z["samples"], potentials=z["potentials"],
            acceptance=z["acceptance"], step_size=z["step_size"], diagnostics=diag,
            settings=dict(settings), key=str(z["key"]), from_cache=True, path=str(path),
            warmup_acceptance=z["warmup_acceptance"])


def _cached_run(task, method: str, settings: dict, cache: bool, cache_dir,
                run: Callable[[], ReferenceResult]) -> ReferenceResult:
    key, path = "", None
    if cache:
        try:
            key = cache_key(task, method, settings)
            path = _cache_dir(cache_dir) / f"{method}-{key[:24]}.npz"
        except _Unfingerprintable as e:
            warnings.warn(f"reference {method}: task cannot be fingerprinted ({e}); "
                          "running without the disk cache", stacklevel=3)
            cache = False
    if cache and path.exists():
        try:
            res = _load(path, settings)
            if res.key == key:
                return res
        except Exception as e:  # corrupt/partial file: recompute
            warnings.warn(f"ignoring unreadable cache file {path}: {e}", stacklevel=3)
    res = run()
    res.key = key
    if cache:
        _save(path, res)
        res.path = str(path)
    return res
