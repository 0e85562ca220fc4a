"""Device profiles: the rates the cost model turns work into seconds with.

`link_bytes_per_s` and `latency_s` may be one number or a dict per mesh axis name, since a mesh
axis inside a node (NVLink, ICI) and one across nodes (InfiniBand, DCN) differ by 10x or more.
Presets are public datasheet numbers (dense bf16 FLOP/s, HBM bandwidth, per-direction link
bandwidth per device), rounded; `DeviceProfile(...)` takes measured numbers instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..errors import InvalidArgumentError

Rate = float | Mapping[str, float]


@dataclass(frozen=True)
class DeviceProfile:
    flops_per_s: float
    hbm_bytes_per_s: float
    link_bytes_per_s: Rate
    latency_s: Rate
    name: str = "custom"
    # XLA's collective combiners merge independent collectives up to this many bytes
    # (xla_gpu_*_combine_threshold_bytes); at most `combine_max` share one latency.
    combine_threshold_bytes: float = 32 * 2**20
    combine_max: int = 16
    # bytes per device a program may use: saturate_and_extract's default memory_limit (None: no
    # limit). GPU presets take JAX's default allocator pool, 75% of HBM
    # (XLA_PYTHON_CLIENT_MEM_FRACTION).
    memory_bytes: float | None = None

    def __post_init__(self) -> None:
        for label, v in (("flops_per_s", self.flops_per_s), ("hbm_bytes_per_s", self.hbm_bytes_per_s)):
            if not v > 0:
                raise InvalidArgumentError(f"DeviceProfile.{label} must be positive, got {v}.")
        for label, r in (("link_bytes_per_s", self.link_bytes_per_s), ("latency_s", self.latency_s)):
            vals = r.values() if isinstance(r, Mapping) else [r]
            if any(not (v >= 0) for v in vals):
                raise InvalidArgumentError(f"DeviceProfile.{label} must be non-negative, got {r}.")
        if self.memory_bytes is not None and not self.memory_bytes > 0:
            raise InvalidArgumentError(f"DeviceProfile.memory_bytes must be positive or None, got {self.memory_bytes}.")
        if isinstance(self.link_bytes_per_s, Mapping):
            if any(not v > 0 for v in self.link_bytes_per_s.values()):
                raise InvalidArgumentError("DeviceProfile.link_bytes_per_s must be positive.")
        elif not self.link_bytes_per_s > 0:
            raise InvalidArgumentError("DeviceProfile.link_bytes_per_s must be positive.")

    def link(self, axis: str) -> float:
        return _per_axis(self.link_bytes_per_s, axis, "link_bytes_per_s")

    def latency(self, axis: str) -> float:
        return _per_axis(self.latency_s, axis, "latency_s")

    def with_axes(self, **links: float) -> DeviceProfile:
        """A copy with per-axis link bandwidths, e.g. profile.with_axes(data=25e9)."""
        base = dict(self.link_bytes_per_s) if isinstance(self.link_bytes_per_s, Mapping) else {}
        if not isinstance(self.link_bytes_per_s, Mapping):
            base["*"] = self.link_bytes_per_s
        base.update(links)
        return replace(self, link_bytes_per_s=base)


def _per_axis(rate: Rate, axis: str, label: str) -> float:
    if not isinstance(rate, Mapping):
        return float(rate)
    if axis in rate:
        return float(rate[axis])
    if "*" in rate:
        return float(rate["*"])
    raise InvalidArgumentError(
        f"DeviceProfile.{label} has no entry for mesh axis {axis!r} (it has {sorted(rate)}). "
        f"Consider adding {axis!r} or a default under '*'."
    )


PRESETS: dict[str, DeviceProfile] = {
    # H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3 (80 GB), NVLink 4: 450 GB/s per direction.
    "h100": DeviceProfile(989e12, 3.35e12, 450e9, 5e-6, name="h100", memory_bytes=0.75 * 80e9),
    # H200 SXM: same compute as H100, 4.8 TB/s HBM3e (141 GB), NVLink 4.
    "h200": DeviceProfile(989e12, 4.8e12, 450e9, 5e-6, name="h200", memory_bytes=0.75 * 141e9),
    # TPU v5e: 197 TFLOP/s bf16, 819 GB/s HBM (16 GiB), ICI ~100 GB/s per axis direction (2D torus).
    "tpu_v5e": DeviceProfile(197e12, 819e9, 100e9, 2e-6, name="tpu_v5e", memory_bytes=16 * 2**30),
    # A host CPU "device": simulated devices share memory; numbers of a few-core server.
    "cpu": DeviceProfile(1e11, 2e10, 1e10, 2e-5, name="cpu"),
}


def get_profile(profile: DeviceProfile | str | None, platform: str = "gpu") -> DeviceProfile:
    """A preset by name, a profile as given, or (None) the preset for the mesh's platform."""
    if profile is None:
        return PRESETS[{"cpu": "cpu", "tpu": "tpu_v5e"}.get(platform, "h100")]
    if isinstance(profile, DeviceProfile):
        return profile
    key = str(profile).lower().replace("-", "_")
    if key in PRESETS:
        return PRESETS[key]
    raise InvalidArgumentError(
        f"Unknown device profile {profile!r}. Consider one of {sorted(PRESETS)} or a "
        "shardsat.DeviceProfile(flops_per_s=..., hbm_bytes_per_s=..., link_bytes_per_s=..., latency_s=...)."
    )
