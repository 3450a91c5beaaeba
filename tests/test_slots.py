"""In-flight slots (cupyep.slots) and the stale-result check of DispatchResult."""
import pytest

from cupyep.errors import StaleResultError
from cupyep.results import POOL_FIELDS, DispatchResult
from cupyep.slots import InFlightSlots, check_num_in_flight


def test_slots_go_round_robin_and_a_reused_slot_makes_its_old_lease_stale():
    slots = InFlightSlots(2, "test pool")
    a, b = slots.take("dispatch A"), slots.take("dispatch B")
    assert (a.slot, b.slot) == (0, 1) and a.valid and b.valid
    c = slots.take("dispatch C")
    assert c.slot == 0 and not a.valid and b.valid and c.valid
    with pytest.raises(StaleResultError, match=r"recv_x of dispatch A #1 is stale: its slot 0 .* dispatch C #3"):
        a.check("recv_x")
    b.check("recv_x")
    slots.invalidate_all()
    assert not b.valid and not c.valid


def test_one_slot_keeps_only_the_last_dispatch():
    slots = InFlightSlots(1)
    a = slots.take("x")
    assert slots.peek() == 0
    b = slots.take("y")
    assert not a.valid and b.valid


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_num_in_flight_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="num_in_flight"):
        check_num_in_flight(bad)
    with pytest.raises(ValueError, match="num_in_flight"):
        InFlightSlots(bad)


def test_a_stale_result_raises_on_every_pool_field_and_a_fresh_one_never():
    slots = InFlightSlots(2)
    lease = slots.take("Buffer.dispatch (direct)")
    res = DispatchResult("x", None, "idx", "w", [1], handle="h", event=None, expert_x="ex", lease=lease)
    assert res.recv_x == "x" and not res.stale
    slots.take("B")
    slots.take("C")
    assert res.stale
    for name in POOL_FIELDS:
        with pytest.raises(StaleResultError, match=name):
            getattr(res, name)
    assert res.handle == "h" and res.num_recv_tokens_per_expert == [1]  # not pool memory: still readable
    own = DispatchResult("x", None, "idx", "w")
    assert own.recv_x == "x" and not own.stale
    part = DispatchResult("x", None, "idx", "w", expert_x="ex", lease=lease, pooled=frozenset({"recv_x"}))
    assert part.expert_x == "ex" and part.recv_topk_idx == "idx"  # arrays of its own: readable when stale
    with pytest.raises(StaleResultError, match="recv_x"):
        part.recv_x


def test_declared_sizes_name_the_constructor_argument():
    from cupyep.sizes import DeclaredSizes
    sizes = DeclaredSizes(max_tokens=128, hidden=1024, num_topk=4)
    sizes.check("Buffer.dispatch", 128, 1024, 4)
    sizes.check("Buffer.dispatch", 1, 128, None)
    for args, name in (((129, 1024, 4), "max_tokens=128"), ((8, 2048, 4), "hidden=1024"),
                       ((8, 1024, 5), "num_topk=4")):
        with pytest.raises(ValueError, match=f"Buffer.dispatch: .*made with {name}"):
            sizes.check("Buffer.dispatch", *args)
    for bad in (dict(max_tokens=0), dict(hidden=100), dict(num_topk=-1), dict(max_tokens=2.5)):
        with pytest.raises(ValueError):
            DeclaredSizes(**bad)


def test_a_captured_dispatch_pins_its_slot_while_its_lease_lives():
    import gc
    slots = InFlightSlots(2, "test pool")
    graph = slots.take("captured", pin=True)
    assert graph.slot == 0 and slots.pinned(0)
    eager = [slots.take(f"eager {i}") for i in range(3)]
    assert [e.slot for e in eager] == [1, 1, 1] and graph.valid  # the rotation skips the pinned slot
    both = slots.take("captured too", pin=True)
    assert both.slot == 1
    with pytest.raises(ValueError, match="pinned by a dispatch captured in a CUDA graph"):
        slots.take("one more")
    del graph
    gc.collect()
    assert not slots.pinned(0) and slots.take("after the graph").slot == 0
