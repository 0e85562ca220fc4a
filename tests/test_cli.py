"""The command line end to end: `python -m shardsat plan` in a subprocess (as users run it, with no
XLA_FLAGS set, so the CLI must ask for the simulated devices itself), its table, JSON and HTML
outputs, a headless-Chromium render of the HTML, and the one-line usage errors."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardsat.cli import UsageError, parse_mesh, parse_state_argnums, with_device_count
from shardsat.runtime.html import group_key, shown_dims
from shardsat.runtime.jsonout import input_tensors

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cli_mlp.py"
TIMEOUT = 240
MESH = {"data": 2, "model": 4}
INPUTS = {
    "args[0]['layers'][0]['w']": [512, 2048],
    "args[0]['layers'][0]['b']": [2048],
    "args[0]['layers'][1]['w']": [2048, 512],
    "args[0]['layers'][1]['b']": [512],
    "args[1]": [64, 512],
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "shardsat", *args], cwd=cwd, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the CLI ran past {TIMEOUT} s:\n{err[-3000:]}")
    return proc.returncode, out, err


# -- the run everything else looks at ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One planning run (the slow part) plus the error cases, started together to share the wait."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "no_args.py").write_text("def f(x):\n    return x\n")
    errors = {  # through the real entry point; the other usage errors are checked in process
        "bad mesh": (["plan", f"{EXAMPLE}:mlp", "--mesh", "data:2,model"], "--mesh"),
        "no example_args": (["plan", f"{tmp / 'no_args.py'}:f", "--mesh", "data=2"], "example_args"),
        # checked before XLA's flags are set: past int32 the flag parser aborted the process
        "huge mesh": (["plan", f"{EXAMPLE}:mlp", "--mesh", "data=99999999999"], "simulates at most 4096"),
    }
    plan_args = ["plan", f"{EXAMPLE}:mlp", "--mesh", "data=2,model=4", "--profile", "h100",
                 "--json", str(tmp / "plan.json"), "--html", str(tmp / "plan.html"), "--plain"]
    main = _start(plan_args, tmp)
    procs = {name: (_start(args, tmp), expect) for name, (args, expect) in errors.items()}
    results = {name: (*_finish(p), expect) for name, (p, expect) in procs.items()}
    rc, out, err = _finish(main)
    assert rc == 0, f"the CLI failed (exit {rc}):\n{err[-3000:]}"
    return {"tmp": tmp, "stdout": out, "stderr": err, "errors": results}


def test_table_prints(cli_run: dict[str, Any]) -> None:
    out = cli_run["stdout"]
    assert "Plan for `mlp` on mesh (data=2, model=4), profile h100" in out
    for path in INPUTS:
        assert path in out
    assert "P(" in out and "per device" in out
    assert "predicted step" in out and "Collectives" in out
    assert "wrote " in out


def test_json_has_specs_per_pytree_path(cli_run: dict[str, Any]) -> None:
    data = json.loads((cli_run["tmp"] / "plan.json").read_text())
    assert data["mesh"]["axes"] == MESH
    assert data["mesh"]["devices"] == 8  # the CLI asked XLA for 8 host devices itself
    assert data["profile"] == "h100"
    pred = data["predicted"]
    assert pred["total_s"] > 0
    assert math.isclose(pred["total_s"], pred["compute_s"] + pred["communication_s"], rel_tol=1e-9)
    assert set(data["inputs"]) == set(INPUTS)
    for path, shape in INPUTS.items():
        entry = data["inputs"][path]
        assert entry["shape"] == shape and entry["dtype"] == "float32"
        spec = entry["spec"]
        assert len(spec) == len(shape)
        split = 1
        for e in spec:
            assert e is None or (isinstance(e, list) and e and set(e) <= set(MESH))
            split *= math.prod(MESH[a] for a in e or [])
        assert entry["bytes_per_device"] * split == entry["bytes_total"] == math.prod(shape) * 4
    (out,) = data["outputs"].values()
    assert out["shape"] == [64, 512] and len(out["spec"]) == 2
    for c in data["collectives"]:
        assert c["kind"] in {"all-gather", "all-reduce", "reduce-scatter", "all-to-all"}
        assert set(c["axes"]) <= set(MESH) and c["bytes"] > 0 and c["seconds"] > 0
    rep = data["report"]
    assert rep["e_classes"] > 0 and rep["e_nodes"] >= rep["e_classes"] and rep["iterations"] >= 1
    assert rep["stop_reason"] == "saturated" and rep["times"]["total_s"] > 0
    assert data["memory"]["total"] >= data["memory"]["arguments"] > 0


def test_html_is_self_contained(cli_run: dict[str, Any]) -> None:
    page = (cli_run["tmp"] / "plan.html").read_text()
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "<link" not in page and " src=" not in page and "url(" not in page
    assert page.replace('xmlns="http://www.w3.org/2000/svg"', "").count("http") == 0
    # groups by layer, one device grid per tensor (8 devices each) and the cost chart
    assert "args[0][&#x27;layers&#x27;][0]" in page and "args[0][&#x27;layers&#x27;][1]" in page
    assert page.count("<svg") >= len(INPUTS) + 2
    assert page.count("<title>device ") >= 8 * len(INPUTS)
    assert "Predicted time per step" in page


def _cli_mlp() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_cli_mlp_for_tests", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_json_loads_as_a_saved_plan(cli_run: dict[str, Any]) -> None:
    """The --json file is a saved plan: shardsat.load_plan rebuilds it here (another process)."""
    import jax

    import shardsat
    from shardsat.testing import check_plan

    mod = _cli_mlp()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    plan = shardsat.load_plan(cli_run["tmp"] / "plan.json", mod.mlp, mesh, *mod.example_args())
    data = json.loads((cli_run["tmp"] / "plan.json").read_text())
    assert plan.profile.name == "h100" and plan.cost.total_s == pytest.approx(data["predicted"]["total_s"], rel=1e-12)
    assert {p: t["spec"] for p, t in data["inputs"].items()} == {t.path: t.spec(plan.axes) for t in input_tensors(plan)}
    keys = jax.random.split(jax.random.key(0), 5)
    args = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(mod.example_args()),
        [jax.random.normal(k, s.shape) for k, s in zip(keys, jax.tree_util.tree_leaves(mod.example_args()), strict=True)])
    check_plan(plan, *args, reference=mod.mlp)


# Debian's headless-only build first (what .ci/run installs), then full browsers
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _chromium() -> str | None:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return next((str(p) for p in (Path("/usr/bin") / n for n in BROWSERS) if p.exists()), None)


def decode_png(data: bytes) -> np.ndarray:
    """8-bit, non-interlaced PNG (what Chromium writes) to an (h, w, channels) array, by hand:
    the test should not need Pillow."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    assert header is not None
    w, h, depth, colour, _, _, interlace = header
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(colour)
    assert depth == 8 and channels is not None and interlace == 0, f"unsupported PNG {header}"
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, 1 + w * channels)
    img = np.zeros((h, w * channels), np.uint8)
    prev = np.zeros(w * channels, np.uint8)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:]
        if f == 0:
            row = line
        elif f == 1:  # sub: a running sum per channel (uint8 arithmetic wraps mod 256)
            row = np.cumsum(line.reshape(w, channels), axis=0, dtype=np.uint8).reshape(-1)
        elif f == 2:  # up
            row = line + prev
        else:  # average or Paeth: sequential along the row
            row = np.frombuffer(_unfilter_row(int(f), line.tobytes(), prev.tobytes(), channels), np.uint8)
        img[y] = row
        prev = img[y]
    return img.reshape(h, w, channels)


