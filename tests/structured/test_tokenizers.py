"""The tokenizer protocol on real tokenizers (the files mistral-common ships: Tekken,
sentencepiece v1 / v3), through mistral-common and Hugging Face, and the audit of a
user-built tokenizer info: control tokens never text, decode equal to the grammar's text."""
from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_constrain import structured as S
from neuron_constrain.kernels import unpack_bitmask
from neuron_constrain.structured.engines.xgrammar.grammars import compile_grammar, xgrammar_info
from neuron_constrain.structured.tokenizers import (
    Tokenizer,
    TokenizerInfoError,
    audit,
    from_huggingface,
    from_mistral,
    mistral_data_file,
)

# what this file checks is host-side, the same on every torch: the main lane runs it (see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic

FILES = {"tekken": "tekken_240911.json", "sp1": "tokenizer.model.v1", "sp3": "mistral_instruct_tokenizer_240323.model.v3"}


@pytest.fixture(scope="module")
def mistral(mistral_tokenizers):
    """``from_mistral`` of each of FILES (built once per session, in conftest)."""
    return {name: mistral_tokenizers[name] for name in FILES}


@pytest.fixture(scope="module")
def sp_dirs(tmp_path_factory):
    """Hugging Face loads a sentencepiece model from a folder holding ``tokenizer.model``."""
    dirs = {}
    for name in ("sp1", "sp3"):
        folder = tmp_path_factory.mktemp(name)
        (folder / "tokenizer.model").write_bytes(open(mistral_data_file(FILES[name]), "rb").read())
        dirs[name] = str(folder)
    return dirs


def test_sizes_controls_and_eos(mistral):
    tekken, sp1, sp3 = mistral["tekken"], mistral["sp1"], mistral["sp3"]
    assert (tekken.vocab_size, sp1.vocab_size, sp3.vocab_size) == (131072, 32000, 32768)
    assert len(tekken.special_ids) == 1000 and set(tekken.special_ids) == set(range(1000))
    assert len(sp3.special_ids) == 751  # 750 control tokens + <unk>
    assert sp1.special_ids == {0, 1, 2}
    for tok in mistral.values():
        assert tok.eos_id == 2 and tok.stop_token_ids == (2,)
        assert tok.control_token("</s>") == 2
    assert tekken.control_token("[TOOL_CALLS]") == 9 and sp3.control_token("[TOOL_CALLS]") == 5
    assert sp1.control_token("[TOOL_CALLS]") is None


@pytest.mark.parametrize("name", list(FILES))
def test_control_tokens_are_never_grammar_text(mistral, name):
    """At any point of a JSON string, of free regex text and of any JSON, no control token is allowed."""
    tok = mistral[name]
    audit(tok.info, tok)
    compiler = xgr.GrammarCompiler(xgrammar_info(tok.info), max_threads=1)
    controls = torch.tensor(sorted(tok.special_ids))
    for grammar, prefix in [
        (compiler.compile_builtin_json_grammar(), '{"a": "x'),
        (compiler.compile_builtin_json_grammar(), ""),
        (compiler.compile_regex(r"[\s\S]*"), "free text "),
        (compile_grammar(compiler, S.json_schema({"type": "string"})), '"'),
    ]:
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(prefix)
        bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        allowed = unpack_bitmask(bitmask[0], tok.vocab_size)
        assert allowed.sum() > (10 if prefix == "" else 1000)  # text is allowed ...
        stops = set(tok.stop_token_ids)
        assert [int(t) for t in controls if allowed[t] and int(t) not in stops] == []  # ... control tokens never


@settings(max_examples=examples(25), deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40))
def test_decode_is_the_text_the_grammar_sees(mistral, text):
    """encode -> decode, and decode equals the pieces the grammar matched, on all three tokenizers."""
    for name, tok in mistral.items():
        ids = tok.encode(text)
        seen = b"".join(tok.pieces[i] for i in ids)
        assert tok.decode(ids) == seen.decode("utf-8", "replace"), (name, text, ids)
        own = tok._decode(ids)  # the tokenizer's own decode of the same ids
        if name == "tekken":
            assert tok.decode(ids) == own == text
        else:  # sentencepiece strips the first piece's space; the grammar saw it, so decode keeps it
            grammar_text = seen.decode("utf-8", "replace")
            assert own == (grammar_text[1:] if grammar_text.startswith(" ") else grammar_text), (name, text, ids)


