"""A compiler that refuses programs larger than the device (XLA:TPU, docs/facts.md fact 21), simulated
on the CPU (`tests/simulated_chip.py`): every path plans, fits the chip and gives the plain step's
answer where the step without remat is refused; a refusal is recorded as over budget, never a crash.

Each chip is sized from the step's own compiled figures (outside the chip): its arguments and
outputs, plus a share of the temp bytes without remat, so that the step without remat is refused
and full remat fits.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import smartremat
from smartremat import MB
from smartremat._memory import Stage, peak_of
from smartremat._model import MemoryModel
from smartremat._refused import Refused, compile_or_refuse, needed_bytes, refusal
from smartremat._planner import no_plan_fits
from smartremat._step_plan import BEYOND, REFERENCE_NOTE, REFUSED, tail

from benchmarks.models import TutorialStack
from tests.helpers import FULL, tree_allclose
from tests.models import ScannedTransformer, Transformer
from tests.simulated_chip import simulated_chip, xla_size

OPT = optax.sgd(1e-2, momentum=0.9)
pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return loss, eqx.apply_updates(model, updates), opt_state


def _args(make):
    model = make()
    x = jax.random.normal(jax.random.key(1), (4, 64, 64))
    return model, OPT.init(eqx.filter(model, eqx.is_array)), x, jnp.tanh(x)


def _fresh(args):
    return jax.tree.map(lambda a: jnp.array(a, copy=True) if eqx.is_array(a) else a, args)


def _memory(jitted, args):
    lowered = jitted.lower(*args)
    return getattr(lowered, "lowered", lowered).compile().memory_analysis()


def _total(m) -> int:
    """What a compiled step holds on the device: temp, arguments and outputs not aliased."""
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


MODELS = {"unrolled": lambda: Transformer(3, 64, 4, jax.random.key(0)),
          "scanned": lambda: ScannedTransformer(3, 64, 4, jax.random.key(0))}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pressured(request):
    """`(name, args, plain answer, chip bytes, plain temp bytes)`: the chip holds the donated
    step's arguments and outputs and 60% of its temp bytes without remat."""
    args = _args(MODELS[request.param])
    plain = eqx.filter_jit(step, donate="all")
    m = _memory(plain, args)
    expected = plain(*_fresh(args))
    return request.param, args, expected, int(_total(m) - 0.4 * m.temp_size_in_bytes), m.temp_size_in_bytes


@pytest.mark.parametrize("budget", ["auto", "half"])
def test_filter_jit_plans_where_no_remat_is_refused(pressured, budget):
    name, args, expected, hbm, plain_temp = pressured
    with simulated_chip(hbm) as chip:
        mb = "auto" if budget == "auto" else 0.5 * plain_temp / MB  # below what the chip leaves
        planned = smartremat.filter_jit(step, budget_mb=mb, donate="all")
        plan = planned.plan(*args)
        # the step without remat was refused, or the model put it above the chip (not compiled)
        assert any("HLO temporaries" in r for r in chip.refused) or any(BEYOND in n for n in plan.notes), plan.notes
        m = _memory(planned, args)  # the step that runs compiles on the chip...
        got = planned(*_fresh(args))
    assert m.temp_size_in_bytes <= plan.budget_bytes and _total(m) <= hbm  # ...and fits it
    if budget == "auto":  # the device less its reserve, the arguments and the outputs
        assert plan.budget_bytes < 0.95 * hbm - m.argument_size_in_bytes + m.alias_size_in_bytes
    assert tree_allclose(got[0], expected[0]) and tree_allclose(got[1:], expected[1:])
    assert plan.compiled_peak_bytes is not None and plan.compiled_peak_bytes <= plan.budget_bytes


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_rest_of_the_step_is_measured_on_a_whole_scan(name):
    """Where the step without remat is refused, the reference is the lowest plan with its last
    block without remat, except where that block is an iteration of a scan: leaving it out of
    remat splits the scan, a program unlike the candidates' (docs/fit.md, "Where the scanned model
    errs"). The chip here holds that split program, and refuses only the step without remat."""
    args = _args(MODELS[name])
    m = _memory(eqx.filter_jit(step, donate="all"), args)
    with simulated_chip(int(_total(m) - 0.1 * m.temp_size_in_bytes)):
        plan = smartremat.filter_jit(step, budget_mb=m.temp_size_in_bytes / MB, donate="all").plan(*args)
    # the note says the step without remat was refused by the chip (REFUSED) or modelled above it (BEYOND)
    reference = "the model's lowest plan" + ("" if name == "scanned" else ", its last block without remat")
    assert {REFERENCE_NOTE.format(why=why, plan=reference) for why in (REFUSED, BEYOND)} & set(plan.notes), plan.notes


