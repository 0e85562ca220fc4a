"""What the search does on one e-graph, decided once: which starting points get chain moves,
whether pressure restarts run and are polished, whether the exact integer program runs and for
how long, how much work the layout families get, which lower bound is computed. api.py derives
it from the e-graph's size, the mesh and the user's options and passes it down; the search
(extract/search.py) reads it and decides nothing by size itself. The thresholds live here."""

from __future__ import annotations

from dataclasses import dataclass, replace

# "auto" runs the exact integer program on e-graphs up to this many e-nodes, for this long: the
# whole-graph ILP stops paying beyond a block or two (its relaxation is weak under sharing).
EXACT_AUTO_NODES = 1000
EXACT_AUTO_SECONDS = 2.0
EXACT_SECONDS = 10.0  # extraction="exact" (shardsat.Limits.exact_seconds)
# ... on e-graphs up to this many e-nodes: beyond, building the program alone takes tens of
# seconds and HiGHS does not return within minutes (a 900k-node 2x2x2 training step)
EXACT_MAX_NODES = 200_000
# up to this many e-nodes every start gets chain moves (before them a start's cost says little:
# a 4-layer llama step on 2x4, 132k e-nodes, ends at 351 us this way and at 507 us when only the
# best start is polished; a 2-layer GPT step, 123k, takes ~9 s instead of ~5 for the same plan)
SEED_CHAIN_NODES = 150_000
# the standard layout families' completions (search._family_starts): all of them on e-graphs up
# to FAMILY_ALL_NODES (a fraction of a second each), else as many pressure-restart completions
# as fit in FAMILY_SHARE of the work (Extractor.work) the search did before them, each released
# (after the first family, completed and released in full), the cheapest FAMILY_RELEASED of them
# polished with chain moves. A 3-layer GPT step on 2x4 tries 3
# families instead of 1 (pressure completions take ~0.27 searches)
FAMILY_SHARE = 0.6
FAMILY_ALL_NODES = 5_000
# ... and beyond that, up to this many e-nodes, tensor parallelism over the whole mesh in full as
# well as the replicated family: pressure ranks it last (it prices bytes, and the family needs
# chain moves), yet it is a small model's best layout on any mesh (a 1-layer MLP step on 2x2x2,
# 14.6k e-nodes: 0.64 us from every other start, 0.40 from it). A completion costs 0.2-0.6 s
# here and won nothing on the experts benchmark (MLP4 train on 2x4, 9.3k e-nodes: 0.74 -> 1.38 s)
FAMILY_WHOLE_TP_NODES = 30_000
FAMILY_RELEASED = 1
# ... on meshes of three or more axes, the cheapest two: once gathers paid their own latency on
# XLA:CPU, a llama step on 2x2x2 polished one family to 453.0 us, beside 450.2 for the pinned
# FSDP layout; polishing two reached 444.8 (planning 22.2 -> 24.2 s)
FAMILY_RELEASED_MANY_AXES = 2
# the split bound (extract/splitbound.py) costs ~0.2 s per round on a 4-layer GPT step's 1.26M
# e-nodes on 2x2x2 (three rounds with loop-carried state): beyond this, the per-value one alone
SPLIT_BOUND_NODES = 2_000_000
# ... raised by agreement prices (extract/agreement.py) for about this share of the search's own
# time, counted in work (Extractor.work) so that a plan's bound is the same on any machine: one
# group's evaluation by the dynamic program takes the time of AGREEMENT_GROUP_WORK units of the
# search's work (2.3-4 on the experts' training steps: a round of the 2-layer GPT step's 806
# priced groups takes 33 / 35 / 64 ms on 8 / 2x4 / 2x2x2, a unit of work 10 / 15 / 34 us).
# With the ties' multipliers and the resharding shares moving too, more rounds pay: the issue 17
# sweep's GPT steps on 2x4 read gaps of 4.8-28.5% at 0.2, 3.0-22.0% at 0.5 and 2.1-21.5% at 1.0,
# planning 47.6 / 52.6 / 57.9 s in all
AGREEMENT_SHARE = 0.5
AGREEMENT_GROUP_WORK = 3.0
# priors="auto" narrows each value's layouts (egraph/narrow.py) when the program (folded) has
# more (value, layout) pairs than this: 4-layer GPT / llama steps have 83k / 118k on 2x2x2 (1.3 M
# / 1.9 M e-nodes, planned whole), 80k / 111k on 4x4x4, and 389k-594k on 2x2x2x2 and 2x2x2x4,
# where the whole e-graph passes 5 M e-nodes in three iterations (api._plan also narrows where
# a whole e-graph stops at a limit with no plan)
NARROW_PAIRS = 200_000
# ... and on meshes of MANY_AXES or more axes, where a value has hundreds of layouts (a rank-4
# attention tensor on 2x2x2x2: 1,273) and the e-graph grows with their square, it narrows beyond
# NARROW_PAIRS_MANY_AXES pairs by the learned prior (below). Measured on 2x2x2x2, whole /
# learned, the same plan in all five: dot_product_attention 28k pairs, 15.5 / 10.9 s; its
# block's gradient 102k, 49.2 / 23.3 s; a soft-MoE gradient 37k, 26.4 / 12.4 s; a 6-layer MLP
# Adam step 75k, 11.3 / 5.5 s; a conv net's gradient 23k, 6.9 / 6.1 s. The families'
# narrowing is faster but lost 2.3x on the MoE gradient (52.95 us against 23.05)
MANY_AXES = 4
NARROW_PAIRS_MANY_AXES = 20_000
# ... keeping the layouts of each equation's NARROW_WIDTH cheapest strategies under each family's
# propagation (extract/propagate.py). That GPT step on 2x2x2x2: 637 ms at width 2 (796k e-nodes),
# 688 ms at width 1 (506k); on 2x2x2 narrowed (priors="families"): 1.010x and 1.043x the whole
# e-graph's plan
NARROW_WIDTH = 2
# a learned prior (priors="builtin" or a weights file, extract/prior.py) keeps each value's
# best-scored layouts up to this softmax mass, at most PRIOR_PAIRS (value, layout) pairs in all
# (before egraph/narrow.py adds the layouts with fewer axes). The 4-layer GPT step on 2x2x2:
# mass 0.99 1.032x the whole e-graph's plan (288k e-nodes), 0.999 1.008x (388k), 0.9999 1.004x
# (422k, 1.2x the time)
PRIOR_MASS = 0.999
PRIOR_PAIRS = 20_000
METHODS = ("auto", "greedy", "exact")


