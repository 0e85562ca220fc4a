"""The program generator: `make_program(seed) -> FuzzCase`, exactly reproducible from the seed.

A program is one of three families, drawn at random:
- "seq": a sequence model (embedding lookup by `table[ids]`, `jnp.take` or one-hot, or a dense
  input projection; 1-4 blocks from fuzz/structure.py's registry: attention, MLPs, GLUs, MoE,
  norms, control flow, scans over layers, ...; a head: LM loss, classifier, regression,
  segment pooling or raw features);
- "image": a conv net in NHWC or NCHW (fuzz/vision.py) with a classifier head;
- "data": input-pipeline / metrics code (fuzz/dataops.py).
A "seq" or "image" program is a forward pass or, a third of the time, a training step:
`jax.value_and_grad` of its loss and an optax update (sgd, momentum, adam, adamw,
clip_by_global_norm + adam, apply_if_finite, MultiSteps, adafactor) or a hand-written SGD.

The program is source text (exec'd, registered with linecache so tracebacks and shardsat's
source locations show its lines) calling fuzz/blocks.py; `FuzzCase.describe()` prints it with
its arguments and the saturate_and_extract call, which is the reproducer.
"""

from __future__ import annotations

import linecache
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fuzz import dataops, vision
from fuzz.builder import BATCH, BATCH_P, MODEL, MODEL_P, SEQ, VOCAB, ArgSpec, Builder, Tensor
from fuzz.options import CaseOptions, draw_options
from fuzz.resolve import resolve
from fuzz.structure import emit_block

HEADER = '''import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from fuzz import blocks as B

EVENTS = []


def record(tag, value):
    """Host callback: the campaign counts how often it ran (under jax.jit and under the plan)."""
    EVENTS.append(tag)
'''

OPTIMIZERS = {
    "sgd": "optax.sgd(0.01)",
    "momentum": "optax.sgd(0.01, momentum=0.9)",
    # adaptive optimizers take tiny steps: their first step is lr * sign(grad), so a gradient
    # that is zero up to rounding (a bias before a norm) would flip by 2 lr between any two
    # correct evaluations; their moments (outputs too) carry the gradients' numbers instead
    "adam": "optax.adam(1e-5)",
    "adamw": "optax.adamw(1e-5, weight_decay=0.01)",
    "clip_adam": "optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-5))",
    "apply_if_finite": "optax.apply_if_finite(optax.adam(1e-5), max_consecutive_errors=3)",
    "multisteps": "optax.MultiSteps(optax.adam(1e-5), every_k_schedule=2)",
    "adafactor": "optax.adafactor(1e-5)",
    "plain": "",
}


def _optimizer(name: str, dtype: str) -> str:
    """The optimizer's source. With half-precision parameters, Adam's eps of 1e-8 is 0: a
    squared gradient that underflows in one evaluation and not in another (XLA fuses and rounds
    differently with different shardings, as jax.jit does across versions) gives an infinite
    update in one only. Engineers training in half precision raise eps; so does the campaign."""
    src = OPTIMIZERS[name]
    if dtype != "float32":
        src = src.replace("optax.adam(1e-5)", "optax.adam(1e-5, eps=1e-3)").replace(
            "optax.adamw(1e-5,", "optax.adamw(1e-5, eps=1e-3,")
    return src


@dataclass
class FuzzCase:
    """A generated program with its arguments and options. `invalid` says why the program is not
    a valid case (jax itself rejects it), when it is not."""

    seed: int
    family: str
    train: bool
    source: str
    arg_names: tuple[str, ...]
    arg_specs: tuple[Any, ...]  # per positional argument a pytree of ArgSpec (None: opt_state)
    options: CaseOptions
    tags: tuple[str, ...]
    namespace: dict[str, Any]
    invalid: str | None = None
    placement: Any = None  # per positional argument a pytree of PartitionSpec (resolve.py)
    out_paths: list[str] = field(default_factory=list)

    @property
    def fn(self) -> Any:
        return self.namespace["program"]

    @property
    def events(self) -> list[Any]:
        return self.namespace["EVENTS"]

    def example_args(self) -> tuple[Any, ...]:
        """Fresh arrays (uncommitted) for the arguments, the same for every call."""
        from fuzz.resolve import build_args

        return build_args(self)

    def describe(self) -> str:
        from fuzz.resolve import describe

        return describe(self)


# ---- the sequence family --------------------------------------------------------------------


