"""The caching-allocator setting a plan runs under, chosen on its verified trace (issue 17).

Note 1 (what is chosen). On a CUDA target, ``memplan.allocator_options`` replays the verified
trace's storages under each setting PyTorch can apply (pools: "default", "optimizer-pool",
"phase-pools", each with and without ``expandable_segments``; a pool is chosen by the phase an
allocation happens in, and the backward stays in the default one) and the one reserving least is the
plan's ``allocator`` when it reserves less than the default:
``{"scheme", "expandable_segments", "saved_bytes"}``. ``saved_bytes`` is modelled (the default's
replay minus the setting's) and is already taken off the plan's predicted reserved and device bytes.
On the step where only expandable segments differ, memplan's replay and the trace's own
(``estimate(..., allocator=AllocatorConfig(expandable_segments=True))``) give the same bytes
(tests/memplan/test_plan_allocator.py holds them to it).

Note 2 (the budget). The saved bytes count: a trace that misses the budget under the default
allocator but fits under the best setting is accepted (the plain-step check and the search's
verification, ``fits``), so a setting is worth a configuration, not only a figure. The options
are replayed only where they matter: for the accepted trace, and for a trace that misses by
the default's figure by less than a setting can save (Note 6).

Note 3 (what can still be applied). ``expandable_segments`` is read once, when CUDA's
allocator starts (from ``PYTORCH_CUDA_ALLOC_CONF``). A model whose tensors are already on a GPU has
started it, so planning it (what ``memfit.fit`` does) weighs only the setting the allocator
runs with (``PYTORCH_CUDA_ALLOC_CONF``'s); pools can be entered at any time, so they are still
weighed. The plan's reasons say what a free choice would have saved and how to get it (export
the variable before starting Python). A plan made elsewhere (JSON, another process) that needs
expandable segments the running allocator lacks is refused when a Runner is built (``apply``),
never run on bytes it cannot realise. On a CPU the setting is not applied (nothing changes:
it is a CUDA caching-allocator setting) and the Runner's notes say so.

Note 4 (a caller's allocator). ``plan(..., allocator=AllocatorConfig(...))`` fixes the
allocator: the traces model that configuration and nothing is chosen (``allocator`` stays None).

Note 5 (one figure). The chosen trace a plan carries (``Planned.chosen``: what the report, the
plot and ``--json`` draw) is the one under the chosen setting (``under_setting``): its
reserved bytes and card are the default's less ``saved_bytes``, as the plan's predicted bytes
are, so every front prints the same device bytes (they printed the default's, 392 MiB above
the console's on the default job).

Note 6 (a trace no setting can save). Every setting allocates the same blocks (the rounding is
the block's size's, not the pool's), so each one's reserved peak is at least the trace's
allocated peak, and the default's replay is the trace's own (the same events through the same
allocator model). A setting can therefore save at most ``reserved - allocated``; a trace that
misses the budget by more is refused without replaying the six settings (the plain fp32 and
16-bit steps of a job that needs a plan: 0.7 s of the README plan's 13).
tests/memplan/test_plan_allocator.py holds both premises on several steps.
"""

from __future__ import annotations

import dataclasses

from memfit.memplan import allocator_options
from memfit.runtime.mem_pools import PhasePools, allocator_expandable, use_expandable_segments
from memfit.units import format_bytes

__all__ = ["AllocatorChoice", "PLAIN_FITS", "apply_allocator", "setting_name"]

_ENV_HINT = ("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting Python "
             "(or call memfit.runtime.mem_pools.use_expandable_segments() before the first "
             "CUDA tensor)")

PLAIN_FITS = "the plain step fits: nothing to change"      # the planner's reason
_UNDER = "the plain step fits under the allocator setting below"


def setting_name(setting) -> str:
    """A plan's ``allocator`` by name, e.g. "phase-pools + expandable_segments"."""
    return setting["scheme"] + (" + expandable_segments" if setting["expandable_segments"]
                                else "")


def _on_cuda(model) -> bool:
    tensors = list(model.parameters()) + list(model.buffers())
    return any(t.device.type == "cuda" for t in tensors)


