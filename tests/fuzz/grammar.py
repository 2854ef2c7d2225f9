"""The grammar of the fuzzer: a `Case` is a plain record of choices (printable, savable, rebuilt
deterministically by `build`), drawn from `CHOICES` with `WEIGHTS` by `draw` (or `cases()`, the
same grammar as a hypothesis strategy).

Each field names an idiom Equinox users write; the first value of every field is the simplest,
which is what the shrinker moves towards. `normalise` makes a drawn record consistent (e.g.
BatchNorm needs the model under `jax.vmap` with an axis name), so every `Case` that `normalise`
leaves unchanged is buildable.

Fields added later (`LATE`: the simulated chip) are drawn after the case's seed, so a seed draws
the same other fields as before they were added (`covering` leaves them out for the same reason).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

#: Every field's values, simplest first.
CHOICES: dict[str, tuple] = {
    "layout": ("loop", "sequential", "scan", "shared", "rnn"),  # list of blocks, eqx.nn.Sequential,
    # filter_vmap-stacked blocks under lax.scan, one block called several times, a GRUCell scanned over time
    "block": ("mlp", "linear", "custom_vjp", "checkpointed", "fields"),  # raw arrays, eqx.nn.Linear,
    # a jax.custom_vjp activation, eqx.filter_checkpoint applied by the user, isinstance/field reads
    "vmap": ("none", "inner", "outer"),  # batched arrays, blocks under jax.vmap, the whole model under jax.vmap
    "norm": ("none", "batchnorm"),  # eqx.nn.BatchNorm with eqx.nn.State (make_with_state)
    "dropout": (False, True),  # eqx.nn.Dropout in every block: key= and inference=
    "control": ("none", "cond", "fori"),  # lax.cond / lax.fori_loop around each block
    "dtype": ("f32", "bf16", "f16"),  # the blocks compute in this dtype
    "method": ("call", "loss", "encode"),  # the step calls model(...), model.loss(...) or model.encode(...)
    "kwargs": (False, True),  # a keyword argument `scale=` on the model's call
    "inputs": ("array", "tuple", "dict"),
    "outputs": ("array", "tuple", "dict"),
    "wrapper": (False, True),  # the step's model holds the network as `self.net`
    "loss": ("mse", "xent_soft", "xent_int", "huber", "multi"),
    "step": ("value_and_grad", "grad", "jax_grad", "sgd", "adam", "adamw", "tutorial"),
    "accum": ("none", "fori", "while"),  # gradient accumulation over two micro-batches
    "donate": (False, True),  # donate="all" (optax steps)
    "path": ("filter_jit", "decorator"),  # smartremat.filter_jit, or smartremat.smartremat(...)(model) in eqx.filter_jit
    "width": (8, 16, 32, 64),
    "batch": (4, 8, 16),
    "depth": (1, 2, 3),
    "budget": (0.5, 0.0, 0.25, 0.75, 1.0),  # where the budget lies between the stated floor (0) and the plain temp (1)
    "chip": ("none", "tight", "auto"),  # no device limit, or a simulated chip (tests/simulated_chip.py)
    # that refuses larger programs, with the budget drawn as above, or `budget_mb="auto"` (check.py sizes it)
}

#: How often each value is drawn (relative weights, same order as `CHOICES`).
WEIGHTS: dict[str, tuple] = {
    "layout": (4, 2, 3, 2, 1),
    "block": (4, 2, 1, 1, 1),
    "vmap": (3, 2, 2),
    "norm": (5, 1),
    "dropout": (5, 1),
    "control": (6, 1, 1),
    "dtype": (6, 1, 1),
    "method": (6, 1, 1),
    "kwargs": (3, 1),
    "inputs": (6, 1, 1),
    "outputs": (6, 1, 1),
    "wrapper": (3, 1),
    "loss": (4, 2, 2, 1, 1),
    "step": (3, 1, 1, 2, 2, 1, 2),
    "accum": (8, 1, 1),
    "donate": (1, 1),
    "path": (5, 1),
    "width": (1, 2, 2, 1),
    "batch": (1, 2, 1),
    "depth": (1, 2, 2),
    "budget": (1, 1, 1, 1, 1),
    "chip": (3, 1, 1),
}

#: Fields added to the grammar later, drawn after the case's seed: the seed and the other fields
#: a run draws are those it drew before they were added.
LATE = ("chip",)

OPTAX = ("sgd", "adam", "adamw")


@dataclass(frozen=True)
class Case:
    """One fuzz case: every choice of the grammar, plus the seed of its parameters and data."""

    seed: int = 0
    layout: str = "loop"
    block: str = "mlp"
    vmap: str = "none"
    norm: str = "none"
    dropout: bool = False
    control: str = "none"
    dtype: str = "f32"
    method: str = "call"
    kwargs: bool = False
    inputs: str = "array"
    outputs: str = "array"
    wrapper: bool = False
    loss: str = "mse"
    step: str = "value_and_grad"
    accum: str = "none"
    donate: bool = False
    path: str = "filter_jit"
    width: int = 8
    batch: int = 4
    depth: int = 1
    budget: float = 0.5
    chip: str = "none"

    def idioms(self) -> list[str]:
        """`field=value` for every choice that is not the simplest (what the summary counts)."""
        first = {k: v[0] for k, v in CHOICES.items()}
        return [f"{k}={getattr(self, k)}" for k in CHOICES if k not in ("width", "batch", "depth", "budget")
                and getattr(self, k) != first[k]]

    def __str__(self) -> str:
        return "Case(" + ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self).items()) + ")"


def normalise(case: Case) -> Case:
    """The consistent case nearest to `case`: each rule drops a choice another one rules out."""
    c = dataclasses.asdict(case)
    if c["layout"] == "rnn":  # a GRUCell: no blocks of ours, no control flow around them
        c.update(block="mlp", control="none")
    if c["block"] == "linear" or c["layout"] == "rnn":  # eqx.nn.Linear / GRUCell take one example
        c["vmap"] = "outer" if c["vmap"] == "outer" else "inner"
    if c["norm"] == "batchnorm":  # BatchNorm reads its batch through the vmap's axis name
        c["vmap"] = "outer"
    if c["step"] == "tutorial":  # loss(model, x, y): no state, no key, no optimizer
        c.update(norm="none", dropout=False, accum="none")
    if c["step"] not in OPTAX:
        c["donate"] = False
    if c["method"] == "encode":  # encode returns features, one array
        c["outputs"] = "array"
        if c["loss"] == "multi":
            c["loss"] = "mse"
    if c["loss"] == "multi" and c["outputs"] == "array":
        c["outputs"] = "tuple"
    if c["path"] == "decorator":  # the instance wrapper is called like the module: __call__ only
        c["method"] = "call"
    if c["vmap"] == "inner" and c["layout"] == "sequential":  # Sequential calls its layers unbatched
        c["vmap"] = "outer"
    if c["chip"] == "auto" and c["path"] == "decorator":  # the decorator takes a number of MB only
        c["chip"] = "tight"
    return Case(**c)


def draw(rng: random.Random) -> Case:
    """A case drawn with `WEIGHTS` (then `normalise`d): the fields, the seed, then the `LATE` fields."""
    pick = lambda k: rng.choices(CHOICES[k], weights=WEIGHTS[k])[0]  # noqa: E731
    fields = {k: pick(k) for k in CHOICES if k not in LATE}
    seed = rng.randrange(2**16)
    return normalise(Case(seed=seed, **fields, **{k: pick(k) for k in LATE}))


def case_at(seed: int, index: int) -> Case:
    """The `index`-th case of a run from `seed` (each drawn alone, so any one can be redrawn)."""
    return draw(random.Random(seed * 1_000_003 + index))


def covering(seed: int, n: int, pool: int = 400) -> list[int]:
    """`n` indexes of cases from `seed` that together draw every value of every field but the
    `LATE` ones (greedily: each next case adds the most values not yet drawn, ties to the lowest
    index; once all are drawn, the next indexes in order). Without the `LATE` fields, the indexes
    chosen are those chosen before these fields were added."""
    drawn = [{(k, getattr(case_at(seed, i), k)) for k in CHOICES if k not in LATE} for i in range(pool)]
    seen: set = set()
    chosen: list[int] = []
    while len(chosen) < n:
        i = max((j for j in range(pool) if j not in chosen), key=lambda j: (len(drawn[j] - seen), -j))
        chosen.append(i)
        seen |= drawn[i]
    return chosen


def cases(exclude: Callable[[Case], bool] | None = None) -> Any:
    """The same grammar as a hypothesis strategy (each field `sampled_from`, simplest first, so
    hypothesis shrinks towards the simplest case); `exclude` filters cases out."""
    from hypothesis import strategies as st

    fields = {k: st.sampled_from(v) for k, v in CHOICES.items()}
    strategy = st.builds(Case, seed=st.integers(0, 2**16 - 1), **fields).map(normalise)
    return strategy if exclude is None else strategy.filter(lambda c: not exclude(c))


# --- the model -----------------------------------------------------------------------------------

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def working(dtype: str) -> Any:
    """The dtype the model and loss compute in for `DTYPES[dtype]`: float32 means the default float,
    float64 while `jax.enable_x64` is on. `check.py` runs a step again in float64 (rule 6), where a
    cast to float32 would bring back the float32 rounding that run is there to remove; bfloat16
    and float16 stay."""
    dt = DTYPES[dtype]
    return jax.dtypes.canonicalize_dtype(jnp.float64) if dt == jnp.float32 else dt


@jax.custom_vjp
def soft_clip(x: jax.Array) -> jax.Array:
    """A user's custom-gradient activation: tanh forward, straight-through-ish backward."""
    return jnp.tanh(x)


