"""`verify --quant`: the onnxruntime simulation against an independent fake-quant of the torch model.

The tiny Qwen2 (T=8, C=64) is compiled and calibrated once. The independent reference quantises
each torch Linear weight per output channel, symmetric, on the same grid as MediaTek's quantiser
(scale = absmax / ((qmax - qmin) / 2), codes clamped to [qmin, qmax]; int4 in [-8, 7]); the tied
lm_head gets its own quantised copy while the host embedding stays float, as in the compiled graphs.
"""

from __future__ import annotations

import copy
import json

import pytest

from mtkc.pipeline.calibrate import calibrate
from mtkc.pipeline.compile import compile_model
from mtkc.pipeline.quantsim import simulate
from mtkc.runtime.prompts import Prompt

T, C = 8, 64
CALIBRATION = [[(11 * k + 5 * j) % 997 + 3 for j in range(n)] for k, n in enumerate((3, 6, 8, 9, 12, 15, 17, 20, 4, 10, 7, 14))]
PROMPT = [17, 400, 23, 911, 5, 77, 301, 640]  # exactly T tokens: one prefill call, no padded row


@pytest.fixture(scope="module")
def out(exported, tmp_path_factory):
    folder = tmp_path_factory.mktemp("quant") / "out"
    compile_model(exported("qwen2", "legacy17", True), "8.0", folder, {"seq_len": T, "cache_len": C, "kv_cache": True,
                                                                                  "mask_value": -100.0})
    calibrate(folder, [Prompt(p) for p in CALIBRATION], 4)
    return folder


@pytest.fixture(scope="module")
def sim(out):
    """`sim(scheme, keep=())` -> QuantResult over PROMPT and two calibration prompts (computed once each)."""
    results = {}

    def get(scheme, keep=(), prompts=(PROMPT,), new_tokens=1):
        key = (scheme, tuple(keep), tuple(map(tuple, prompts)), new_tokens)
        if key not in results:
            results[key] = simulate(out, scheme, [list(p) for p in prompts], new_tokens, list(keep))
        return results[key]

    return get


def _cos(result, graph="prefill", output="logits"):
    return next(o["cosine"] for o in result.outputs if o["graph"] == graph and o["output"] == output)


def fake_quant(weight, bits):
    """Per-output-channel (rows of a torch Linear weight) symmetric fake quantisation."""
    import torch

    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    scale = weight.abs().amax(dim=1, keepdim=True) / ((qmax - qmin) / 2)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.clamp(torch.round(weight / scale), qmin, qmax) * scale


def torch_cosine(model, bits):
    import torch

    quant = copy.deepcopy(model)
    with torch.no_grad():
        quant.lm_head.weight = torch.nn.Parameter(quant.lm_head.weight.detach().clone())  # untie from the embedding
        for module in quant.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(fake_quant(module.weight, bits))
        ids = torch.tensor([PROMPT])
        a = model(ids).logits.double().ravel()
        b = quant(ids).logits.double().ravel()
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("scheme,bits", [("A16W8", 8), ("A16W4", 4)])
def test_cosine_matches_independent_torch_fake_quant(scheme, bits, sim, tiny_model):
    expected = torch_cosine(tiny_model("qwen2"), bits)
    got = _cos(sim(scheme))
    assert abs(got - expected) < 0.01 * (1 - expected) + 2e-4, (got, expected)


def test_a16w16_is_float_and_weights8_never_worse_than_weights4(sim):
    assert _cos(sim("A16W16")) > 0.99999
    for a in ("A16", "A8"):
        w8, w4 = sim(f"{a}W8"), sim(f"{a}W4")
        for o8 in w8.outputs:
            assert o8["cosine"] >= _cos(w4, o8["graph"], o8["output"]) - 1e-6, (a, o8)
    assert _cos(sim("A16W8")) >= _cos(sim("A8W8"))


def test_layers_reported_and_keep_fp_of_the_named_layers_raises_cosine(sim):
    prompts = (PROMPT, CALIBRATION[5])
    base = sim("A16W4", prompts=prompts, new_tokens=6)
    assert [entry["layer"] for entry in base.layers] == [0, 1]
    assert all(0 < entry["cosine"] < 1 for entry in base.layers)
    assert {o["graph"] for o in base.outputs} == {"prefill", "decode"}
    weak = base.weak_layers
    assert weak and base.suggestion() == f"--keep-fp {','.join(map(str, weak))}"
    kept = sim("A16W4", keep=weak, prompts=prompts, new_tokens=6)
    for graph in ("prefill", "decode"):
        assert _cos(kept, graph) > _cos(base, graph)
    assert kept.tokens["agreement"] >= base.tokens["agreement"]
    assert len(base.tokens["per_prompt"]) == 2 and all(len(p["quant"]) == 6 for p in base.tokens["per_prompt"])


def test_cli_exit_1_under_the_bar_json_carries_every_number(out, run_cli):
    code, stdout, err = run_cli("verify", out, "--quant", "A16W4", "--samples", 2, "--new-tokens", 4, "--format", "json")
    assert code == 1 and "under 0.99" in err and "try --keep-fp" in err and "Traceback" not in err
    data = json.loads(stdout)
    assert data["scheme"] == "A16W4" and data["ok"] is False and data["tokens"]["prompts"] == 2
    logits = [o for o in data["outputs"] if o["output"] == "logits"]
    assert logits and all({"cosine", "max_abs", "top1", "worst_call_cosine"} <= set(o) for o in logits)
    code, stdout, err = run_cli("verify", out, "--quant", "A16W16", "--prompt-ids", ",".join(map(str, PROMPT)),
                                "--new-tokens", 4)
    assert code == 0, err
    assert "greedy tokens: 1.000 agreement" in stdout
    code, _, err = run_cli("verify", out, "--quant", "A16W8", "--keep-fp", "x")
    assert code == 2 and "--keep-fp 'x'" in err