def test_huggingface_adapters_agree_with_mistral_common(mistral, sp_dirs):
    import transformers
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    tekken = from_huggingface(convert_tekken_tokenizer(mistral_data_file(FILES["tekken"])))
    assert tekken.pieces == mistral["tekken"].pieces and tekken.special_ids == mistral["tekken"].special_ids
    audit(tekken.info, mistral["tekken"])  # the HF route builds an info mistral-common's tokenizer accepts
    for name, cls in [("sp3", transformers.LlamaTokenizer), ("sp3", transformers.AutoTokenizer),  # slow, fast
                      ("sp1", transformers.AutoTokenizer)]:
        if True:
            hf = cls.from_pretrained(sp_dirs[name])
            tok = from_huggingface(hf)
            assert tok.vocab_size == mistral[name].vocab_size
            assert mistral[name].special_ids <= tok.special_ids  # HF also drops [REFERENCE_DOC_*] in v3
            for i in range(tok.vocab_size):
                if i not in tok.special_ids:
                    assert tok.pieces[i] == mistral[name].pieces[i], (name, cls.__name__, i)
            ids = hf.encode('Hello world\n{"a": [1, 2]}', add_special_tokens=False)
            assert tok.decode(ids) == b"".join(tok.pieces[i] for i in ids).decode()
            audit(tok.info, tok)


def test_audit_refuses_from_huggingface_info_with_unmarked_control_tokens(mistral, sp_dirs):
    import transformers

    tok = mistral["sp3"]
    info = xgr.TokenizerInfo.from_huggingface(transformers.LlamaTokenizer.from_pretrained(sp_dirs["sp3"]))
    assert info.special_token_ids == []  # the route xgrammar documents marks none of them
    with pytest.raises(TokenizerInfoError, match=r"^751 control tokens are not special .*'\[INST\]'.* from_mistral") as error:
        audit(info, tok)
    assert "\n" not in str(error.value)
    with pytest.raises(TokenizerInfoError, match="control tokens are not special"):
        S.StructuredRuntime(tok, tokenizer_info=info, max_rows=1)


def test_audit_refuses_vocab_size_and_piece_disagreements(mistral):
    tok = mistral["sp1"]
    with pytest.raises(TokenizerInfoError, match=r"vocab_size=32000 but the model has 32064 logits; build it with vocab_size=32064"):
        audit(tok.info, tok, vocab_size=32064)
    wide = from_mistral(mistral_data_file(FILES["sp1"]), vocab_size=32064)  # a padded lm_head
    audit(wide.info, wide, vocab_size=32064)
    assert wide.info.vocab_size == 32064
    raw = [bytes(p) for p in tok.info.decoded_vocab]
    raw[500] = b"zz"
    other = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, stop_token_ids=[2])
    with pytest.raises(TokenizerInfoError, match=r"1 tokens decode differently .*500: info b'zz'"):
        audit(other, tok)
    # a token the tokenizer decodes to nothing, given text by the info
    silent = Tokenizer([b"a", b"b", b"", b""], special_ids=[3], stop_token_ids=[3], encode=list, decode=str)
    info = xgr.TokenizerInfo([b"a", b"b", b"c", b""], xgr.VocabType.RAW, stop_token_ids=[3])
    with pytest.raises(TokenizerInfoError, match=r"1 tokens decode to nothing .*\(2 ''\)"):
        audit(info, silent)


def test_too_small_vocab_size_refused(mistral):
    with pytest.raises(TokenizerInfoError, match="smaller than the tokenizer's 32000 tokens"):
        from_mistral(mistral_data_file(FILES["sp1"]), vocab_size=1000)