def _soft_clip_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.tanh(x), x


def _soft_clip_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return (g / (1 + x * x),)


soft_clip.defvjp(_soft_clip_fwd, _soft_clip_bwd)


class Block(eqx.Module):
    """A residual MLP block, written in the style `kind` names."""

    w1: Any
    w2: Any
    drop: eqx.nn.Dropout | None
    kind: str = eqx.field(static=True)
    dtype: str = eqx.field(static=True)
    control: str = eqx.field(static=True)

    def __init__(self, width: int, kind: str, dtype: str, control: str, dropout: bool, key: jax.Array | int):
        """`key`: a JAX key (under `eqx.filter_vmap`), or an int seed for NumPy (no compile per shape)."""
        hidden = 2 * width
        if kind == "linear":
            dt = DTYPES[dtype]
            k1, k2 = jax.random.split(jax.random.key(key) if isinstance(key, int) else key)
            self.w1 = eqx.nn.Linear(width, hidden, key=k1, dtype=dt)
            self.w2 = eqx.nn.Linear(hidden, width, key=k2, dtype=dt)
        elif isinstance(key, int):
            rng = np.random.default_rng(key)
            self.w1 = jnp.asarray(rng.standard_normal((width, hidden), np.float32) / width**0.5)
            self.w2 = jnp.asarray(rng.standard_normal((hidden, width), np.float32) / hidden**0.5)
        else:
            k1, k2 = jax.random.split(key)
            self.w1 = jax.random.normal(k1, (width, hidden)) / width**0.5
            self.w2 = jax.random.normal(k2, (hidden, width)) / hidden**0.5
        self.drop = eqx.nn.Dropout(0.2) if dropout else None
        self.kind, self.dtype, self.control = kind, dtype, control

    def mlp(self, h: jax.Array, key: jax.Array | None = None, inference: bool = False) -> jax.Array:
        dt = working(self.dtype)
        if self.kind == "linear":
            h = self.w2(jax.nn.gelu(self.w1(h.astype(dt))))
        else:
            act = soft_clip if self.kind == "custom_vjp" else jax.nn.gelu
            h = act(h.astype(dt) @ self.w1.astype(dt)) @ self.w2.astype(dt)
        if self.drop is not None:
            h = self.drop(h, key=key, inference=inference)
        return h.astype(working("f32"))

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None, inference: bool = False) -> jax.Array:
        mlp = eqx.filter_checkpoint(self.mlp) if self.kind == "checkpointed" else self.mlp
        if self.control == "cond":
            return jax.lax.cond(jnp.mean(x) > -1e9, lambda h: h + mlp(h, key, inference), lambda h: h, x)
        if self.control == "fori":
            return jax.lax.fori_loop(0, 2, lambda i, h: h + 0.5 * mlp(h, key, inference), x)
        return x + mlp(x, key, inference)