def test_a_step_the_model_puts_above_the_chip_is_not_compiled_as_the_reference():
    """Where the model's blocks alone, beside the step's arguments and outputs, need more than the
    device holds, the step without remat is not compiled only to be refused (on XLA:TPU a trace and
    a compile of the whole step: 12 s of compile for the TPU check's GPT-2-medium): the reference is
    the model's lowest plan with its last block without remat, and the plan fits."""
    args = _args(MODELS["unrolled"])
    m = _memory(eqx.filter_jit(step, donate="all"), args)
    with simulated_chip(int(_total(m) - 0.4 * m.temp_size_in_bytes)) as chip:
        planned = smartremat.filter_jit(step, budget_mb="auto", donate="all")
        plan = planned.plan(*args)
        ran = _memory(planned, args)
    said = " ".join(chip.refused)
    assert f"({xla_size(m.temp_size_in_bytes)})" not in said and f"Used {xla_size(_total(m))} " not in said
    assert REFERENCE_NOTE.format(why=BEYOND, plan="the model's lowest plan, its last block without remat") in plan.notes
    assert ran.temp_size_in_bytes == plan.compiled_peak_bytes <= plan.budget_bytes


def test_a_device_that_compiles_too_large_programs(pressured):
    """As XLA:GPU: a program larger than the device compiles (and would fail at run time). A
    candidate whose compiled figures exceed the device's memory does not fit, whatever the budget."""
    name, args, expected, hbm, plain_temp = pressured
    if name == "scanned" and not FULL:
        pytest.skip("the unrolled model covers it in CI")
    with simulated_chip(hbm, refuses=False) as chip:
        planned = smartremat.filter_jit(step, budget_mb=2 * plain_temp / MB, donate="all")  # above the device
        plan = planned.plan(*args)
        m = _memory(planned, args)
    assert chip.refused  # the step without remat (at least) was larger than the device
    assert _total(m) <= hbm and plan.compiled_peak_bytes == m.temp_size_in_bytes


def test_explain_and_tune_under_refusals(pressured):
    name, args, expected, hbm, _ = pressured
    if name == "scanned" and not FULL:
        pytest.skip("the scanned model is tuned under `make test-full` (40 s); CI plans it above")
    with simulated_chip(hbm) as chip:
        tuned = smartremat.filter_jit(step, budget_mb="auto", donate="all", tune=True)
        text = str(smartremat.explain(tuned, *args))
        plan = tuned.plan(*args)
        got = tuned(*_fresh(args))
    assert chip.refused and "budget" in text
    assert plan.timed, "tune=True timed no candidate"
    assert tree_allclose(got[0], expected[0]) and tree_allclose(got[1:], expected[1:])


def test_decorator_where_candidates_are_refused():
    model, _, x, y = _args(MODELS["unrolled"])
    loss = lambda m: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    expected = eqx.filter_jit(eqx.filter_grad(loss))(model)
    m = _memory(eqx.filter_jit(eqx.filter_grad(loss)), (model,))
    hbm = int(_total(m) - 0.4 * m.temp_size_in_bytes)
    with simulated_chip(hbm) as chip:
        wrapped = smartremat.smartremat(budget_mb=hbm / MB)(model)  # a budget the chip cannot hold
        grads = eqx.filter_jit(eqx.filter_grad(loss))(wrapped)
        plan = smartremat.explain(wrapped, x)
    assert chip.refused  # some candidate was refused, and planning went on
    assert plan.compiled_peak_bytes is not None and plan.compiled_peak_bytes < hbm
    # the refused candidates are counted in the notes, not paired with a figure the compiler never gave
    assert any(f"did not fit the device's memory" in n for n in plan.notes)
    assert plan.checked and all(compiled <= hbm for _, compiled in plan.checked)
    assert _total(_memory(eqx.filter_jit(eqx.filter_grad(loss)), (wrapped,))) <= hbm  # the step that ran
    assert tree_allclose(grads.module, expected)


