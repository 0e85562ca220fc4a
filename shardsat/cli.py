"""The command line: plan a function defined in a Python file without writing a driver script.

    python -m shardsat plan path/to/model.py:fn --mesh data=2,model=4 [--profile h100|FILE.json]
        [--json plan.json] [--html plan.html] [--fallback replicate|error] [--state-argnums 0]
        [--devices cpu|default] [--plain]
    python -m shardsat calibrate --mesh data=2,model=4 --out profile.json [--devices default|cpu]

The file defines `fn` and `example_args()`, which returns the tuple of `fn`'s positional arguments
(arrays or `jax.ShapeDtypeStruct`s). Planning needs only shapes, so by default it runs on simulated
CPU devices: the CLI asks XLA for as many host devices as the mesh has before JAX creates its
backends. Usage errors print one line and exit with 2; a planning failure prints shardsat's
message and exits with 1. `calibrate` measures a device profile on the mesh's devices (by default
the default backend's; simulated CPU devices where it has too few) and writes it as JSON, which
`plan --profile FILE.json` and `saturate_and_extract(profile="FILE.json")` read.

jax is imported lazily (inside functions) so that the device flags can still take effect when
this module is the first to be imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from .runtime.plan import Plan

EXIT_USAGE = 2
EXIT_PLAN_FAILED = 1
DEVICE_FLAG = "--xla_force_host_platform_device_count"
DEFAULT_PROFILE = "h100"
# XLA creates every simulated host device up front: 4096 took 23 s and 0.6 GB here, 65536 over
# 2 minutes and 3 GB; a count past int32 aborts the process while XLA parses its flags
MAX_SIMULATED_DEVICES = 4096
_MESH_ITEM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([0-9]+)\s*$")


class UsageError(Exception):
    """A mistake in the command line or the target file: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse prints usage plus a message; the CLI promises one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"shardsat: error: {message} (see `python -m shardsat {self._cmd()}--help`)\n")
        raise SystemExit(EXIT_USAGE)

    def _cmd(self) -> str:
        for cmd in ("plan", "calibrate"):
            if self.prog.endswith(f" {cmd}"):
                return f"{cmd} "
        return ""


# -- parsing ---------------------------------------------------------------------------------------
def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """'data=2,model=4' -> (('data', 'model'), (2, 4)); order is kept (it is the mesh's order)."""
    names: list[str] = []
    sizes: list[int] = []
    for item in text.split(","):
        m = _MESH_ITEM.match(item)
        if m is None:
            raise UsageError(
                f"bad --mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...], e.g. --mesh data=2,model=4"
            )
        name, size = m.group(1), int(m.group(2))
        if size < 1:
            raise UsageError(f"bad --mesh {text!r}: axis {name!r} has size {size}; sizes must be at least 1")
        if name in names:
            raise UsageError(f"bad --mesh {text!r}: axis {name!r} appears twice")
        names.append(name)
        sizes.append(size)
    return tuple(names), tuple(sizes)


