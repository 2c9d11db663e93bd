"""Tokenizer: tokenizer.json encoding, streaming detokenization of CJK/emoji (never a broken
character mid-stream), stop strings across token boundaries, chat templates like transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "天气很好😀 東京タワー🗼 done."
EOS = 50256
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def gpt2_folder(fixtures, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-tok")
    shutil.copy(fixtures / "tokenizers" / "gpt2" / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "chat_template": CHATML,
    }))
    return path


def test_gpt2_tokenizer_json(gpt2_folder):
    tok = Tokenizer.from_folder(str(gpt2_folder))
    assert tok.encode("Hello world!") == [15496, 995, 0]
    assert tok.decode([15496, 995, 0]) == "Hello world!"
    assert tok.eos_token_ids == [EOS]


def test_incremental_detokenizer_never_breaks_a_character(gpt2_folder):
    tok = Tokenizer.from_folder(str(gpt2_folder))
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.replace(" ", "")) // 2  # multi-byte characters span tokens
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.step(t) for t in ids]
    assert "" in pieces  # some tokens end mid-character and were held back
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == TEXT


def test_chat_template_renders_like_transformers(gpt2_folder):
    from transformers import PreTrainedTokenizerFast

    ours = Tokenizer.from_folder(str(gpt2_folder))
    ref = PreTrainedTokenizerFast.from_pretrained(str(gpt2_folder))
    chats = [[{"role": "user", "content": "Hi!"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]]
    for messages in chats:
        for gen in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_chat_template_jinja_file_wins(gpt2_folder, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gpt2_folder / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    tok = Tokenizer.from_folder(str(tmp_path))
    assert tok.apply_chat_template([{"role": "user", "content": "abc"}]) == "ABC"
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}],
                                chat_template="{{ raise_exception('no system role') }}")


@pytest.fixture(scope="module")
def scripted(gpt2_folder, tmp_path_factory):
    """A Llama whose greedy continuation of TEXT's first token is the rest of TEXT, then EOS:
    attention and MLP outputs are zeroed, so the logits are lm_head(norm(embedding)), and
    lm_head maps each token's embedding direction to its successor. Needs TEXT's tokens to be
    distinct (checked)."""
    import transformers

    tok = Tokenizer.from_folder(str(gpt2_folder))
    ids = tok.encode(TEXT)
    assert len(set(ids)) == len(ids)
    cfg = transformers.LlamaConfig(
        vocab_size=50257, hidden_size=128, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, eos_token_id=EOS, bos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        emb = torch.randn(50257, 128)
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.zero_()
        for cur, nxt in zip(ids, ids[1:] + [EOS]):
            model.lm_head.weight[nxt] += emb[cur] / emb[cur].norm()
    path = tmp_path_factory.mktemp("scripted")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gpt2_folder / name, path / name)
    return LLM(str(path), dtype="float32"), ids


def stream_pieces(llm, prompt, params):
    pieces, last = [], None
    for out in llm.stream(prompt, params):
        pieces.append(out.outputs[0].delta_text)
        last = out
    return pieces, last.outputs[0]


def test_streaming_cjk_emoji_yields_whole_characters(scripted):
    llm, ids = scripted
    pieces, final = stream_pieces(llm, {"prompt_token_ids": ids[:1]},
                                  SamplingParams(temperature=0, max_tokens=64))
    assert final.token_ids == ids[1:] + [EOS]
    assert final.finish_reason == "stop"
    assert final.text == TEXT[1:]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # held back while a character was incomplete
    assert "".join(pieces) == final.text


def test_stop_string_across_token_boundaries(scripted):
    llm, ids = scripted
    stop = "ワー🗼"
    assert not any(stop in llm.tokenizer.decode([t]) for t in ids)  # no single token has it
    pieces, final = stream_pieces(llm, {"prompt_token_ids": ids[:1]},
                                  SamplingParams(temperature=0, max_tokens=64, stop=[stop]))
    assert final.text == TEXT[1 : TEXT.index(stop)]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert "".join(pieces) == final.text  # nothing streamed that was later taken back
    out = llm.generate({"prompt_token_ids": ids[:1]},
                       SamplingParams(temperature=0, max_tokens=64, stop=stop,
                                      include_stop_str_in_output=True), use_tqdm=False)
    assert out[0].outputs[0].text == TEXT[1 : TEXT.index(stop) + len(stop)]


def test_text_prompt_and_chat(scripted):
    llm, ids = scripted
    out = llm.generate(TEXT[:1], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    assert out[0].prompt_token_ids == ids[:1]
    assert out[0].outputs[0].text == TEXT[1:]
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3),
                    use_tqdm=False)
    expected = llm.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False)
    assert chat[0].prompt_token_ids == expected
