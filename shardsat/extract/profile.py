"""Device profiles: the rates the cost model turns work into seconds with.

`link_bytes_per_s` and `latency_s` may be one number or a dict per mesh axis name, since a mesh
axis inside a node (NVLink, ICI) and one across nodes (InfiniBand, DCN) differ by 10x or more.
Presets are public datasheet numbers (dense bf16 FLOP/s, HBM bandwidth, per-direction link
bandwidth per device), rounded; `DeviceProfile(...)` takes measured numbers instead, and
`DeviceProfile.calibrate(mesh)` measures them on the mesh's own devices (runtime/calibrate.py:
it runs jax collectives, so it lives with the runtime and is imported only when called). A
profile saves to and loads from JSON; a path is accepted wherever a profile is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checks import integer_problem, real_problem
from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from jax.sharding import Mesh

PROFILE_FORMAT = "shardsat.DeviceProfile/1"
PLATFORMS = ("cpu", "gpu", "tpu")
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
    # whose XLA combiners the cost model assumes ("cpu", "gpu", "tpu"); None: the mesh's platform,
    # where the plan compiles. Set it to price a CPU mesh as the GPU it stands in for (tests).
    combining: str | None = None
    # bytes per device a program may use: saturate_and_extract's default memory_limit (None: no
    # limit). GPU presets take JAX's default allocator pool, 75% of HBM
    # (XLA_PYTHON_CLIENT_MEM_FRACTION).
    memory_bytes: float | None = None
    # what calibrate() measured, for people (per-dtype FLOP/s, per-axis per-collective fits);
    # the cost model reads only the fields above
    measurements: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # every field is checked and the problems reported together; NaN and inf pass `v > 0`
        # style checks one way or the other, and a wrong type failed with a bare TypeError
        problems = [p for p in (
            real_problem("flops_per_s", self.flops_per_s),
            real_problem("hbm_bytes_per_s", self.hbm_bytes_per_s),
            _rate_problem("link_bytes_per_s", self.link_bytes_per_s, positive=True),
            _rate_problem("latency_s", self.latency_s, positive=False),
            None if isinstance(self.name, str) else f"name must be a string, got {self.name!r}",
            real_problem("combine_threshold_bytes", self.combine_threshold_bytes),
            integer_problem("combine_max", self.combine_max),
            None if self.combining in (None, *PLATFORMS) else
            f"combining must be None or one of {PLATFORMS}, got {self.combining!r}",
            None if self.memory_bytes is None else real_problem("memory_bytes", self.memory_bytes),
        ) if p]
        if problems:
            raise InvalidArgumentError(
                "DeviceProfile: " + "; ".join(problems) + ". Consider measured numbers, e.g. "
                "shardsat.DeviceProfile(flops_per_s=989e12, hbm_bytes_per_s=3.35e12, link_bytes_per_s=450e9, "
                "latency_s=5e-6), or a preset from shardsat.PRESETS."
            )

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

    # -- measuring and saving -----------------------------------------------------------------
    @classmethod
    def calibrate(cls, mesh: Mesh, *, quick: bool = False) -> DeviceProfile:
        """Measure a profile on `mesh`'s own devices: matmul FLOP/s (float32 and bfloat16: the
        faster is the profile's rate), HBM bandwidth (a large copy), and per mesh axis the
        all-reduce, all-gather and reduce-scatter times over several sizes, fitted to the cost
        model's alpha-beta form (latency + bytes moved / link bandwidth). Every process of a
        multi-host mesh must call it. quick=True: smaller sizes and fewer repeats (tests)."""
        from ..runtime.calibrate import calibrate

        return calibrate(mesh, quick=quick)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": PROFILE_FORMAT}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = dict(v) if isinstance(v, Mapping) else v
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "the profile") -> DeviceProfile:
        """A profile from to_dict()'s output; its values are checked like the constructor's."""
        if not isinstance(data, Mapping) or data.get("format") != PROFILE_FORMAT:
            raise InvalidArgumentError(
                f"{source} is not a saved shardsat.DeviceProfile (its \"format\" is "
                f"{data.get('format') if isinstance(data, Mapping) else type(data).__name__!r}, expected "
                f"{PROFILE_FORMAT!r}). Consider writing it with DeviceProfile.save(path) or "
                "`python -m shardsat calibrate --out PATH`.")
        known = {f.name for f in fields(cls)}
        missing = sorted({"flops_per_s", "hbm_bytes_per_s", "link_bytes_per_s", "latency_s"} - set(data))
        if missing:
            raise InvalidArgumentError(f"{source} lacks {', '.join(missing)}. Consider saving it again with "
                                       "DeviceProfile.save(path).")
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as JSON; `profile="path.json"` reads it back anywhere a profile is taken."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeviceProfile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise InvalidArgumentError(
                f"Cannot read device profile {str(path)!r}: {e.strerror or e}. Consider a preset name "
                f"({', '.join(sorted(PRESETS))}) or the path of a profile written by DeviceProfile.save().") from e
        except ValueError as e:
            raise InvalidArgumentError(f"Device profile {str(path)!r} is not valid JSON ({e}). Consider "
                                       "writing it again with DeviceProfile.save(path).") from e
        return cls.from_dict(data, source=f"Device profile {str(path)!r}")


def _rate_problem(label: str, rate: Any, *, positive: bool) -> str | None:
    """Why a rate (one number, or a dict of numbers per mesh axis name and '*') is not valid."""
    if not isinstance(rate, Mapping):
        return real_problem(label, rate, positive=positive)
    if not rate:
        return f"{label} is an empty dict; it needs an entry per mesh axis name or a default under '*'"
    for k, v in rate.items():
        if not isinstance(k, str):
            return f"{label} has key {k!r}; keys must be mesh axis names or '*'"
        bad = real_problem(f"{label}[{k!r}]", v, positive=positive)
        if bad:
            return bad
    return None


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


def is_profile_path(text: str) -> bool:
    """A profile argument names a file (not a preset): it ends in .json or contains a path separator."""
    return text.lower().endswith(".json") or os.sep in text or "/" in text


def get_profile(profile: DeviceProfile | str | None, platform: str = "gpu") -> DeviceProfile:
    """A preset by name, a profile as given, or (None) the preset for the mesh's platform."""
    if profile is None:
        return PRESETS[{"cpu": "cpu", "tpu": "tpu_v5e"}.get(platform, "h100")]
    if isinstance(profile, DeviceProfile):
        return profile
    if isinstance(profile, os.PathLike) or (isinstance(profile, str) and is_profile_path(profile)):
        return DeviceProfile.load(profile)
    if not isinstance(profile, str):
        raise InvalidArgumentError(
            f"profile must be a preset name, a shardsat.DeviceProfile or None, got {type(profile).__name__} "
            f"{profile!r}. Consider one of {sorted(PRESETS)} or a "
            "shardsat.DeviceProfile(flops_per_s=..., hbm_bytes_per_s=..., link_bytes_per_s=..., latency_s=...)."
        )
    key = profile.lower().replace("-", "_")
    if key in PRESETS:
        return PRESETS[key]
    raise InvalidArgumentError(
        f"Unknown device profile {profile!r}. Consider one of {sorted(PRESETS)}, the path of a saved profile "
        "(.json), or a shardsat.DeviceProfile(flops_per_s=..., hbm_bytes_per_s=..., link_bytes_per_s=..., "
        "latency_s=...)."
    )
