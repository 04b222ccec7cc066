"""`sparkspec bench serve | offline | latency | grammar | prefix | budget`."""

from __future__ import annotations

import argparse

from sparkspec.bench.budget_host import add_budget_parser
from sparkspec.bench.grammar import add_grammar_parser
from sparkspec.bench.latency import add_latency_parser
from sparkspec.bench.offline import add_offline_parser
from sparkspec.bench.prefix import add_prefix_parser
from sparkspec.bench.serve import add_serve_bench_parser


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="throughput / latency benchmarks (serve: against a server; offline)")
    sub = p.add_subparsers(dest="bench_command", required=True)
    add_serve_bench_parser(sub)
    add_offline_parser(sub)
    add_latency_parser(sub)
    add_grammar_parser(sub)
    add_prefix_parser(sub)
    add_budget_parser(sub)
    return p