def _unfilter_row(f: int, line: bytes, prev: bytes, bpp: int) -> bytearray:
    out = bytearray(line)
    for x in range(len(out)):
        a = out[x - bpp] if x >= bpp else 0
        b = prev[x]
        if f == 3:
            out[x] = (out[x] + ((a + b) >> 1)) & 255
            continue
        c = prev[x - bpp] if x >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        out[x] = (out[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    return out


def test_html_renders_in_headless_chromium(cli_run: dict[str, Any]) -> None:
    browser = _chromium()
    if browser is None:
        # CI installs it (.ci/run) and says so: there a missing browser is a failure, not a skip
        if os.environ.get("SHARDSAT_REQUIRE_BROWSER"):
            pytest.fail("SHARDSAT_REQUIRE_BROWSER is set but no Chromium was found (.ci/run installs "
                        "chromium-headless-shell with apt-get)")
        pytest.skip("no chromium found (apt-get install -y chromium-headless-shell) to render the HTML report")
    tmp = cli_run["tmp"]
    shot = tmp / "plan.png"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'chromium'}",
           f"--screenshot={shot}", "--window-size=1200,900", (tmp / "plan.html").as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.exists(), f"chromium wrote no screenshot (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
    img = decode_png(shot.read_bytes())
    assert img.shape[:2] == (900, 1200)
    pixels = img[..., :3].reshape(-1, 3)
    packed = pixels[:, 0].astype(np.uint32) << 16 | pixels[:, 1].astype(np.uint32) << 8 | pixels[:, 2]
    colours, counts = np.unique(packed, return_counts=True)
    assert len(colours) >= 16, f"only {len(colours)} colours: a blank page?"
    assert counts.max() < 0.97 * len(pixels), "the page is almost one colour"
    # the shard colours of the device grids (saturated hues), not only text anti-aliasing
    sat = pixels.max(axis=1).astype(int) - pixels.min(axis=1).astype(int)
    assert (sat > 80).sum() > 500


# -- usage errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["bad mesh", "no example_args", "huge mesh"])
def test_usage_errors_exit_2_in_one_line(cli_run: dict[str, Any], case: str) -> None:
    rc, out, err, expect = cli_run["errors"][case]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, f"{case}: exit {rc}\n{err}"
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("shardsat: error:") and expect in lines[0], lines[0]
    assert out == ""


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """cli.main() in this process sets device flags and imports files: undo it afterwards."""
    import jax

    for var in ("XLA_FLAGS", "JAX_PLATFORMS"):
        if var in os.environ:
            monkeypatch.setenv(var, os.environ[var])
        else:
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    platforms = jax.config.jax_platforms
    yield
    jax.config.update("jax_platforms", platforms)
    for name in [m for m in sys.modules if m.startswith("_shardsat_target_")]:
        del sys.modules[name]


USAGE_ERRORS = {
    "bad path": (["plan", "does/not/exist.py:mlp", "--mesh", "data=2"], "no such file"),
    "no colon": (["plan", str(EXAMPLE), "--mesh", "data=2"], "FILE.py:FUNCTION"),
    "missing function": (["plan", f"{EXAMPLE}:nope", "--mesh", "data=2"], "no function 'nope'"),
    "import error": (["plan", "{tmp}/raises.py:f", "--mesh", "data=2"], "ModuleNotFoundError"),
    "syntax error": (["plan", "{tmp}/syntax.py:f", "--mesh", "data=2"], "SyntaxError"),
    "not a tuple": (["plan", "{tmp}/bad_args.py:f", "--mesh", "data=2"], "must return a tuple"),
    "bad profile": (["plan", f"{EXAMPLE}:mlp", "--mesh", "data=2", "--profile", "abacus"], "--profile"),
    "mesh too big": (["plan", f"{EXAMPLE}:mlp", "--mesh", "data=64,model=64"], "needs 4096 devices"),
    "bad state_argnums": (["plan", f"{EXAMPLE}:mlp", "--mesh", "data=2", "--state-argnums", "a"], "state-argnums"),
    "no target": (["plan", "--mesh", "data=2"], "FILE.py:FUNCTION"),
    "bad fallback": (["plan", f"{EXAMPLE}:mlp", "--mesh", "data=2", "--fallback", "x"], "--fallback"),
    "missing profile file": (["plan", f"{EXAMPLE}:mlp", "--mesh", "data=2", "--profile", "{tmp}/none.json"],
                             "bad --profile: Cannot read device profile"),
    "calibrate bad mesh": (["calibrate", "--mesh", "data:2", "--out", "{tmp}/p.json"], "--mesh"),
    "calibrate no out": (["calibrate", "--mesh", "data=2"], "--out"),
    "function fails": (["plan", "{tmp}/bad_fn.py:f", "--mesh", "data=2"], "f(float32[8, 4]) in"),
    # a helper's CLI hunt: a traceback after planning, or after labelling for minutes, or numpy's
    # "load it unsafely" advice
    "json to no folder": (["plan", f"{EXAMPLE}:mlp", "--mesh", "data=2", "--json", "{tmp}/no/p.json"],
                          "--json {tmp}/no/p.json: no folder"),
    "html to a folder": (["plan", f"{EXAMPLE}:mlp", "--mesh", "data=2", "--html", "{tmp}"], "is a folder"),
    "train to no folder": (["priors", "train", "--out", "{tmp}/no/w.npz"], "--out {tmp}/no/w.npz: no folder"),
    "train no cases": (["priors", "train", "--out", "{tmp}/w.npz", "--cases", "0"], "--cases must be at least 1"),
    "eval missing weights": (["priors", "eval", "--priors", "{tmp}/none.npz"], "is not a prior's weights file"),
    "eval not weights": (["priors", "eval", "--priors", "{tmp}/bad_args.py"], "(not an .npz archive)"),
}


@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_usage_errors_in_process(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 isolated: None) -> None:
    from shardsat.cli import main

    (tmp_path / "raises.py").write_text("import missing_module_for_shardsat_test\n")
    (tmp_path / "syntax.py").write_text("def f(x:\n")
    (tmp_path / "bad_args.py").write_text("def f(x):\n    return x\n\ndef example_args():\n    return {'x': 1}\n")
    (tmp_path / "bad_fn.py").write_text("import jax, jax.numpy as jnp\n\ndef f(x):\n    return x @ jnp.ones((3, 3))\n\n"
                                        "def example_args():\n    return (jax.ShapeDtypeStruct((8, 4), jnp.float32),)\n")
    args, expect = USAGE_ERRORS[case]
    try:
        rc = main([a.format(tmp=tmp_path) for a in args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert rc == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("shardsat: error:"), captured.err
    assert expect.format(tmp=tmp_path) in lines[0], captured.err
    assert captured.out == ""


# -- pieces, in process --------------------------------------------------------------------------------
def test_parse_mesh() -> None:
    assert parse_mesh("data=2,model=4") == (("data", "model"), (2, 4))
    assert parse_mesh(" x = 8 ") == (("x",), (8,))
    for bad in ("data2", "data=2,,model=4", "data=2,data=4", "data=0", "2=data", ""):
        with pytest.raises(UsageError):
            parse_mesh(bad)


def test_state_argnums_and_device_flags() -> None:
    assert parse_state_argnums("0,1") == (0, 1)
    assert parse_state_argnums("auto") == "auto"
    assert parse_state_argnums(None) is None
    with pytest.raises(UsageError):
        parse_state_argnums("x")
    flag = "--xla_force_host_platform_device_count"
    assert with_device_count("", 8) == f"{flag}=8"
    assert with_device_count(f"--foo {flag}=2 --bar", 8) == f"--foo {flag}=8 --bar"
    assert with_device_count(f"{flag}=16", 8) == f"{flag}=16"


def test_grouping_and_shown_dims() -> None:
    assert group_key("args[0]['layers'][1]['ln1']['scale']") == "args[0]['layers'][1]"
    assert group_key("args[0]['w1']") == "args[0]"
    assert group_key("args[1]") == "args[1]"
    assert group_key("args[0]['params']['Dense_0']['kernel']") == "args[0]['params']['Dense_0']"
    assert group_key("args[0][1][0].mu['layers'][0]['wq']") == "args[0][1][0].mu['layers'][0]"
    assert shown_dims(()) == (None, None)
    assert shown_dims((7,)) == (None, 0)
    assert shown_dims((256, 4, 64)) == (0, 2)
    assert shown_dims((4, 64, 256)) == (1, 2)


def test_plan_with_a_saved_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str], isolated: None) -> None:
    import shardsat
    from shardsat.cli import main

    prof = shardsat.DeviceProfile(2e13, 1e12, {"data": 5e9, "model": 5e10}, 1e-5, name="measured-here")
    prof.save(tmp_path / "prof.json")
    out = tmp_path / "plan.json"
    assert main(["plan", f"{EXAMPLE}:mlp", "--mesh", "data=2,model=4", "--profile", str(tmp_path / "prof.json"),
                 "--json", str(out), "--plain"]) == 0
    assert "profile measured-here" in capsys.readouterr().out
    assert json.loads(out.read_text())["record"]["profile"]["link_bytes_per_s"] == {"data": 5e9, "model": 5e10}


def test_rich_table_when_installed(capsys: pytest.CaptureFixture[str]) -> None:
    """`rich` is optional: when it is importable the CLI prints its tables instead of explain()."""
    pytest.importorskip("rich")
    import importlib.util

    import jax

    import shardsat
    from shardsat.cli import print_plan

    spec = importlib.util.spec_from_file_location("_cli_mlp_for_rich", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    plan = shardsat.saturate_and_extract(mod.mlp, jax.make_mesh((2, 4), ("data", "model")), *mod.example_args(),
                                         profile="h100")
    print_plan(plan)
    out = capsys.readouterr().out
    for path in INPUTS:
        assert path in out
    assert "PartitionSpec" in out and "predicted step" in out
