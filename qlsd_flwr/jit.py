"""``njit`` for this package, with numba's on-disk cache shared by every copy of the package.

Numba files a cached kernel under a folder named by the full path of its source file
(``UserProvidedCacheLocator.get_suitable_cache_subpath``). The tests stage the app for ``flwr run``
and for SuperNodes as a copy of ``qlsd_flwr`` in a new folder each time (ten such copies), whose
processes inherit the stager's ``NUMBA_CACHE_DIR``; with numba's own locators every copy compiled
every kernel again (about 11 s of a 71 s ``flwr run`` stop-and-resume test). A copy that sets its
own ``NUMBA_CACHE_DIR`` (its ``__pycache__``: ``qlsd_flwr/__init__.py``) keeps its own cache.

The locator installed here files a kernel under the path *inside* the package and a hash
(:func:`sources_hash`) of the modules that compile and of the package's modules they import:
identical copies share one compiled kernel, and a copy whose compiled code differs gets its own
folder. The hash spans more than the function's own file because numba checks a cached kernel
against that file only, not against the kernels it calls in other files (the vectorised kernel
calls the twins in ``core/rng.py``, ``compression/qsgd_nb.py``, ``codec.py``, ``elias.py``) nor
the constants it freezes from them (``core/oracles.py``'s codes).

The package's modules take :func:`njit` from here, so the locator is in place before the first
``cache=True`` decorator runs. Numba is imported on first use, not by ``import qlsd_flwr``.
Functions outside a copy of ``qlsd_flwr`` fall through to numba's own locators; a numba whose
cache internals differ (no ``CacheImpl._locator_classes``) gets nothing installed and files
kernels as shipped, under ``NUMBA_CACHE_DIR`` (set by ``qlsd_flwr/__init__.py``, itself named by
the same hash).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path


def sources_hash(root: str | os.PathLike) -> str:
    """A hash of every module under ``root`` (a copy of this package) that compiles with numba (it imports numba or
    this module's ``njit``) and of every module of the package those import: a kernel can freeze another module's
    constants (the vectorised kernel's oracle codes, ``core/oracles.py``) as well as call its kernels. Read once a
    process (every process that imports the package asks: plain substring tests, about 35 ms for the whole package)."""
    return _sources_hash(str(Path(root).resolve()))


@functools.lru_cache(maxsize=None)
def _sources_hash(root: str) -> str:
    root = Path(root)
    files = {f.relative_to(root): f.read_bytes() for f in root.rglob("*.py")}
    compiled = {r for r, text in files.items()
                if b"from numba" in text or b"import numba" in text or b"from qlsd_flwr.jit import" in text}
    imported = set()
    for r in compiled:
        for m, names in re.findall(rb"^from qlsd_flwr\.([\w.]+) import \(?([\w, ]+)", files[r], flags=re.M):
            base = Path(*m.decode().split("."))  # the module, or the package and the modules named from it
            cands = [base.with_suffix(".py"), base / "__init__.py"]
            cands += [base / f"{n.strip()}.py" for n in names.decode().split(",") if n.strip()]
            imported |= {c for c in cands if c in files}
    h = hashlib.sha256()
    for r in sorted(compiled | imported):
        h.update(str(r).encode() + b"\0" + files[r])
    return h.hexdigest()[:16]


def njit(*args, **kwargs):
    """``numba.njit``, with this package's cache locator installed first."""
    _install()
    import numba

    return numba.njit(*args, **kwargs)


def _package_root(py_file: str) -> Path | None:
    """The top folder of the ``qlsd_flwr`` copy that holds ``py_file``, else None."""
    p = Path(py_file).resolve().parent
    while (p / "__init__.py").exists() and p.name != "qlsd_flwr" and p.parent != p:
        p = p.parent
    return p if p.name == "qlsd_flwr" and (p / "__init__.py").exists() else None


def _sources_tag(root: Path) -> str:
    return "src-" + sources_hash(root)


@functools.lru_cache(maxsize=None)
def _install() -> None:
    from numba.core import caching

    base = getattr(caching, "UserProvidedCacheLocator", None) or getattr(caching, "_UserProvidedCacheLocator", None)
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)  # renamed in numba 0.6x
    classes = getattr(impl, "_locator_classes", None)
    if base is None or not isinstance(classes, list):
        return

    class PackageCopyLocator(base):
        """``NUMBA_CACHE_DIR``, keyed by the path inside the package and the package's numba
        sources rather than by the file's absolute path."""

        def __init__(self, py_func, py_file):
            super().__init__(py_func, py_file)
            root = _package_root(py_file)
            inner = Path(py_file).resolve().parent.relative_to(root)
            self._cache_path = os.path.join(caching.config.CACHE_DIR, _sources_tag(root),
                                            "_".join(("qlsd_flwr", *inner.parts)))

        @classmethod
        def from_function(cls, py_func, py_file):
            if _package_root(py_file) is None:
                return None
            return super().from_function(py_func, py_file)

    classes.insert(0, PackageCopyLocator)
