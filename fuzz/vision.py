"""Image-model blocks: convolutions (NHWC and NCHW, strided, dilated, depthwise, explicit and
reflect padding), batch norm, pooling with lax.reduce_window, resizing, layout switches.

The feature map's layout lives in `b.layout` ("NHWC" or "NCHW"); every block keeps track of the
spatial size so that VALID windows are only drawn where they fit.
"""

from __future__ import annotations

from fuzz.builder import ArgSpec, Builder, Tensor


def dims(b: Builder, x: Tensor) -> tuple[int, int, int, int]:
    """(n, h, w, c) of x in the builder's layout."""
    if b.layout == "NHWC":
        n, h, w, c = x.shape
    else:
        n, c, h, w = x.shape
    return n, h, w, c


def shaped(b: Builder, n: int, h: int, w: int, c: int) -> tuple[int, int, int, int]:
    return (n, h, w, c) if b.layout == "NHWC" else (n, c, h, w)


def kernel(b: Builder, k: int, c_in: int, c_out: int) -> tuple[int, int, int, int]:
    return (k, k, c_in, c_out) if b.layout == "NHWC" else (c_out, c_in, k, k)


def _out_size(size: int, k: int, stride: int, padding: str, dilation: int = 1) -> int:
    eff = (k - 1) * dilation + 1
    if padding == "VALID":
        return (size - eff) // stride + 1
    if padding == "PAD1":
        return (size + 2 - eff) // stride + 1
    return -(-size // stride)


def conv(b: Builder, x: Tensor) -> Tensor:
    n, h, w, c = dims(b, x)
    k = b.pick([1, 3])
    stride = b.pick([1, 1, 2])
    dilation = b.pick([1, 1, 2]) if k == 3 else 1
    eff = (k - 1) * dilation + 1
    pads = ["SAME", "SAME", "PAD1"] + (["VALID"] if min(h, w) >= eff else [])
    padding = b.pick(pads)
    c_out = b.pick([c, 4, 8, 16])
    oh, ow = _out_size(h, k, stride, padding, dilation), _out_size(w, k, stride, padding, dilation)
    if oh < 1 or ow < 1 or not b.fits(n, max(h, oh), max(w, ow), max(c, c_out)):
        return x
    wexpr = b.param("conv", ArgSpec(kernel(b, k, c, c_out), b.dtype, scale=(k * k * c) ** -0.5))
    pad = "((1, 1), (1, 1))" if padding == "PAD1" else repr(padding)
    call = (f"B.conv2d({x.name}, {wexpr}, layout={b.layout!r}, stride={stride}, padding={pad}"
            f"{f', dilation={dilation}' if dilation > 1 else ''})")
    b.tag(f"conv-{b.layout}" + ("-strided" if stride > 1 else "") + ("-dilated" if dilation > 1 else ""))
    out = b.fresh("y")
    shape = shaped(b, n, oh, ow, c_out)
    if shape == x.shape and b.chance(0.6):
        b.line(f"{out} = {x.name} + jax.nn.relu({call})")
        b.tag("conv-residual")
    else:
        b.line(f"{out} = jax.nn.relu({call})")
    return Tensor(out, shape, x.dtype)


def depthwise(b: Builder, x: Tensor) -> Tensor:
    c = dims(b, x)[3]
    wexpr = b.param("dw", ArgSpec(kernel(b, 3, 1, c), b.dtype, scale=1 / 3))
    out = b.fresh("y")
    b.line(f"{out} = B.conv2d({x.name}, {wexpr}, layout={b.layout!r}, groups={c})")
    b.tag("conv-depthwise")
    return Tensor(out, x.shape, x.dtype)


def reflect_conv(b: Builder, x: Tensor) -> Tensor:
    """jnp.pad(mode="reflect" | "symmetric" | "edge" | "wrap") then a VALID 3x3 conv: same size."""
    n, c = dims(b, x)[0], dims(b, x)[3]
    if n == 0:
        return x
    mode = b.pick(["reflect", "symmetric", "edge", "wrap"])
    spatial = "(0, 0), (1, 1), (1, 1), (0, 0)" if b.layout == "NHWC" else "(0, 0), (0, 0), (1, 1), (1, 1)"
    wexpr = b.param("conv", ArgSpec(kernel(b, 3, c, c), b.dtype, scale=(9 * c) ** -0.5))
    out = b.fresh("y")
    b.line(f"{out} = B.conv2d(jnp.pad({x.name}, [{spatial}], mode={mode!r}), {wexpr}, layout={b.layout!r}, "
           "padding='VALID')")
    b.tag(f"pad-{mode}-conv")
    return Tensor(out, x.shape, x.dtype)


def pool(b: Builder, x: Tensor) -> Tensor:
    n, h, w, c = dims(b, x)
    kind = b.pick(["max", "avg"])
    window = b.pick([2, 3])
    stride = b.pick([1, 2])
    padding = b.pick(["SAME"] + (["VALID"] * 2 if min(h, w) >= window else []))
    oh, ow = _out_size(h, window, stride, padding), _out_size(w, window, stride, padding)
    out = b.fresh("y")
    b.line(f"{out} = B.{kind}_pool({x.name}, {window}, {stride}, layout={b.layout!r}, padding={padding!r})")
    b.tag(f"{kind}-pool-reduce-window")
    return Tensor(out, shaped(b, n, oh, ow, c), x.dtype)


def batch_norm(b: Builder, x: Tensor) -> Tensor:
    c = dims(b, x)[3]
    p = b.group("bn", {"scale": ArgSpec((c,), b.dtype, "positive"), "bias": ArgSpec((c,), b.dtype, scale=0.1)})
    out = b.fresh("y")
    b.line(f"{out} = B.batch_norm({x.name}, {p}, channel_axis={-1 if b.layout == 'NHWC' else 1})")
    b.tag("batch-norm")
    return Tensor(out, x.shape, x.dtype)


def resize(b: Builder, x: Tensor) -> Tensor:
    """jax.image.resize up by 2 and back down (nearest or linear)."""
    n, h, w, c = dims(b, x)
    if not b.fits(n, 2 * h, 2 * w, c):
        return x
    method = b.pick(["nearest", "linear"])
    up = shaped(b, n, 2 * h, 2 * w, c)
    out = b.fresh("y")
    b.line(f"{out} = jax.image.resize(jax.image.resize({x.name}, {up}, {method!r}), {x.shape}, {method!r})")
    b.tag("image-resize")
    return Tensor(out, x.shape, x.dtype)


def switch_layout(b: Builder, x: Tensor) -> Tensor:
    """A transpose between NHWC and NCHW (code ported from PyTorch does this)."""
    n, h, w, c = dims(b, x)
    perm = "(0, 3, 1, 2)" if b.layout == "NHWC" else "(0, 2, 3, 1)"
    b.layout = "NCHW" if b.layout == "NHWC" else "NHWC"
    out = b.fresh("y")
    b.line(f"{out} = {x.name}.transpose{perm}")
    b.tag("layout-transpose")
    return Tensor(out, shaped(b, n, h, w, c), x.dtype)


def spatial_dropout(b: Builder, x: Tensor) -> Tensor:
    out = b.fresh("y")
    b.line(f"{out} = B.dropout({x.name}, {b.key()}, 0.2)")
    b.tag("dropout-random")
    return Tensor(out, x.shape, x.dtype)


IMAGE_BLOCKS = [(conv, 4.0), (depthwise, 1.0), (reflect_conv, 1.0), (pool, 2.0), (batch_norm, 1.5),
                (resize, 0.6), (switch_layout, 0.5), (spatial_dropout, 0.5)]


def emit_image_block(b: Builder, x: Tensor) -> Tensor:
    fns = [f for f, _ in IMAGE_BLOCKS]
    fn = b.pick(fns, [wt for _, wt in IMAGE_BLOCKS])
    return fn(b, x)
