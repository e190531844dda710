"""Argument types and checks that run before anything is traced (nothing here imports torch).

Note 1 (values that start with '-'). argparse reads ``--budget -3GiB`` as a flag followed by
the unknown option ``-3GiB`` and answers "expected one argument". ``join_dash_values`` rewrites
it to ``--budget=-3GiB`` before parsing, so the value reaches its type and is refused for what
it is (negative), with the fix.

Note 2 (one syntax per flag, issue 26). A flag that switches a lever takes ``on`` or ``off`` in
every subcommand (``--offload-optimizer on``), and alone means on (``--offload-optimizer``, as
``estimate`` spelled it), so a command line copied from one subcommand to another means the
same. ``--reshard-after-forward`` takes on, off or a group size N; its old true/false still
work, with a deprecation warning.

Note 3 (a flag typed, or its default). argparse gives a flag left out its default, so a check
that must know whether the user typed a flag (``--batch-size 8`` under ``--hf-args``, where the
JSON's batch size is the run's) cannot read it from the value. ``given_dests`` parses the same
command line again with every default suppressed: what remains was typed.
"""

from __future__ import annotations

import argparse
import os

from memfit.knobs import ZERO_GRADS
from memfit.units import UNITS_HELP, parse_bytes

__all__ = ["add_switch", "reshard_value", "budget_bytes", "reserve_bytes", "cuda_version", "positive_int", "positive_float", "int_or_auto",
           "join_dash_values", "check_output_path", "progressive_spec", "add_zero_grad_arg",
           "add_chunked_loss_arg", "chunk_count", "add_optimizer_in_backward_arg",
           "add_offload_gradients_arg", "given_dests",
           "VALUE_FLAGS", "BYTES_HELP"]

# flags whose value may start with '-' (Note 1)
VALUE_FLAGS = ("--budget", "--reserve", "--cuda-version", "--micro-batch-size", "--max-grad-norm", "--batch-size",
               "--seq-len", "--max-seq-len", "--image-size", "--lora-rank", "--progressive",
               "--chunked-loss")

BYTES_HELP = f"a number and a unit: {UNITS_HELP}"


def join_dash_values(argv: list[str]) -> list[str]:
    """``[..., "--budget", "-3GiB"]`` -> ``[..., "--budget=-3GiB"]`` (Note 1)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in VALUE_FLAGS and i + 1 < len(argv) and argv[i + 1].startswith("-") and \
                argv[i + 1] not in ("-h", "--help") and not argv[i + 1].startswith("--"):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def given_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the flags ``argv`` types (Note 3); ``argv`` parses already."""
    parsers, saved, positional = [parser], [], {"command"}
    while parsers:
        p = parsers.pop()
        saved.append((p, dict(p._defaults)))
        p._defaults.clear()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
            if not action.option_strings:      # a positional's default must be a choice
                positional.add(action.dest)
                continue
            saved.append((action, action.default))
            action.default = argparse.SUPPRESS
    try:
        return set(vars(parser.parse_args(argv))) - positional
    finally:
        for owner, value in saved:
            if isinstance(owner, argparse.ArgumentParser):
                owner._defaults.update(value)
            else:
                owner.default = value


def budget_bytes(text: str) -> int:
    """--budget: a byte size of at least 1 byte; a bare number under 1 MiB is refused
    (as ``memfit.parse_bytes`` refuses one: no step fits in 11 bytes), so ``11`` asks for a unit
    and ``11B`` is 11 bytes."""
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value == 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is a budget of 0 bytes, which nothing fits: give the device bytes to "
            f"fit, e.g. 10GiB ({UNITS_HELP})")
    return value


