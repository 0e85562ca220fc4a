"""Plan and run a GPT training step on a mesh that spans two processes ("hosts").

    .venv/bin/python examples/multihost.py               # starts both processes itself, here
    .venv/bin/python examples/multihost.py --model mlp   # a smaller model (what the tests run)

Each process owns 4 CPU devices and joins the other with `jax.distributed.initialize` (gloo
collectives over 127.0.0.1); together they form one 2x4 mesh whose `data` axis crosses the
processes and whose `model` axis stays inside one. Every process calls saturate_and_extract with
the same function and ShapeDtypeStructs (the plans are compared: a process that planned otherwise
raises a ShardsatError instead of hanging in mismatched collectives), builds the global state
from the same values with `jax.make_array_from_callback`, and hands in only its own half of the
batch with `jax.make_array_from_process_local_data`, as a data loader on each host would. Process
0 writes the loss and the new parameters, which must equal the step run in a single process.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
PROCESSES = 2
LOCAL_DEVICES = 4
STEPS = 2


def model_and_data(model: str = "gpt", seed: int = 0) -> tuple[Any, Any, list[Any], Any]:
    """(step, state, batches, abstract (state, batch)): a one-layer GPT ("gpt") or a two-layer
    MLP classifier ("mlp", small enough for the test suite) trained with AdamW. The values are
    made with numpy, the same in every process (eager jax ops would each compile)."""
    import jax

    sys.path.insert(0, str(HERE))
    from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step

    if model == "gpt":
        cfg = GPTConfig(layers=1, d_model=64, heads=4, mlp=256, vocab=256, seq=16, batch=8)
        opt, step = make_gpt_step(cfg)
        shapes, batch, high = gpt_params(cfg, abstract=True), gpt_batch(cfg, abstract=True), cfg.vocab
    else:
        opt, step = make_mlp_step()
        f32, i32 = np.float32, np.int32
        shapes = {"w1": jax.ShapeDtypeStruct((32, 128), f32), "b1": jax.ShapeDtypeStruct((128,), f32),
                  "w2": jax.ShapeDtypeStruct((128, 16), f32), "b2": jax.ShapeDtypeStruct((16,), f32)}
        batch = {"x": jax.ShapeDtypeStruct((16, 32), f32), "labels": jax.ShapeDtypeStruct((16,), i32)}
        high = 16
    rng = np.random.default_rng(seed)

    def init(path: Any, x: Any) -> np.ndarray:
        if len(x.shape) >= 2:
            return (rng.standard_normal(x.shape) / np.sqrt(x.shape[0])).astype(x.dtype)
        return np.full(x.shape, 1.0 if "scale" in jax.tree_util.keystr(path) else 0.0, x.dtype)

    params = jax.tree_util.tree_map_with_path(init, shapes)
    # AdamW starts from zero moments and a zero count: its state, without running opt.init
    opt_state = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(opt.init, params))

    def draw(x: Any) -> np.ndarray:
        if np.issubdtype(x.dtype, np.integer):
            return rng.integers(0, high, x.shape).astype(x.dtype)
        return rng.standard_normal(x.shape).astype(x.dtype)

    batches = [jax.tree_util.tree_map(draw, batch) for _ in range(STEPS)]
    return step, (params, opt_state), batches, (jax.eval_shape(lambda: (params, opt_state)), batch)


def make_mlp_step() -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp
    import optax

    opt = optax.adamw(1e-2, weight_decay=0.01)

    def loss_fn(params: Any, batch: Any) -> Any:
        h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
        logp = jax.nn.log_softmax(h @ params["w2"] + params["b2"])
        return -jnp.take_along_axis(logp, batch["labels"][:, None], axis=1).mean()

    def step(state: Any, batch: Any) -> Any:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return opt, step


def join(process_id: int, port: int) -> Any:
    """Join the job: LOCAL_DEVICES CPU devices here, gloo collectives with the other processes.
    Returns the global mesh: one row of devices per process, so `data` crosses processes."""
    import jax
    from jax.sharding import Mesh

    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # (the default on CPU)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=PROCESSES, process_id=process_id)
    # jax.devices() lists process 0's devices first
    return Mesh(np.array(jax.devices()).reshape(PROCESSES, LOCAL_DEVICES), ("data", "model"))


def train(mesh: Any, out: Path, model: str = "gpt", multihost: str = "check") -> Any:
    """Plan the step in every process, run it on global arrays; process 0 saves the result and
    the plan. Returns the plan."""
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardsat

    step, state, batches, (abstract_state, abstract_batch) = model_and_data(model)
    # the input pipeline decides the batch's layout: each process reads its own rows
    by_rows = jax.tree_util.tree_map(lambda _: P("data"), abstract_batch)
    plan = shardsat.saturate_and_extract(step, mesh, abstract_state, abstract_batch, state_argnums=(0,),
                                         in_shardings=(None, by_rows), multihost=multihost)
    g_state = jax.tree_util.tree_map(  # every process holds all values: each gives its devices' part
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]), state, plan.in_shardings[0])
    run = plan.jit()
    me, rows = jax.process_index(), jax.tree_util.tree_leaves(batches[0])[0].shape[0] // PROCESSES
    for b in batches:
        mine = jax.tree_util.tree_map(lambda v: v[me * rows:(me + 1) * rows], b)  # this host's rows only
        g_batch = jax.tree_util.tree_map(
            lambda v, x: jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), v, x.shape), mine, b)
        g_state, loss = run(g_state, g_batch)
    params = multihost_utils.process_allgather(g_state[0], tiled=True)  # global arrays, fetched whole
    loss = multihost_utils.process_allgather(loss, tiled=True)
    if me == 0:
        flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(out / "result.npz", loss=np.asarray(loss), **flat)
        plan.save(out / "plan.json")
    print(f"process {me}: loss {float(loss):.6f} after {STEPS} steps; {plan}", flush=True)
    return plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(out: Path, model: str = "gpt", multihost: str = "check", timeout: float = 300,
           script: str | Path = __file__) -> list[str]:
    """Start the processes (`script --worker I ...`), wait for them, and return their output;
    raise with their logs if one fails (or they run past `timeout` seconds)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    root = str(HERE.parent)  # this checkout's shardsat first
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    procs = [subprocess.Popen([sys.executable, str(script), "--worker", str(i), "--port", str(port), "--out", str(out),
                               "--model", model, "--multihost", multihost], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(PROCESSES)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] for p in procs]
        raise RuntimeError(f"the processes ran past {timeout} s:\n" + "\n".join(x[-3000:] for x in logs)) from None
    if any(p.returncode for p in procs):
        raise RuntimeError("a process failed:\n" + "\n".join(f"--- process {i} (exit {p.returncode}):\n{log[-4000:]}"
                                                             for i, (p, log) in enumerate(zip(procs, logs, strict=True))))
    return logs


