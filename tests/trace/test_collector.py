"""``trace.collector.old_objects_frozen``: what existed before a trace is out of the
collector's reach inside it, and the collector is as it was after (its Notes 2 and 3)."""

import gc

import pytest

from memfit.trace.collector import old_objects_frozen


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_objects_alive_at_entry_are_frozen_inside_and_thawed_after(unfrozen):
    before = [object() for _ in range(10)]
    assert gc.get_freeze_count() == 0
    with old_objects_frozen():
        assert gc.get_freeze_count() >= len(before)
    assert gc.get_freeze_count() == 0


def test_a_nested_call_freezes_what_the_outer_one_made_and_only_the_outer_one_thaws(unfrozen):
    with old_objects_frozen():
        outer = gc.get_freeze_count()
        made = [[i] for i in range(1000)]          # objects the collector tracks
        with old_objects_frozen():
            assert gc.get_freeze_count() >= outer + len(made)
        assert gc.get_freeze_count() > 0           # still the outer call's
    assert gc.get_freeze_count() == 0


def test_a_freeze_of_the_callers_own_is_left_as_it_was(unfrozen):
    gc.freeze()
    theirs = gc.get_freeze_count()
    with old_objects_frozen():
        made = [[i] for i in range(1000)]
        assert gc.get_freeze_count() == theirs     # nothing of ours frozen beside theirs
    assert gc.get_freeze_count() == theirs and made


def test_an_error_inside_thaws(unfrozen):
    with pytest.raises(ValueError):
        with old_objects_frozen():
            raise ValueError("inside")
    assert gc.get_freeze_count() == 0
