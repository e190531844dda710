"""measure._grad_hooks.when_all_gradients: once per backward, after every watched gradient,
holding none of them (torch's "all" multi-grad hook keeps each until the last arrives: a
cross-attention's early input gradient stayed alive through a BART decoder's backward)."""

import torch
from torch.autograd.graph import register_multi_grad_hook

from memfit.measure._grad_hooks import when_all_gradients


def _run(watch) -> list[list[bool]]:
    """Two tensors whose gradients arrive apart (``x``'s long before ``y``'s, which waits on
    a chain of ops); at the hook: whether each gradient's storage was already freed."""
    a = torch.randn(64, 64, requires_grad=True)
    x, y = a * 2, a * 3
    seen, fired = {}, []
    def keeps_a_weak_ref(name):
        def hook(grad):
            seen.setdefault(name, grad.untyped_storage()._weak_ref())
        return hook

    for name, t in (("x", x), ("y", y)):
        t.register_hook(keeps_a_weak_ref(name))
    handle = watch([x, y], lambda *_: fired.append(
        [torch.UntypedStorage._expired(seen[n]) for n in ("x", "y")]))
    z = y
    for _ in range(4):
        z = z.tanh() * 1.5
    (x.sin() + z).sum().backward()
    handle.remove()
    for ref in seen.values():
        torch.UntypedStorage._free_weak_ref(ref)
    return fired


def test_it_fires_once_after_both_and_keeps_neither():
    fired = _run(when_all_gradients)
    assert len(fired) == 1
    assert sorted(fired[0]) == [False, True]      # the early one was freed, the last is in hand


def test_torchs_all_hook_keeps_the_early_gradient():
    """Why memfit has its own: the same run under torch's hook frees neither before it fires."""
    fired = _run(lambda ts, fn: register_multi_grad_hook(ts, fn, mode="all"))
    assert fired == [[False, False]]
