"""``trace.collector.old_objects_frozen``: what existed before a trace is out of the
collector's reach inside it, and the collector is as it was after (its Notes 2 and 3).

An object is frozen when the collector tracks it but lists it in no generation
(``gc.get_objects`` leaves the permanent one out). Counts of frozen objects are not compared:
a frozen object that dies by its reference count leaves the permanent generation at once.
"""

import gc

import pytest

from memfit.trace.collector import old_objects_frozen


def _frozen(x) -> bool:
    assert gc.is_tracked(x)
    return all(o is not x for o in gc.get_objects())


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_objects_alive_at_entry_are_frozen_inside_and_thawed_after(unfrozen):
    before = [[0]]
    with old_objects_frozen():
        assert _frozen(before)
        made = [[1]]
        assert not _frozen(made)               # what the trace makes, the collector sees
    assert not _frozen(before) and gc.get_freeze_count() == 0


def test_a_nested_call_freezes_what_the_outer_one_made_and_only_the_outer_one_thaws(unfrozen):
    with old_objects_frozen():
        made = [[2]]
        with old_objects_frozen():
            assert _frozen(made)
        assert _frozen(made)                   # still the outer call's
    assert not _frozen(made) and gc.get_freeze_count() == 0


def test_a_freeze_of_the_callers_own_is_left_as_it_was(unfrozen):
    theirs = [[3]]
    gc.freeze()
    with old_objects_frozen():
        made = [[4]]
        with old_objects_frozen():
            assert not _frozen(made)           # nothing of ours frozen beside theirs
    assert _frozen(theirs) and not _frozen(made)


def test_an_error_inside_thaws(unfrozen):
    before = [[5]]
    with pytest.raises(ValueError):
        with old_objects_frozen():
            raise ValueError("inside")
    assert not _frozen(before) and gc.get_freeze_count() == 0
