"""`verify --quant SCHEME --plan`: the fewest units raised so every quantised output holds the bar.

    sensitivity  each unit (decoder layer, LM head) quantised alone at SCHEME: SQNR of the logits
    order        most sensitive first (lowest SQNR)
    search       k = fewest of the first units in that order raised to A16W16 with every output's cosine
                 (teacher-forced, real positions, every graph: `verify --quant`'s bar) >= target, by bisection
                 over k (the cosine grows with k); then the same k at A16W8 when that also holds
    result       the plan, OUT/quant-plan.json, and its full simulation (own cache, tokens, perplexity)

Raised precisions are the converter's per-output-channel ones (`quantplan.raised`), never block-wise.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from mtkc.contract import io
from mtkc.pipeline.quantplan import PLAN_FILE, Precision, raised, unit_key, write_plan
from mtkc.pipeline.quantsim import QuantResult, Simulation, run_simulation


def lowest_cosine(figures: dict) -> float:
    return min(o["cosine"] for o in figures["outputs"])


def search(sim: Simulation, scheme: str, prompts: list[list[int]], target: float, mask_value: float,
           sensitivity: list[dict]) -> tuple[dict, list[dict]]:
    """({unit: scheme} raised, every evaluation made [{units, cosine}])."""
    order = [e["unit"] for e in sorted(sensitivity, key=lambda e: (e["sqnr_db"], unit_key(e["unit"])))]
    levels = raised(scheme)
    tried: list[dict] = []

    def score(k: int, level: str) -> float:
        units = {u: level for u in order[:k]}
        cos = lowest_cosine(sim.compare(Precision(scheme, units), prompts, 1, mask_value, full=False))
        tried.append({"units": {unit_key(u): s for u, s in units.items()}, "cosine": cos})
        return cos

    if not levels or score(0, scheme) >= target:
        return {}, tried
    top = levels[-1]
    lo, hi = 1, len(order)
    while lo < hi:  # fewest units at the highest precision
        mid = (lo + hi) // 2
        if score(mid, top) >= target:
            hi = mid
        else:
            lo = mid + 1
    k = lo
    level = next((lv for lv in levels[:-1] if score(k, lv) >= target), top)
    return {u: level for u in order[:k]}, tried


def plan(out: Path, sim: Simulation, scheme: str, prompts: list[list[int]], new_tokens: int, target: float,
         eval_ids: list[int] | None) -> QuantResult:
    """Search the plan, simulate it in full, write OUT/quant-plan.json; the result carries the plan."""
    mask_value, _ = sim.proven_mask(scheme, prompts, new_tokens)
    sensitivity = sim.sensitivity(scheme, prompts, mask_value)
    units, tried = search(sim, scheme, prompts, target, mask_value, sensitivity)
    result = run_simulation(sim, scheme, prompts, new_tokens, [], units, target, eval_ids, sensitivity=False)
    result.sensitivity = sensitivity
    summary = {"target_cosine": target, "mask_value": result.mask_value, "smooth": sim.smooth,
               "lowest_cosine": min(o["cosine"] for o in result.outputs),
               "cosine": {f"{o['graph']}.{o['output']}": o["cosine"] for o in result.outputs if o["output"] == io.LOGITS},
               "perplexity": result.perplexity or None, "sensitivity": [{**e, "unit": unit_key(e["unit"])} for e in sensitivity],
               "evaluated": tried}
    write_plan(Path(out) / PLAN_FILE, scheme, units, json.loads(json.dumps(summary)))
    if not result.ok:
        result.notes.append(f"the target {target:g} is not reached even with every unit at {(raised(scheme) or [scheme])[-1]}")
    result.notes.append(f"plan: {len(units)} unit(s) raised ({', '.join(f'{u} {s}' for u, s in units.items()) or 'none'}) "
                        f"after {len(tried)} evaluation(s); written to {Path(out) / PLAN_FILE}")
    return result


def run_plan(out: str | Path, scheme: str, prompts: list[list[int]], new_tokens: int, target: float,
             calibration_samples: int | None = None, eval_ids: list[int] | None = None,
             smooth: float | None = None) -> QuantResult:
    with tempfile.TemporaryDirectory(prefix="mtkc-plan-") as tmp:
        return plan(Path(out), Simulation(Path(out), Path(tmp), calibration_samples, smooth), scheme, prompts,
                    new_tokens, target, eval_ids)