def _apply(block: Any, x: jax.Array, key: jax.Array | None, inference: bool, inner: bool) -> jax.Array:
    """`block(x)`, under `jax.vmap` over the batch when `inner` (same dropout key per example)."""
    call = functools.partial(block, key=key, inference=inference)
    return jax.vmap(call)(x) if inner else call(x)


class Net(eqx.Module):
    """The network: blocks in the case's layout, an optional BatchNorm, outputs as the case says."""

    layers: Any
    norm: eqx.nn.BatchNorm | None
    layout: str = eqx.field(static=True)
    inner: bool = eqx.field(static=True)
    fields: bool = eqx.field(static=True)
    inputs: str = eqx.field(static=True)
    outputs: str = eqx.field(static=True)
    loss_kind: str = eqx.field(static=True)
    depth: int = eqx.field(static=True)

    def __init__(self, case: Case, seed: int):
        seeds = [seed * 8 + i for i in range(case.depth)]
        make = lambda k: Block(case.width, case.block, case.dtype, case.control, case.dropout, k)  # noqa: E731
        if case.layout == "loop":
            self.layers = [make(k) for k in seeds]
        elif case.layout == "sequential":
            self.layers = eqx.nn.Sequential([make(k) for k in seeds])
        elif case.layout == "scan":
            self.layers = eqx.filter_vmap(make)(jax.random.split(jax.random.key(seed), case.depth))
        elif case.layout == "shared":
            self.layers = make(seeds[0])
        else:
            self.layers = eqx.nn.GRUCell(case.width, case.width, key=jax.random.key(seed))
        self.norm = eqx.nn.BatchNorm(case.width, "batch", mode="ema") if case.norm == "batchnorm" else None
        self.layout, self.inner, self.fields = case.layout, case.vmap == "inner", case.block == "fields"
        self.inputs, self.outputs, self.loss_kind, self.depth = case.inputs, case.outputs, case.loss, case.depth

    def encode(self, inputs: Any, state: eqx.nn.State | None = None, *, key: jax.Array | None = None,
               inference: bool = False, scale: float = 1.0) -> Any:
        x = _read_inputs(self.inputs, inputs) * scale
        x = self._body(x, key, inference)
        if self.norm is None:
            return x
        assert state is not None, "a BatchNorm model is called with its state"
        x, state = self.norm(x, state)
        return x, state

    def __call__(self, inputs: Any, state: eqx.nn.State | None = None, *, key: jax.Array | None = None,
                 inference: bool = False, scale: float = 1.0) -> Any:
        out = self.encode(inputs, state, key=key, inference=inference, scale=scale)
        if self.norm is None:
            return _write_outputs(self.outputs, out)
        return _write_outputs(self.outputs, out[0]), out[1]

    def loss(self, inputs: Any, target: jax.Array, state: eqx.nn.State | None = None, *,
             key: jax.Array | None = None, inference: bool = False, scale: float = 1.0) -> Any:
        out = self(inputs, state, key=key, inference=inference, scale=scale)
        if self.norm is None:
            return loss_value(self.loss_kind, out, target)
        return loss_value(self.loss_kind, out[0], target), out[1]

    def _body(self, x: jax.Array, key: jax.Array | None, inference: bool) -> jax.Array:
        n = self.depth
        keys = [None] * (n + 1) if key is None else list(jax.random.split(key, n + 1))
        if self.layout == "loop":
            for layer, k in zip(self.layers, keys):
                if not self.fields or (isinstance(layer, Block) and layer.kind == "fields"
                                       and jnp.shape(layer.w1)[0] == x.shape[-1]):
                    x = _apply(layer, x, k, inference, self.inner)
            return x
        if self.layout == "sequential":
            return self.layers(x, key=key)
        if self.layout == "shared":
            for k in keys:  # the same block, depth + 1 times
                x = _apply(self.layers, x, k, inference, self.inner)
            return x
        if self.layout == "scan":
            return self._scan(x, keys[:n], inference)
        return self._rnn(x)

    def _scan(self, x: jax.Array, keys: list, inference: bool) -> jax.Array:
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def body(h: jax.Array, xs: Any) -> tuple[jax.Array, None]:
            params, k = xs
            return _apply(eqx.combine(params, static), h, k, inference, self.inner), None

        ks = None if keys[0] is None else jnp.stack(keys)
        return jax.lax.scan(body, x, (dynamic, ks))[0]

    def _rnn(self, x: jax.Array) -> jax.Array:
        """A GRUCell over `depth + 1` time steps made from the features (x: (width,) or (B, width))."""
        steps = jnp.stack([jnp.roll(x, t, axis=-1) for t in range(self.depth + 1)])
        cell = jax.vmap(self.layers) if self.inner else self.layers
        h0 = jnp.zeros_like(x)
        return jax.lax.scan(lambda h, xt: (cell(xt, h), None), h0, steps)[0]