def parse_state_argnums(text: str | None) -> str | tuple[int, ...] | None:
    """'0' / '0,1' -> argument positions; 'auto' ties every argument that comes back."""
    if text is None:
        return None
    if text.strip() == "auto":
        return "auto"
    try:
        nums = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UsageError(f"bad --state-argnums {text!r}: expected 'auto' or positions such as 0 or 0,1") from None
    if not nums or any(n < 0 for n in nums):
        raise UsageError(f"bad --state-argnums {text!r}: expected 'auto' or non-negative positions such as 0,1")
    return nums


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m shardsat", description="Automatic sharding of JAX programs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser(
        "plan",
        help="plan how to shard a function defined in a Python file",
        description="Plan FILE.py:FUNCTION over a device mesh and print the chosen shardings. "
        "FILE.py must define example_args() returning a tuple of FUNCTION's positional arguments "
        "(arrays or jax.ShapeDtypeStructs).",
    )
    p.add_argument("target", metavar="FILE.py:FUNCTION", help="the file and the function in it to plan")
    p.add_argument("--mesh", required=True, metavar="NAME=SIZE,...",
                   help="mesh axes in order, e.g. data=2,model=4")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"device profile the costs are predicted for: a preset (default {DEFAULT_PROFILE}) or a "
                        "profile saved as JSON (python -m shardsat calibrate --out FILE.json)")
    p.add_argument("--json", type=Path, metavar="OUT.json", help="also write the plan as JSON")
    p.add_argument("--html", type=Path, metavar="OUT.html", help="also write a self-contained HTML report")
    p.add_argument("--fallback", choices=["replicate", "error"], default="replicate",
                   help="replicate (default): keep equations no sharding rule applies to replicated, "
                        "with a warning; error: fail instead")
    p.add_argument("--state-argnums", metavar="I[,J...]|auto",
                   help="positional arguments that are loop-carried state (returned with the same structure)")
    p.add_argument("--example-args", default="example_args", metavar="NAME",
                   help="the function in FILE.py returning the example arguments (default example_args)")
    p.add_argument("--devices", choices=["cpu", "default"], default="cpu",
                   help="plan on simulated CPU devices (default) or on the default JAX backend's devices")
    p.add_argument("--plain", action="store_true", help="plain-text output even when `rich` is installed")
    p.add_argument("--traceback", action="store_true", help="show tracebacks of errors raised by FILE.py")
    c = sub.add_parser(
        "calibrate",
        help="measure a device profile (FLOP/s, memory and per-axis link bandwidth and latency)",
        description="Run micro-benchmarks on the devices of a mesh and write the measured DeviceProfile as "
        "JSON, for --profile FILE.json and saturate_and_extract(profile='FILE.json').",
    )
    c.add_argument("--mesh", required=True, metavar="NAME=SIZE,...", help="mesh axes in order, e.g. data=2,model=4")
    c.add_argument("--out", type=Path, required=True, metavar="OUT.json", help="where to write the profile")
    c.add_argument("--devices", choices=["cpu", "default"], default="default",
                   help="the default JAX backend's devices (default; simulated CPU devices are added where it is "
                        "the CPU) or simulated CPU devices")
    c.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (seconds, rough numbers)")
    from .learn.command import add_parser as add_priors

    add_priors(sub)
    return parser


# -- devices ---------------------------------------------------------------------------------------
def with_device_count(flags: str, n: int) -> str:
    """XLA_FLAGS asking for at least `n` host devices (a larger count already there is kept)."""
    m = re.search(rf"{DEVICE_FLAG}=(\d+)", flags)
    if m is None:
        return f"{flags} {DEVICE_FLAG}={n}".strip()
    if int(m.group(1)) >= n:
        return flags
    return flags[: m.start()] + f"{DEVICE_FLAG}={n}" + flags[m.end():]


def configure_devices(n: int, devices: str) -> None:
    """Before JAX creates its backends: enough host devices, and (cpu) only the CPU platform.

    Importing jax does not create backends, so this works even after `import shardsat`; JAX reads
    JAX_PLATFORMS at import, hence the config update when it is already imported."""
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), n)
    if devices == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        if "jax" in sys.modules:
            import jax

            jax.config.update("jax_platforms", "cpu")


def make_mesh(names: tuple[str, ...], sizes: tuple[int, ...], devices: str) -> Any:
    import jax

    n = 1
    for s in sizes:
        n *= s
    have = jax.devices()
    if len(have) < n:
        hint = ("JAX's backends were created before the CLI could ask for more host devices"
                if devices == "cpu" else "consider --devices cpu to plan on simulated CPU devices"
                if n <= MAX_SIMULATED_DEVICES else "consider a smaller mesh with the same axes")
        raise UsageError(
            f"the mesh needs {n} devices but {have[0].platform} has {len(have)}; {hint}")
    return jax.make_mesh(sizes, names, devices=have[:n])


