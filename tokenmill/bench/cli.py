"""`tokenmill bench SUBCOMMAND`: each benchmark is a module with add_parser(subparsers) that
sets run; add a module name to SUBCOMMANDS to register another one."""

from __future__ import annotations

import importlib

SUBCOMMANDS = [
    "tokenmill.bench.serve",
    "tokenmill.bench.latency",
    "tokenmill.bench.throughput",
]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (a human table, then one JSON line)")
    bench = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(bench)