def seq_front(b: Builder) -> tuple[Tensor, str | None, int]:
    """The input of a sequence model: (h, embedding table expression or None, vocab)."""
    bsz, s, d = b.pick(BATCH, BATCH_P), b.pick(SEQ), b.pick(MODEL, MODEL_P)
    while not b.fits(bsz, s, 128) and s > 1:
        s //= 2
    kind = b.pick(["index", "take", "one_hot", "one_row", "dense"], [0.3, 0.2, 0.1, 0.1, 0.3])
    if kind == "dense":
        d_in = b.pick([1, 3, 8, 16])
        x = b.input("x", ArgSpec((bsz, s, d_in), b.dtype))
        p = b.group("proj", {"w": (d_in, d), "b": ArgSpec((d,), b.dtype, scale=0.1)})
        h, table, vocab = f"B.dense({x}, {p})", None, 0
        b.tag("dense-input")
    else:
        vocab = 1 if kind == "one_row" else b.pick([v for v in VOCAB if b.fits(bsz, s, v)])
        ids = b.input("ids", ArgSpec((bsz, s), "int32", "ids", high=vocab))
        table = b.param("embed", ArgSpec((vocab, d), b.dtype))
        fn = {"index": "B.embed", "take": "B.embed_take", "one_hot": "B.embed_one_hot", "one_row": "B.embed"}[kind]
        h = f"{fn}({table}, {ids})"
        b.tag(f"embed-{kind.replace('_', '-')}")
    if b.chance(0.4):
        pos = b.param("pos", ArgSpec((s + b.pick([0, 3]), d), b.dtype, scale=0.1))
        h += b.pick([f" + {pos}[:{s}]", f" + jnp.take({pos}, jnp.arange({s}), axis=0)", f" + {pos}[None, :{s}, :]"])
        b.tag("positional-embedding")
    name = b.fresh("h")
    b.line(f"{name} = {h}")
    return Tensor(name, (bsz, s, d), b.dtype), table, vocab


def _loss(b: Builder, logits: str, labels: str, mask_shape: tuple[int, ...] | None) -> str:
    kinds = ["B.cross_entropy", "B.cross_entropy_one_hot", "B.cross_entropy_optax"]
    if mask_shape is not None:
        kinds.append("masked")
    kind = b.pick(kinds)
    if kind == "masked":
        mask = b.input("loss_mask", ArgSpec(mask_shape, "bool", "mask"))  # type: ignore[arg-type]
        b.tag("masked-loss")
        return f"B.masked_cross_entropy({logits}, {labels}, {mask})"
    b.tag(kind.removeprefix("B.").replace("_", "-"))
    return f"{kind}({logits}, {labels})"


