"""One plan for every process of a multi-host job.

Under `jax.distributed`, each process runs its own copy of the program on its own devices, and the
compiled programs must match collective for collective: processes that planned differently would
run programs that wait on each other forever. Planning is deterministic, but a search cut short by
a time limit (a loaded host, the exact solver's time limit) need not be, so the plans are compared
(`agree`: every process plans, a digest of each plan's choices is gathered and compared) or made
once (`share_plan`: process 0 plans and sends the plan, as JSON, to the others).

Both exchange data through collectives every process joins, also the ones whose planning failed:
a failure is sent as such and raised everywhere, so no process is left waiting in a collective
its peers never reach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import Mesh

from ..errors import ShardsatError

if TYPE_CHECKING:
    from .plan import Plan

DIGEST_BYTES = 32  # sha256
_FAILED = b"\0" * DIGEST_BYTES


def spans_processes(mesh: Mesh) -> bool:
    """Whether the mesh's devices belong to more than one process."""
    return len({d.process_index for d in mesh.devices.flat}) > 1


def _allgather(row: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(row))


def _broadcast(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x))


def agree(make: Callable[[], Plan], digest_of: Callable[[Plan], str]) -> Plan:
    """make() in every process; the plans' digests must be equal. Raises ShardsatError naming
    the processes whose plan differs from process 0's, or that failed to plan."""
    error: BaseException | None = None
    try:
        plan = make()
        mine = bytes.fromhex(digest_of(plan))
    except Exception as e:  # the others must still get an answer from this process
        error, mine = e, _FAILED
    rows = _allgather(np.frombuffer(mine, dtype=np.uint8))
    if error is not None:
        raise error
    digests = [bytes(r).hex() for r in rows.reshape(-1, DIGEST_BYTES)]
    failed = [i for i, d in enumerate(digests) if bytes.fromhex(d) == _FAILED]
    if failed:
        raise ShardsatError(
            f"Planning failed in process(es) {failed} of {len(digests)} (their own error is raised there). "
            "Consider fixing that error; every process must plan the same function, mesh and options.")
    differ = [i for i, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ShardsatError(
            f"The processes planned differently: process(es) {differ} chose another plan than process 0 "
            f"(plan digests {digests[0][:12]} vs {', '.join(digests[i][:12] for i in differ)}); running them "
            "would hang in mismatched collectives. This happens when a search is cut short by a time limit "
            "(shardsat.Limits, the exact solver's seconds) or the processes were given different functions, "
            "arguments or options. Consider saturate_and_extract(..., multihost='share'), which plans in "
            "process 0 only and sends its plan to the others.")
    return plan  # type: ignore[possibly-undefined]


def share_plan(make: Callable[[], Plan], text_of: Callable[[Plan], str], load: Callable[[str], Plan]) -> Plan:
    """make() in process 0, whose plan's text every other process load()s. A failure in process
    0 is sent instead of a plan and raised everywhere."""
    first = jax.process_index() == 0
    error: BaseException | None = None
    payload = b""
    if first:
        try:
            plan = make()
            payload = b"P" + text_of(plan).encode()
        except Exception as e:
            error = e
            payload = b"E" + f"{type(e).__name__}: {e}".encode()
    size = int(_broadcast(np.asarray(len(payload), dtype=np.int64)))
    data = np.frombuffer(payload, dtype=np.uint8) if first else np.zeros(size, dtype=np.uint8)
    received = bytes(_broadcast(data).astype(np.uint8))
    if error is not None:
        raise error
    if first:
        return plan  # type: ignore[possibly-undefined]
    if received[:1] != b"P":
        raise ShardsatError(f"Process 0 failed to plan, so this process has no plan to run: "
                            f"{received[1:].decode(errors='replace')}")
    return load(received[1:].decode())