def _read_inputs(kind: str, inputs: Any) -> jax.Array:
    if kind == "tuple":
        x, m = inputs
        return x * m
    if kind == "dict":
        return inputs["x"] * inputs["m"]
    return inputs


def _write_outputs(kind: str, x: jax.Array) -> Any:
    if kind == "tuple":
        return x, jnp.tanh(x)
    if kind == "dict":
        return {"y": x, "aux": jnp.tanh(x)}
    return x


class Wrapper(eqx.Module):
    """A model that holds the network as `self.net` and forwards to it."""

    net: Net

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.net(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        return self.net.encode(*args, **kwargs)

    def loss(self, *args: Any, **kwargs: Any) -> Any:
        return self.net.loss(*args, **kwargs)


# --- losses ---------------------------------------------------------------------------------------

def loss_value(kind: str, out: Any, target: jax.Array) -> jax.Array:
    """The loss of the model's output(s) against `target` (int labels for `xent_int`)."""
    main = out[0] if isinstance(out, tuple) else out["y"] if isinstance(out, dict) else out
    main = main.astype(working("f32"))
    if kind == "mse":
        return jnp.mean((main - target) ** 2)
    if kind == "xent_soft":
        return jnp.mean(optax.softmax_cross_entropy(main, target))
    if kind == "xent_int":
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(main, target))
    if kind == "huber":
        return jnp.mean(optax.huber_loss(main, target))
    aux = out[1] if isinstance(out, tuple) else out["aux"]
    return jnp.mean((main - target) ** 2) + 0.1 * jnp.mean(optax.huber_loss(aux.astype(working("f32")), target))


