"""A scanned GPT in Equinox: midGPT's model (a nanoGPT port), trained per sequence under `jax.vmap`.

Source: AllanYangZhou/midGPT @ 684347d7a902c63e99d032c0bf2c86288a7e401d ("Fix eval behavior of
scan over blocks", 2023-11-29), `src/model.py` whole, and `loss_fn` from `src/train.py` at the
same commit. The layers are built with `eqx.filter_vmap(make_block)` and run with
`jax.lax.scan(block_fn, ...)`, `eqx.partition` outside and `eqx.combine` in the scan body;
`GPT.__call__` takes one sequence and `loss_fn` does `vmap(model)(x, key=key)` (one dropout key
per sequence) then softmax cross-entropy on the next tokens.

This revision is taken rather than the repository's head because at head (482be37, 2024-09-29)
the scan body is hand-decorated with `@jax.checkpoint` (commit b5dd2c4), which is exactly what
smartremat is meant to choose instead; the code of this file is otherwise the same idiom.

Changed from the source:
- sizes only: the `shakespeare_char` config (block 256, vocab 65, 6 layers, 6 heads, 384
  wide, dropout 0.2, no bias) shrunk to block 32, 4 layers, 4 heads, 32 wide (vocab, dropout
  and bias kept); batch 4 sequences; float32 throughout (that config computes in bf16 via jmp
  in its training step, which is not copied);
- `loss_fn(model_params, model_static, x, y, key)` copied unchanged and called by `loss`.
"""

from dataclasses import dataclass
import math
import typing as tp
import equinox as eqx
import jax

jnp, jrandom, vmap, Array, jtu = jax.numpy, jax.random, jax.vmap, jax.Array, jax.tree_util
KeyArray = jax.Array
P, NamedSharding = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
Mesh, with_sharding_constraint = jax.sharding.Mesh, jax.lax.with_sharding_constraint


class Embedding(eqx.Module):
    """eqx Embedding requires vmapping over T dimension, which ends up being very slow."""
    num_embeddings: int = eqx.field(static=True)
    embedding_size: int = eqx.field(static=True)
    weight: Array

    def __init__(self, num_embeddings, embedding_size, weight=None, *, key=None, **kwargs):
        super().__init__(**kwargs)
        if weight is None:
            self.weight = jrandom.normal(key, (num_embeddings, embedding_size))
        else:
            self.weight = weight
        self.num_embeddings = num_embeddings
        self.embedding_size = embedding_size

    @jax.named_scope("Embedding")
    def __call__(self, x_T, *, key=None):
        return jnp.take(self.weight, x_T, axis=0)


def reinit_linear(layer: eqx.nn.Linear, key, w_std=0.02):
    weight = jrandom.normal(key, layer.weight.shape) * w_std
    layer = eqx.tree_at(lambda layer: layer.weight, layer, weight)
    if layer.bias is not None:
        bias = jnp.zeros_like(layer.bias)
        layer = eqx.tree_at(lambda layer: layer.bias, layer, bias)
    return layer


class MLP(eqx.Module):
    c_fc: eqx.Module
    c_proj: eqx.Module
    dropout: eqx.Module

    def __init__(self, n_embd, bias, dropout, c_proj_std, key):
        key1, key2 = jrandom.split(key)
        self.c_fc = reinit_linear(eqx.nn.Linear(n_embd, 4 * n_embd, use_bias=bias, key=key1), key1)
        self.c_proj = reinit_linear(eqx.nn.Linear(
            4 * n_embd, n_embd, use_bias=bias, key=key2), key2, w_std=c_proj_std)
        self.dropout = eqx.nn.Dropout(dropout)

    @jax.named_scope('mlp')
    def __call__(self, x_D, inference=False, key=None):
        x_D = jax.nn.gelu(self.c_fc(x_D))
        return self.dropout(self.c_proj(x_D), inference=inference, key=key)


