"""The partitioning IR in egglog.

`Val` terms are logical values (inputs and equations over inputs). `Dist` e-classes are
"this value, laid out this way": `At(value, layout)`. Every e-node of a `Dist` class is one way to
produce it on the devices: a placed input, a local op on shards of its operands, or a collective
from another layout of the same value. Layouts are interned integers (see layout.py); mesh axis
sets are bitmasks.

Bulk data (the program's values and equations, the strategy and resharding tables of the rules
stage) enters through relations loaded with egglog's `input`, and generic rules turn table rows
into terms: one egglog command per table instead of one per fact.
"""

from __future__ import annotations

from egglog import Expr, String, StringLike, function, i64, i64Like, relation


class Val(Expr):
    """A logical value of the program."""

    @classmethod
    def arg(cls, pos: i64Like) -> Val:
        """Flat argument (or closed-over constant) number `pos`."""

    @classmethod
    def ref(cls, id: i64Like) -> Val:
        """The program's value number `id` (a name, unioned with its definition)."""

    @classmethod
    def op(cls, key: StringLike, args: VList) -> Val:
        """An equation: `key` names primitive, params, operand types and literal operands."""


class VList(Expr):
    @classmethod
    def nil(cls) -> VList: ...

    @classmethod
    def cons(cls, head: Val, tail: VList) -> VList: ...


class LList(Expr):
    """A list of layout ids (operand layouts of a local strategy)."""

    @classmethod
    def nil(cls) -> LList: ...

    @classmethod
    def cons(cls, head: i64Like, tail: LList) -> LList: ...


class Dist(Expr):
    """One way to hold a value in a layout on the devices."""

    @classmethod
    def place(cls, pos: i64Like, layout: i64Like) -> Dist:
        """Argument `pos` passed in with this layout (its in_sharding)."""

    @classmethod
    def local(cls, key: StringLike, strategy: i64Like, args: DList) -> Dist:
        """Equation `key` run on every device on shards of `args` (strategy `strategy`)."""

    @classmethod
    def all_gather(cls, src: Dist, axes: i64Like, dim: i64Like) -> Dist:
        """Gather the minor `axes` (a bitmask) of dimension `dim`."""

    @classmethod
    def dyn_slice(cls, src: Dist, axes: i64Like, dim: i64Like) -> Dist:
        """Keep the local slice along `dim` for `axes`: no communication."""

    @classmethod
    def all_reduce(cls, src: Dist, axes: i64Like) -> Dist:
        """Sum the pending partial sums over `axes`."""

    @classmethod
    def reduce_scatter(cls, src: Dist, axes: i64Like, dim: i64Like) -> Dist:
        """Sum the pending partial sums over `axes`, leaving dimension `dim` split over them."""

    @classmethod
    def all_to_all(cls, src: Dist, axes: i64Like, src_dim: i64Like, dst_dim: i64Like) -> Dist:
        """Move the split over `axes` from dimension `src_dim` to `dst_dim`."""


class DList(Expr):
    @classmethod
    def nil(cls) -> DList: ...

    @classmethod
    def cons(cls, head: Dist, tail: DList) -> DList: ...


@function(unextractable=True)
def At(value: Val, layout: i64Like) -> Dist:
    """The e-class of `value` laid out as `layout`."""


@function(unextractable=True)
def AtList(values: VList, layouts: LList) -> DList:
    """Element-wise At over operand and layout lists."""


@function(unextractable=True)
def ArgsFrom(id: i64Like, pos: i64Like) -> VList:
    """Operands `pos..` of the equation defining value `id` (built from ValInT rows)."""


@function
def SpaceOf(value: Val) -> i64:
    """The (shape, dtype) space of a value; resharding edges are tabled per space."""


# Bulk tables of the program (loaded with `input`).
ValArgT = relation("ValArgT", i64, i64)  # (value id, flat arg position)
ValOpT = relation("ValOpT", i64, String, i64)  # (value id, key, operand count)
ValInT = relation("ValInT", i64, i64, i64)  # (value id, operand position, operand value id)
ValSpaceT = relation("ValSpaceT", i64, i64)  # (value id, space id)
PlaceT = relation("PlaceT", i64, i64)  # (space id, layout id) layouts an input may be placed in
ValEqT = relation("ValEqT", i64, i64)  # (value id, value id) computed alike (a user rewrite)
