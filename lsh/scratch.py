"""Query scratch lent to one query at a time.

A table's query marks the ids it meets in scratch arrays and clears the marks before it returns
(:class:`lsh.tables.QueryScratch`, the counts of :class:`lsh.compact.CompactTables`), so that the
next query finds them clear without a pass over all of them. Two queries in one set of scratch
at once, from two Python threads (the kernels release the GIL, and a recommender serves from a
pool of threads), would read each other's marks and leave some of them set: wrong candidates
then, and in every later query. So a table keeps a list of free scratch sets, and each query
borrows one (a new one where all are out) and gives it back when it is done.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

__all__ = ["borrowed"]

#: guards the lists of free scratch, not the queries
_LOCK = threading.Lock()


@contextmanager
def borrowed(free: list, fits, make):
    """A scratch set from the list ``free`` for which ``fits(s)`` holds, or ``make()``'s where
    none is free, given back to ``free`` after the block. Sets that no longer fit (made for
    another thread count, or before a rebuild) are dropped as they are met, and so is one whose
    block raised, since its marks may be left set."""
    scratch = None
    with _LOCK:
        while free and scratch is None:
            s = free.pop()
            if fits(s):
                scratch = s
    if scratch is None:
        scratch = make()
    yield scratch
    with _LOCK:
        free.append(scratch)