def _logit_outputs(b: Builder, logits: str, labels: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if b.chance(0.4):
        out["logits"] = logits
    if b.chance(0.3):
        pred, correct = b.fresh("pred"), b.fresh("correct")
        b.line(f"{pred}, {correct} = B.accuracy({logits}, {labels})")
        out.update({"pred": pred, "correct": correct})
        b.tag("int-bool-outputs")
    if b.chance(0.15):
        out["first_logit"] = f"{logits}[..., 0]"
    return out


def seq_head(b: Builder, h: Tensor, table: str | None, vocab: int) -> tuple[str | None, dict[str, str]]:
    """(loss expression or None, outputs): LM, classifier, regression, segments or raw."""
    bsz, s, d = h.shape
    kinds = ["lm", "classify", "regress", "segments"] + ([] if b.training else ["raw"])
    kind = b.pick(kinds, [0.4, 0.2, 0.15, 0.1, 0.15][: len(kinds)])
    b.tag(f"head-{kind}")
    if kind in ("lm", "classify"):
        if kind == "lm" and table is not None and b.chance(0.4):
            logits_expr, n_cls, lab_shape = f"{h.name} @ {table}.T", vocab, (bsz, s)
            b.tag("tied-embedding")
        elif kind == "lm":
            n_cls = b.pick([v for v in VOCAB if b.fits(bsz, s, v)])
            logits_expr, lab_shape = f"{h.name} @ {b.param('unembed', (d, n_cls))}", (bsz, s)
        else:
            n_cls = b.pick([1, 2, 3, 5, 10])
            pooled = b.pick([f"{h.name}.mean(axis=1)", f"{h.name}[:, 0]", f"{h.name}[:, -1]", f"{h.name}.max(axis=1)"])
            logits_expr, lab_shape = f"B.dense({pooled}, {b.group('cls', {'w': (d, n_cls), 'b': (n_cls,)})})", (bsz,)
        logits = b.fresh("logits")
        b.line(f"{logits} = {logits_expr}")
        labels = b.input("labels", ArgSpec(lab_shape, "int32", "ids", high=n_cls))
        return _loss(b, logits, labels, lab_shape), _logit_outputs(b, logits, labels)
    if kind == "regress":
        pred = b.fresh("pred")
        b.line(f"{pred} = {h.name} @ {b.param('head', (d, 1))}")
        target = b.input("target", ArgSpec((bsz, s, 1), b.dtype))
        loss = b.pick([f"jnp.mean(({pred} - {target}) ** 2)", f"optax.l2_loss({pred}, {target}).mean()",
                       f"optax.huber_loss({pred}, {target}).mean()"])
        return loss, {"prediction": pred} if b.chance(0.3) else {}
    if kind == "segments":
        k = b.pick([1, 2, 3, 5, 8])
        seg = b.input("segment_ids", ArgSpec((bsz, s), "int32", "ids", high=k))
        pooled = b.fresh("pooled")
        b.line(f"{pooled} = B.segment_pool({h.name}, {seg}, {k})")
        return f"jnp.mean(jnp.tanh({pooled}) ** 2)", {"segments": pooled}
    return None, {"hidden": h.name} | ({"hidden_first": f"{h.name}[..., 0]"} if b.chance(0.3) else {})


def seq_forward(b: Builder) -> tuple[str | None, dict[str, str]]:
    h, table, vocab = seq_front(b)
    for _ in range(b.randint(1, 4)):
        h = emit_block(b, h)
    return seq_head(b, h, table, vocab)


# ---- the image family -----------------------------------------------------------------------


def image_forward(b: Builder) -> tuple[str | None, dict[str, str]]:
    b.layout = b.pick(["NHWC", "NCHW"])
    n, hh = b.pick([0, 1, 2, 3, 4, 5, 8]), b.pick([1, 3, 4, 5, 7, 8, 13, 16])
    ww, c = (hh if b.chance(0.7) else b.pick([1, 3, 8, 16])), b.pick([1, 3, 4])
    x = Tensor(b.input("images", ArgSpec(vision.shaped(b, n, hh, ww, c), b.dtype)), vision.shaped(b, n, hh, ww, c),
               b.dtype)
    x = vision.conv(b, x)
    for _ in range(b.randint(1, 4)):
        x = vision.emit_image_block(b, x)
    n, hh, ww, c = vision.dims(b, x)
    if b.chance(0.6) or not b.fits(hh * ww * c, 10):
        feats = f"B.global_avg_pool({x.name}, layout={b.layout!r})"
        width = c
    else:
        feats, width = f"{x.name}.reshape({n}, {hh * ww * c})", hh * ww * c
        b.tag("flatten")
    n_cls = b.pick([1, 2, 5, 10])
    logits = b.fresh("logits")
    b.line(f"{logits} = B.dense({feats}, {b.group('cls', {'w': (width, n_cls), 'b': (n_cls,)})})")
    labels = b.input("labels", ArgSpec((n,), "int32", "ids", high=n_cls))
    outs = _logit_outputs(b, logits, labels)
    if not b.training and b.chance(0.3):
        outs["features"] = x.name
    return _loss(b, logits, labels, None), outs


# ---- assembly -------------------------------------------------------------------------------


def _return(b: Builder, entries: dict[str, str]) -> None:
    """The return statement: a dict, tuple, list, nested pytree, one value, None (the values go
    to a host callback instead) or values mixed with constants."""
    styles = ["dict", "tuple", "list", "single", "nested", "none", "constants"]
    style = b.pick(styles, [0.35, 0.15, 0.08, 0.12, 0.12, 0.08, 0.1]) if entries else "none"
    items = list(entries.items())
    b.tag(f"return-{style}")
    if style == "none":
        if items:
            b.line(f"jax.debug.callback(record, 'result', {items[0][1]})")
        b.line("return None")
    elif style == "dict":
        b.line("return {" + ", ".join(f"{k!r}: {v}" for k, v in items) + "}")
    elif style == "tuple":
        b.line("return " + ", ".join(v for _, v in items) + ("," if len(items) == 1 else ""))
    elif style == "list":
        b.line("return [" + ", ".join(v for _, v in items) + "]")
    elif style == "single":
        b.line(f"return {items[0][1]}")
    elif style == "nested":
        half = max(1, len(items) // 2)
        first = "{" + ", ".join(f"{k!r}: {v}" for k, v in items[:half]) + "}"
        b.line(f"return {{'metrics': {first}, 'rest': ({', '.join(v for _, v in items[half:])}{',' if items[half:] else ''})}}")
    else:
        const = b.pick(["3", "jnp.float32(0.5)", "jnp.zeros((2,), jnp.int32)", "True"])
        b.line("return {" + ", ".join(f"{k!r}: {v}" for k, v in items) + f", 'version': {const}}}")


def _forward(b: Builder, family: str) -> tuple[str | None, dict[str, str]]:
    if family == "seq":
        return seq_forward(b)
    if family == "image":
        return image_forward(b)
    return None, dataops.data_program(b)


def _train_step(b: Builder, family: str) -> tuple[list[str], list[str]]:
    """Lines of a training step (`loss_fn` nested in `program`); returns (header, leading args)."""
    opt = b.pick(list(OPTIMIZERS))
    b.tag(f"train-{opt}")
    b.line("def loss_fn(params):")
    b.indent += 1
    loss, _ = _forward(b, family)
    aux = dict(b.aux) if b.aux and b.chance(0.5) else {}
    b.line(f"return {loss}" + (", {" + ", ".join(f"{k!r}: {v}" for k, v in aux.items()) + "}" if aux else ""))
    b.indent -= 1
    grad = "jax.value_and_grad(loss_fn" + (", has_aux=True)" if aux else ")")
    b.line(("(loss, aux), grads" if aux else "loss, grads") + f" = {grad}(params)")
    outs = {"params": "new_params"}
    if opt == "plain":
        b.line("new_params = jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)")
        header, lead = [], ["params"]
    else:
        b.line("updates, new_opt_state = tx.update(grads, opt_state, params)")
        b.line("new_params = optax.apply_updates(params, updates)")
        outs["opt_state"] = "new_opt_state"
        header, lead = [f"tx = {_optimizer(opt, b.dtype)}"], ["params", "opt_state"]
    outs["loss"] = "loss"
    if aux:
        outs["aux"] = "aux"
    if b.chance(0.3):
        outs["grad_norm"] = "optax.tree.norm(grads)"
    if b.chance(0.5):
        b.line("return " + ", ".join(outs.values()))
    else:
        b.line("return {" + ", ".join(f"{k!r}: {v}" for k, v in outs.items()) + "}")
    return header, lead


def build(seed: int) -> tuple[Builder, str, bool, list[str], list[str]]:
    """Draw a program: (builder, family, train, module header lines, leading arguments)."""
    rng = np.random.default_rng([seed, 0])
    family = ["seq", "image", "data"][int(rng.choice(3, p=[0.6, 0.22, 0.18]))]
    dtype = ["float32", "bfloat16", "float16"][int(rng.choice(3, p=[0.8, 0.12, 0.08]))]
    b = Builder(rng, dtype=dtype, batch_style=["args", "dict", "tuple"][int(rng.choice(3, p=[0.5, 0.35, 0.15]))])
    b.tag(f"family-{family}")
    if dtype != "float32":
        b.tag(f"dtype-{dtype}")
    train = family != "data" and b.chance(0.35)
    if train:
        b.training = True
        header, lead = _train_step(b, family)
    else:
        loss, outs = _forward(b, family)
        entries = ({"loss": loss} if loss is not None and b.chance(0.8) else {}) | outs
        entries |= {k: v for k, v in b.aux.items() if b.chance(0.5)}
        _return(b, entries)
        header, lead = [], (["params"] if b.params else [])
    return b, family, train, header, lead


def make_program(seed: int) -> FuzzCase:
    """The fuzz case of `seed`: program, argument specs, options (resolved against its shapes)."""
    b, family, train, header, lead = build(seed)
    data = list(b.inputs) if b.batch_style == "args" else (["batch"] if b.inputs else [])
    key_kind = ("key" if b.chance(0.7) else "rawkey") if b.uses_key else None
    names = tuple(lead + data + (["key"] if key_kind else []))
    source = "\n".join([HEADER, *header, "", "", f"def program({', '.join(names)}):", *b.lines, ""])
    specs: list[Any] = []
    for name in names:
        if name == "params":
            specs.append(b.params)
        elif name == "opt_state":
            specs.append(None)
        elif name == "batch":
            specs.append(dict(b.inputs) if b.batch_style == "dict" else tuple(b.inputs.values()))
        elif name == "key":
            specs.append(ArgSpec((), key_kind, key_kind))  # type: ignore[arg-type]
        else:
            specs.append(b.inputs[name])
    options = draw_options(np.random.default_rng([seed, 1]), train=train, has_opt_state="opt_state" in names)
    case = FuzzCase(seed, family, train, source, names, tuple(specs), options, tuple(b.tags), _exec(seed, source))
    resolve(case, np.random.default_rng([seed, 2]))
    return case


def _exec(seed: int, source: str) -> dict[str, Any]:
    filename = f"<fuzz-program-{seed}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": f"fuzz_program_{seed}"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace
