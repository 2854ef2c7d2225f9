"""Options are values: told apart by what they do, not by their display name; equal ones are one."""

import jax
import jax.numpy as jnp

from smartremat import _model
from smartremat._decorator import make_config
from smartremat._discover import call_module
from smartremat._options import NO_REMAT, Nested, NoRemat, Policy, Segments, from_json
from smartremat._policies import DEFAULT_MENU, FULL_REMAT, normalise_policies
from smartremat._profile import profile_block
from smartremat._spec import make_spec

from benchmarks.models import TutorialBlock

cp = jax.checkpoint_policies
MLP, ATTN = (("attr", "mlp"),), (("attr", "attn"),)


def saves_dots(prim, *avals, **params):
    return prim is jax.lax.dot_general_p


def saves_nothing(prim, *avals, **params):
    return False


def test_options_with_one_display_name_are_told_apart():
    """Two policies shown under the same name are two options, each with its own figures."""
    dots, nothing = Policy(saves_dots, "mine", checked=True), Policy(saves_nothing, "mine", checked=True)
    assert dots.name == nothing.name and dots != nothing
    block, x = TutorialBlock(32, 256, jax.random.key(0)), jnp.ones((16, 32))
    profile = profile_block(make_spec(block, (x,), {}), call_module, (NO_REMAT, dots, nothing), False)
    found = [_model.find_option(profile, o) for o in (dots, nothing)]
    assert [f.option for f in found] == [dots, nothing]
    assert found[1].saved_bytes < found[0].saved_bytes
    assert Nested(((MLP, dots),)) != Nested(((MLP, nothing),))
    assert Segments(((0, 1, dots), (1, 2, NO_REMAT))) != Segments(((0, 1, nothing), (1, 2, NO_REMAT)))


def test_equal_options_compare_and_hash_equal():
    """Options made twice from the same policies are equal (caches keyed on them hit), whatever
    argument they came from; no remat is one value."""
    assert NoRemat() == NO_REMAT and hash(NoRemat()) == hash(NO_REMAT)
    one, two = Policy(saves_dots, "d", checked=True), Policy(saves_dots, "d", checked=True, argument="explain")
    assert one == two and hash(one) == hash(two)
    assert normalise_policies([saves_dots, cp.nothing_saveable]) == normalise_policies([saves_dots, cp.nothing_saveable])
    assert normalise_policies([cp.dots_saveable, cp.nothing_saveable]) == (NO_REMAT, DEFAULT_MENU[1], FULL_REMAT)
    nested = lambda: Nested(((MLP, FULL_REMAT), (ATTN, NO_REMAT)))
    assert nested() == nested() and hash(nested()) == hash(nested())
    first, second = (make_config(1.0, policies=[saves_dots], verify=False) for _ in range(2))
    assert first == second and hash(first) == hash(second)


def test_options_round_trip_through_json():
    named = {o.name: o for o in DEFAULT_MENU}.__getitem__
    nested = Nested(((MLP, FULL_REMAT), ((("idx", 0),), DEFAULT_MENU[1])))
    for option in (*DEFAULT_MENU, nested, Segments(((0, 2, nested), (2, 4, NO_REMAT)))):
        assert from_json(option.to_json(), named) == option
    assert nested.name == "nested(mlp=full,[0]=dots)"
    assert nested.expand((("attr", "layer"),)) == (((("attr", "layer"), ("attr", "mlp")), FULL_REMAT),
                                                   ((("attr", "layer"), ("idx", 0)), DEFAULT_MENU[1]))
