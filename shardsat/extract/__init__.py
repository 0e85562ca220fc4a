"""Stage 3: the cost model and extraction of one plan from the saturated e-graph."""

from .cost import CostModel
from .greedy import Extractor
from .profile import PRESETS, DeviceProfile, get_profile
from .result import Extraction, GroupChoice, ReshardStep

__all__ = [
    "PRESETS",
    "CostModel",
    "DeviceProfile",
    "Extraction",
    "Extractor",
    "GroupChoice",
    "ReshardStep",
    "get_profile",
]