# --- the step -------------------------------------------------------------------------------------

@dataclass
class Built:
    """A built case: the model, the step's argument names and values, the step, the optimizer."""

    model: Any
    names: tuple[str, ...]
    args: tuple
    step: Callable
    loss_fn: Callable  # loss_fn(model, *the step's other arguments but opt_state) -> (loss, state or None)
    opt: Any = None


def build(case: Case) -> Built:
    """The model, data and step of `case` (deterministic: the same case builds the same values)."""
    state = None
    if case.norm == "batchnorm":
        net, state = eqx.nn.make_with_state(Net)(case, case.seed)
    else:
        net = Net(case, case.seed)
    model = Wrapper(net) if case.wrapper else net
    inputs, target = _data(case, np.random.default_rng(case.seed))
    kd = jax.random.key(case.seed)
    opt = _optimizer(case.step)
    names = ("model",) + (("opt_state",) if opt else ()) + (("state",) if state is not None else ()) \
        + ("inputs", "target") + (("key",) if case.dropout else ())
    values = {"model": model, "state": state, "inputs": inputs, "target": target, "key": kd}
    if opt is not None:
        values["opt_state"] = opt.init(eqx.filter(model, eqx.is_array))
    loss_fn = _loss_fn(case)
    step = _step(case, names, loss_fn, opt)
    return Built(model, names, tuple(values[n] for n in names), step, loss_fn, opt)


