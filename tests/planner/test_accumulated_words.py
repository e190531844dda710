"""The plan's words for micro-batches say the split accumulation makes (an uneven batch's last
micro-batch is short: 32 in micro-batches of 3 printed "3 x 11")."""

import pytest
import torch

from memfit.planner._explain import accumulated_words
from memfit.techniques.accumulation import Accumulation


@pytest.mark.parametrize("b, m", [(32, 3), (32, 8), (16, 6), (5, 4)])
def test_the_words_are_the_split_accumulation_makes(b, m):
    sizes = [len(part) for part in Accumulation(Accumulation.Config(m)).split(torch.arange(b))]
    full = sizes.count(m)
    short = [s for s in sizes if s != m]
    assert accumulated_words(b, m) == f"micro-batch {m} x {full}" + \
        (f" + {short[0]}" if short else "") + " accumulated"
    assert sum(sizes) == b and len(short) <= 1
