"""``planner.verify.least_traced``: the floor's candidates, traced from the least the models
predict, skipping those far above both that prediction and the least traced so far (Note 2).

The candidates are plain values here and the "trace" a table, so the rule itself is the
oracle: which candidates are traced and which is returned.
"""

from memfit.planner.verify import FLOOR_PRUNE, least_traced

GIB = 2 ** 30


def _run(predicted: dict, traced: dict):
    asked = []

    def trace(c):
        asked.append(c)
        return traced[c], f"trace of {c}"

    out = least_traced(predicted, predicted=predicted.get, ident=lambda c: c, trace=trace)
    return out, asked


def test_a_model_far_too_optimistic_does_not_hide_the_least():
    """Parameter offload predicted lowest traces at 11.11 GiB; the gradients on the host,
    predicted above 1.5x that prediction, trace at 8.26 GiB, and are the least."""
    predicted = {"params on host": 5.0 * GIB, "grads on host": 8.0 * GIB,
                 "recompute": 14.0 * GIB, "far": 40.0 * GIB}
    traced = {"params on host": int(11.11 * GIB), "grads on host": int(8.26 * GIB),
              "recompute": int(12.5 * GIB), "far": int(30 * GIB)}
    (floor, choice, est), asked = _run(predicted, traced)
    assert (floor, choice, est) == (traced["grads on host"], "grads on host",
                                    "trace of grads on host")
    # 14 GiB is above 1.5 x 8.26 GiB, the least traced when it is reached: not traced
    assert asked == ["params on host", "grads on host"]


def test_models_that_hold_keep_the_cutoff_at_their_least():
    """Where the traces agree with the models, the cutoff is FLOOR_PRUNE x the least
    predicted, as it was: nothing more is traced."""
    predicted = {"a": 10.0 * GIB, "b": 10.0 * GIB * FLOOR_PRUNE, "c": 16.0 * GIB}
    traced = {c: int(v) for c, v in predicted.items()}
    (floor, choice, _), asked = _run(predicted, traced)
    assert (floor, choice) == (traced["a"], "a") and asked == ["a", "b"]


def test_a_pessimistic_model_still_traces_up_to_its_own_cutoff():
    """A first trace far below its prediction does not shrink the cutoff below FLOOR_PRUNE x
    the least predicted (the candidates traced before this rule still are)."""
    predicted = {"a": 10.0 * GIB, "b": 14.0 * GIB}
    traced = {"a": 5 * GIB, "b": 4 * GIB}
    (floor, choice, _), asked = _run(predicted, traced)
    assert (floor, choice) == (4 * GIB, "b") and asked == ["a", "b"]


def test_every_traced_candidate_is_returned_least_first():
    from memfit.planner.verify import traced_candidates

    predicted = {"a": 10, "b": 11, "c": 12}
    traced = {"a": 13, "b": 9, "c": 11}
    out = traced_candidates(predicted, predicted=predicted.get, ident=lambda c: c,
                            trace=lambda c: (traced[c], c))
    assert [t[1] for t in out] == ["b", "c", "a"]
