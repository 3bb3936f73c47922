"""One policy for vkgraph's in-memory caches: bounded, least recently used out, counted, reset in one place.

Every cache that grows with the programs a process meets (lowerings, schedules, compiled programs, SPIR-V,
GLSL sources, pipelines, movements) is registered here by name: `stats()` reports each one's size, capacity,
hits, misses and evictions, `clear()` empties them all. A cache kept per device (one per `Device`) has one
instance per device under one name; their figures are summed. A server that meets many shapes therefore holds
at most each cache's capacity, never one entry per shape it ever saw.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from .interrupts import critical

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Cache(Protocol):
    name: str

    def stats(self) -> dict[str, int]: ...

    def clear(self) -> None: ...


_REGISTRY: weakref.WeakSet[Cache] = weakref.WeakSet()
_REGISTRY_LOCK = threading.Lock()


@critical  # (a KeyboardInterrupt just after `with lock` took the lock would leave it taken)
def register(cache: Cache) -> None:
    with _REGISTRY_LOCK:
        _REGISTRY.add(cache)


class LRU(Generic[K, V]):
    """A mapping of at most `capacity` entries; inserting past it drops the least recently used ones, passing
    each to `on_evict` (which releases what the entry holds, if anything). Lookups are lock-free (single dict
    operations); inserts and evictions take a lock so the bound holds with many threads."""

    __slots__ = ("name", "capacity", "hits", "misses", "evictions", "_data", "_on_evict", "_lock", "__weakref__")

    def __init__(self, name: str, capacity: int, on_evict: Callable[[K, V], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"cache {name}: capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.hits = self.misses = self.evictions = 0
        self._data: OrderedDict[K, V] = OrderedDict()
        self._on_evict = on_evict
        self._lock = threading.Lock()
        register(self)

    def get(self, key: K, default: V | None = None) -> V | None:
        """The entry (now the most recently used), or default; counts a hit or a miss."""
        try:
            value = self._data[key]
        except KeyError:
            self.misses += 1
            return default
        self.hits += 1
        try:
            self._data.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile: the value is still good to use
            pass
        return value

    @critical
    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            evicted = [self._data.popitem(last=False) for _ in range(len(self._data) - self.capacity)]
            self.evictions += len(evicted)
        if self._on_evict is not None:
            for k, v in evicted:
                self._on_evict(k, v)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def values(self) -> list[V]:
        return list(self._data.values())

    def items(self) -> Iterator[tuple[K, V]]:
        return iter(list(self._data.items()))

    @critical
    def clear(self) -> None:
        """Drop every entry (through on_evict) and zero the counters."""
        with self._lock:
            entries = list(self._data.items())
            self._data.clear()
            self.hits = self.misses = self.evictions = 0
        if self._on_evict is not None:
            for k, v in entries:
                self._on_evict(k, v)

    def stats(self) -> dict[str, int]:
        return {"size": len(self._data), "capacity": self.capacity, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions}

    def __repr__(self) -> str:
        return f"LRU({self.name}, {len(self._data)}/{self.capacity})"


class Memo:
    """functools.lru_cache-wrapped functions (C-fast on hot paths such as view movements) under one name."""

    def __init__(self, name: str, functions: list[Any]) -> None:
        self.name = name
        self.functions = functions
        register(self)

    def stats(self) -> dict[str, int]:
        infos = [f.cache_info() for f in self.functions]
        return {"size": sum(i.currsize for i in infos), "capacity": sum(i.maxsize for i in infos),
                "hits": sum(i.hits for i in infos), "misses": sum(i.misses for i in infos),
                "evictions": max(0, sum(i.misses - i.currsize for i in infos))}

    def clear(self) -> None:
        for f in self.functions:
            f.cache_clear()


@critical
def stats() -> dict[str, dict[str, int]]:
    """Every registered cache by name: size, capacity, hits, misses, evictions (summed over devices)."""
    with _REGISTRY_LOCK:
        caches = list(_REGISTRY)
    out: dict[str, dict[str, int]] = {}
    for c in caches:
        s = c.stats()
        if c.name in out:
            s = {k: out[c.name][k] + v for k, v in s.items()}
        out[c.name] = s
    return dict(sorted(out.items()))


@critical
def clear() -> None:
    """Empty every registered cache (tests, or a process that wants its memory back)."""
    with _REGISTRY_LOCK:
        caches = list(_REGISTRY)
    for c in caches:
        c.clear()
