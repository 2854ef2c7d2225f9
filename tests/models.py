"""Small Equinox models only the tests use.

The tutorial block and its residual stack, the GPT and the models users run are defined once, in
`benchmarks/models.py` (the tests import them from there)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp


class Attention(eqx.Module):
    wqkv: jax.Array
    wo: jax.Array
    heads: int = eqx.field(static=True)

    def __init__(self, d: int, heads: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.wqkv = jax.random.normal(k1, (d, 3 * d)) / d**0.5
        self.wo = jax.random.normal(k2, (d, d)) / d**0.5
        self.heads = heads

    def __call__(self, x):  # x: (B, T, D)
        b, t, d = x.shape
        q, k, v = jnp.split(x @ self.wqkv, 3, axis=-1)
        split = lambda a: a.reshape(b, t, self.heads, d // self.heads).transpose(0, 2, 1, 3)
        q, k, v = split(q), split(k), split(v)
        s = jnp.einsum("bhtd,bhsd->bhts", q, k) / (d // self.heads) ** 0.5
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        o = jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)
        return o.transpose(0, 2, 1, 3).reshape(b, t, d) @ self.wo


class MLP(eqx.Module):
    w1: jax.Array
    w2: jax.Array

    def __init__(self, d: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (d, 4 * d)) / d**0.5
        self.w2 = jax.random.normal(k2, (4 * d, d)) / (4 * d) ** 0.5

    def __call__(self, x):
        return jax.nn.gelu(x @ self.w1) @ self.w2


def layer_norm(x, eps=1e-5):
    m = jnp.mean(x, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + eps)


class Layer(eqx.Module):
    attn: Attention
    mlp: MLP

    def __init__(self, d: int, heads: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.attn, self.mlp = Attention(d, heads, k1), MLP(d, k2)

    def __call__(self, x):
        x = x + self.attn(layer_norm(x))
        return x + self.mlp(layer_norm(x))


class Transformer(eqx.Module):
    layers: list

    def __init__(self, n: int, d: int, heads: int, key: jax.Array):
        self.layers = [Layer(d, heads, k) for k in jax.random.split(key, n)]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return layer_norm(x)


class TokenTransformer(eqx.Module):
    """Token embedding, `Transformer`'s layers, and a vocabulary head: a small language model of
    its own, not `benchmarks.models.GPT` (which adds position embeddings, LayerNorm modules with
    weights, biases and a final norm, and draws its parameters from other keys)."""

    embed: jax.Array
    layers: list
    head: jax.Array

    def __init__(self, n: int, d: int, heads: int, seq: int, vocab: int, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = jax.random.normal(k1, (vocab, d)) * 0.02
        self.layers = [Layer(d, heads, k) for k in jax.random.split(k2, n)]
        self.head = jax.random.normal(k3, (d, vocab)) * 0.02

    def __call__(self, tokens):
        x = self.embed[tokens]
        for layer in self.layers:
            x = layer(x)
        return layer_norm(x) @ self.head


class ScannedTransformer(eqx.Module):
    """`Transformer` written the Equinox way for deep models: layers stacked with
    `eqx.filter_vmap` and run by `jax.lax.scan` (same keys give the same parameters)."""

    layers: Layer

    def __init__(self, n: int, d: int, heads: int, key: jax.Array):
        self.layers = eqx.filter_vmap(lambda k: Layer(d, heads, k))(jax.random.split(key, n))

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(x, p):
            return eqx.combine(p, static)(x), None

        x, _ = jax.lax.scan(body, x, params)
        return layer_norm(x)


class ConvBlock(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d

    def __init__(self, c: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.conv1 = eqx.nn.Conv2d(c, c, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(c, c, 3, padding=1, key=k2)

    def __call__(self, x):
        return x + self.conv2(jax.nn.relu(self.conv1(x)))


class ConvNet(eqx.Module):
    """A per-example ConvNet (one image `(3, H, W)` in, logits out), the way Equinox layers are
    written: the user batches it with `jax.vmap(model)`."""

    stem: eqx.nn.Conv2d
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, n: int, c: int, classes: int, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.stem = eqx.nn.Conv2d(3, c, 3, padding=1, key=k1)
        self.blocks = [ConvBlock(c, k) for k in jax.random.split(k2, n)]
        self.head = eqx.nn.Linear(c, classes, key=k3)

    def __call__(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


class Batched(eqx.Module):
    """`jax.vmap(model)` over the leading axis, as the user's loss would write it."""

    model: eqx.Module

    def __call__(self, x):
        return jax.vmap(self.model)(x)