def _data(case: Case, rng: np.random.Generator) -> tuple[Any, jax.Array]:
    """Inputs and targets, made with NumPy (no compile per shape)."""
    shape = (case.batch, case.width)
    x = jnp.asarray(rng.standard_normal(shape, np.float32))
    m = jnp.asarray(1 + 0.1 * rng.standard_normal(shape, np.float32))
    inputs = {"array": x, "tuple": (x, m), "dict": {"x": x, "m": m}}[case.inputs]
    z = rng.standard_normal(shape, np.float32)
    if case.loss == "xent_int":
        target = jnp.asarray(rng.integers(0, case.width, case.batch, dtype=np.int32))
    elif case.loss == "xent_soft":
        target = jnp.asarray(np.exp(z) / np.exp(z).sum(-1, keepdims=True))
    else:
        target = jnp.asarray(np.tanh(z))
    return inputs, target


#: The learning rate of each optimizer step.
LR = {"sgd": 1e-2, "adam": 1e-3, "adamw": 1e-3}


def _optimizer(step: str) -> Any:
    if step == "sgd":
        return optax.sgd(LR[step], momentum=0.9)
    if step == "adam":
        return optax.adam(LR[step])
    if step == "adamw":
        return optax.adamw(LR[step], weight_decay=1e-2)
    return None


def _loss_fn(case: Case) -> Callable:
    """`loss_fn(model, [state,] inputs, target[, key]) -> (loss, state)`: the step's forward and loss,
    the model called as the case says (method, keywords, under `jax.vmap`)."""
    bn, drop = case.norm == "batchnorm", case.dropout

    def loss_fn(model: Any, *rest: Any) -> tuple[jax.Array, Any]:
        state = rest[0] if bn else None
        inputs, target = rest[int(bn)], rest[int(bn) + 1]
        key = rest[-1] if drop else None
        kw = ({"scale": 0.5} if case.kwargs else {}) | ({"inference": False} if drop else {})
        method = model if case.method == "call" else getattr(model, case.method)
        pos = (inputs, target) if case.method == "loss" else (inputs,)
        pos = pos + ((state,) if bn else ())
        if case.vmap == "outer":
            call = jax.vmap(functools.partial(method, **kw), axis_name="batch",
                            in_axes=(0,) * (len(pos) - bn) + (None,) * bn, out_axes=(0, None) if bn else 0)
            n = jax.tree.leaves(inputs)[0].shape[0]
            out = call(*pos, key=jax.random.split(rest[-1], n)) if drop else call(*pos)  # key: rest[-1]
        else:
            out = method(*pos, key=key, **kw) if drop else method(*pos, **kw)
        out, state = out if bn else (out, None)
        if case.method == "loss":
            return jnp.mean(out), state
        return loss_value(case.loss, out, target), state

    return loss_fn


