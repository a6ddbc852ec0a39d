"""Compile options for placement and the converter hand-off (`mtkc compile`)."""

from __future__ import annotations

import argparse
from typing import Any

from mtkc.errors import InputError


def add_partitioning(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("partitions and converter")
    group.add_argument("--min-partition-nodes", type=int, metavar="N",
                       help="NPU partitions smaller than N nodes run on the CPU instead (default 1)")
    group.add_argument("--force-cpu", action="append", default=[], metavar="op:TYPE|node:GLOB",
                       help="run matching nodes on the CPU (repeatable)")
    group.add_argument("--force-npu", action="append", default=[], metavar="op:TYPE|node:GLOB",
                       help="keep matching nodes on the NPU whatever the minimum size; an unsupported node is an error")
    group.add_argument("--converter-cmd", metavar="TEMPLATE",
                       help="convert each NPU partition with this command; placeholders {input} {output} {arch} "
                            "{sdk} {input_names} {input_shapes} (default: MediaTek's converter when installed)")
    group.add_argument("--no-convert", action="store_true", help="only write OUT/convert.sh; run no converter")
    group.add_argument("--converter-timeout", type=float, metavar="SECONDS",
                       help="kill a converter run (its whole process group) after this long (default 14400)")


def partitioning_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options above as compile options (only those given, so a config file can set them)."""
    if args.min_partition_nodes is not None and args.min_partition_nodes < 1:
        raise InputError(f"--min-partition-nodes {args.min_partition_nodes}: must be at least 1")
    timeout = args.converter_timeout
    if timeout is not None and not (timeout > 0 and timeout < float("inf")):
        raise InputError(f"--converter-timeout {timeout:g}: expected a positive number of seconds")
    given = {
        "min_partition_nodes": args.min_partition_nodes,
        "force_cpu": args.force_cpu or None,
        "force_npu": args.force_npu or None,
        "converter_cmd": args.converter_cmd,
        "no_convert": args.no_convert or None,
        "converter_timeout": timeout,
    }
    return {k: v for k, v in given.items() if v is not None}
