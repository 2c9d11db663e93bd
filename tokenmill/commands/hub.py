"""`tokenmill pull [NAME]` and `tokenmill list`: fetch built-in models into the model cache and
show what is cached."""

from __future__ import annotations

from tokenmill.commands.common import DEFAULT_MODEL


def add_parser(sub) -> None:
    p = sub.add_parser("pull", help="download a built-in model into the model cache")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                   help=f"built-in model name (default: {DEFAULT_MODEL})")
    p.add_argument("--force", action="store_true", help="download again even when cached")
    p.set_defaults(run=run_pull)
    p = sub.add_parser("list", help="list the models in the model cache")
    p.set_defaults(run=run_list)


def run_pull(args) -> int:
    from tokenmill import hub

    print(hub.pull(args.name, force=args.force))
    return 0


def run_list(args) -> int:
    from tokenmill import hub

    models = hub.cached_models()
    if not models:
        print(f"no models in {hub.home() / 'models'}; try `tokenmill pull {DEFAULT_MODEL}` "
              f"(known: {', '.join(hub.KNOWN_MODELS)})")
        return 0
    width = max(len("NAME"), *(len(name) for name, _, _ in models))
    print(f"{'NAME':<{width}}  {'SIZE':>10}  PATH")
    for name, size, path in models:
        print(f"{name:<{width}}  {size / 2**20:>6.1f} MiB  {path}")
    return 0
