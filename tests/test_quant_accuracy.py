"""`verify --quant` on the trained reference model (examples/reference), against an independent torch
fake-quant written here.

The reference quantises every torch Linear: weights per output channel, symmetric, on MediaTek's grid
(scale = absmax / ((qmax - qmin) / 2), codes in [qmin, qmax]); its input per tensor from the min/max
the same calibration prompts give (16 bits symmetric, 8 bits asymmetric uint8); the tied LM head gets
its own quantised copy, the embedding stays float (on the host, as compiled). mtkc quantises more
(norms, attention, softmax, residual adds), so the two agree within `agrees`' band, not exactly.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from mtkc.pipeline import quantsmooth
from mtkc.backend.calibration_data import folder_name, sample_files
from mtkc.pipeline.calibrate import calibrate, npu_partitions
from mtkc.pipeline.compile import compile_model
from mtkc.pipeline.quantsearch import run_plan
from mtkc.pipeline.quantsim import SampleReader, Simulation, simulate
from mtkc.pipeline.verify import load_manifest
from mtkc.runtime.prompts import Prompt

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import train_reference  # noqa: E402

T, C, NEW = 16, 128, 6
CALIBRATION_PROMPTS, CALIBRATION_TOKENS = 24, 40
EVAL_PROMPTS = 4


def agrees(got: float, reference: float) -> bool:
    """The stated tolerance: mtkc's error (1 - cosine) at most 15x the reference's plus 1e-4, and no
    better than the reference's by more than 1e-4. mtkc quantises a superset (at A8 also the norms'
    internals, attention scores, softmax and residual adds at 8 bits), so its error is the larger; the
    default-mask bug of issue 23 (A16W8 0.99971 against 0.999995) is outside this band."""
    return (1 - got) <= 15 * (1 - reference) + 1e-4 and got <= reference + 1e-4


@pytest.fixture(scope="module")
def reference():
    return train_reference.load()


@pytest.fixture(scope="module")
def prompts(reference):
    _, tokenizer = reference
    lines = (train_reference.HERE / "prompts.txt").read_text().splitlines()
    calibration = [tokenizer(t)["input_ids"][:CALIBRATION_TOKENS] for t in lines[:: len(lines) // CALIBRATION_PROMPTS]]
    held = [x for x in (train_reference.HERE / "heldout.txt").read_text().splitlines() if len(x.strip()) > 40]
    evaluation = [tokenizer(t.strip())["input_ids"][:T] for t in held[:: len(held) // EVAL_PROMPTS][:EVAL_PROMPTS]]
    return calibration[:CALIBRATION_PROMPTS], evaluation


@pytest.fixture(scope="module")
def out(tmp_path_factory, prompts, request):
    cache = Path(os.environ.get("MTKC_EXPORT_CACHE") or request.config.cache.mkdir("mtkc-exports"))
    model = train_reference.export(cache)
    folder = tmp_path_factory.mktemp("accuracy") / "out"
    compile_model(model, "8.0", folder, {"seq_len": T, "cache_len": C, "kv_cache": True})
    calibrate(folder, [Prompt(p) for p in prompts[0]], 4)
    return folder


@pytest.fixture(scope="module")
def sim(out, prompts):
    results = {}

    def get(scheme, keep=(), smooth=None, sensitivity=False):
        key = (scheme, tuple(keep), smooth, sensitivity)
        if key not in results:
            results[key] = simulate(out, scheme, prompts[1], NEW, list(keep), sensitivity=sensitivity or None,
                                    smooth=smooth)
        return results[key]

    return get


def _cos(result, graph="prefill"):
    return next(o["cosine"] for o in result.outputs if o["graph"] == graph and o["output"] == "logits")


# ---------------------------------------------------------------- the independent reference

def linear_ranges(model, prompts):
    """(min, max) of every Linear's input over the calibration prompts (float model, whole prompts)."""
    import torch

    ranges, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(_, args, name=name):
                x = args[0].detach()
                lo, hi = ranges.get(name, (math.inf, -math.inf))
                ranges[name] = (min(lo, float(x.min())), max(hi, float(x.max())))
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return ranges


def fake_weight(weight, bits):
    import torch

    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    scale = weight.abs().amax(dim=1, keepdim=True) / ((qmax - qmin) / 2)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.clamp(torch.round(weight / scale), qmin, qmax) * scale


