"""FP8 matmuls for the linear layers inside the blocks (`--fp8`): the forward matmul and both
backward ones (input and weight gradients) take FP8 operands, each scaled into FP8's range
by its own amax, and accumulate in float32; the scales are applied to the product, outside
the dot, so that XLA:GPU compiles it to an FP8 tensor-core GEMM (docs/fp8.md).

The recipes, as their references compute them (every scale from this step's values):
- tensorwise (torchao's `tensorwise`, Transformer Engine's current scaling): one scale per
  tensor; activations and weights in E4M3, gradients in E5M2.
- rowwise (torchao's `rowwise`): a scale per row along the contraction of each matmul (per
  token and per output feature forward; per token and per input feature for the input
  gradient; per feature over the tokens for the weight gradient), E4M3 throughout, scales
  rounded down to powers of two; each product rounded to bfloat16, as torchao does.
- blockwise (DeepSeek-V3's, Transformer Engine's `Float8BlockScaling`): activations and
  gradients per 1x128 tile along the contraction, weights per 128x128 block; E4M3
  throughout, power-of-two scales, the products of each 128-long piece of the contraction
  scaled and summed in float32.

A model names its linear layers' einsums with `linear` (models stay free of the choice); the
trainer sets the recipe around the model (`active`), none by default (a plain einsum).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BLOCK = 128  # blockwise: the tile's and the weight block's side
# torchao divides the format's largest value by the amax clamped to 1e-12, in float64, then
# rounds to float32; that is float32's own quotient for any amax from the smallest float32
# at or above 1e-12, and below it the quotient by 1e-12 (an all-zero tensor quantizes to 0).
_TINY = np.float32(1e-12) if float(np.float32(1e-12)) >= 1e-12 else np.nextafter(np.float32(1e-12), np.float32(1))


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    granularity: str  # "tensor", "row" or "block"
    grad_dtype: object  # the gradients' FP8 format (activations and weights are E4M3)
    power_of_two: bool  # scales rounded down to a power of two
    bf16_products: bool  # each matmul's product rounded to bfloat16 (torchao's rowwise)


RECIPES = {
    "tensorwise": Recipe("tensorwise", "tensor", E5M2, power_of_two=False, bf16_products=False),
    "rowwise": Recipe("rowwise", "row", E4M3, power_of_two=True, bf16_products=True),
    "blockwise": Recipe("blockwise", "block", E4M3, power_of_two=True, bf16_products=False),
}
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("fp8 recipe", default=None)


@contextlib.contextmanager
def active(name: str | None):
    """Run the models' linear layers in the FP8 recipe `name` (None: as they are)."""
    token = _ACTIVE.set(None if name is None else RECIPES[name])
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def linear(spec: str, x: jax.Array, w: jax.Array, parts: tuple[str, tuple[int, ...]] | None = None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` of an activation `x` and a weight `w`, in the active FP8
    recipe if any. `parts` (letter, sizes): `w` is several linear layers side by side along
    that letter (queries, keys and values; gate and up), each of which FP8 scales as its
    own, as the references do the separate layers."""
    recipe = _ACTIVE.get()
    if recipe is None:
        return jnp.einsum(spec, x, w)
    einsum = _Einsum.of(spec)
    if parts is None:
        return einsum.run(recipe, x, w)
    letter, sizes = parts
    pieces = jnp.split(w, np.cumsum(sizes)[:-1], axis=einsum.rhs.index(letter))
    return jnp.concatenate([einsum.run(recipe, x, piece) for piece in pieces], axis=einsum.out.index(letter))


@dataclasses.dataclass(frozen=True)
class _Einsum:
    """An einsum of two operands as a batched matmul (batch, M, K) x (batch, K, N): its
    letters in the order of each side of it."""

    lhs: str
    rhs: str
    out: str
    batch: str
    contracted: str
    lhs_free: str
    rhs_free: str

    @staticmethod
    @functools.lru_cache
    def of(spec: str) -> _Einsum:
        operands, out = spec.replace(" ", "").split("->")
        lhs, rhs = operands.split(",")
        batch = "".join(c for c in lhs if c in rhs and c in out)
        contracted = "".join(c for c in lhs if c in rhs and c not in out)
        return _Einsum(lhs, rhs, out, batch, contracted, "".join(c for c in lhs if c not in rhs),
                       "".join(c for c in rhs if c not in lhs))

    def run(self, recipe: Recipe, x: jax.Array, w: jax.Array) -> jax.Array:
        size = dict(zip(self.lhs, x.shape)) | dict(zip(self.rhs, w.shape))
        count = lambda letters: int(np.prod([size[c] for c in letters], dtype=np.int64))  # noqa: E731
        b, m, k, n = (count(s) for s in (self.batch, self.lhs_free, self.contracted, self.rhs_free))
        lhs = jnp.einsum(f"{self.lhs}->{self.batch}{self.lhs_free}{self.contracted}", x).reshape(b, m, k)
        rhs = jnp.einsum(f"{self.rhs}->{self.batch}{self.contracted}{self.rhs_free}", w).reshape(b, k, n)
        product = _matmul(recipe, lhs, rhs)
        laid = self.batch + self.lhs_free + self.rhs_free
        return jnp.einsum(f"{laid}->{self.out}", product.reshape([size[c] for c in laid]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(recipe: Recipe, x: jax.Array, w: jax.Array) -> jax.Array:
    """x (batch, M, K) @ w (batch, K, N) in FP8: the activation in tiles, the weight in blocks."""
    return scaled_dot(recipe, (x, E4M3, "tile"), (w, E4M3, "block"), x.dtype)


def _matmul_forward(recipe, x, w):
    # As torchao: the operands are kept in their own precision and cast again backward.
    return _matmul(recipe, x, w), (x, w)


def _matmul_backward(recipe, saved, g):
    x, w = saved
    dx = scaled_dot(recipe, (g, recipe.grad_dtype, "tile"), (jnp.swapaxes(w, 1, 2), E4M3, "block"), x.dtype)
    # The weight's gradient contracts the tokens: both operands tiled along them.
    dw = scaled_dot(recipe, (jnp.swapaxes(x, 1, 2), E4M3, "tile"), (g, recipe.grad_dtype, "tile"), w.dtype)
    return dx, dw


_matmul.defvjp(_matmul_forward, _matmul_backward)


def scaled_dot(recipe: Recipe, lhs: tuple, rhs: tuple, out_dtype) -> jax.Array:
    """lhs (batch, M, K) @ rhs (batch, K, N), each operand given as (value, FP8 format,
    "tile" or "block": how blockwise scales it), quantized by `recipe` along K."""
    (a, a_format, _), (b, b_format, b_kind) = lhs, rhs
    if recipe.granularity == "block":
        return _blockwise_dot(recipe, a, a_format, b, b_format, b_kind).astype(out_dtype)
    axes = (1, 2) if recipe.granularity == "tensor" else None
    qa, sa = quantize(a, a_format, recipe.power_of_two, axes or (2,))
    qb, sb = quantize(b, b_format, recipe.power_of_two, axes or (1,))
    product = _dot(qa, qb) * (1.0 / sa) * (1.0 / sb)
    if recipe.bf16_products:  # bfloat16's rounding, in the product's own dtype
        product = jax.lax.reduce_precision(product, exponent_bits=8, mantissa_bits=7)
    return product.astype(out_dtype)


def quantize(x: jax.Array, fp8, power_of_two: bool, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """x in the FP8 format `fp8`, scaled by the amax over `axes` (kept as size-1 dimensions),
    and the float32 scales it was multiplied by."""
    scale = _scale(jnp.max(jnp.abs(x), axis=axes, keepdims=True), fp8, power_of_two)
    return _saturated(x.astype(jnp.float32) * scale, fp8), scale


def _scale(amax: jax.Array, fp8, power_of_two: bool) -> jax.Array:
    top = float(jnp.finfo(fp8).max)
    amax = amax.astype(jnp.float32)
    scale = jnp.where(amax >= _TINY, np.float32(top) / amax, np.float32(top / 1e-12))
    return jnp.exp2(jnp.floor(jnp.log2(scale))) if power_of_two else scale


def _saturated(x: jax.Array, fp8) -> jax.Array:
    # XLA's conversion makes NaN of what is past the format's range: clipped first.
    top = float(jnp.finfo(fp8).max)
    return jnp.clip(x, -top, top).astype(fp8)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jax.lax.dot_general(a, b, (((a.ndim - 1,), (b.ndim - 2,)), (tuple(range(a.ndim - 2)),) * 2),
                               preferred_element_type=jnp.float32)


def _blockwise_dot(recipe: Recipe, a, a_format, b, b_format, b_kind) -> jax.Array:
    """DeepSeek-V3's: the contraction cut into 128-long pieces, each piece's FP8 product
    scaled by its tile's and block's scales, the pieces summed in float32. Sizes that 128
    does not divide are padded with zeros (they change no amax and add nothing)."""
    batch, m, k = a.shape
    n = b.shape[2]
    pieces = -(-k // BLOCK)
    a = jnp.pad(a, ((0, 0), (0, 0), (0, pieces * BLOCK - k))).reshape(batch, m, pieces, BLOCK)
    qa, sa = quantize(a, a_format, recipe.power_of_two, (3,))  # sa (batch, M, pieces, 1)
    b = jnp.pad(b, ((0, 0), (0, pieces * BLOCK - k), (0, 0))).reshape(batch, pieces, BLOCK, n)
    if b_kind == "block":
        columns = -(-n // BLOCK)
        blocks = jnp.pad(b, ((0, 0), (0, 0), (0, 0), (0, columns * BLOCK - n)))
        blocks = blocks.reshape(batch, pieces, BLOCK, columns, BLOCK)
        qb, sb = quantize(blocks, b_format, recipe.power_of_two, (2, 4))  # (batch, pieces, 1, columns, 1)
        qb = qb.reshape(batch, pieces, BLOCK, columns * BLOCK)[..., :n]
        sb = jnp.repeat(sb.reshape(batch, pieces, 1, columns), BLOCK, axis=3)[..., :n]
    else:
        qb, sb = quantize(b, b_format, recipe.power_of_two, (2,))  # (batch, pieces, 1, N)
    # (batch, pieces, M, N): each piece's product, in float32, scaled, then summed.
    products = jax.lax.dot_general(qa, qb, (((3,), (2,)), ((0, 2), (0, 1))), preferred_element_type=jnp.float32)
    return jnp.sum(products * (1.0 / jnp.moveaxis(sa, 2, 1)) * (1.0 / sb), axis=1)
