"""Benchmarks run from the command line: `tokenmill bench serve` (load-test an
OpenAI-compatible server); more subcommands plug into bench/cli.py."""
