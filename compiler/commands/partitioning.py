"""Placement options (`check` and `compile`: they change the partitions) and the converter hand-off (`compile`)."""

from __future__ import annotations

import argparse


def add_placement(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("partitions")
    group.add_argument("--min-partition-nodes", type=int, metavar="N",
                       help="NPU partitions smaller than N nodes run on the CPU instead (default 1)")
    group.add_argument("--force-cpu", action="append", default=[], metavar="op:TYPE|node:GLOB",
                       help="run matching nodes on the CPU (repeatable)")
    group.add_argument("--force-npu", action="append", default=[], metavar="op:TYPE|node:GLOB",
                       help="keep matching nodes on the NPU whatever the minimum size; an unsupported node is an error")


def add_converter(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("converter")
    group.add_argument("--converter-cmd", metavar="TEMPLATE",
                       help="convert each NPU partition with this command, run without a shell; placeholders {input} "
                            "{output} {arch} {sdk} {input_names} {input_shapes} (default: MediaTek's converter when installed)")
    group.add_argument("--no-convert", action="store_true", help="only write OUT/convert.sh; run no converter")
    group.add_argument("--converter-timeout", type=float, metavar="SECONDS",
                       help="kill a converter run (its whole process group) after this long (default 14400)")
