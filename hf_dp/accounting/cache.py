"""The accountant's memo: discretisations and results, in one object with a `clear()`.

Each discretisation holds a few arrays of the mesh size (up to a few million points), so only a
handful are kept; results are small and many. Everything is keyed by the full parameters, so
the cache never changes a number, only how fast it comes.
"""
from __future__ import annotations

from collections import OrderedDict


class _LRU(OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or_build(self, key, build):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = build()
        self[key] = value
        while len(self) > self.size:
            self.popitem(last=False)
        return value


class AccountingCache:
    """All memoised accounting state of this process.

    Example:
        >>> from hf_dp.accounting import CACHE
        >>> CACHE.clear()  # e.g. before timing a cold computation
    """

    def __init__(self) -> None:
        self.discretisations = _LRU(6)   # fine discretisations, per direction
        self.coarse = _LRU(8)            # coarse ones: they set the error target and guide calibration
        self.eps_errors = _LRU(256)      # the error target of a (kinds, horizons, δ)
        self.results = _LRU(4096)        # (lower, estimate, upper) of a composition
        self.prvs = _LRU(256)            # privacy random variables (they memoise their RDP values)

    def clear(self) -> None:
        """Forget everything (the next computation is cold)."""
        for memo in (self.discretisations, self.coarse, self.eps_errors, self.results, self.prvs):
            memo.clear()


CACHE = AccountingCache()
