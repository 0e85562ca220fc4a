"""Stage 2: rewrite rules. Factor signatures per primitive, resharding, and the generic egglog
rules that grow the layout e-graph from them."""

from .apply import KeyInfo, RuleTables, grow
from .registry import SIGNATURES, UNSUPPORTED, add_rule, register, rule_for
from .reshard import ReshardEdge
from .rule import Fuse, PrimitiveRule
from .signature import FactorSignature
from .strategies import Strategy

__all__ = [
    "SIGNATURES",
    "UNSUPPORTED",
    "FactorSignature",
    "Fuse",
    "KeyInfo",
    "PrimitiveRule",
    "ReshardEdge",
    "RuleTables",
    "Strategy",
    "add_rule",
    "grow",
    "register",
    "rule_for",
]