# -- the target file -------------------------------------------------------------------------------
@dataclass
class Target:
    path: Path
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _user_error(what: str, e: BaseException, show_traceback: bool) -> UsageError:
    if show_traceback:
        traceback.print_exception(e)
    return UsageError(f"{what} raised {_first_line(e)}" + ("" if show_traceback else " (--traceback shows where)"))


def load_target(spec: str, args_name: str = "example_args", show_traceback: bool = False) -> Target:
    """Import FILE.py (its folder on sys.path, for sibling imports) and find FUNCTION and the
    example arguments in it."""
    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name:
        raise UsageError(f"bad target {spec!r}: expected FILE.py:FUNCTION, e.g. examples/cli_mlp.py:mlp")
    path = Path(file)
    if not path.is_file():
        raise UsageError(f"no such file: {file}")
    module_name = "_shardsat_target_" + re.sub(r"\W", "_", path.stem)
    mod_spec = importlib.util.spec_from_file_location(module_name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise UsageError(f"cannot import {file}: not a Python source file")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.resolve().parent))
    try:
        mod_spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(module_name, None)
        raise UsageError(f"cannot import {file}: SyntaxError at line {e.lineno}: {e.msg}") from None
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise _user_error(f"importing {file}", e, show_traceback) from None
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            break
    if not callable(obj):
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module_name)
        raise UsageError(f"{file} defines no function {name!r}" + (f" (it defines: {', '.join(found)})" if found else ""))
    make_args = getattr(module, args_name, None)
    if not callable(make_args):
        raise UsageError(
            f"{file} defines no {args_name}(); add one returning the tuple of {name}'s positional "
            "arguments (arrays or jax.ShapeDtypeStruct)")
    try:
        args = make_args()
    except Exception as e:
        raise _user_error(f"{args_name}() in {file}", e, show_traceback) from None
    if isinstance(args, list):
        args = tuple(args)
    if not isinstance(args, tuple):
        raise UsageError(
            f"{args_name}() in {file} returned {type(args).__name__}; it must return a tuple of "
            f"{name}'s positional arguments, e.g. `return (params, x)` or `return (x,)`")
    return Target(path, name, obj, args)


def _types(args: tuple[Any, ...]) -> list[str]:
    """Example arguments as short types for messages: pytrees of arrays name their leaf count."""
    import jax

    out = []
    for a in args:
        leaves = jax.tree_util.tree_leaves(a)
        if len(leaves) == 1 and hasattr(leaves[0], "shape"):
            out.append(f"{getattr(leaves[0], 'dtype', '?')}{list(leaves[0].shape)}")
        else:
            out.append(f"<{type(a).__name__} of {len(leaves)} leaves>")
    return out


# -- printing --------------------------------------------------------------------------------------
def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def print_plan(plan: Plan, plain: bool = False) -> None:
    """The inputs, outputs and collectives as tables: `rich` when importable, else plan.explain()."""
    if plain or not _rich_available():
        print(plan.explain())
        return
    print_rich(plan)