def test_the_decorator_where_the_chip_refuses_every_candidate():
    """The decorator's candidates are the module's gradient under its losses, which stand in for
    the step that calls the module: where the device refuses them all, the plan is the model's
    lowest, unconfirmed (no compiled figure, a note, a warning naming what the device refused),
    not an error; the gradient is the plain one."""
    model, _, x, y = _args(MODELS["unrolled"])
    loss = lambda m: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    expected = eqx.filter_jit(eqx.filter_grad(loss))(model)
    m = _memory(eqx.filter_jit(eqx.filter_grad(loss)), (model,))
    hbm = int(_total(m) - m.temp_size_in_bytes)  # arguments and outputs only: every candidate refused
    with simulated_chip(hbm) as chip:  # one chip: its profiles are made once (leaving it clears the caches)
        with pytest.warns(UserWarning, match=r"(?s)no remat plan for Transformer is confirmed by the compiler: the "
                                             r"device refused its gradient under every plan tried \(\d+ candidate "
                                             r"plan\(s\).*plan the whole step with `smartremat.filter_jit`"):
            # whole blocks only, as in `test_no_plan_fits_the_chip`: every candidate is compiled and refused
            wrapped = smartremat.smartremat(budget_mb=m.temp_size_in_bytes / MB, nested=False)(model)
            plan = smartremat.explain(wrapped, x)
        # under the unconfirmed plan (a plain `eqx.filter_jit` call compiles past the simulated chip)
        grads = eqx.filter_jit(eqx.filter_grad(loss))(wrapped)
        with pytest.raises(ValueError, match=r"`smartremat\(budget_mb=0.001\)` is below the lowest peak smartremat's "
                                             r"model predicts for a remat plan .* \(predicted by smartremat's model\)"):
            smartremat.explain(smartremat.smartremat(budget_mb=1e-3, nested=False)(model), x)  # below the model's floor
    assert plan.compiled_peak_bytes is None and 0 < plan.compiles <= len(chip.refused)
    assert plan.predicted_peak_bytes == plan.min_peak_bytes and not plan.checked
    assert any("the model's lowest plan, unconfirmed" in n for n in plan.notes) and "unconfirmed" in str(plan)
    assert tree_allclose(grads.module, expected)


@pytest.mark.parametrize("needed, said", [(int(19.40 * 2**30), "19865.6 MB"), (8550, "0.0082 MB")])
def test_no_plan_fits_states_the_least_any_needed(needed, said):
    """The least figure a refusal named, also for a program of a few kilobytes (not "0.0 MB")."""
    refused = [Refused(needed + 1000, "RESOURCE_EXHAUSTED: ..."), Refused(needed, "RESOURCE_EXHAUSTED: ...")]
    with pytest.raises(ValueError, match=rf"2 candidate plan\(s\), full remat among them, did not fit it "
                                         rf"\(the least any needed: {said}\)"):
        raise no_plan_fits("step", refused)


def test_no_plan_fits_the_chip():
    args = _args(MODELS["unrolled"])
    m = _memory(eqx.filter_jit(step, donate="all"), args)
    hbm = int(_total(m) - m.temp_size_in_bytes)  # arguments and outputs only: nothing fits
    with simulated_chip(hbm), pytest.raises(ValueError, match=r"does not fit the device's memory under any remat "
                                            r"plan tried: \d+ candidate plan\(s\).*No budget changes that"):
        # every candidate refused; whole blocks only: the search compiles every candidate before it gives
        # up, and the nested ones add nothing to the error path tested here
        smartremat.filter_jit(step, budget_mb=1.0, donate="all", nested=False).plan(*args)
    with simulated_chip(hbm), pytest.raises(ValueError, match=r"arguments and outputs alone take"):
        smartremat.filter_jit(step, budget_mb="auto", donate="all").plan(*args)


def test_a_budget_below_what_the_chip_holds_states_the_floor_it_reaches():
    """The cheaper candidates are refused, some compile: the error states the lowest compiled
    figure (a budget that then plans and fits the chip), says that the refused ones fit no budget,
    and the refused step without remat was compiled once (the error path keeps the refusal)."""
    args = _args(MODELS["unrolled"])
    m = _memory(eqx.filter_jit(step, donate="all"), args)
    hbm = int(_total(m) - 0.4 * m.temp_size_in_bytes)
    plain = f"({xla_size(m.temp_size_in_bytes)})"
    with simulated_chip(hbm) as chip, pytest.raises(ValueError, match=r"(?s)Raise `budget_mb` to at least "
                                                    r"([0-9.]+).*did not fit the device's memory.*no budget makes "
                                                    r"those run") as e:
        smartremat.filter_jit(step, budget_mb=0.01, donate="all", nested=False).plan(*args)  # as above
    assert sum(plain in r for r in chip.refused) == 1
    floor = float(e.value.args[0].split("at least ")[1].split(",")[0])
    with simulated_chip(hbm):  # the floor it states is reachable on the chip
        plan = smartremat.filter_jit(step, budget_mb=floor, donate="all", nested=False).plan(*args)
    assert plan.compiled_peak_bytes is not None and plan.compiled_peak_bytes <= floor * MB