class AllocatorChoice:
    """The allocator choice of one ``plan_traced`` call (Notes 1-4)."""

    def __init__(self, model, spec, allocator):
        self.free = spec.kind == "cuda" and allocator is None        # Note 4
        self.expandable = None                                         # None: either (Note 3)
        if self.free and _on_cuda(model):
            self.expandable = allocator_expandable()
        self._options: dict[int, tuple] = {}

    def _best(self, est):
        """(best applicable option under Note 3's limit, the unlimited best, default), or None."""
        key = id(est)
        if key not in self._options:
            result = None
            if self.free and getattr(est, "lifetimes", None) is not None:
                opts = allocator_options(est, ("default", "optimizer-pool", "phase-pools"))
                allowed = [o for o in opts.options if o.applicable and
                           (self.expandable is None or o.expandable_segments == self.expandable)]
                result = (min(allowed, key=lambda o: o.reserved_bytes), opts.best, opts.default)
            self._options[key] = (est, result)       # est kept so its id is not reused
        return self._options[key][1]

    def saved(self, est) -> int:
        """Bytes the best applicable setting reserves less than the default (modelled, >= 0)."""
        best = self._best(est)
        return 0 if best is None else max(0, best[2].reserved_bytes - best[0].reserved_bytes)

    def fits(self, est, held: int, budget: int) -> bool:
        """The trace fits the budget under the default, or else under the best setting."""
        bytes_ = est.device_bytes + held
        if bytes_ <= budget:
            return True
        if not self.free or bytes_ - (est.reserved_bytes - est.peak_bytes) > budget:
            return False                       # Note 6: no setting can save that much
        return bytes_ - self.saved(est) <= budget

    def under_setting(self, est):
        """``est`` as the chosen setting reserves it: the saved bytes off its reservation and
        its card's allocator line (Note 5), so a front printing it prints the plan's bytes."""
        saved = self.saved(est)
        if saved <= 0:
            return est
        card = None if est.card is None else \
            dataclasses.replace(est.card, allocator_bytes=est.card.allocator_bytes - saved)
        return dataclasses.replace(est, reserved_bytes=est.reserved_bytes - saved, card=card)

    def apply(self, plan, est):
        """``plan`` with the setting chosen on ``est`` (its verified trace) and its bytes."""
        best = self._best(est)
        if best is None:
            return plan
        chosen, unlimited, default = best
        saved = max(0, default.reserved_bytes - chosen.reserved_bytes)
        reasons = list(plan.reasons)
        more = chosen.reserved_bytes - unlimited.reserved_bytes
        if more > 0:
            reasons.append(
                f"allocator: {unlimited.name} would reserve {format_bytes(more)} less again "
                "(modelled), but CUDA has started here (the model is on the GPU), so "
                f"expandable_segments stays {self.expandable}: {_ENV_HINT}, and plan again")
        if saved <= 0:
            return dataclasses.replace(plan, reasons=reasons) if more > 0 else plan
        setting = {"scheme": chosen.scheme, "expandable_segments": chosen.expandable_segments,
                   "saved_bytes": int(saved)}
        how = []
        if chosen.scheme != "default":
            how.append("memfit's Runner enters torch.cuda.MemPools around the step's phases")
        if chosen.expandable_segments and self.expandable is None:
            how.append(f"expandable_segments must be set before CUDA starts: {_ENV_HINT}")
        if plan.budget_bytes is not None and plan.predicted_device_bytes is not None and \
                plan.predicted_device_bytes > plan.budget_bytes:     # fits by the setting alone
            reasons = [_UNDER if r == PLAIN_FITS else r for r in reasons]
        reasons.append(f"allocator: {chosen.name} reserves {format_bytes(saved)} less than the "
                       "default caching allocator at the peak (modelled, counted in the "
                       "budget)" + ("; " + "; ".join(how) if how else ""))
        device = None if plan.predicted_device_bytes is None else \
            plan.predicted_device_bytes - saved
        floor = plan.floor_bytes if plan.floor_bytes is None or device is None else \
            min(plan.floor_bytes, device)
        return dataclasses.replace(
            plan, allocator=setting, reasons=reasons, predicted_device_bytes=device,
            predicted_reserved_bytes=None if plan.predicted_reserved_bytes is None else
            plan.predicted_reserved_bytes - saved, floor_bytes=floor)


def apply_allocator(plan, device_type: str):
    """What a Runner built from ``plan`` does about its ``allocator`` (Note 3): returns
    ``(PhasePools or None, note or None)``; raises ``RuntimeError`` where the setting needs
    expandable segments the running allocator cannot take."""
    setting = plan.allocator
    if setting is None:
        return None, None
    name = setting_name(setting)
    if device_type != "cuda":
        return None, (f"allocator {name}: not applied, the model runs on {device_type} (a "
                      "CUDA caching-allocator setting; nothing changes)")
    notes = []
    if setting["expandable_segments"]:
        try:
            use_expandable_segments(True)
        except RuntimeError as e:
            raise RuntimeError(
                f"this plan's predicted bytes assume {name} "
                f"({format_bytes(setting['saved_bytes'])} less reserved than the default), but "
                f"the running allocator cannot take expandable_segments any more: {e}; or plan "
                "again in this process (memfit.fit plans with the allocator as it runs)") from e
        notes.append("expandable_segments:True is in force")
    elif allocator_expandable():
        notes.append("the allocator runs with expandable_segments:True, which the plan did "
                     "not assume (its figures are the fixed-segment allocator's)")
    pools = None
    if setting["scheme"] != "default":
        pools = PhasePools(setting["scheme"])
        phases = "forward and the optimizer step" if setting["scheme"] == "phase-pools" \
            else "optimizer step"
        notes.append(f"torch.cuda.MemPools around the {phases}")
    return pools, f"allocator {name}: " + "; ".join(notes)