def print_rich(plan: Plan) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from .runtime.explain import fmt_bytes, fmt_s
    from .runtime.jsonout import input_tensors, output_tensors

    # piped output has no terminal width: wide lines beat truncated pytree paths
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    prog, axes, cost = plan.program, plan.axes, plan.cost
    mesh = ", ".join(f"{n}={s}" for n, s in zip(axes.names, axes.sizes, strict=True))
    console.print(f"[bold]Plan for `{escape(prog.name)}`[/bold] on mesh ({escape(mesh)}), "
                  f"profile {escape(plan.profile.name)}")
    for title, tensors in (("Inputs", input_tensors(plan)), ("Outputs", output_tensors(plan))):
        table = Table(title=title, title_justify="left")
        for col, just in (("path", "left"), ("type", "left"), ("PartitionSpec", "left"), ("per device", "right")):
            table.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
        for t in tensors:
            # Text, not markup: pytree paths are full of square brackets
            table.add_row(Text(t.path), Text(t.type_str()), Text(t.describe(axes)), fmt_bytes(t.bytes_per_device))
        console.print(table)
    if cost.collectives:
        table = Table(title="Collectives", title_justify="left")
        for col, just in (("kind", "left"), ("axes", "left"), ("buffer", "right"), ("time", "right"),
                          ("tensor", "left"), ("layouts", "left")):
            table.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
        for c in cost.collectives:
            table.add_row(c.kind, Text(",".join(c.axes)), fmt_bytes(c.bytes), fmt_s(c.seconds), Text(c.value),
                          Text(f"{c.src} -> {c.dst}"))
        console.print(table)
    else:
        console.print("Collectives: none")
    if plan.report.fallbacks:
        console.print(Text("Replicated by fallback (no sharding rule): " + "; ".join(plan.report.fallbacks)))
    mem = cost.memory
    console.print(
        f"[bold]predicted step {fmt_s(cost.total_s)}[/bold] = compute {fmt_s(cost.compute_s)} + communication "
        f"{fmt_s(cost.communication_s)}; {len(cost.collectives)} collectives; arguments "
        f"{fmt_bytes(cost.argument_bytes)} per device"
        + (f"; memory {fmt_bytes(mem.total)} per device" if mem is not None else ""))
    console.print(Text(f"Search: {plan.report}"), soft_wrap=True)


# -- main ------------------------------------------------------------------------------------------
def _profile_arg(text: str) -> Any:
    """--profile: a preset's name, or a saved profile (checked now: a typo fails before planning)."""
    from .errors import InvalidArgumentError
    from .extract.profile import PRESETS, DeviceProfile, is_profile_path

    if is_profile_path(text):
        try:
            return DeviceProfile.load(text)
        except InvalidArgumentError as e:
            raise UsageError(f"bad --profile: {str(e).splitlines()[0]}") from None
    if text.lower().replace("-", "_") not in PRESETS:
        raise UsageError(f"unknown --profile {text!r}; presets: {', '.join(sorted(PRESETS))}, or a FILE.json "
                         "written by `python -m shardsat calibrate`")
    return text


def _devices_for(sizes: tuple[int, ...], mesh_text: str, devices: str) -> None:
    """Ask XLA for the simulated devices the mesh needs (before JAX creates its backends)."""
    n = 1
    for s in sizes:
        n *= s
    if n > MAX_SIMULATED_DEVICES and devices == "cpu":
        raise UsageError(
            f"--mesh {mesh_text} needs {n:,} devices; the CLI simulates at most {MAX_SIMULATED_DEVICES} CPU devices "
            "(XLA creates each one). Consider a smaller mesh with the same axes, or --devices default on a "
            "machine that has the devices")
    if n <= MAX_SIMULATED_DEVICES:  # (with --devices default, more than that is for real devices)
        configure_devices(n, devices)


def check_writable(path: Path | None, flag: str) -> None:
    """Refuse an output path whose folder does not exist or cannot be written, before the work
    that ends in writing it (a plan, a calibration, an hour of training)."""
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file path, e.g. {path / 'out'}")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: no folder {folder}; create it first or give another path")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: folder {folder} is not writable")


def run_calibrate(ns: argparse.Namespace) -> int:
    """Measure a profile on the mesh and write it; print it and what it took."""
    check_writable(ns.out, "--out")
    names, sizes = parse_mesh(ns.mesh)
    _devices_for(sizes, ns.mesh, ns.devices)
    mesh = make_mesh(names, sizes, ns.devices)
    from .extract.profile import DeviceProfile

    profile = DeviceProfile.calibrate(mesh, quick=ns.quick)
    try:
        profile.save(ns.out)
    except OSError as e:
        raise UsageError(f"cannot write {e.filename}: {e.strerror}") from None
    print(format_profile(profile))
    print(f"wrote {ns.out}")
    return 0