@pytest.mark.parametrize("reference", [(0, 0, 0), (2, 2, 0), (2, 2, 2)])
def test_the_tail_is_measured_on_any_reference_plan(reference):
    """`tail(model, temp, choice)`: where the rest of the step sets the reference's peak, the
    refined model predicts that reference at its compiled temp bytes, whichever plan it is (the
    step without remat, or the lowest plans tried where the device refuses it)."""
    stages = tuple(Stage(saved=(100, 40, 5), peak=(150, 90, 60), cost=(0, 10, 30), group=g) for g in range(3))
    model = MemoryModel((), (), stages, 7, (0, 1, 2), ())
    temp = peak_of(stages, reference) + 7 + 500  # a rest of the step larger than any block's own peak
    refined = tail(model, temp, reference)
    assert peak_of(refined.stages, reference) + refined.fixed_bytes == temp
    assert refined.stages[:2] == stages[:2]  # only the last stage's own peak is raised


@pytest.mark.parametrize("message, needed", [
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (19.40G) "
     "exceeds available HBM (15.75G).", int(19.40 * 2**30)),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used "
     "20.51G of 15.48G hbm. Exceeded hbm capacity by 5.03G.", int(20.51 * 2**30)),
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 512.00MiB.", 512 * 2**20),
    ("RESOURCE_EXHAUSTED: out of memory on device 0", None),
])
def test_refusal_messages(message, needed):
    refused = refusal(jax.errors.JaxRuntimeError(message))
    assert isinstance(refused, Refused) and refused.needed == needed
    assert needed_bytes(message) == needed
    with pytest.raises(Refused, match="RESOURCE_EXHAUSTED"):
        compile_or_refuse(lambda: (_ for _ in ()).throw(jax.errors.JaxRuntimeError(message)))


def test_other_errors_are_not_refusals():
    assert refusal(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: shapes differ")) is None
    assert refusal(ValueError("RESOURCE_EXHAUSTED")) is None  # not the compiler's error
    with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT"):
        compile_or_refuse(lambda: (_ for _ in ()).throw(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: x")))


def test_the_simulated_chip_words_sizes_as_xla():
    assert (xla_size(19.4 * 2**30), xla_size(512 * 2**20), xla_size(3 * 2**10), xla_size(12)) == \
        ("19.40G", "512.00M", "3.00K", "12B")
    f = jax.jit(lambda a: jnp.sin(a) @ a.T)
    a = jnp.ones((256, 256))
    need = _memory(f, (a,)).temp_size_in_bytes
    with simulated_chip(need // 2) as chip, pytest.raises(jax.errors.JaxRuntimeError, match="HLO temporaries"):
        f.lower(a).compile()
    assert len(chip.refused) == 1
    assert f.lower(a).compile() is not None  # the chip is gone


def test_calibration_falls_back_option_by_option():
    """A chip that holds the block's backward under remat but not without it: the options whose
    calibrating compiles fit keep the compiler's own peak, only the refused one falls back to the
    jaxpr's counts (not the whole block)."""
    model, x = TutorialStack(2, 64, 4096, jax.random.key(0)), jnp.ones((1024, 64))

    def figures():
        plan = smartremat.explain(smartremat.smartremat(budget_mb=1000, verify=False)(model), x)
        return {o.name: o.peak_bytes for o in plan.blocks[0].options}

    calibrated = figures()
    hbm = (calibrated["none"] + calibrated["nothing_saveable"]) // 2
    with simulated_chip(hbm) as chip:
        got = figures()
    assert chip.refused and got["none"] != calibrated["none"]
    assert got["nothing_saveable"] == calibrated["nothing_saveable"]
    assert got["dots_saveable"] == calibrated["dots_saveable"]
