"""What a person reads after a compile: placement facts, a Model Explorer overlay, report.md.

    placement(graph, parts, placements)  -> report.json "placement"[graph]: counts, partitions,
                                            every CPU node with op, reason, detail, remedy
    overlay(name, placements, sdk)       -> OUT/<graph>.placement.json, Model Explorer node data
                                            (single-graph form; keys are node names)
    markdown(manifest, report)           -> OUT/report.md

Load the overlay with `model-explorer OUT/model.onnx --extensions=model_explorer_onnx
--node_data_paths=OUT/model.placement.json`.
"""

from __future__ import annotations

from collections import Counter

import onnx_graphsurgeon as gs

from mtkc.backend.partition import CPU, NPU, Partition, Placement
from mtkc.display import escape, md_code

NPU_COLOR = "#2e7d32"
COLORS = {  # CPU reason -> background colour; anything else: CPU_COLOR
    "op-not-in-table": "#c62828",
    "op-unsupported": "#c62828",
    "unknown-domain": "#c62828",
    "host-op": "#1565c0",
    "partition-too-small": "#f9a825",
    "forced-cpu": "#6a1b9a",
}
CPU_COLOR = "#ef6c00"  # constraint reasons: dtype, rank, shape, attribute, broadcast, constant input


def placement(graph: gs.Graph, parts: list[Partition], placements: dict[str, Placement]) -> dict:
    """Placement facts of one graph (deterministic: graph order)."""
    where = {n.name: p.id for p in parts for n in p.nodes}
    npu = sum(1 for n in graph.nodes if placements[n.name].target == NPU)
    cpu_nodes = []
    for n in graph.nodes:
        pl = placements[n.name]
        if pl.target == CPU:
            cpu_nodes.append({"node": n.name, "op": n.op, "domain": n.domain or "ai.onnx", "partition": where[n.name],
                              "reason": pl.reason, "detail": pl.detail, "remedy": pl.remedy})
    return {
        "nodes": len(graph.nodes),
        "npu_nodes": npu,
        "cpu_nodes": len(graph.nodes) - npu,
        "coverage": round(npu / len(graph.nodes), 6) if graph.nodes else 1.0,
        "partitions": [{"id": p.id, "target": p.target, "nodes": len(p.nodes)} for p in parts],
        "cpu": cpu_nodes,
    }


def overlay(graph_name: str, placements: dict[str, Placement], sdk: str) -> dict:
    """Model Explorer node data: "NPU" or "CPU: <reason>" per node, coloured by category."""
    results = {}
    for name, pl in placements.items():
        if pl.target == NPU:
            results[name] = {"value": "NPU", "bgColor": NPU_COLOR}
        else:
            results[name] = {"value": f"CPU: {pl.reason}", "bgColor": COLORS.get(pl.reason, CPU_COLOR)}
    return {
        "name": f"mtkc placement: {graph_name}, NeuroPilot {sdk}",
        "results": results,
        "showExpandedSummaryOnGroupNode": True,
        "showLabelCountColumnsInChildrenStatsTable": True,
    }


def markdown(manifest: dict, report: dict) -> str:
    """report.md: summary, converter, per-graph partitions and CPU nodes, pass log."""
    sdk, arch = manifest.get("sdk"), manifest.get("arch")
    source = (report.get("input") or {}).get("file") or "model"
    lines = [f"# mtkc compile report: {escape(source)}", "", f"NeuroPilot SDK {sdk}, arch {arch}.", "", "## Summary", ""]
    crossings = {g["name"]: sum(1 for p in g.get("partitions", []) for i in p["inputs"] if i.get("from", "graph") != "graph")
                 for g in manifest.get("graphs", [])}
    lines += _table(["graph", "nodes", "NPU", "CPU", "NPU coverage", "partitions (NPU / CPU)", "tensors handed between partitions"], [
        [g, p["nodes"], p["npu_nodes"], p["cpu_nodes"], f"{100 * p['coverage']:.1f}%",
         f"{sum(q['target'] == NPU for q in p['partitions'])} / {sum(q['target'] == CPU for q in p['partitions'])}",
         crossings.get(g, 0)]
        for g, p in report.get("placement", {}).items()])
    coverage = manifest.get("coverage") or {}
    if coverage.get("raw") is not None:
        lines += ["", f"Table coverage before passes: {100 * coverage['raw']:.1f}%, after: "
                      f"{100 * (coverage.get('compiled') or 0):.1f}%."]
    lines += ["", "## Converter", "", _converter(manifest.get("converter") or report.get("converter"))]
    for graph in manifest.get("graphs", []):
        facts = report.get("placement", {}).get(graph["name"])
        lines += ["", f"## Graph {md_code(graph['name'])} ({escape(graph['path'])})", "", "### Partitions (execution order)", ""]
        lines += _table(["id", "target", "nodes", "inputs", "outputs", "file"], [
            [p["id"], p["target"].upper(), len(p["nodes"]), _names(p["inputs"]), _names(p["outputs"]), md_code(p["path"])]
            for p in graph.get("partitions", [])])
        if facts and facts["cpu"]:
            lines += ["", "### CPU nodes by reason", ""]
            groups = Counter((c["op"], c["reason"], c["remedy"]) for c in facts["cpu"])
            lines += _table(["op", "reason", "count", "remedy"], [[op, r, k, rem] for (op, r, rem), k in groups.items()])
            lines += ["", "### CPU nodes", ""]
            lines += _table(["node", "op", "partition", "reason", "detail"],
                            [[md_code(c["node"]), c["op"], c["partition"], c["reason"], c["detail"]] for c in facts["cpu"]])
    passes = report.get("passes") or manifest.get("passes") or []
    if passes:
        lines += ["", "## Passes", ""]
        lines += _table(["pass", "rewrites", "nodes before", "nodes after", "misses"], [
            [p["name"], p.get("rewrites", ""), p.get("nodes_before", ""), p.get("nodes_after", ""), len(p.get("misses", []))]
            for p in passes])
        notes = [f"- `{p['name']}` ({p.get('graph', 'model')}): {_escape(n)}" for p in passes for n in p.get("notes", [])]
        if notes:
            lines += ["", "### Notes from the passes", "", *notes]
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return str(text).replace("\n", " ")


def _converter(section: dict | None) -> str:
    if not section:
        return "No converter hand-off recorded."
    if not section.get("ran"):
        return f"Not run: {escape(section.get('reason', ''))}. The exact commands are in `{section.get('script')}`."
    items = section.get("partitions", [])
    failed = [p for p in items if p["exit_code"] != 0]
    text = f"Ran `{section.get('backend')}` on {len(items)} NPU partition(s): {len(items) - len(failed)} converted"
    text += f", {len(failed)} failed." if failed else "."
    for p in failed:
        blame = p.get("blame") or {}
        nodes = ", ".join(md_code(n) for n in blame.get("nodes", [])[:5]) or "unknown node"
        text += (f"\n- {escape(p['graph'])}/{escape(p['id'])}: exit {p['exit_code']}, {nodes} "
                 f"({escape(blame.get('method', '?'))}); log {md_code(p['log'])}")
    return text


def _names(items: list[dict], limit: int = 4) -> str:
    names = [md_code(i["name"]) for i in items]
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit})" if len(names) > limit else "")


def _table(header: list[str], rows: list[list]) -> list[str]:
    def cell(value) -> str:
        return escape(value).replace("|", "\\|")

    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