def fake_activation(x, lo, hi, bits):
    import torch

    if bits == 16:  # symmetric int16
        absmax = max(abs(lo), abs(hi))
        scale = absmax / (65535 / 2) or 1.0
        return torch.clamp(torch.round(x / scale), -32768, 32767) * scale
    lo, hi = min(lo, 0.0), max(hi, 0.0)  # asymmetric uint8, zero exact
    scale = (hi - lo) / 255 or 1.0
    zero = round(-lo / scale)
    return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale


def torch_quantised(model, ranges, a_bits, w_bits, keep=()):
    import torch

    quant = copy.deepcopy(model)
    quant.lm_head.weight = torch.nn.Parameter(quant.lm_head.weight.detach().clone())  # untie: embedding stays float
    for name, module in quant.named_modules():
        if isinstance(module, torch.nn.Linear) and name not in keep:
            with torch.no_grad():
                module.weight.copy_(fake_weight(module.weight, w_bits))
            lo, hi = ranges[name]
            module.register_forward_pre_hook(lambda _, args, lo=lo, hi=hi: (fake_activation(args[0], lo, hi, a_bits),))
    return quant


def torch_cosine(model, quant, prompts):
    import torch

    with torch.no_grad():
        a = torch.cat([model(torch.tensor([p])).logits[0] for p in prompts]).double().ravel()
        b = torch.cat([quant(torch.tensor([p])).logits[0] for p in prompts]).double().ravel()
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("scheme,a_bits,w_bits", [("A16W8", 16, 8), ("A16W4", 16, 4), ("A8W8", 8, 8)])
def test_simulation_agrees_with_an_independent_torch_fake_quant(scheme, a_bits, w_bits, sim, reference, prompts):
    model, _ = reference
    expected = torch_cosine(model, torch_quantised(model, linear_ranges(model, prompts[0]), a_bits, w_bits), prompts[1])
    result = sim(scheme)
    got = _cos(result)
    print(f"{scheme}: mtkc {got:.6f}, torch fake-quant {expected:.6f}")
    assert agrees(got, expected), (scheme, got, expected)
    if scheme in ("A16W8", "A8W8"):  # A8W8 at the default mask handling (the mask kept out of the scores' range)
        assert got >= 0.99 and result.ok, (scheme, got)


def test_weights8_never_worse_than_weights4(sim):
    w8, w4 = sim("A16W8"), sim("A16W4")
    for o8 in w8.outputs:
        o4 = next(o for o in w4.outputs if (o["graph"], o["output"]) == (o8["graph"], o8["output"]))
        assert o8["cosine"] >= o4["cosine"] - 1e-6, (o8, o4)
    assert w8.own_cache["cosine"] >= w4.own_cache["cosine"]


def test_metrics_count_real_positions_and_the_quantised_cache(sim, prompts):
    result = sim("A16W8")
    prefill = next(o for o in result.outputs if o["graph"] == "prefill" and o["output"] == "logits")
    assert prefill["positions"] == sum(len(p) for p in prompts[1])  # no padded row
    assert result.own_cache["positions"] == sum(len(p) + NEW - 1 for p in prompts[1])
    assert 0.9 < result.own_cache["cosine"] <= 1 and result.tokens["prompts"] == EVAL_PROMPTS
    assert result.mask_value == -100.0 and any("proven on the float pipeline" in n for n in result.notes)


def test_keep_fp_lm_head_raises_a16w4_and_the_suggestion_comes_from_sensitivity(sim, reference, prompts):
    base, kept = sim("A16W4", sensitivity=True), sim("A16W4", keep=("lm_head",))
    assert _cos(kept) > _cos(base) and kept.keep_fp == ["lm_head"]
    units = [e["unit"] for e in base.sensitivity]
    assert units == [0, 1, 2, 3, "lm_head"]
    worst = min(base.sensitivity, key=lambda e: e["sqnr_db"])
    assert all(e["cosine"] >= worst["cosine"] - 1e-9 for e in base.sensitivity)
    model, _ = reference  # the reference, LM head alone float, moves the same way
    ranges = linear_ranges(model, prompts[0])
    assert torch_cosine(model, torch_quantised(model, ranges, 16, 4, keep=("lm_head",)), prompts[1]) > \
        torch_cosine(model, torch_quantised(model, ranges, 16, 4), prompts[1])


