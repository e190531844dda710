"""planner.verify Note 1: a proposal that missed lowers its family's cap at least by the
models' error on it, so the same proposal is not traced again.

Oracle: a search over three proposals of known predicted bytes, each traced 11 MiB above its
prediction; the proposals traced are counted."""

from memfit.planner.verify import Margins, verify_loop

MiB = 2 ** 20
BUDGET = 1000 * MiB
PREDICTED = (990 * MiB, 900 * MiB, 800 * MiB)      # what the models say each needs
ERROR = 11 * MiB                                    # each traces this much above it


def _run(with_prediction: bool):
    traced = []

    def search(margins: Margins):
        cap = BUDGET - margins.get("fp32")
        return next((p for p in PREDICTED if p <= cap), None)

    def verify(p):
        traced.append(p)
        return None, p + ERROR

    margins = Margins(BUDGET)
    margins.start("fp32")
    found = verify_loop(search, verify, lambda p: "fp32", margins,
                        predicted=(lambda p: p) if with_prediction else None)
    return found, traced


def test_a_miss_lowers_the_cap_by_the_models_error():
    found, traced = _run(with_prediction=True)
    assert traced == [990 * MiB, 900 * MiB]            # 990 missed by 1 MiB: never again
    assert found.candidate == 900 * MiB and found.device_bytes <= BUDGET


def test_without_the_prediction_the_shortfall_alone_lowers_it():
    """What the error adds: the shortfall (1 MiB) plus the slack leaves the 990 MiB proposal
    under the lowered cap, so it is traced again before its family gives way."""
    _, traced = _run(with_prediction=False)
    assert traced[:2] == [990 * MiB, 990 * MiB]
