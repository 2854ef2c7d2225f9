"""Equinox models for the demo, the benchmarks, the studies and the tests (one definition each).

`tests/models.py` holds the models only the tests use."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray


class TutorialBlock(eqx.Module):
    """The tutorial block `x -> gelu(x @ W1) @ W2`, one Module holding only arrays."""

    w1: Float[Array, "d h"]
    w2: Float[Array, "h d"]

    def __init__(self, d: int, hidden: int, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (d, hidden)) / d**0.5
        self.w2 = jax.random.normal(k2, (hidden, d)) / hidden**0.5

    def __call__(self, x: Float[Array, "b d"]) -> Float[Array, "b d"]:
        return jax.nn.gelu(x @ self.w1) @ self.w2


class ResidualBlock(eqx.Module):
    block: TutorialBlock

    def __call__(self, x: Float[Array, "b d"]) -> Float[Array, "b d"]:
        return x + self.block(x)


class TutorialStack(eqx.Module):
    """A residual stack of tutorial blocks."""

    layers: list[ResidualBlock]

    def __init__(self, n: int, d: int, hidden: int, key: PRNGKeyArray):
        self.layers = [ResidualBlock(TutorialBlock(d, hidden, k)) for k in jax.random.split(key, n)]

    def __call__(self, x: Float[Array, "b d"]) -> Float[Array, "b d"]:
        for layer in self.layers:
            x = layer(x)
        return x


class Stack(eqx.Module):
    """Blocks called one after another (the GPT blocks of the fit, scan and sharded reports)."""

    blocks: list

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _layer_norm(ln: eqx.nn.LayerNorm, x: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
    return jax.vmap(jax.vmap(ln))(x)


class CausalSelfAttention(eqx.Module):
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, d: int, heads: int, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(d, 3 * d, use_bias=False, key=k1)
        self.out = eqx.nn.Linear(d, d, use_bias=False, key=k2)
        self.heads = heads

    def __call__(self, x: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
        b, t, d = x.shape
        q, k, v = jnp.split(x @ self.qkv.weight.T, 3, axis=-1)
        split = lambda a: a.reshape(b, t, self.heads, d // self.heads).transpose(0, 2, 1, 3)
        q, k, v = split(q), split(k), split(v)
        scores = jnp.einsum("bhtd,bhsd->bhts", q, k) / (d // self.heads) ** 0.5
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        o = jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(scores, axis=-1), v)
        return o.transpose(0, 2, 1, 3).reshape(b, t, d) @ self.out.weight.T


class GPTBlock(eqx.Module):
    """Pre-LayerNorm decoder block: causal multi-head attention and a 4x GELU MLP."""

    ln1: eqx.nn.LayerNorm
    attn: CausalSelfAttention
    ln2: eqx.nn.LayerNorm
    fc: eqx.nn.Linear
    proj: eqx.nn.Linear

    def __init__(self, d: int, heads: int, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, k1)
        self.fc = eqx.nn.Linear(d, 4 * d, key=k2)
        self.proj = eqx.nn.Linear(4 * d, d, key=k3)

    def __call__(self, x: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
        x = x + self.attn(_layer_norm(self.ln1, x))
        h = jax.nn.gelu(_layer_norm(self.ln2, x) @ self.fc.weight.T + self.fc.bias)
        return x + h @ self.proj.weight.T + self.proj.bias


class GPT(eqx.Module):
    """Decoder-only transformer: token and position embeddings, blocks, final norm, head."""

    embed: Float[Array, "v d"]
    pos: Float[Array, "t d"]
    blocks: list[GPTBlock]
    ln_f: eqx.nn.LayerNorm
    head: Float[Array, "d v"]

    def __init__(self, layers: int, d: int, heads: int, seq: int, vocab: int, key: PRNGKeyArray):
        ks = jax.random.split(key, layers + 3)
        self.embed = jax.random.normal(ks[0], (vocab, d)) * 0.02
        self.pos = jax.random.normal(ks[1], (seq, d)) * 0.02
        self.blocks = [GPTBlock(d, heads, k) for k in ks[3:]]
        self.ln_f = eqx.nn.LayerNorm(d)
        self.head = jax.random.normal(ks[2], (d, vocab)) * 0.02

    def __call__(self, tokens: Int[Array, "b t"]) -> Float[Array, "b t v"]:
        x = self.embed[tokens] + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return _layer_norm(self.ln_f, x) @ self.head


def gpt_loss(model: GPT, tokens: Int[Array, "b t"]) -> Float[Array, ""]:
    """Next-token cross-entropy."""
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


class ResBlock(eqx.Module):
    """Two 3x3 convolutions with GroupNorm and a residual connection (channels first, batched)."""

    conv1: eqx.nn.Conv2d
    norm1: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    norm2: eqx.nn.GroupNorm

    def __init__(self, channels: int, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.conv1 = eqx.nn.Conv2d(channels, channels, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(channels, channels, 3, padding=1, key=k2)
        self.norm1 = eqx.nn.GroupNorm(8, channels)
        self.norm2 = eqx.nn.GroupNorm(8, channels)

    def __call__(self, x: Float[Array, "b c h w"]) -> Float[Array, "b c h w"]:
        h = jax.nn.relu(jax.vmap(self.norm1)(jax.vmap(self.conv1)(x)))
        h = jax.vmap(self.norm2)(jax.vmap(self.conv2)(h))
        return jax.nn.relu(x + h)


class ResNet(eqx.Module):
    """A residual network on 32x32x3 images: stem convolution, residual blocks, pooled head."""

    stem: eqx.nn.Conv2d
    blocks: list[ResBlock]
    head: eqx.nn.Linear

    def __init__(self, n: int, channels: int, classes: int, key: PRNGKeyArray):
        ks = jax.random.split(key, n + 2)
        self.stem = eqx.nn.Conv2d(3, channels, 3, padding=1, key=ks[0])
        self.blocks = [ResBlock(channels, k) for k in ks[2:]]
        self.head = eqx.nn.Linear(channels, classes, key=ks[1])

    def __call__(self, x: Float[Array, "b 3 32 32"]) -> Float[Array, "b classes"]:
        x = jax.vmap(self.stem)(x)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jnp.mean(x, axis=(2, 3)))


class SequenceBlock(eqx.Module):
    """A pre-norm decoder block on one sequence, written with Equinox's own layers:
    `eqx.nn.LayerNorm`, `eqx.nn.MultiheadAttention` under a causal mask, a 4x GELU MLP of
    `eqx.nn.Linear` (each applied per position with `jax.vmap`)."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc: eqx.nn.Linear
    proj: eqx.nn.Linear

    def __init__(self, d: int, heads: int, key: PRNGKeyArray, dtype: Any = None):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d, dtype=dtype), eqx.nn.LayerNorm(d, dtype=dtype)
        self.attn = eqx.nn.MultiheadAttention(heads, d, dtype=dtype, key=k1)
        self.fc = eqx.nn.Linear(d, 4 * d, dtype=dtype, key=k2)
        self.proj = eqx.nn.Linear(4 * d, d, dtype=dtype, key=k3)

    def __call__(self, x: Float[Array, "t d"]) -> Float[Array, "t d"]:
        h = jax.vmap(self.ln1)(x)
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attn(h, h, h, mask=causal)
        h = jax.nn.gelu(jax.vmap(self.fc)(jax.vmap(self.ln2)(x)))
        return x + jax.vmap(self.proj)(h)


