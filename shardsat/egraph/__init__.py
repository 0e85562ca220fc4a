"""Stage 1: trace a function and build its layout e-graph in egglog."""

from .export import ExportedGraph, NodeKind
from .layout import Layout, LayoutTable, MeshAxes, Space, SpaceTable
from .program import Equation, Literal, Program, ValueInfo, trace
from .run import EGraphRun, SaturationReport

__all__ = [
    "EGraphRun",
    "Equation",
    "ExportedGraph",
    "Layout",
    "LayoutTable",
    "Literal",
    "MeshAxes",
    "NodeKind",
    "Program",
    "SaturationReport",
    "Space",
    "SpaceTable",
    "ValueInfo",
    "trace",
]