def format_profile(p: Any) -> str:
    """A measured profile as a few lines of text: rates, per-axis links, and what it took."""
    from .runtime.explain import fmt_s

    m = p.measurements or {}
    flops = m.get("matmul_flops_per_s", {})
    lines = [f"{p.name}: {m.get('devices', '?')} x {m.get('device_kind', '?')} devices, measured in "
             f"{m.get('seconds', 0.0):.1f} s",
             "  matmul " + ", ".join(f"{k} {v / 1e9:,.1f} GFLOP/s" for k, v in flops.items())
             + f" -> flops_per_s {p.flops_per_s:.3e}",
             f"  memory bandwidth {p.hbm_bytes_per_s / 1e9:,.2f} GB/s"]
    for axis, fits in m.get("collectives", {}).items():
        kinds = ", ".join(f"{k} {f['link_bytes_per_s'] / 1e9:,.2f} GB/s + {fmt_s(f['latency_s'])}"
                          for k, f in fits.items() if k != "all")
        lines.append(f"  axis {axis}: link {p.link(axis) / 1e9:,.2f} GB/s, latency {fmt_s(p.latency(axis))} ({kinds})")
    return "\n".join(lines)


def run_plan(ns: argparse.Namespace) -> int:
    check_writable(ns.json, "--json")
    check_writable(ns.html, "--html")
    names, sizes = parse_mesh(ns.mesh)
    state_argnums = parse_state_argnums(ns.state_argnums)
    profile = _profile_arg(ns.profile)
    _devices_for(sizes, ns.mesh, ns.devices)
    target = load_target(ns.target, ns.example_args, ns.traceback)
    mesh = make_mesh(names, sizes, ns.devices)

    from .api import saturate_and_extract
    from .errors import InvalidArgumentError, InvalidMeshError, ShardsatError, UnsupportedPrimitiveError

    try:
        plan = saturate_and_extract(target.fn, mesh, *target.args, profile=profile, fallback=ns.fallback,
                                    state_argnums=state_argnums)
    except (InvalidArgumentError, InvalidMeshError) as e:
        raise UsageError(str(e).strip().splitlines()[0]) from None
    except ShardsatError as e:
        hint = "\n(On the command line: leave out --fallback error.)" if isinstance(e, UnsupportedPrimitiveError) else ""
        sys.stderr.write(f"shardsat: planning {ns.target} failed: {e}{hint}\n")
        return EXIT_PLAN_FAILED
    except Exception as e:  # the function itself fails on its example arguments (tracing it)
        raise _user_error(f"{target.name}({', '.join(_types(target.args))}) in {target.path}", e, ns.traceback) from None
    print_plan(plan, plain=ns.plain)
    meta = {"target": ns.target}
    try:
        if ns.json is not None:
            from .runtime.jsonout import write_json

            write_json(plan, ns.json, **meta)
            print(f"wrote {ns.json}")
        if ns.html is not None:
            from .runtime.html import write_html

            write_html(plan, ns.html, **meta)
            print(f"wrote {ns.html}")
    except OSError as e:
        raise UsageError(f"cannot write {e.filename}: {e.strerror}") from None
    except InvalidArgumentError as e:  # write_json's own message for an unwritable path
        raise UsageError(str(e).strip().splitlines()[0]) from None
    return 0


def run_priors(ns: argparse.Namespace) -> int:
    """`priors train|eval` (shardsat/learn/command.py), on simulated CPU devices."""
    from .errors import InvalidArgumentError
    from .learn import command

    if ns.cases < 1:
        raise UsageError(f"--cases must be at least 1, got {ns.cases}")
    if ns.action == "train":
        check_writable(ns.out, "--out")
        check_writable(ns.examples, "--examples")
    configure_devices(command.DEVICES, "cpu")
    try:
        return command.run_train(ns) if ns.action == "train" else command.run_eval(ns)
    except InvalidArgumentError as e:  # a weights file that is missing or not a prior's
        raise UsageError(str(e).strip().splitlines()[0]) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        if ns.command == "priors":
            return run_priors(ns)
        return run_calibrate(ns) if ns.command == "calibrate" else run_plan(ns)
    except UsageError as e:
        sys.stderr.write(f"shardsat: error: {e}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("shardsat: interrupted\n")
        return 130
