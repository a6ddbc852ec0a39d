"""Greedy generation through compiled prefill/decode graphs equals transformers' generate.

Four compiles cover every axis twice (family, exporter, cache in the export, chunks, cache_io,
rope_mode); T=8, C=64; prompts shorter than, equal to and longer than T. Two of them compile with
--verify-each (every pass, chunk cuts included, keeps the numbers of the input model).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import factory
from mtkc.pipeline.check import check
from mtkc.pipeline.compile import compile_model
from mtkc.runtime.generate import Generator

T, C, NEW = 8, 64, 32
PROMPTS = {"short": [5, 17, 300], "equal": list(range(10, 18)), "long": list(range(40, 53))}
CASES = {  # name: (family, exporter, cache export, options)
    "qwen2-cache-1-new": ("qwen2", "legacy17", True, {"chunks": 1, "cache_io": "new"}),
    "qwen2-nocache-2-sliding": ("qwen2", "legacy17", False, {"chunks": 2, "cache_io": "sliding", "verify_each": True}),
    "llama-cache-2-new-posemb": ("llama", "legacy17", True, {"chunks": 2, "cache_io": "new", "rope_mode": "pos_emb",
                                                              "verify_each": True}),
    "llama-dynamo-nocache-1-sliding": ("llama", "dynamo", False, {"chunks": 1, "cache_io": "sliding"}),
}


@pytest.fixture(scope="module")
def compiled(exported, tmp_path_factory):
    """`compiled(case)` -> OUT folder of `mtkc compile` for that case (compiled once per module)."""
    outs = {}

    def get(case: str):
        if case not in outs:
            family, exporter, cache, options = CASES[case]
            out = tmp_path_factory.mktemp("gen") / case
            compile_model(exported(family, exporter, cache), "8.0", out,
                          {"seq_len": T, "cache_len": C, "kv_cache": True, **options})
            outs[case] = out
        return outs[case]

    return get


@pytest.fixture(scope="module")
def reference(tiny_model):
    """`reference(family, prompt name, n)` -> transformers greedy tokens (computed once)."""
    tokens = {}

    def get(family: str, prompt: str, n: int = NEW):
        if (family, prompt, n) not in tokens:
            tokens[family, prompt, n] = factory.reference_generate(tiny_model(family), PROMPTS[prompt], n)
        return tokens[family, prompt, n]

    return get


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers(case, compiled, reference):
    generator = Generator(compiled(case))
    family = CASES[case][0]
    for prompt in PROMPTS:
        tokens = generator.generate(PROMPTS[prompt], NEW)
        assert tokens == reference(family, prompt), f"{case}, {prompt} prompt"
        assert len(set(tokens)) > NEW // 2  # random weights still give varied tokens
        assert generator.stop_reason is None


@pytest.mark.parametrize("case", CASES)
def test_graphs_static_int64_free_opset17_all_npu(case, compiled):
    out = compiled(case)
    manifest = json.loads((out / "manifest.json").read_text())
    chunks = CASES[case][3]["chunks"]
    names = [g["name"] for g in manifest["graphs"]]
    assert names == (["prefill", "decode"] if chunks == 1 else
                     [f"{v}_{k}" for v in ("prefill", "decode") for k in range(chunks)])
    for entry in manifest["graphs"]:
        path = out / entry["path"]
        proto = onnx.load(str(path), load_external_data=False)
        assert max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) <= 17
        g = proto.graph
        for vi in [*g.input, *g.output, *g.value_info]:
            dims = vi.type.tensor_type.shape.dim
            assert all(d.HasField("dim_value") for d in dims), f"{entry['name']}: {vi.name} is not static"
            assert vi.type.tensor_type.elem_type != onnx.TensorProto.INT64, f"{entry['name']}: {vi.name} is int64"
        report = check(path, "8.0", compiled=False)
        assert report.assessment.coverage == 1.0, f"{entry['name']}: {report.assessment.groups}"
    # what the table sends to the host: the embedding lookup (and cos/sin rows for pos_emb)
    host = sorted(manifest.get("host", {}))
    assert host == (["embedding", "rope"] if CASES[case][3].get("rope_mode") == "pos_emb" else ["embedding"])


def test_cli_generate_json(compiled, reference, run_cli):
    code, stdout, stderr = run_cli("generate", compiled("qwen2-cache-1-new"), "--prompt-ids", "5,17,300",
                                   "--max-new-tokens", "8", "--format", "json")
    assert code == 0, stderr
    assert json.loads(stdout) == {"tokens": reference("qwen2", "short")[:8]}


def test_stops_when_the_cache_is_full(compiled, reference, tiny_model):
    generator = Generator(compiled("qwen2-nocache-2-sliding"))
    prompt = list(range(100, 140))  # 40 tokens in 5 prefill calls: 40 of 64 slots used
    tokens = generator.generate(prompt, NEW)
    assert len(tokens) == C - len(prompt) + 1  # the last token needs no cache slot
    assert tokens == factory.reference_generate(tiny_model("qwen2"), prompt, len(tokens))
    assert generator.stop_reason.startswith("cache full: 64 tokens fill cache_len 64")


def test_prompt_longer_than_the_cache_is_an_input_error(compiled):
    from mtkc.errors import InputError

    with pytest.raises(InputError, match="prompt of 65 tokens does not fit the cache of 64"):
        Generator(compiled("qwen2-cache-1-new")).generate(list(range(65)), 4)


def test_cli_errors_are_one_line(compiled, run_cli, tmp_path):
    code, _, stderr = run_cli("generate", compiled("qwen2-cache-1-new"), "--prompt-ids", "1,x")
    assert code == 2 and stderr.strip() == "mtkc: error: --prompt-ids '1,x': expected comma-separated integers"
    code, _, stderr = run_cli("generate", tmp_path, "--prompt-ids", "1")
    assert code == 2 and "no manifest.json" in stderr and len(stderr.strip().splitlines()) == 1


def test_mask_rows_and_cache_validity(compiled):
    """Additive mask: cache slots visible once valid; new tokens causal; padding never visible."""
    generator = Generator(compiled("qwen2-cache-1-new"))
    generator.reset()
    generator.valid[:3] = True
    mask = generator._mask([1, 1, T, C + T], k=5, t=T)[0, 0]
    assert mask.shape == (T, C + T)
    assert (mask[:, :3] == 0).all() and (mask[:, 3:C] == generator.mask_value).all()
    new = mask[:, C:] == 0
    assert np.array_equal(new[:5, :5], np.tril(np.ones((5, 5), bool))) and not new[:, 5:].any()


def test_mtkc_check_cli_accepts_a_compiled_decode_graph(compiled, run_cli):
    code, stdout, stderr = run_cli("check", compiled("llama-dynamo-nocache-1-sliding") / "decode.onnx",
                                   "--sdk", "8.0", "--format", "json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["coverage"]["raw"] == 1.0 and report["unsupported"] == []


def test_chunks_are_chained_by_the_manifest_wiring(compiled, reference, tmp_path):
    """Chunk k's hidden_states is the output its manifest `from` names (not a naming convention):
    renamed outputs still chain; a `from` naming no produced output is an InputError."""
    import shutil

    from mtkc.errors import InputError

    out = tmp_path / "renamed"
    shutil.copytree(compiled("qwen2-nocache-2-sliding"), out)
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["graphs"]:
        wired = [i["from"] for i in entry["inputs"] if i.get("from")]
        for source in wired:
            producer = next(g for g in manifest["graphs"] if g["name"] == source["graph"])
            proto = onnx.load(str(out / producer["path"]), load_external_data=False)
            renamed = f"{source['output']}_of_{producer['name']}"
            for node in proto.graph.node:
                node.output[:] = [renamed if o == source["output"] else o for o in node.output]
            for o in proto.graph.output:
                o.name = renamed if o.name == source["output"] else o.name
            for o in producer["outputs"]:
                o["name"] = renamed if o["name"] == source["output"] else o["name"]
            onnx.save(proto, str(out / producer["path"]))
            source["output"] = renamed
        assert len(wired) == (1 if entry["name"].endswith("_1") else 0)
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert Generator(out).generate(PROMPTS["long"], NEW) == reference("qwen2", "long")

    next(i for g in manifest["graphs"] for i in g["inputs"] if i.get("from"))["from"]["output"] = "nowhere"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"graph 'prefill_1': input 'hidden_states' is wired from 'prefill_0' "
                                         r"output 'nowhere', which no earlier graph of this pass produced"):
        Generator(out).generate(PROMPTS["long"], NEW)


def test_a_compile_without_kv_cache_generates_by_rerunning_the_sequence(exported, tiny_model, tmp_path):
    """One static `model` graph of T tokens: the whole sequence, padded to T, per new token."""
    out = tmp_path / "out"
    compile_model(exported("llama", "legacy17"), "8.0", out, {"seq_len": T, "no_convert": True})
    generator = Generator(out)
    tokens = generator.generate(PROMPTS["short"], NEW)
    assert len(tokens) == T - len(PROMPTS["short"]) + 1 and generator.stop_reason.startswith("sequence full")
    assert tokens == factory.reference_generate(tiny_model("llama"), PROMPTS["short"], len(tokens))