def single_process(model: str = "gpt") -> tuple[float, dict[str, np.ndarray]]:
    """The same steps, unsharded, in this process: what the processes together must reproduce."""
    import jax

    step, state, batches, _ = model_and_data(model)
    run = jax.jit(step)
    for b in batches:
        state, loss = run(state, b)
    return float(loss), {jax.tree_util.keystr(p): np.asarray(x)
                         for p, x in jax.tree_util.tree_flatten_with_path(state[0])[0]}


def compare(out: Path, model: str) -> None:
    """The processes' loss and parameters (saved by process 0) equal the single-process step's."""
    got = np.load(out / "result.npz")
    loss, params = single_process(model)
    np.testing.assert_allclose(got["loss"], loss, rtol=1e-5)
    for path, want in params.items():
        np.testing.assert_allclose(got[path], want, rtol=1e-4, atol=1e-6, err_msg=path)


def main(model: str = "gpt", multihost: str = "check") -> None:
    with tempfile.TemporaryDirectory() as tmp:
        logs = launch(Path(tmp), model, multihost)
        compare(Path(tmp), model)
    print(logs[0].strip().splitlines()[-1])
    print(f"{PROCESSES} processes x {LOCAL_DEVICES} devices: loss and parameters equal the single-process step")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt", choices=["gpt", "mlp"])
    ap.add_argument("--multihost", default="check", choices=["check", "share"])
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker is None:
        main(ns.model, ns.multihost)
    else:
        train(join(ns.worker, ns.port), ns.out, ns.model, ns.multihost)
