"""Planning time and plan cost of two (or more) checkouts of shardsat side by side, interleaved case by case
(a loaded 2-core machine varies ~40% within minutes: a ratio measured in one run is what counts).

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/planning_time.py /tmp/before .            # experts + 24/96 layers
    .venv/bin/python benchmarks/planning_time.py /tmp/before . --no-layers  # no depth-scaling steps
    .venv/bin/python benchmarks/planning_time.py /tmp/before . --no-layers --only GPT --only conv
    .venv/bin/python benchmarks/planning_time.py /tmp/base /tmp/before .  # three checkouts: ratios to the first

`--only TEXT` (repeatable) keeps the cases whose name contains TEXT. The "same plan" column says
whether the last two checkouts chose the same production for every e-class (a refactoring's
check). With more than two checkouts, the ratios are to the first.

Every free plan of the experts benchmark (benchmarks/experts/, H100 profile) and the unrolled
24- and 96-layer GPT steps of benchmarks/scaling.py, planned by one persistent process per
checkout, taking turns at going first. Columns: wall seconds of saturate_and_extract
(tracing included) before and after, their ratio, predicted step time before and after and its
ratio, the plan's reported optimality gap (against the integer program's bound, else the
lower bound of extract/bound.py and extract/splitbound.py), and the search's note on a layout
family it started from. The wall time is of planning; reading the gap afterwards, which computes
the bound where planning left it pending (extract/result.py's Bound), is totalled apart.
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
        t = time.perf_counter()
        gap = plan.extraction.gap  # where the bound waits for its first read, computed here
        read = time.perf_counter() - t
        print(json.dumps({"case": name, "wall": wall, "read": read, "us": plan.cost.total_s * 1e6, "notes": notes,
                          "gap": gap,
                          "plan": hashlib.sha1(repr(chosen).encode()).hexdigest()}), flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(argv[1])
        return 0
    flags = {"--only"}
    roots = [a for k, a in enumerate(argv) if not a.startswith("--") and (k == 0 or argv[k - 1] not in flags)]
    only = [argv[k + 1] for k, a in enumerate(argv) if a == "--only"]
    if not roots or {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0 if roots or argv else 2
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", os.path.abspath(root)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for root in roots]
    headers = [json.loads(p.stdout.readline()) for p in procs]  # every worker's, read
    names = headers[0]["names"]
    keys = [str(i) for i in range(len(names))] + ([] if "--no-layers" in argv else ["L24", "L96"])
    keys = [k for k in keys if not only or any(o in (names[int(k)] if k.isdigit() else "GPT step") for o in only)]
    n = len(roots)
    cols = [f"s {c}" for c in range(n)] + [f"s {c}/0" for c in range(1, n)] + [f"us {c}" for c in range(n)] + \
        [f"us {c}/0" for c in range(1, n)] + [f"gap {c}" for c in range(n)] + [f"same plan {n - 1} as {n - 2}", "family"]
    print("| case | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * (len(cols) - 2) + "---|---|")
    total, read = [0.0] * n, [0.0] * n
    for i, key in enumerate(keys):
        res: list[dict] = [{} for _ in roots]
        for j in [(i + c) % n for c in range(n)]:  # who goes first rotates
            procs[j].stdin.write(key + "\n")
            procs[j].stdin.flush()
            res[j] = json.loads(procs[j].stdout.readline())
        for c in range(n):
            total[c] += res[c]["wall"]
            read[c] += res[c].get("read", 0.0)
        walls = [f"{r['wall']:.2f}" for r in res] + [f"{r['wall'] / max(res[0]['wall'], 1e-9):.2f}" for r in res[1:]]
        costs = [f"{r['us']:,.1f}" for r in res] + [f"{r['us'] / res[0]['us']:.3f}" for r in res[1:]]
        costs += ["-" if r.get("gap") is None else f"{r['gap']:.1%}" for r in res]
        same = "yes" if res[-1].get("plan") == res[-2].get("plan") else "no"
        print(f"| {res[0]['case']} | " + " | ".join(walls + costs) + f" | {same} | {'; '.join(res[-1]['notes'])} |",
              flush=True)
    ratios = [f"{t / total[0]:.2f}" for t in total[1:]]
    print("| **total** | " + " | ".join([f"{t:.1f}" for t in total] + ratios + [""] * (n + n - 1 + n + 2)) + " |")
    print("\nFirst read of the gap (the lower bound, computed then where planning leaves it pending), s in all: "
          + ", ".join(f"{r:.1f}" for r in read))
    for p in procs:
        p.stdin.close()
        p.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
