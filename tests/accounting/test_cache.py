"""hf_dp.accounting.cache: a memo that changes how fast a number comes, never the number."""
from hf_dp import accounting
from hf_dp.accounting import CACHE
from hf_dp.accounting.cache import AccountingCache, _LRU
from pld_reference import DELTA


def test_lru_builds_each_key_once_and_evicts_the_least_recently_used():
    built = []
    memo = _LRU(2)

    def build(key):
        return lambda: built.append(key) or key * 10

    assert memo.get_or_build(1, build(1)) == 10
    assert memo.get_or_build(2, build(2)) == 20
    assert memo.get_or_build(1, build(1)) == 10  # a hit: not rebuilt, and now the most recent
    assert memo.get_or_build(3, build(3)) == 30  # evicts 2, the least recently used
    assert list(memo) == [1, 3] and built == [1, 2, 3]
    assert memo.get_or_build(2, build(2)) == 20 and built == [1, 2, 3, 2]  # 2 was forgotten


def test_a_cached_epsilon_is_the_cold_one_and_clear_forgets_everything():
    setting = dict(sample_rate=0.02, noise_multiplier=1.1, steps=50, delta=DELTA)
    CACHE.clear()
    cold = accounting.epsilon(**setting)
    memos = (CACHE.discretisations, CACHE.coarse, CACHE.eps_errors, CACHE.results, CACHE.prvs)
    assert len(CACHE.results) >= 1 and len(CACHE.prvs) >= 1
    filled = [len(memo) for memo in memos]
    assert accounting.epsilon(**setting) == cold  # from the memo: the same number, nothing new built
    assert [len(memo) for memo in memos] == filled
    CACHE.clear()
    assert all(len(memo) == 0 for memo in memos)
    assert accounting.epsilon(**setting) == cold


def test_each_process_cache_is_one_object_with_bounded_memos():
    cache = AccountingCache()
    sizes = [cache.discretisations.size, cache.coarse.size, cache.eps_errors.size, cache.results.size,
             cache.prvs.size]
    assert all(0 < size <= 4096 for size in sizes)
    assert cache.discretisations.size <= 8  # the big arrays: only a handful kept
    assert isinstance(CACHE, AccountingCache)