def reserve_bytes(text: str) -> int:
    """--reserve: a byte size (0 allowed), the same reading as --budget."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cuda_version(text: str) -> str:
    """--cuda-version: "12", "12.4", "11.8" (checked here; the device checks its range)."""
    from memfit._cuda_overhead import parse_cuda_version

    try:
        major, minor = parse_cuda_version(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return f"{major}.{minor}"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    if value > _LARGEST_COUNT:
        raise argparse.ArgumentTypeError(f"{value} is larger than any batch, length or count "
                                         f"memfit can build (at most {_LARGEST_COUNT:,})")
    return value


_LARGEST_COUNT = 2 ** 40     # samples, tokens, pixels, ranks: far past any machine's memory


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive finite number")
    return value


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text}")
    return value


def int_or_auto(text: str):
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or 'auto')") from None


def progressive_spec(text: str) -> tuple[int, float]:
    """--progressive LEN[:FRACTION] -> (LEN, FRACTION); FRACTION in (0, 1), default 0.9."""
    length, sep, fraction = text.partition(":")
    try:
        n = int(length)
        f = float(fraction) if sep else 0.9
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write LEN or LEN:FRACTION, e.g. 128 or 128:0.9") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: LEN must be at least 1")
    if not 0 < f < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: FRACTION must be between 0 and 1, e.g. 0.9")
    return n, f


def add_chunked_loss_arg(g, *, plan: bool = False) -> None:
    """--chunked-loss N: ``Knobs.chunked_loss`` (techniques.chunked_loss)."""
    unset = "0: the model's own loss; default: memfit picks (8 pieces, where the plain step " \
        "does not fit)" if plan else "0 or unset: the model's own loss"
    g.add_argument("--chunked-loss", type=chunk_count, default=None, metavar="N",
                   help="a causal LM's loss over N pieces of the tokens (torchtune's way: the "
                        "head, the fp32 upcast and the cross-entropy per piece, each piece's "
                        "logits recomputed in backward), so the tokens x vocabulary logits never "
                        f"exist whole; {unset}")


def add_optimizer_in_backward_arg(g, *, plan: bool = False) -> None:
    """--optimizer-in-backward [on|off]: ``Knobs.optimizer_in_backward``
    (techniques.optimizer_in_backward)."""
    unset = "default: memfit picks it where the plain step does not fit" if plan else \
        "default: off"
    add_switch(g, "--optimizer-in-backward",
               "step each parameter, and free its gradient, as soon as backward has made it "
               "(one optimizer per parameter, run by a post-accumulate-grad hook, as torchtune "
               "does), so the whole set of gradients never exists; same numerics; not with "
               "accumulation (--micro-batch-size below the batch), --max-grad-norm, fp16, "
               f"--offload-optimizer or several GPUs; {unset}")


def add_offload_gradients_arg(g, *, plan: bool = False) -> None:
    """--offload-gradients [on|off]: ``Knobs.offload_gradients`` (techniques.optimizer_offload)."""
    unset = "default: memfit picks it where the optimizer state on the host is not enough" \
        if plan else "default: off"
    add_switch(g, "--offload-gradients",
               "with --offload-optimizer: copy each gradient to the host as backward makes it and "
               "free it on the device (torchao's CPUOffloadOptimizer(offload_gradients=True)), "
               "so the gradients never accumulate on the device; micro-batches add up on the "
               f"host; same numerics; not with fp16 or --offload-params; {unset}")


def chunk_count(text: str) -> int:
    """--chunked-loss's value: pieces >= 1, or 0 (off)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of pieces") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: give N >= 1 pieces, or 0 for the model's "
                                         "own loss")
    return value


def add_zero_grad_arg(g) -> None:
    """--zero-grad: where the step frees or zeroes last step's gradients (Knobs.zero_grad)."""
    g.add_argument("--zero-grad", default=None, choices=ZERO_GRADS, metavar="STYLE",
                   help="where the training loop calls optimizer.zero_grad(): before-forward "
                        "(first thing in the step: last step's gradients are freed before the "
                        "forward; the default), after-forward (between forward and backward: "
                        "they stay alive through the forward), keep-buffers "
                        "(zero_grad(set_to_none=False): the gradient buffers are never freed). "
                        f"One of {', '.join(ZERO_GRADS)}")


def check_output_path(path: str | None, flag: str) -> None:
    """Refuse a plot file that cannot be written, before any tracing (``check_output_file``)."""
    check_output_file(path, flag, (".png", ".pdf", ".svg"),
                      "the file name must end in .png, .pdf or .svg (the format is taken from it)")


def check_output_file(path: str | None, flag: str, suffixes: tuple[str, ...],
                      suffix_message: str | None = None) -> None:
    """Refuse an output file that cannot be written, before any tracing (a missing folder, a
    folder given as the file, a read-only place, another suffix than ``suffixes``)."""
    if path is None:
        return
    where = f"{flag} {path}" if flag else path
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{where}: that is a folder; give a file name, e.g. "
                         f"{os.path.join(path, 'memory' + suffixes[0])}")
    if not os.path.isdir(folder):
        raise ValueError(f"{where}: the folder {folder} does not exist; create it "
                         "(mkdir -p) or write the file elsewhere")
    if not os.access(folder, os.W_OK) or os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{where}: cannot write there (permission denied); write the "
                         "file elsewhere")
    if not path.lower().endswith(suffixes):
        raise ValueError(f"{where}: " + (suffix_message or
                                         f"the file name must end in {' or '.join(suffixes)}"))


def _on_off(text: str) -> bool:
    low = text.lower()
    if low in ("on", "off"):
        return low == "on"
    raise argparse.ArgumentTypeError(f"{text!r}: write on or off")


def add_switch(g, flag: str, help: str) -> None:
    """``flag [on|off]`` (Note 2): True, False, or None when not given."""
    g.add_argument(flag, nargs="?", const=True, default=None, type=_on_off, metavar="on|off",
                   help=f"{help} (the flag alone: on)")


def reshard_value(text: str) -> bool | int:
    """--reshard-after-forward on|off|N (Note 2); true/false are the old spelling."""
    import sys

    low = text.lower()
    if low in ("on", "off"):
        return low == "on"
    if low in ("true", "false"):     # parsed before the CLI's warning display: said here
        print(f"memfit: warning: --reshard-after-forward {text} is deprecated: write "
              f"--reshard-after-forward {'on' if low == 'true' else 'off'}", file=sys.stderr)
        return low == "true"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: write on, off, or a group size N >= 2")
    return n
