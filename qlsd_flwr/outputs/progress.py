"""A progress bar for long runs (tqdm), or a silent stand-in."""

from __future__ import annotations

import sys


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool, desc: str):
    """A tqdm bar showing rounds per second, or a no-op when ``enabled`` is false."""
    if not enabled:
        return _Silent()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="round", file=sys.stderr, dynamic_ncols=True,
                mininterval=0.5, smoothing=0.05)
