"""Planning time and plan cost of two checkouts of shardsat side by side, interleaved case by case
(a loaded 2-core machine varies ~40% within minutes: a ratio measured in one run is what counts).

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/planning_time.py /tmp/before .            # experts + 24/96 layers
    .venv/bin/python benchmarks/planning_time.py /tmp/before . --no-layers  # no depth-scaling steps
    .venv/bin/python benchmarks/planning_time.py /tmp/before . --no-layers --only GPT --only conv

`--only TEXT` (repeatable) keeps the cases whose name contains TEXT. The "same plan" column says
whether the two checkouts chose the same production for every e-class (a refactoring's check).

Every free plan of the experts benchmark (benchmarks/experts/, H100 profile) and the unrolled
24- and 96-layer GPT steps of benchmarks/scaling.py, planned by one persistent process per
checkout, the two alternating which goes first. Columns: wall seconds of saturate_and_extract
(tracing included) before and after, their ratio, predicted step time before and after and its
ratio, and the search's note on a layout family it started from.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time


def worker(root: str) -> None:
    """Plan the cases named on stdin with the checkout at `root`; one JSON line each."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    for sub in ("examples", "benchmarks", "", os.path.join("benchmarks", "experts")):
        sys.path.insert(0, os.path.join(root, sub))
    import common
    import misc
    import mlp
    import scaling
    import transformer

    import shardsat

    assert os.path.realpath(shardsat.__file__).startswith(os.path.realpath(root)), shardsat.__file__
    cases = [(w, s) for w in mlp.workloads() + misc.workloads() + transformer.workloads() for s in w.meshes]
    names = [f"{w.name} {common.mesh_label(common.make_mesh(shape))}" for w, shape in cases]
    print(json.dumps({"names": names}), flush=True)
    for line in sys.stdin:
        key = line.strip()
        if key.startswith("L"):
            t = time.perf_counter()
            plan, name = scaling.plan_for(int(key[1:]), "unrolled"), f"unrolled GPT step, {key[1:]} layers"
        else:
            w, shape = cases[int(key)]
            mesh = common.make_mesh(shape)
            pr = w.build(mesh)
            t = time.perf_counter()
            plan = shardsat.saturate_and_extract(pr.fn, mesh, *pr.args, profile="h100", state_argnums=pr.state_argnums)
            name = f"{w.name} {common.mesh_label(mesh)}"
        wall = time.perf_counter() - t
        notes = [n for n in plan.extraction.notes if "family" in n]
        chosen = sorted((g, c.node, c.layout, c.demanded) for g, c in plan.extraction.choices.items())
        print(json.dumps({"case": name, "wall": wall, "us": plan.cost.total_s * 1e6, "notes": notes,
                          "plan": hashlib.sha1(repr(chosen).encode()).hexdigest()}), flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(argv[1])
        return 0
    before, after, *rest = argv
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", os.path.abspath(root)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for root in (before, after)]
    names, _ = (json.loads(p.stdout.readline())["names"] for p in procs)
    only = [rest[i + 1] for i, a in enumerate(rest) if a == "--only"]
    keys = [str(i) for i in range(len(names))] + ([] if "--no-layers" in rest else ["L24", "L96"])
    keys = [k for k in keys if not only or any(o in (names[int(k)] if k.isdigit() else "GPT step") for o in only)]
    print("| case | before s | after s | after/before | before us | after us | after/before | same plan | family |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    total = [0.0, 0.0]
    for i, key in enumerate(keys):
        res: list[dict] = [{}, {}]
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            procs[j].stdin.write(key + "\n")
            procs[j].stdin.flush()
            res[j] = json.loads(procs[j].stdout.readline())
        a, b = res
        total[0] += a["wall"]
        total[1] += b["wall"]
        print(f"| {a['case']} | {a['wall']:.2f} | {b['wall']:.2f} | {b['wall'] / max(a['wall'], 1e-9):.2f} | "
              f"{a['us']:,.1f} | {b['us']:,.1f} | {b['us'] / a['us']:.3f} | {'yes' if a.get('plan') == b.get('plan') else 'no'} | "
              f"{'; '.join(b['notes'])} |", flush=True)
    print(f"| **total** | {total[0]:.1f} | {total[1]:.1f} | {total[1] / total[0]:.2f} | | | | | |")
    for p in procs:
        p.stdin.close()
        p.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
