"""Stage 2: rewrite rules. Factor signatures per primitive, resharding, and the generic egglog
rules that grow the layout e-graph from them."""

from .apply import KeyInfo, RuleTables, grow
from .registry import SIGNATURES, UNSUPPORTED, register
from .reshard import ReshardEdge
from .signature import FactorSignature
from .strategies import Strategy

__all__ = [
    "SIGNATURES",
    "UNSUPPORTED",
    "FactorSignature",
    "KeyInfo",
    "ReshardEdge",
    "RuleTables",
    "Strategy",
    "grow",
    "register",
]
