"""`mtkc convert OUT --quant SCHEME`: hand the NPU partitions to MediaTek's converter, quantising."""

from __future__ import annotations

import argparse
import logging

from mtkc.backend.quant_handoff import PRECISION
from mtkc.commands.options import add_common, print_json
from mtkc.pipeline.convert import convert

log = logging.getLogger("mtkc")


def add_parser(subparsers) -> None:

    parser = subparsers.add_parser(
        "convert",
        description="Rewrite OUT/convert.sh so MediaTek's converter quantises every NPU partition: "
        "quantize on, per-output-channel weights, calibration_data_gen fed from "
        "OUT/calibration/<graph>.<partition>/*.npz, precision_proportion of the scheme; run it when the "
        "SDK is present (exit 3 when it fails), else only write the script.",
    )
    parser.add_argument("out", metavar="OUT", help="folder written by `mtkc compile` and `mtkc calibrate`")
    parser.add_argument("--quant", required=True, choices=list(PRECISION), metavar="SCHEME",
                        help=f"MediaTek precision: {', '.join(PRECISION)}")
    parser.add_argument("--converter-cmd", metavar="TEMPLATE",
                        help="your converter command per NPU partition; placeholders as compile's, plus "
                        "{calibration} (the samples folder) and {precision}")
    parser.add_argument("--plan", metavar="FILE",
                        help="mixed precision written by `mtkc verify OUT --quant SCHEME --plan` (quant-plan.json): "
                        "each precision's share as precision_proportion, the raised layers in the manifest")
    parser.add_argument("--no-convert", action="store_true", help="only write OUT/convert.sh; run no converter")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="summary format on stdout")
    add_common(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    section = convert(args.out, args.quant, args.converter_cmd, args.no_convert, args.plan)
    if args.format == "json":
        print_json(section)
    elif section.get("ran"):  # messages, not data: stderr
        log.info("mtkc: converted %d partition(s) with %s; logs in %s/logs", len(section["partitions"]), args.quant,
                 args.out)
    else:
        log.warning("mtkc: not converted (%s)", section["reason"])
    return 0