class SequenceGPT(eqx.Module):
    """A GPT on one sequence of tokens (batched by `jax.vmap` in the loss, as Equinox models are):
    token and position embeddings, `SequenceBlock`s, final norm, head. `scanned`: the blocks
    stacked with `eqx.filter_vmap` and run by `jax.lax.scan`, as large JAX models are written."""

    embed: eqx.nn.Embedding
    pos: Array
    blocks: Any  # a list of blocks, or one block of stacked parameters (scanned)
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    scanned: bool = eqx.field(static=True)

    def __init__(self, layers: int, d: int, heads: int, seq: int, vocab: int, key: PRNGKeyArray,
                 scanned: bool = False, dtype: Any = None):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(vocab, d, dtype=dtype, key=k1)
        self.pos = (jax.random.normal(k2, (seq, d)) * 0.02).astype(dtype or jnp.float32)
        keys = jax.random.split(k3, layers)
        make = lambda k: SequenceBlock(d, heads, k, dtype)  # noqa: E731
        self.blocks = eqx.filter_vmap(make)(keys) if scanned else [make(k) for k in keys]
        self.ln_f = eqx.nn.LayerNorm(d, dtype=dtype)
        self.head = eqx.nn.Linear(d, vocab, use_bias=False, dtype=dtype, key=k4)
        self.scanned = scanned

    def __call__(self, tokens: Int[Array, " t"]) -> Float[Array, "t v"]:
        x = jax.vmap(self.embed)(tokens) + self.pos[: tokens.shape[0]]
        if self.scanned:
            params, static = eqx.partition(self.blocks, eqx.is_array)
            x, _ = jax.lax.scan(lambda x, p: (eqx.combine(p, static)(x), None), x, params)
        else:
            for block in self.blocks:
                x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))


def sequence_gpt_loss(model: SequenceGPT, tokens: Int[Array, "b t"]) -> Float[Array, ""]:
    """Next-token cross-entropy (in float32) of the per-sequence GPT over a batch."""
    logits = jax.vmap(model)(tokens[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