@dataclass(frozen=True)
class SearchPolicy:
    method: str  # the user's extraction= ("auto", "greedy", "exact"), after exact_method
    exact: bool  # the integer program runs after the local search
    exact_seconds: float  # and for this long at most
    chain_every_start: bool  # every start gets chain moves; else the best POLISHED starts only
    restarts: bool  # the starts again under memory pressure
    polish_restarts: bool  # the pressure restarts' plans get chain moves
    seed_hybrids: bool  # FSDP + TP seeds (extract/seeds.py)
    families: bool  # the standard layout families are completed and released
    family_share: float | None  # their budget: a share of the search's work; None: every family in full
    family_released: int  # ... and the cheapest this many of them polished with chain moves
    whole_tp_in_full: bool  # ... and tensor parallelism over the whole mesh completed in full
    regions: bool  # the plan found is polished last by region moves (extract/moves_region.py)
    bound: bool  # the plan's lower bound and gap are computed
    split_bound: bool  # ... with the split bound too, else the per-value bound alone
    agreement_share: float  # ... raised by agreement prices for this share of the search's work

    @classmethod
    def derive(cls, method: str, nodes: int, active_axes: int, exact_seconds: float = EXACT_SECONDS) -> SearchPolicy:
        """The policy for an exported e-graph of `nodes` e-nodes on a mesh of `active_axes` axes
        of more than one device."""
        small = nodes <= SEED_CHAIN_NODES
        return cls(
            method=method,
            exact=runs_exact(method, nodes),
            exact_seconds=exact_seconds if method == "exact" else EXACT_AUTO_SECONDS,
            chain_every_start=small,
            restarts=True,
            polish_restarts=small or active_axes >= 3,
            seed_hybrids=small or active_axes >= 3,
            families=True,
            family_share=None if nodes <= FAMILY_ALL_NODES else FAMILY_SHARE,
            family_released=FAMILY_RELEASED_MANY_AXES if active_axes >= 3 else FAMILY_RELEASED,
            whole_tp_in_full=nodes <= FAMILY_WHOLE_TP_NODES,
            regions=True,
            bound=True,
            split_bound=nodes <= SPLIT_BOUND_NODES,
            agreement_share=AGREEMENT_SHARE,
        )

    def greedy(self, *, restarts: bool = True, bound: bool = True) -> SearchPolicy:
        """The same search without the integer program, the families or the region polish: a
        family's own completion, a memory-pressure round of fit_memory."""
        return replace(self, method="greedy", exact=False, families=False, regions=False, restarts=restarts,
                       bound=bound)


def exact_method(method: str, nodes: int) -> tuple[str, str | None]:
    """The extraction method the saturated e-graph allows, and why the integer program will not
    run where it was asked for (None if it will)."""
    if method == "exact" and nodes > EXACT_MAX_NODES:  # hopeless for the integer program
        return "greedy", (f"not run: {nodes:,} e-nodes (it runs on up to {EXACT_MAX_NODES:,}; its "
                          "relaxation is weak beyond a few thousand)")
    return method, None


def runs_exact(method: str, nodes: int) -> bool:
    """Whether the integer program runs on an exported e-graph of `nodes` e-nodes (it needs the
    resharding e-nodes exported; the greedy search does not, and they are most of the nodes)."""
    return method == "exact" or (method == "auto" and nodes <= EXACT_AUTO_NODES)