def heldout_ids(tokenizer) -> list[int]:
    return tokenizer((train_reference.HERE / "heldout.txt").read_text()[:1500])["input_ids"]


def torch_perplexity(model, ids) -> tuple[float, int]:
    """(perplexity, scored tokens) in the simulation's windows: cache-length blocks, each from empty."""
    import torch

    window = C // T * T
    nll, count = 0.0, 0
    with torch.no_grad():
        for k in range(0, min(len(ids), 2048), window):
            block = torch.tensor([ids[k:k + window]])
            if block.shape[1] > 1:
                nll += float(model(block, labels=block).loss) * (block.shape[1] - 1)
                count += block.shape[1] - 1
    return math.exp(nll / count), count


def test_float_perplexity_is_the_torch_models(out, reference):
    model, tokenizer = reference
    ids = heldout_ids(tokenizer)
    result = simulate(out, "A16W8", [ids[:T]], 1, eval_ids=ids)
    expected, count = torch_perplexity(model, ids)
    assert result.perplexity["tokens"] == count
    assert result.perplexity["float"] == pytest.approx(expected, rel=1e-4)
    assert result.perplexity["quant"] >= result.perplexity["float"] * 0.99


@pytest.mark.parametrize("scheme,a_bits,w_bits", [("A16W8", 16, 8), ("A16W4", 16, 4), ("A8W8", 8, 8)])
def test_quantised_perplexity_agrees_with_the_torch_fake_quant(scheme, a_bits, w_bits, out, reference, prompts):
    """The stated tolerance: the log-perplexity of mtkc's simulation within twice the torch fake-quant's
    own change from float, plus 1e-3, of the fake-quant's (mtkc quantises a superset; measured: A16W8
    gap 6e-7 against a 1.3e-4 change, A16W4 1.1e-5 / 2.4e-3, A8W8 1.1e-3 / 1.4e-3)."""
    model, tokenizer = reference
    ids = heldout_ids(tokenizer)
    got = simulate(out, scheme, [ids[:T]], 1, eval_ids=ids).perplexity
    expected, _ = torch_perplexity(torch_quantised(model, linear_ranges(model, prompts[0]), a_bits, w_bits), ids)
    change = abs(math.log(expected / got["float"]))
    print(f"{scheme}: perplexity float {got['float']:.3f}, mtkc {got['quant']:.3f}, torch fake-quant {expected:.3f}")
    assert abs(math.log(got["quant"] / expected)) <= 2 * change + 1e-3, (scheme, got, expected)


def test_plan_reaches_its_target(out, prompts, tmp_path, run_cli):
    result = run_plan(out, "A16W4", prompts[1], NEW, 0.999)
    assert all(o["cosine"] >= 0.999 for o in result.outputs if o["output"] == "logits")
    plan = json.loads((out / "quant-plan.json").read_text())
    assert plan["scheme"] == "A16W4" and plan["units"] == {str(u): s for u, s in result.units.items()}
    assert result.units and set(plan["units"].values()) <= {"A16W8", "A16W16"}
    code, _, err = run_cli("convert", out, "--quant", "A16W4", "--plan", out / "quant-plan.json", "--no-convert")
    assert code == 0, err
    script = (out / "convert.sh").read_text()
    section = json.loads((out / "manifest.json").read_text())["converter"]["quant"]
    assert section["plan"]["units"] == plan["units"] and "sym8W_sym16A" in script or "sym16W_sym16A" in script


