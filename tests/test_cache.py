"""smartremat's caches: keys that cannot go stale, a bound on each cache, a value made once per key
across threads, and `smartremat.clear_caches()`."""

import gc
import random
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import pytest

import smartremat
from smartremat import _cache, _planner, _profile, _spec, _step, _verify
from smartremat import smartremat as sr

from benchmarks.models import TutorialStack
from tests.helpers import in_threads


class Unhashable:
    """A static value with `__eq__` and so no `__hash__` (as a non-frozen dataclass has)."""

    def __eq__(self, other):
        return self is other

    __hash__ = None


@pytest.mark.parametrize("to_key", [_spec.hashable, _verify._option_key], ids=["static_leaf", "policy"])
def test_a_freed_object_cannot_leave_a_key_that_a_new_one_at_its_address_hits(to_key):
    cache = _cache.KeyedCache()
    old = Unhashable()
    address, alive = id(old), weakref.ref(old)
    assert cache.get(to_key(old), lambda: "old") == "old"
    del old
    gc.collect()
    assert alive() is not None  # the key holds it: its address cannot be given to another object
    news = [Unhashable() for _ in range(1000)]  # CPython reuses a freed address at once
    assert all(id(n) != address for n in news)
    assert all(cache.get(to_key(n), lambda: "new") == "new" for n in news[:50])
    assert to_key(news[0]) == to_key(news[0]) and to_key(news[0]) != to_key(news[1])
    cache.clear()
    gc.collect()
    assert alive() is None  # and frees it once the entry goes


def test_mutable_static_sets_key_by_value():
    assert _spec.hashable({1, 2}) == _spec.hashable({2, 1}) != _spec.hashable({1, 3})
    assert hash(_spec.hashable({1, 2})) == hash(_spec.hashable({2, 1}))
    assert _spec.hashable(bytearray(b"ab")) == _spec.hashable(bytearray(b"ab")) != _spec.hashable(bytearray(b"ac"))


def test_keyed_cache_keeps_the_most_recently_used_entries_only():
    cache, made = _cache.KeyedCache(max_entries=3), []

    def make(k):
        return lambda: made.append(k) or k * 10

    for k in range(3):
        assert cache.get(k, make(k)) == k * 10
    assert cache.get(0, make(0)) == 0  # a hit: 0 becomes the most recent
    assert cache.get(3, make(3)) == 30  # evicts 1, the least recently used
    assert len(cache) == 3 and made == [0, 1, 2, 3]
    assert cache.get(0, make(0)) == 0 and cache.get(2, make(2)) == 20 and made == [0, 1, 2, 3]
    assert cache.get(1, make(1)) == 10 and made == [0, 1, 2, 3, 1]
    with pytest.raises(ValueError, match=r"`KeyedCache\(max_entries=...\)` should be at least 1, not 0"):
        _cache.KeyedCache(max_entries=0)


def test_every_cache_is_bounded():
    for cache in (_planner._PLANS, _profile._CACHE, _verify._CACHE, _step._FIGURES):
        assert cache.max_entries == _cache.MAX_ENTRIES
    assert _spec._concrete_mesh.cache_info().maxsize is not None


def test_eviction_from_many_threads_keeps_the_bound_and_the_values():
    cache, errors = _cache.KeyedCache(max_entries=8), []

    def work(seed):
        rng = random.Random(seed)
        for _ in range(500):
            k = rng.randrange(32)
            if cache.get(k, lambda: ("v", k)) != ("v", k):
                errors.append(k)

    assert in_threads(work, 8) == [] and errors == [] and len(cache) == 8


@pytest.mark.parametrize("n_threads", [2, 8])
def test_keyed_cache_makes_a_key_once_across_threads_and_retries_after_an_error(n_threads):
    cache, made, entered, gate = _cache.KeyedCache(), [], threading.Semaphore(0), threading.Event()

    def make():
        made.append(1)
        entered.release()
        gate.wait(30)
        return object()

    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.get("k", make))) for _ in range(n_threads)]
    for t in threads:
        t.start()
    assert entered.acquire(timeout=30)
    time.sleep(0.2)  # time enough for the other threads to reach the cache (not an assertion)
    gate.set()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(got) == n_threads and all(v is got[0] for v in got)

    other = threading.Event()  # different keys are made in parallel: "a" waits for "b" to start
    ta = threading.Thread(target=lambda: cache.get("a", lambda: other.wait(30)))
    ta.start()
    assert cache.get("b", lambda: other.set() or "b") == "b"
    ta.join()
    assert cache.get("a", lambda: pytest.fail("made again")) is True

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        cache.get("e", fails)
    assert cache.get("e", lambda: "second try") == "second try"


def test_a_value_made_across_a_clear_is_returned_but_not_kept():
    cache = _cache.KeyedCache()
    assert cache.get("k", lambda: cache.clear() or "during") == "during"
    assert len(cache) == 0 and cache.get("k", lambda: "after") == "after"


def test_clear_caches_makes_the_next_plan_from_scratch(monkeypatch):
    model, x = TutorialStack(2, 16, 64, jax.random.key(0)), jnp.ones((8, 16))
    planned, profiled = [], []
    make_plan, profile = _planner.make_plan, _profile._profile_uncached
    monkeypatch.setattr(_planner, "make_plan", lambda *a: planned.append(1) or make_plan(*a))
    monkeypatch.setattr(_profile, "_profile_uncached", lambda *a: profiled.append(1) or profile(*a))
    smartremat.clear_caches()
    first = smartremat.explain(sr(budget_mb=0.1)(model), x)
    assert len(planned) == 1 and len(profiled) >= 1
    assert len(_planner._PLANS) == 1 and len(_profile._CACHE) >= 1 and len(_verify._CACHE) >= 1
    n_profiled = len(profiled)
    assert smartremat.explain(sr(budget_mb=0.1)(model), x) is first and len(planned) == 1
    smartremat.clear_caches()
    assert len(_planner._PLANS) == len(_profile._CACHE) == len(_verify._CACHE) == len(_step._FIGURES) == 0
    again = smartremat.explain(sr(budget_mb=0.1)(model), x)
    assert again is not first and again.policies == first.policies
    assert len(planned) == 2 and len(profiled) == 2 * n_profiled