def _step(case: Case, names: tuple[str, ...], loss_fn: Callable, opt: Any) -> Callable:
    """The training step, as a function whose signature is `names` (as a user writes it)."""
    if case.step == "tutorial":
        return eqx.filter_value_and_grad(lambda model, inputs, target: loss_fn(model, inputs, target)[0])

    def body(a: dict) -> Any:
        rest = tuple(a[n] for n in names if n not in ("model", "opt_state"))
        loss, grads, state = _gradient(case, loss_fn, a["model"], rest)
        out: tuple = (loss, grads) if opt is None else _update(opt, a["model"], grads, a["opt_state"], loss)
        if case.step == "grad":
            out = (grads,)
        return out + ((state,) if case.norm == "batchnorm" else ())

    return _with_signature(names, body)


def _with_signature(names: tuple[str, ...], body: Callable) -> Callable:
    """`def step(<names>): return body({...})`: a step with named parameters, as users write it."""
    src = f"def step({', '.join(names)}):\n    return body({{{', '.join(f'{n!r}: {n}' for n in names)}}})\n"
    namespace: dict = {"body": body}
    exec(src, namespace)  # noqa: S102  # a fixed template over the grammar's own names
    return namespace["step"]


def _gradient(case: Case, loss_fn: Callable, model: Any, rest: tuple) -> tuple[jax.Array, Any, Any]:
    """`(loss, grads, state)` as the case computes them: filter_value_and_grad, filter_grad,
    jax.value_and_grad on the partitioned model, or accumulated over two micro-batches."""
    if case.accum != "none":
        return _accumulated(case, loss_fn, model, rest)
    return _value_and_grad(case, loss_fn, model, rest)


def _value_and_grad(case: Case, loss_fn: Callable, model: Any, rest: tuple) -> tuple[jax.Array, Any, Any]:
    if case.step == "jax_grad":
        params, static = eqx.partition(model, eqx.is_inexact_array)
        f = lambda p: loss_fn(eqx.combine(p, static), *rest)  # noqa: E731
        (loss, state), grads = jax.value_and_grad(f, has_aux=True)(params)
    elif case.step == "grad":
        grads, state = eqx.filter_grad(loss_fn, has_aux=True)(model, *rest)
        loss = jnp.asarray(0, working("f32"))
    else:
        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, *rest)
    return loss, grads, state


def _accumulated(case: Case, loss_fn: Callable, model: Any, rest: tuple) -> tuple[jax.Array, Any, Any]:
    """Gradient accumulation over two micro-batches in `lax.fori_loop` or `lax.while_loop`."""
    bn, drop = case.norm == "batchnorm", case.dropout
    state = rest[0] if bn else None
    batch = rest[int(bn): int(bn) + 2]
    micro = jax.tree.map(lambda a: a.reshape(2, a.shape[0] // 2, *a.shape[1:]), batch)
    zeros = jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array))

    def one(i: jax.Array, carry: tuple) -> tuple:
        total, acc, st = carry
        args = ((st,) if bn else ()) + jax.tree.map(lambda a: a[i], micro) \
            + ((jax.random.fold_in(rest[-1], i),) if drop else ())
        (loss, st), g = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, *args)
        return total + loss / 2, jax.tree.map(lambda a, b: a + b / 2, acc, g), st

    init = (jnp.asarray(0, working("f32")), zeros, state)
    if case.accum == "fori":
        total, grads, state = jax.lax.fori_loop(0, 2, one, init)
    else:
        i, (total, grads, state) = jax.lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, one(c[0], c[1])), (jnp.int32(0), init))
    return total, grads, state


def _update(opt: Any, model: Any, grads: Any, opt_state: Any, loss: jax.Array) -> tuple:
    updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return loss, eqx.apply_updates(model, updates), opt_state
