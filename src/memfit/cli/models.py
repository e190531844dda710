"""``memfit models``: the built-in models (names for --model, their tasks and sizes)."""

from __future__ import annotations

from memfit.cli._listing import add_listing_parser, print_listing


def add_parser(sub):
    return add_listing_parser(
        sub, "models", help="list the built-in models (names for --model)",
        description="The model zoo: the name to pass as --model, its family, its tasks (for "
                    "--task; the first is the default) and its parameter count (built on the "
                    "meta device: no memory).", run=run)


def rows() -> list[dict]:
    from memfit import zoo
    from memfit.cli._common import _quiet_transformers

    _quiet_transformers()
    out = []
    for name in zoo.names():
        spec = zoo.get(name)
        model = spec.build(device="meta")
        tasks = [spec.default_task] + [t for t in spec.tasks if t != spec.default_task]
        out.append({"name": spec.name, "family": spec.family, "default_task": spec.default_task,
                    "tasks": tasks, "parameters": zoo.count_parameters(model),
                    "source": spec.source, "aliases": list(spec.aliases)})
    return out


def run(args) -> int:
    columns = [("name", {"no_wrap": True}), ("family", {"no_wrap": True}),
               ("parameters", {"justify": "right", "no_wrap": True}),
               ("tasks (for --task; the default first)", {})]
    return print_listing(
        args, rows(), "Built-in models (pass the name as --model, or --config PATH for your own)",
        columns,
        lambda r: [r["name"], r["family"], f"{r['parameters'] / 1e6:,.0f}M", ", ".join(r["tasks"])])
