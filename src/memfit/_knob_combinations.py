"""Which combinations of knobs no technique runs yet, refused with the fix.

Knobs alone, no torch: the CLI asks before any import, ``build_runner`` before anything is
applied (``Knobs.check_combinations`` calls ``check_combinations`` here). Each refusal names
the knobs and what to set instead; the docs it points to say why.
"""

from __future__ import annotations

__all__ = ["check_combinations"]


def check_combinations(k, user_step: bool = False) -> None:
    """Refuse, with the fix, the combinations of ``k`` (a ``Knobs``) no technique runs yet;
    ``user_step``: the loop is the caller's (``step=fn``)."""
    if k.offload_gradients:
        _check_offload_gradients(k, user_step)
    if k.offload_optimizer and k.precision == "bf16-pure":
        raise ValueError("offload_optimizer with bf16-pure is not supported yet: its fp32 "
                         "master weights would be kept twice; use bf16 autocast instead")
    if k.offload_params not in (None, "none") and not k.offload_optimizer:
        raise ValueError(f"offload_params={k.offload_params!r} needs "
                         "offload_optimizer=True: an offloaded weight's host copy is the "
                         "optimizer's fp32 host twin, stepped on the host "
                         "(docs/techniques/parameter-offload.md)")
    if k.optimizer_impl == "compiled":
        _check_compiled_step(k)
    if k.chunked_loss and (k.sharding not in (None, "none") or k.gpus not in (None, 1)):
        raise ValueError(f"chunked_loss={k.chunked_loss} with several GPUs (gpus, "
                         "sharding) is not supported yet: leave chunked_loss unset there")


def _check_compiled_step(k) -> None:
    """What a compiled optimizer step is not modelled with (docs/compiled.md, "Compiled
    optimizer steps"), with the fix."""
    refused = [name for name, bad in (
        ("offload_optimizer", k.offload_optimizer),
        ("offload_params", k.offload_params not in (None, "none")),
        ("offload_gradients", k.offload_gradients),
        ("optimizer_in_backward", k.optimizer_in_backward),
        (f"optimizer_state={k.optimizer_state!r}",
         k.optimizer_state not in (None, "fp32")),
        ("gpus/sharding", k.sharding not in (None, "none") or k.gpus not in (None, 1)),
        ("remat", k.remat)) if bad]
    if refused:
        raise ValueError(f"optimizer_impl='compiled' with {', '.join(refused)} is not "
                         f"modelled: a compiled step runs on the device, over fp32 state, "
                         f"on one GPU; leave optimizer_impl unset (or 'foreach', 'fused', "
                         f"'for-loop') or leave those unset")


def _check_offload_gradients(k, user_step: bool) -> None:
    """What cannot run with the gradients moved to the host in backward
    (techniques.optimizer_offload), with the fix."""
    refused = (
        (not k.offload_optimizer, "needs offload_optimizer=True (the gradients go to the "
         "optimizer's fp32 host copies, which only the offloaded optimizer has); set "
         "offload_optimizer=True"),
        (k.precision == "fp16", "with precision='fp16' is not supported: the GradScaler "
         "unscales and checks the device gradients, which the hooks have moved; use "
         "precision='bf16' (no loss scaling)"),
        (k.offload_params not in (None, "none"), "with offload_params is not supported "
         "yet: both move tensors in the same post-accumulate-grad hooks; leave one unset"),
        (user_step, "with step=fn is not supported: the step's own clipping or GradScaler "
         "would read the device gradients, which the hooks have moved; use memfit's step "
         "(max_grad_norm clips the host gradients)"),
    )
    for bad, why in refused:
        if bad:
            raise ValueError(f"offload_gradients=True {why}, or leave offload_gradients "
                             "unset")
