"""Global starting points for the local search: the layouts experts start from.

Extraction improves a plan one value or one chain at a time; switching every parameter between
replicated and sharded at once is beyond such moves. For a training step (loop-carried state)
two seeds are tried besides the cost estimate: data parallel (state replicated, each other input
split on its leading dimension over as many mesh axes as divide it) and fully sharded state
(ZeRO-3: each state leaf split on its largest dimension that divides, inputs as before). On a
mesh of several axes, one seed per axis instead of data parallel: the batch split over that axis
alone, each state leaf's largest dimension over the other axes and its next over that one (FSDP +
tensor parallelism), which no sequence of local moves reaches from the others (a GPT step on 4x2:
539 us from the old seeds, 389 us now, 381 us for the pinned expert layout). A program without
state (a forward pass) starts from data parallelism besides the estimate.
"""

from __future__ import annotations

from ..egraph.export import ExportedGraph
from ..egraph.layout import Layout, SpaceTable
from ..egraph.program import Program


def _split(shape: tuple[int, ...], dim: int, spaces: SpaceTable, only: tuple[int, ...] | None = None) -> Layout | None:
    mesh = spaces.mesh
    axes: list[int] = []
    for a in (mesh.active if only is None else only):  # as many axes as divide, in mesh order
        if shape[dim] % mesh.size((*axes, a)) == 0:
            axes.append(a)
    if not axes:
        return None
    return Layout(tuple(tuple(axes) if d == dim else () for d in range(len(shape))), ())


def seeds(program: Program, graph: ExportedGraph, spaces: SpaceTable, ties: list[tuple[int, int]],
          pins: dict[int, frozenset[int]], hybrids: bool = True) -> list[dict[int, int]]:
    """Seeds as {input group: layout id}. `hybrids`: whether to try the FSDP + TP starts. They
    reach their plans mostly through chain moves, so the caller tries them where every start gets
    chain moves (extract/search.py, SEED_CHAIN_NODES) and on meshes of three axes, where the
    other starts are poorest: before chain moves they were behind on 2x4 (a llama step 625 vs
    510 us, ending at 432 vs 507; a folded 24-layer GPT step 22.9 vs 20.0 ms) but ahead on 2x2x2
    (a GPT step 548 vs 606 us, polished to 514 against 592; a llama step 547 vs 589, to 504)."""
    if not ties:
        return _forward_seeds(program, graph, spaces, pins) if hybrids else []
    state = {a for a, _ in ties}
    dp: dict[int, int] = {}
    zero: dict[int, int] = {}
    for pos, vid in enumerate(program.args):
        if pos in pins:
            continue
        grp = graph.value_group.get(vid)
        if grp is None:
            continue
        shape = program.values[vid].shape
        if pos in state:
            dp[grp] = spaces.layouts.intern(Layout.replicated(len(shape)))
            if shape:
                big = max(range(len(shape)), key=lambda d: (shape[d], -d))
                lay = _split(shape, big, spaces)
                if lay is not None:
                    zero[grp] = spaces.layouts.intern(lay)
        elif shape:
            lay = _split(shape, 0, spaces)
            if lay is not None:
                dp[grp] = zero[grp] = spaces.layouts.intern(lay)
    active = list(spaces.mesh.active)
    if len(active) < 2:
        return [dp, zero]
    if not hybrids:
        return [zero]
    # several axes: the hybrids below take the data-parallel seed's place (it has never been the
    # best start on such a mesh: GPT, llama, MLP and MoE steps on 2x4, 4x2 and 2x2x2)
    out = [zero]
    for batch_axis in active:
        rest = tuple(a for a in active if a != batch_axis)
        hybrid: dict[int, int] = {}
        for pos, vid in enumerate(program.args):
            grp = graph.value_group.get(vid)
            shape = program.values[vid].shape
            if pos in pins or grp is None or not shape:
                continue
            if pos in state:  # the largest dimension over the other axes, the next over the batch's
                dims = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
                lay = _split(shape, dims[0], spaces, rest)
                if lay is not None and len(dims) > 1:
                    second = _split(shape, dims[1], spaces, (batch_axis,))
                    if second is not None:
                        lay = Layout(tuple(a or b for a, b in zip(lay.dims, second.dims, strict=True)), ())
            else:
                lay = _split(shape, 0, spaces, (batch_axis,))
            if lay is not None:
                hybrid[grp] = spaces.layouts.intern(lay)
        if hybrid and hybrid not in out:
            out.append(hybrid)
    return out


def _forward_seeds(program: Program, graph: ExportedGraph, spaces: SpaceTable,
                   pins: dict[int, frozenset[int]]) -> list[dict[int, int]]:
    """A program without state (inference, a forward pass): data parallel. The batch is the
    positional arguments every leaf of which has a leading dimension an output keeps; the others
    (a params pytree, where some leaf differs) stay replicated. The estimate's start settles in
    tensor-parallel layouts it cannot leave one value at a time (a Soft-MoE layer on 2x4: 18.1
    us against 18.0 with the batch split)."""
    lead = {program.values[o].shape[0] for o in program.outputs
            if isinstance(o, int) and program.values[o].shape}
    dp: dict[int, int] = {}
    batch = False
    start = 0
    for count in program.arg_counts:
        positions = range(start, start + count)
        start += count
        shapes = [program.values[program.args[pos]].shape for pos in positions]
        is_batch = all(shape and shape[0] in lead for shape in shapes)
        for pos, shape in zip(positions, shapes, strict=True):
            grp = graph.value_group.get(program.args[pos])
            if pos in pins or grp is None:
                continue
            lay = _split(shape, 0, spaces) if is_batch else None
            batch |= lay is not None
            dp[grp] = spaces.layouts.intern(lay if lay is not None else Layout.replicated(len(shape)))
    return [dp] if batch else []
