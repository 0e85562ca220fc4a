"""Factor signatures of the windowed primitives: convolutions and windowed reductions.

Halo exchange is not implemented, so a dimension a window slides along needs replication; a
dimension with a trivial window (size 1, stride 1, no padding, no dilation of the base) maps
element to element and is shared by every operand and the result.

conv_general_dilated, with any dimension_numbers (lhs batch N / feature C, rhs out-feature O /
in-feature I, out batch / feature):
  * plain (feature_group_count == batch_group_count == 1): N is shared by lhs and out, O by rhs
    and out, C = I is a reduction factor (out becomes a pending sum). This covers both transposes
    of a convolution: the input gradient is a plain conv (rev'd kernel), and the kernel gradient is
    a plain conv whose dimension_numbers swap the roles, so the batch N becomes its contracted
    feature dim: sharding N leaves the kernel gradient a pending sum, as data parallelism wants;
  * feature_group_count G > 1: lhs C = (g, cg), rhs I = cg, rhs O = out feature = (g, og).
    Depthwise-like convs (cg == 1) shard N, g and og (verified with XLA). Grouped convs with
    cg > 1 are kept replicated: XLA's SPMD partitioner all-gathers them whatever the sharding
    (even a batch-sharded one), so a sharded rule would promise what XLA does not do. Set
    GROUPED_CONV_SHARDING to shard N, g and og there too;
  * batch_group_count B > 1 (the kernel gradient of a grouped or depthwise conv): lhs batch =
    (bg, nb), out batch = nb, rhs O = out feature = (bg, ob). Only bg is sharded: XLA computes
    wrong numbers when C = I is sharded, and aborts or all-gathers when nb or ob is.
  * spatial dims need replication on all three tensors (kernel spatial dims too), except a
    trivial one (kernel size 1, stride 1, no padding, no lhs dilation) which lhs and out share.
  Convolution is linear in each operand on its own; plain and replicated convs say so. Split
  group counts are not linear groups: an equation with a pending sum runs on shards by
  re-binding the primitive with its params unchanged (runtime/local.py), and a split group
  factor would need feature_group_count / batch_group_count divided by its split.

reduce_window_sum (linear), reduce_window_max / _min, reduce_window (generic: all operands alike,
scalar init values), select_and_scatter_add (source, operand -> operand shape; linear in the
source), select_and_scatter (operand, source, init), select_and_gather_add (tangents, operand ->
window shape; linear in the tangents): trivial dims shared, windowed dims need replication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .indexing import Factors, summable
from .primitives import EqnTypes
from .signature import DimFactors, FactorSignature

GROUPED_CONV_SHARDING = False


def conv_general_dilated(t: EqnTypes) -> FactorSignature:
    lhs_spec, rhs_spec, out_spec = t.params["dimension_numbers"]
    fgc = int(t.params["feature_group_count"])
    bgc = int(t.params["batch_group_count"])
    if fgc > 1 and bgc > 1:
        raise ValueError("conv_general_dilated with both feature and batch groups")
    lhs_shape, rhs_shape = t.in_shapes[0], t.in_shapes[1]
    out_shape = t.out_shapes[0]
    nsp = len(lhs_spec) - 2
    strides = tuple(t.params.get("window_strides") or (1,) * nsp)
    padding = tuple(tuple(p) for p in t.params.get("padding") or ((0, 0),) * nsp)
    lhs_dil = tuple(t.params.get("lhs_dilation") or (1,) * nsp)
    F = Factors()
    lhs: list[DimFactors] = [()] * len(lhs_shape)
    rhs: list[DimFactors] = [()] * len(rhs_shape)
    out: list[DimFactors] = [()] * len(out_shape)
    n_lhs, c_lhs = lhs_shape[lhs_spec[0]], lhs_shape[lhs_spec[1]]
    o_rhs, i_rhs = rhs_shape[rhs_spec[0]], rhs_shape[rhs_spec[1]]
    grouped = fgc > 1 and i_rhs > 1 and not GROUPED_CONV_SHARDING
    if bgc > 1:
        bg = F("bg", bgc)
        lhs[lhs_spec[0]] = bg + F("nb", n_lhs // bgc, need=True)
        out[out_spec[0]] = F("nb", n_lhs // bgc, need=True)
        rhs[rhs_spec[0]] = out[out_spec[1]] = bg + F("ob", o_rhs // bgc, need=True)
        lhs[lhs_spec[1]] = rhs[rhs_spec[1]] = F("c", c_lhs, need=True)
    else:
        lhs[lhs_spec[0]] = out[out_spec[0]] = F("n", n_lhs, need=grouped)
        g = F("g", fgc, need=grouped)
        rhs[rhs_spec[0]] = out[out_spec[1]] = g + F("o", o_rhs // fgc, need=grouped)
        c = F("c", i_rhs, reduction=fgc == 1, need=fgc > 1)
        lhs[lhs_spec[1]] = g + c
        rhs[rhs_spec[1]] = c
    kernel = 1
    for i in range(nsp):
        ld, rd, od = lhs_spec[2 + i], rhs_spec[2 + i], out_spec[2 + i]
        k = rhs_shape[rd]
        kernel *= k
        trivial = (k == 1 and strides[i] == 1 and padding[i] == (0, 0) and lhs_dil[i] == 1
                   and lhs_shape[ld] == out_shape[od] and not grouped)
        if trivial:
            lhs[ld] = out[od] = F(f"h{i}", lhs_shape[ld])
        else:
            lhs[ld] = F(f"xh{i}", lhs_shape[ld], need=True)
            rhs[rd] = F(f"kh{i}", k, need=True)
            out[od] = F(f"yh{i}", out_shape[od], need=True)
    # A pending sum runs the conv on shards with the global group counts: exact only when no
    # group factor can be split (plain or fully replicated convs).
    exact_on_shards = (fgc == 1 and bgc == 1) or grouped
    linear = ((0,), (1,)) if exact_on_shards and summable(t.out_dtypes[0]) else ()
    return F.sig(t, [tuple(lhs), tuple(rhs)], [tuple(out)], linear=linear,
                 flops=2.0 * t.out_size * i_rhs * kernel)


def _trivial(window: Sequence[int], strides: Sequence[int], padding: Sequence[Sequence[int]],
             base_dilation: Sequence[int] | None, d: int) -> bool:
    return (window[d] == 1 and strides[d] == 1 and tuple(padding[d]) == (0, 0)
            and (base_dilation is None or base_dilation[d] == 1))


def _windowed(t: EqnTypes, big: Sequence[int], small: Sequence[int], linear: tuple[tuple[int, ...], ...],
              *, dilation: bool = True) -> FactorSignature:
    """Operands `big` have the input's shape, operands `small` (and the result, where the result
    has the window's shape) the reduced shape; others are scalars without factors."""
    p = t.params
    window = tuple(p["window_dimensions"])
    strides = tuple(p["window_strides"])
    padding = tuple(p["padding"])
    base = tuple(p["base_dilation"]) if dilation and "base_dilation" in p else None
    in_shape = t.in_shapes[big[0]]
    F = Factors()
    ins: list[DimFactors] = []
    outs: list[DimFactors] = []
    red_shape = t.in_shapes[small[0]] if small else t.out_shapes[0]
    for d, n in enumerate(in_shape):
        if _trivial(window, strides, padding, base, d) and red_shape[d] == n:
            ins.append(F(f"d{d}", n))
            outs.append(ins[-1])
        else:
            ins.append(F(f"x{d}", n, need=True))
            outs.append(F(f"y{d}", red_shape[d], need=True))
    operands = []
    for i in range(len(t.in_shapes)):
        operands.append(tuple(ins) if i in big else tuple(outs) if i in small else ())
    results = [tuple(ins) if s == in_shape and small else tuple(outs) for s in t.out_shapes]
    flops = float(t.out_size * max(1, math.prod(window)))
    return F.sig(t, operands, results, linear=linear, flops=flops)


def reduce_window_sum(t: EqnTypes) -> FactorSignature:
    return _windowed(t, [0], [], ((0,),) if summable(t.in_dtypes[0]) else ())


def reduce_window_other(t: EqnTypes) -> FactorSignature:
    """reduce_window_max / _min, and the generic reduce_window (operands then init values)."""
    n = len(t.out_shapes)
    return _windowed(t, list(range(n)), [], ())


def select_and_scatter_add(t: EqnTypes) -> FactorSignature:
    """(source, operand) -> operand shape; linear in the source."""
    return _windowed(t, [1], [0], ((0,),) if summable(t.in_dtypes[0]) else (), dilation=False)


def select_and_scatter(t: EqnTypes) -> FactorSignature:
    """(operand, source, init value) -> operand shape."""
    return _windowed(t, [0], [1], (), dilation=False)


def select_and_gather_add(t: EqnTypes) -> FactorSignature:
    """(tangents, operand) -> window shape; linear in the tangents."""
    return _windowed(t, [0, 1], [], ((0,),) if summable(t.in_dtypes[0]) else ())
