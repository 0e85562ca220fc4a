"""egglog's thread count, fixed once per process, without changing the user's environment; and
the lock that keeps planning to one thread at a time.

egglog 13.2's Python bindings have no thread setting: egglog runs on rayon's global thread pool,
which is built once per process, when `egglog` is imported, from `RAYON_NUM_THREADS`
(measured: 1 + N threads right after `import egglog` with the variable at N; changing it later
does nothing). shardsat wants one thread (egglog-notes.md: two were slower and changed
tie-breaking, so plans would differ from run to run). So the variable has to be set before the
first `import egglog`, and only where the user has not chosen a value; it is removed again once
the pool exists, so the user's environment (and that of the processes it starts) is as it was.
If egglog was imported before shardsat, its pool exists already and is left as it is.

This module must be imported before any other shardsat module imports egglog: the package's
`__init__` imports it first.
"""

from __future__ import annotations

import os
import sys
import threading

VARIABLE = "RAYON_NUM_THREADS"


def import_egglog_single_threaded() -> None:
    """Import egglog with a one-thread pool unless the user chose a size or egglog is loaded."""
    if "egglog" in sys.modules or VARIABLE in os.environ:
        return
    os.environ[VARIABLE] = "1"
    try:
        import egglog  # noqa: F401  (builds rayon's global pool, reading the variable once)
    finally:
        os.environ.pop(VARIABLE, None)


import_egglog_single_threaded()

# Planning from several threads at once failed at random (KeyError on egglog's declarations,
# "Class ... has no method cons", NoPlanError, an EGraph dropped on another thread): egglog's
# Python declarations and its EGraph are not thread-safe, and planning pauses the process-wide
# garbage collector. Every public entry that plans or loads a plan holds this lock, so threads
# plan one after another; re-entrant, as the testing helpers plan inside one.
PLANNING = threading.RLock()
