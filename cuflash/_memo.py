"""Bounded memo tables: the one home of the host's per-layout caches.

A call's host work that depends only on its layout (validation, the chosen path, offset tables,
kernel arguments, launch plans) is built by the first call of that layout and found by the next
ones (issue 17: a repeated call does only what its data needs). Keys are the signatures
``cuflash._validate`` computes (``Problem.key``). When a table is full its oldest entry goes.
"""
import threading


class Memo(dict):
    """A dict of at most ``size`` entries, oldest out first. Lookups take no lock; insertions
    do (threads share the tables: cuflash.ring.emulate runs a thread per rank)."""

    def __init__(self, size=256):
        super().__init__()
        self.size = size
        self.lock = threading.Lock()

    def put(self, key, value):
        """Keep ``value`` under ``key`` (in place of the one there)."""
        with self.lock:
            if key not in self and len(self) >= self.size:
                self.pop(next(iter(self)), None)
            self[key] = value

    def build(self, key, make):
        """The value of ``key``; ``make()`` builds it the first time (not kept when key is None)."""
        if key is None:
            return make()
        try:
            return self[key]
        except KeyError:
            pass
        value = make()
        with self.lock:
            if len(self) >= self.size:
                self.pop(next(iter(self)), None)
            self[key] = value
        return value