class CausalSelfAttention(eqx.Module):
    n_head: int
    n_embd: int
    c_attn: eqx.Module
    c_proj: eqx.Module
    attn_dropout: eqx.Module
    resid_dropout: eqx.Module

    def __init__(self, n_embd, n_head, bias, dropout, c_proj_std, key):
        key1, key2 = jrandom.split(key)
        assert n_embd % n_head == 0
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = reinit_linear(eqx.nn.Linear(n_embd, 3 * n_embd, use_bias=bias, key=key1), key1)
        self.c_proj = reinit_linear(eqx.nn.Linear(
            n_embd, n_embd, use_bias=bias, key=key2), key2, w_std=c_proj_std)
        self.attn_dropout = eqx.nn.Dropout(dropout)
        self.resid_dropout = eqx.nn.Dropout(dropout)

    @jax.named_scope('causal_sa')
    def __call__(self, x_TxD, inference=False, key=None):
        adrop_key, pdrop_key = jrandom.split(key) if key is not None else (None, None)
        T, D = x_TxD.shape
        Q_TxD, K_TxD, V_TxD = jnp.split(vmap(self.c_attn)(x_TxD), 3, axis=-1)
        C = self.n_embd // self.n_head
        Q_HxTxC = jnp.transpose(jnp.reshape(Q_TxD, (T, self.n_head, C)), (1, 0, 2))
        K_HxTxC = jnp.transpose(jnp.reshape(K_TxD, (T, self.n_head, C)), (1, 0, 2))
        V_HxTxC = jnp.transpose(jnp.reshape(V_TxD, (T, self.n_head, C)), (1, 0, 2))
        A_HxTxT = Q_HxTxC @ jnp.transpose(K_HxTxC, (0, 2, 1))
        causal_mask = jnp.tril(jnp.ones((1, T, T))) == 0
        A_HxTxT = jnp.where(causal_mask, float('-inf'), A_HxTxT)
        # Softmax should be in full precision.
        orig_dtype = A_HxTxT.dtype
        A_HxTxT = jax.nn.softmax(A_HxTxT.astype(jnp.float32) / jnp.sqrt(C), axis=-1)
        A_HxTxT = A_HxTxT.astype(orig_dtype)
        A_HxTxT = self.attn_dropout(A_HxTxT, inference=inference, key=adrop_key)
        out_TxD = jnp.reshape(jnp.transpose(A_HxTxT @ V_HxTxC, (1, 0, 2)), (T, D))
        out_TxD = self.resid_dropout(vmap(self.c_proj)(out_TxD), inference=inference, key=pdrop_key)
        return out_TxD


class Block(eqx.Module):
    attn: CausalSelfAttention
    mlp: MLP
    ln1: eqx.Module
    ln2: eqx.Module
    def __init__(self, n_embd, n_head, bias, dropout, c_proj_std, key):
        key1, key2 = jrandom.split(key)
        self.attn = CausalSelfAttention(
            n_embd=n_embd, n_head=n_head, bias=bias, dropout=dropout, c_proj_std=c_proj_std,
            key=key1)
        self.mlp = MLP(
            n_embd=n_embd, bias=bias, dropout=dropout, c_proj_std=c_proj_std, key=key2)
        self.ln1 = eqx.nn.LayerNorm(n_embd, eps=1e-5, use_bias=bias)
        self.ln2 = eqx.nn.LayerNorm(n_embd, eps=1e-5, use_bias=bias)

    @jax.named_scope('block')
    def __call__(self, x_TxD, inference=False, key=None):
        attn_key, mlp_key = (None, None)
        if key is not None:
            attn_key, mlp_key = jrandom.split(key)
            mlp_key = jrandom.split(mlp_key, x_TxD.shape[0])
        x_TxD = x_TxD + self.attn(vmap(self.ln1)(x_TxD), inference=inference, key=attn_key)
        mlp = vmap(eqx.Partial(self.mlp, inference=inference))
        return x_TxD + mlp(vmap(self.ln2)(x_TxD), key=mlp_key)


@dataclass
class GPTConfig:
    block_size: int  # Max sequence length
    vocab_size: int  # No. of tokens
    n_layer: int  # No. of transformer blocks
    n_head: int  # No. attention heads
    n_embd: int  # Hidden dimension
    dropout: float
    bias: bool  # Whether or not to use biases in linear layers


