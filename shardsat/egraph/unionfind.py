"""Union-find over dense integer ids, the smaller id the root of each class. The layout
narrowing joins values that must share a layout set and the Megatron analysis joins (value,
dimension) pairs; both are this structure, so it lives here once."""

from __future__ import annotations


class UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]  # path halving
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)
