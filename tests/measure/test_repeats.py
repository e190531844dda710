"""A stretch of a fake trace copied instead of run again (``measure._repeats``).

The oracle is the same ops run again: the copy must leave the tracker as running them would
(timeline, peak, ops, costs), and a stretch that is not closed (a storage it makes outlives it,
one it did not make dies in it) must not be recorded at all.
"""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.measure import Tracker
from memfit.measure._repeats import opening, recorded, repeat


def _update(x):
    """Temporaries only, freed before it returns."""
    y = x * 2
    z = y + 1
    del y
    return float(z.shape[0])


def _traced(copies: bool):
    with FakeTensorMode():
        with Tracker(device="cpu", fake=True) as t:
            x = torch.empty(256)               # made in the region: no entry in the stretch
            mark = opening(t)
            _update(x)
            stretch = recorded(t, mark)
            for _ in range(3):
                if copies:
                    repeat(t, stretch)
                else:
                    _update(x)
    return t, stretch


def test_a_copied_stretch_counts_what_running_it_again_counts():
    copied, stretch = _traced(copies=True)
    ran, _ = _traced(copies=False)
    assert stretch is not None and len(stretch.ops) == 2
    assert copied.timeline == ran.timeline and len(copied.timeline) == 9
    assert copied.peak_bytes == ran.peak_bytes == 3 * 256 * 4
    assert copied.op_log == ran.op_log and copied.op_costs == ran.op_costs
    assert copied.ops == ran.ops and copied.fw_flops == ran.fw_flops


def test_a_stretch_that_is_not_closed_is_not_recorded():
    with FakeTensorMode():
        x = torch.empty(256)
        older = x * 5
        with Tracker(device="cpu", fake=True) as t:
            mark = opening(t)
            kept = x * 2                       # outlives the stretch
            assert recorded(t, mark) is None
            mark = opening(t)
            del kept                           # made before the stretch, dies in it
            _update(x)
            assert recorded(t, mark) is None
            mark = opening(t)
            older.add(1)                       # first read here: an entry storage
            assert recorded(t, mark) is None
            mark = opening(t)                  # no op at all: nothing to copy
            assert recorded(t, mark) is None


def test_a_real_run_is_never_recorded():
    x = torch.ones(64)
    with Tracker(device="cpu") as t:
        mark = opening(t)
        _update(x)
        assert recorded(t, mark) is None
