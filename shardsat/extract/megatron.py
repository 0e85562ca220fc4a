"""Which dimension of each weight tensor parallelism splits, read from the program's factors.

Megatron splits a block's weights on the dimension the block keeps to itself: the heads of the
attention projections (wq, wk, wv on their output heads, wo on its input heads), the hidden
width of an MLP pair (w1's output, w2's input), the vocabulary. The largest dimension is that
one for an MLP pair, not for attention weights shaped (d_model, heads, head_dim), whose largest
is d_model: the residual stream, which every layer shares.

Dimensions that must be split together are found as Shardy does: every equation's factor
signature ties the dimensions it maps to one factor (a dimension's major factor is what
splitting it splits), and a union-find over (value, dimension) joins them across the program.
A weight dimension is then ranked by its class:
- contracted between two activations (a dot_general no weight feeds: q.k over head_dim, the
  attention's sum over keys), or an activation's dimension a rule keeps whole (sliced or
  concatenated on: rotary embeddings halve head_dim): last, since splitting it leaves
  activations partial sums or gathers them;
- then by how many weights share the class: the residual stream spans them all (extract/
  families.py keeps it whole over tensor parallelism), a block's heads or hidden width its own
  few; a class of one weight alone is an edge (an MLP chain's input features), ranked after;
- then larger first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..egraph.program import Literal, Program
from ..egraph.unionfind import UnionFind
from ..rules.apply import RuleTables
from ..rules.registry import rule_for


class _Classes(UnionFind):
    """Union-find over (value, dimension)."""

    def __init__(self, program: Program) -> None:
        self.offset: list[int] = []
        n = 0
        for v in program.values:
            self.offset.append(n)
            n += len(v.shape)
        super().__init__(n)

    def node(self, vid: int, dim: int) -> int:
        return self.offset[vid] + dim


def _weight_derived(program: Program, weights: set[int]) -> set[int]:
    """Values computed from the weights alone (casts, transposes, reshapes of them)."""
    out = {program.alias(program.args[pos]) for pos in weights}
    for eqn in program.equations:
        reads = [program.alias(a) for a in eqn.inputs if not isinstance(a, Literal)]
        if reads and all(r in out for r in reads):
            out.update(eqn.outputs)
    return out


@dataclass
class DimFacts:
    """The program's (value, dimension) classes: which are contracted between activations or kept
    whole (`bad`), and which weights (flat positions) share each (`sharing`); by class root."""

    classes: _Classes
    bad: set[int]
    sharing: dict[int, set[int]]

    def root(self, vid: int, dim: int) -> int:
        return self.classes.find(self.classes.node(vid, dim))


def dim_facts(program: Program, tables: RuleTables, weights: tuple[int, ...]) -> DimFacts:
    """The union-find over every equation's factor signature (module docstring), with the
    classes flagged and the weights counted per class."""
    classes = _Classes(program)
    derived = _weight_derived(program, set(weights))
    flagged: set[int] = set()
    for eqn in program.equations:
        key = tables.output_key.get(eqn.outputs[0]) if eqn.outputs else None
        if key is None:
            continue
        sig = tables.keys[key.rpartition("#")[0]].signature
        dims: dict[str, list[int]] = {}  # major factor -> (value, dimension) nodes
        reads: list[int] = []
        for atom, tensor in zip(eqn.inputs, sig.operands, strict=False):
            if isinstance(atom, Literal):
                continue
            reads.append(program.alias(atom))
            for d, fs in enumerate(tensor):
                if fs:
                    dims.setdefault(fs[0], []).append(classes.node(reads[-1], d))
                    if fs[0] in sig.need_replication and reads[-1] not in derived:
                        flagged.add(classes.node(reads[-1], d))
        for vid, tensor in zip(eqn.outputs, sig.results, strict=False):
            for d, fs in enumerate(tensor):
                if fs:
                    dims.setdefault(fs[0], []).append(classes.node(program.alias(vid), d))
        for nodes in dims.values():
            for n in nodes[1:]:
                classes.union(nodes[0], n)
        if rule_for(eqn.primitive).heavy and not any(r in derived for r in reads):
            flagged.update(n for f in sig.reduction for n in dims.get(f, ()))
    sharing: dict[int, set[int]] = {}
    for pos in weights:
        vid = program.alias(program.args[pos])  # a folded loop's layers: their body's
        for d in range(len(program.values[vid].shape)):
            sharing.setdefault(classes.find(classes.node(vid, d)), set()).add(pos)
    return DimFacts(classes, {classes.find(n) for n in flagged}, sharing)


def tensor_ranks(program: Program, tables: RuleTables, weights: tuple[int, ...], state: tuple[int, ...] = ()
                 ) -> dict[int, list[tuple[int, int]]]:
    """Per weight or state argument (flat position): per dimension, (contracted between
    activations: 0/1, weights sharing its class); smaller ranks first (see the module
    docstring). Optimizer state shares its weight's classes through the update."""
    facts = dim_facts(program, tables, weights)
    out: dict[int, list[tuple[int, int]]] = {}
    for pos in (*weights, *state):
        vid = program.alias(program.args[pos])  # a folded loop's layers: their body's
        roots = [facts.root(vid, d) for d in range(len(program.values[vid].shape))]
        out[pos] = [(int(r in facts.bad), len(facts.sharing.get(r, ()))) for r in roots]
    return out