def test_smoothing_changes_no_float_output_and_is_reported(out, sim):
    import onnx
    import onnxruntime as ort
    from onnx.external_data_helper import load_external_data_for_model

    manifest = load_manifest(out)
    graph, part = npu_partitions(manifest)[0]
    proto = onnx.load(str(out / part["path"]), load_external_data=False)
    load_external_data_for_model(proto, str(out))
    files = sample_files(out, manifest, folder_name(graph, part))[:8]
    feeds = [SampleReader([f], part["inputs"]).get_next() for f in files]
    before = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in before.get_outputs()]
    want = [before.run(names, f) for f in feeds]
    assert quantsmooth.smooth(proto, feeds, 0.5) >= 2 * 4 + 1  # two norms per layer and the final one
    after = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for feed, ref in zip(feeds, want):
        for a, b in zip(after.run(names, feed), ref):
            assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())
    with tempfile.TemporaryDirectory() as tmp:  # the simulation's own copy: weights read from and written to files
        simulation = Simulation(out, Path(tmp), smooth=0.5)
        copy, _ = simulation.float_copy(graph, part, Path(tmp), (simulation.compiled_mask, simulation.compiled_mask))
        assert any(t.name.endswith(".smooth") for t in copy.graph.initializer)
        streamed = simulation.store.sessions.model(copy, Path(tmp), "smoothed")
        for feed, ref in zip(feeds, want):
            for a, b in zip(streamed.run(names, feed), ref):
                assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())
        del streamed, simulation
    smoothed = sim("A8W8", smooth=0.5)
    assert smoothed.smooth == 0.5 and 0.9 < _cos(smoothed) <= 1


def test_bad_options_are_one_line_errors(out, tmp_path, run_cli):
    bad = tmp_path / "plan.json"
    bad.write_text('{"scheme": "A16W4", "units": {"x": "A16W8"}}')
    cases = [
        (("verify", out, "--quant", "A16W8", "--eval", tmp_path / "none.txt"), "--eval"),
        (("verify", out, "--quant", "A16W8", "--keep-fp", "0,head"), "--keep-fp '0,head'"),
        (("verify", out, "--quant", "A16W8", "--target-cosine", "0.9"), "--target-cosine"),
        (("verify", out, "--quant", "A16W8", "--smooth", "2"), "--smooth 2"),
        (("convert", out, "--quant", "A16W4", "--plan", bad, "--no-convert"), "unit 'x'"),
        (("convert", out, "--quant", "A16W8", "--plan", bad, "--no-convert"), "unit 'x'"),
        (("convert", out, "--quant", "A16W4", "--plan", tmp_path / "missing.json", "--no-convert"), "missing.json"),
    ]
    for args, needle in cases:
        code, _, err = run_cli(*args)
        assert code == 2 and needle in err and "Traceback" not in err, (args, err)
    bad.write_text('{"scheme": "A16W8", "units": {"0": "A16W16"}}')
    code, _, err = run_cli("convert", out, "--quant", "A16W4", "--plan", bad, "--no-convert")
    assert code == 2 and "the plan is for A16W8" in err


def test_the_text_report_is_short_at_24_layers_and_whole_with_every_output():
    """verify --quant's text: a row per graph's logits and one for its caches, one line for the
    layers' accumulated error, the units under the bar or most sensitive; -v prints every row."""
    from mtkc.pipeline.quantsim import QuantResult, format_text

    outputs = [{"graph": g, "output": o, "cosine": c, "sqnr_db": 10.0, "worst_call_cosine": c, "max_abs": 1.0}
               for g in ("prefill", "decode") for o, c in [("logits", 0.95)] + [(f"present_key_{i}", 0.999 - i / 100)
                                                                               for i in range(24)]]
    layers = [{"layer": i, "cosine": 0.999 - i / 200} for i in range(24)]
    sensitivity = [{"unit": i, "cosine": 0.98 if i == 5 else 0.9999, "sqnr_db": 40.0 - (i == 5) * 30 - i / 10}
                   for i in range(24)] + [{"unit": "lm_head", "cosine": 0.9999, "sqnr_db": 45.0}]
    result = QuantResult("A16W8", 0.99, [], outputs=outputs, layers=layers, sensitivity=sensitivity)
    short, every = format_text(result).splitlines(), format_text(result, every_output=True).splitlines()
    assert len(short) <= 15 < 60 < len(every)
    assert "prefill  24 caches" in "\n".join(short) and "UNDER BAR (23)" in "\n".join(short)  # 0.999 - i/100 < 0.99 from i = 1
    assert any(line.startswith("layers 0-23: output cosine 0.999000 after layer 0, lowest 0.884000") for line in short)
    assert [line.split(" quantised")[0] for line in short if line.startswith("sensitivity ") and " quantised alone:" in line] \
        == ["sensitivity 5", "sensitivity 22", "sensitivity 23"]  # under the bar, then the lowest SQNR
    assert any(line.startswith("sensitivity of the other 22 units alone") for line in short)
    assert sum(line.startswith("sensitivity ") for line in every) == 25 and sum(" present_key_" in line for line in every) == 48
