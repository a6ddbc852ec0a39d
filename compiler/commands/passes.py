"""`mtkc passes [--sdk VER]`: every known pass, where it comes from, and whether it runs."""

from __future__ import annotations

import argparse
import json

from mtkc.commands.options import add_common, add_pipeline, from_args
from mtkc.manager.guard import guarded
from mtkc.manager.pass_manager import resolve_pipeline
from mtkc.pipeline.registry import load_registry
from mtkc.options import Options
from mtkc.passes.pipelines import default_pipeline
from mtkc.rewrite.pass_api import Context
from mtkc.target.capability import load_table


def add_parser(sub) -> None:
    p = sub.add_parser(
        "passes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sdk", help="say which passes apply to this SDK and are in its default pipeline")
    p.add_argument("--arch", help="MDLA arch; default: the SDK table's default")
    add_pipeline(p)
    p.add_argument("--format", choices=["text", "json"], default="text")
    add_common(p)
    p.set_defaults(func=run)


def run(args) -> int:
    options = from_args(args)
    sdk = options.sdk
    rows, pipeline = list_passes(sdk, options)
    if args.format == "json":
        print(json.dumps({"schema_version": 1, "sdk": sdk, "pipeline": pipeline, "passes": rows}, sort_keys=True, indent=2))
        return 0
    print(_table(rows))
    if pipeline is not None:
        print(f"\npipeline: {' -> '.join(pipeline) or '(empty)'}")
    return 0


def list_passes(sdk: str | None, options: Options) -> tuple[list[dict], list[str] | None]:
    """One row per pass: name, origin, description, applies (None without an SDK), default (named
    in the SDK's default pipeline, or an enabled plugin); and the effective pipeline (with an SDK)."""
    registry = load_registry(options.plugins)
    ctx = pipeline = None
    if sdk:
        ctx = Context(load_table(sdk, options.arch), options)
        pipeline = resolve_pipeline(registry, ctx, options.passes, options.skip_passes).names
    defaults = set(default_pipeline(sdk)) | set(registry.enabled)
    rows = []
    for name in sorted(registry.names()):
        cls = registry.get(name)
        rows.append({
            "name": name,
            "origin": cls.origin,
            "description": cls.description,
            "applies": None if ctx is None else bool(guarded(cls, "applies", lambda: cls().applies(ctx))),
            "default": name in defaults,
        })
    return rows, pipeline


def _table(rows: list[dict]) -> str:
    header = ("pass", "origin", "applies", "default", "description")
    cells = [header] + [
        (r["name"], r["origin"], "-" if r["applies"] is None else "yes" if r["applies"] else "no",
         "yes" if r["default"] else "no", r["description"])
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(4)) + "  " + c[4] for c in cells).rstrip()