class GPT(eqx.Module):
    wte: eqx.Module
    wpe: eqx.Module
    drop: eqx.Module
    blocks: tp.List[eqx.Module]
    ln_f: eqx.Module
    lm_head: eqx.Module
    n_layer: int

    def __init__(self, config, key):
        self.n_layer = config.n_layer
        block_key, head_key, wpe_key = jrandom.split(key, 3)
        self.drop = eqx.nn.Dropout(config.dropout)
        c_proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        def make_block(_key):
            return Block(config.n_embd, config.n_head, config.bias, config.dropout, c_proj_std, _key)
        self.blocks = eqx.filter_vmap(make_block)(jrandom.split(block_key, config.n_layer))
        self.ln_f = eqx.nn.LayerNorm(config.n_embd, eps=1e-5, use_bias=config.bias)
        self.lm_head = reinit_linear(eqx.nn.Linear(
            config.n_embd, config.vocab_size, use_bias=config.bias, key=head_key), head_key)
        self.wte = Embedding(config.vocab_size, config.n_embd, weight=self.lm_head.weight)
        wpe_wt = 0.02 * jrandom.normal(wpe_key, (config.block_size, config.n_embd))
        self.wpe = Embedding(config.block_size, config.n_embd, weight=wpe_wt)

    @jax.named_scope('gpt')
    def __call__(self, x_T, inference=False, key=None):
        # Either (inference=False and key) or (inference=True and key=None)
        drop_key, block_keys = None, None
        if key is not None:
            drop_key, block_keys = jrandom.split(key)
            block_keys = jrandom.split(block_keys, self.n_layer)
        x_TxD = self.wte(x_T) + self.wpe(jnp.arange(x_T.shape[0]))
        x_TxD = self.drop(x_TxD, inference=inference, key=drop_key)
        dynamic_blocks, static_blocks = eqx.partition(self.blocks, eqx.is_array)
        def block_fn(_x_TxD: Array, block_and_key: tp.Tuple[GPT, tp.Optional[KeyArray]]):
            _dynamic_block, _key = block_and_key
            block = eqx.combine(_dynamic_block, static_blocks)
            return block(_x_TxD, inference=inference, key=_key), None
        x_TxD, _ = jax.lax.scan(block_fn, x_TxD, (dynamic_blocks, block_keys))
        x_TxD = vmap(self.ln_f)(x_TxD)
        logits_TxV = vmap(self.lm_head)(x_TxD)
        return logits_TxV


def count_params(model: GPT) -> int:
    dupe = jnp.size(model.lm_head.weight)  # embedding and final layer are shared.
    tot = sum([jnp.size(x) for x in jtu.tree_leaves(model) if isinstance(x, jax.Array)])
    return tot - dupe - jnp.size(model.wpe.weight)  # non-embedding only.


def shard_gpt(model: GPT, mesh: Mesh, sharding_fn=with_sharding_constraint) -> eqx.Module:
    """Shard model parameters over devices (TPUs or GPUs)."""
    def sharding_map(x: Array) -> NamedSharding:
        if x.ndim == 3:
            return NamedSharding(mesh, P(None, None, 'data'))
        elif x.ndim == 2:
            return NamedSharding(mesh, P(None, 'data'))
        else:
            return NamedSharding(mesh, P('data',))
    dynamic_model, static_model = eqx.partition(model, eqx.is_array)
    dynamic_model = jtu.tree_map(lambda x: sharding_fn(x, sharding_map(x)), dynamic_model)
    return eqx.combine(dynamic_model, static_model)


# ---- from src/train.py @ 684347d (the loss) ----
import optax  # noqa: E402


def loss_fn(model_params: GPT, model_static: GPT, x: Array, y: Array, key: tp.Optional[KeyArray]) -> Array:
    model = eqx.combine(model_params, model_static)
    if key is not None:
        key = jrandom.split(key, x.shape[0])
    logits = vmap(model)(x, key=key)
    orig_dtype = logits.dtype
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y)  # compute loss in float32
    return loss.mean().astype(orig_dtype)


# ---- the corpus interface ----
NAME = "nanogpt"
BATCH = 4
config = GPTConfig(  # src/configs/shakespeare_char.py, sizes shrunk (source values in comments)
    block_size=32,  # 256
    vocab_size=65,
    n_layer=4,  # 6
    n_head=4,  # 6
    n_embd=32,  # 384
    dropout=0.2,
    bias=False,
)


def make(key):
    """The GPT and a batch `(x, y, key)`: token windows, the next tokens, a dropout key."""
    model_key, data_key, train_key = jrandom.split(key, 3)
    model = GPT(config, model_key)
    data = jrandom.randint(data_key, (BATCH, config.block_size + 1), 0, config.vocab_size)
    x, y = data[:, :-1], data[:, 1:]  # as get_batch: y is x shifted by one
    return model, (x, y, train_key)


def loss(model, batch):
    """The source's `loss_fn` on the model split as its training step splits it."""
    x, y, key = batch
    model_params, model_static = eqx.partition(model, eqx.is_array)
    return loss_fn(model_params, model_static, x, y, key)
