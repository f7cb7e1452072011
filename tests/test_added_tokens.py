"""Fine-tunes that add tokens past the sentencepiece model (ChatML's <|im_end|> and <|im_start|>, ids
2000 and 2001 of the shipped tiny-mistral's 2000 pieces): made by transformers' own tokenizer and
model code, then read here; encodings, decodings and greedy tokens against transformers."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from mixtral_infer import Tokenizer, generate, load_model
from mixtral_infer.checkpoint.convert import convert
from mixtral_infer.errors import CheckpointError
from mixtral_infer.tokenizer import read_added_tokens

CHATML = ["<|im_end|>", "<|im_start|>"]
# The common ChatML chat template (as OpenHermes-style fine-tunes ship it), which transformers renders.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Answer in the words of the King James Bible."},
    {"role": "user", "content": "Who art thou?"},
    {"role": "assistant", "content": "I am that I am."},
    {"role": "user", "content": "Say more."},
]
TEXTS = [
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b",
    " <|im_start|> x",
    "<|im_end|><|im_start|>",
    "x\n\n<|im_end|>  y  ",
    "In the beginning God created the heaven and the earth.",
    "unicode: café 東京 😀 <|im_end|>",
    "<|im_end",  # a prefix of one is text
    "",
]


def transformers_tokenizer(folder):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def chatml_folder(tmp_path_factory):
    """tiny-mistral as a ChatML fine-tune leaves transformers: the tokens added by its tokenizer
    (``add_special_tokens``, ``<|im_end|>`` the end token), the embeddings resized to 2002 rows."""
    import transformers

    folder = tmp_path_factory.mktemp("chatml") / "tiny-mistral-chatml"
    convert("tiny-mistral", folder, to="hf")
    tokenizer = transformers_tokenizer(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": CHATML})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHATML_TEMPLATE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model.resize_token_embeddings(len(tokenizer))
    torch.manual_seed(0)
    with torch.no_grad():  # rows of their own, so that the new tokens can win
        model.get_input_embeddings().weight[2000:] = torch.randn(2, model.config.hidden_size) * 0.05
        model.get_output_embeddings().weight[2000:] = torch.randn(2, model.config.hidden_size) * 0.05
    model.save_pretrained(folder)
    (folder / "special_tokens_map.json").unlink()  # convert's; transformers 5 writes none, and would read it first
    tokenizer.save_pretrained(folder)
    return folder


def test_added_tokens_encode_and_decode_as_transformers_does(chatml_folder):
    """The module docstring's example among them: "a<|im_end|>b" -> [▁a, 2000, ▁b], decoded "a b"."""
    ours, theirs = Tokenizer.from_folder(chatml_folder), transformers_tokenizer(chatml_folder)
    assert (ours.n_words, ours.eos_id, ours.bos_id) == (2002, 2000, 1) == (len(theirs), theirs.eos_token_id, 1)
    assert [t.content for t in ours.added.values()] == CHATML and all(t.special for t in ours.added.values())
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids, text
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids), text
    a, b = ours.encode("a", bos=False), ours.encode("b", bos=False)
    assert ours.encode("a<|im_end|>b", bos=False) == a + [2000] + b and ours.decode(a + [2000] + b) == "a b"
    assert ours.id_to_piece(2001) == "<|im_start|>"


def test_a_fine_tune_with_added_tokens_loads_and_decodes_as_transformers_does(chatml_folder):
    """Its 2002 rows match the tokenizer's 2000 pieces and 2 added tokens; greedy tokens of a ChatML
    prompt = transformers' (a model too tiny to have learnt ChatML: the check is of the reading)."""
    import transformers

    ours = load_model(chatml_folder, dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(chatml_folder)
    prompt = tokenizer.encode("<|im_start|>user\nIn the beginning<|im_end|>\n<|im_start|>assistant\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(chatml_folder, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=2000, pad_token_id=2000
            )
    generated, _ = generate([prompt], ours, max_tokens=12, eos_id=tokenizer.eos_id)
    assert generated[0] == expected[0, len(prompt):].tolist()[: len(generated[0])]


def test_converting_keeps_the_added_tokens_and_the_end_token(chatml_folder, tmp_path):
    """To the Mistral layout (the files they were read from travel beside tokenizer.model) and back to
    Hugging Face's (written into tokenizer.json and the end token): transformers reads them alike."""
    convert(chatml_folder, tmp_path / "mistral", to="mistral")
    mistral = Tokenizer.from_folder(tmp_path / "mistral")
    assert (mistral.n_words, mistral.eos_id) == (2002, 2000)
    convert(tmp_path / "mistral", tmp_path / "hf", to="hf")
    again, original = transformers_tokenizer(tmp_path / "hf"), transformers_tokenizer(chatml_folder)
    assert again.eos_token_id == 2000 and len(again) == 2002
    for text in TEXTS:
        assert again.encode(text) == original.encode(text) == mistral.encode(text), text
    assert load_model(tmp_path / "hf", dtype=torch.float32).args.vocab_size == 2002


def test_the_end_token_is_read_where_transformers_reads_it(chatml_folder, tmp_path):
    """``special_tokens_map.json`` first, then ``tokenizer_config.json``; one that names nothing is refused."""
    folder = tmp_path / "end"
    shutil.copytree(chatml_folder, folder)
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert Tokenizer.from_folder(folder).eos_id == 2 == transformers_tokenizer(folder).eos_token_id
    (folder / "special_tokens_map.json").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|eot|>"}))
    with pytest.raises(CheckpointError, match="eos_token '<|eot|>' is neither a piece of tokenizer.model nor an added"):
        Tokenizer.from_folder(folder)


def test_added_tokens_that_do_not_follow_the_pieces_are_refused(chatml_folder, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(chatml_folder, folder)
    pipeline = json.loads((folder / "tokenizer.json").read_text())
    for token in pipeline["added_tokens"]:
        if token["id"] == 2001:
            token["id"] = 2005
    (folder / "tokenizer.json").write_text(json.dumps(pipeline))
    with pytest.raises(CheckpointError, match=r"added token ids \[2000, 2005\] must follow the tokenizer's 2000"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer.json").unlink()
    (folder / "added_tokens.json").write_text(json.dumps({"<|im_end|>": 2000, "<|im_start|>": 2001}))
    assert [t.id for t in read_added_tokens(folder, 2000)] == [2000, 2001]  # the older file, read when alone
    assert Tokenizer.from_folder(folder).encode("a<|im_end|>", bos=False)[-1] == 2000


def test_rows_past_the_tokens_are_still_refused(chatml_folder, tmp_path):
    """A vocabulary padded past every token (no string for rows 2002+) is refused as before, naming both sizes."""
    folder = tmp_path / "padded"
    shutil.copytree(chatml_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 2048}))
    with pytest.raises(CheckpointError, match="vocabulary of 2002 tokens, but the model config says vocab_size=2048"):
        load_model(folder)


def test_added_tokens_past_a_power_of_ten_are_taken_in_order(tmp_path):
    """Ids sorted as numbers (9998, 9999, 10000), not as text."""
    entries = [{"id": i, "content": f"<t{i}>", "special": True} for i in (10000, 9999, 9998)]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": entries}))
    assert [t.id for t in read_added_tokens(tmp_path, 9998)] == [9998, 9999, 10000]


@pytest.mark.parametrize(
    "added_tokens, message",
    [
        ("x", "added_tokens must be a list of objects"),
        ([{"id": "2000", "content": "<a>"}], "added token ids"),
        ([{"id": 2001, "content": "<a>"}], r"added token ids \[2001\] must follow"),
        ([{"id": 2000, "content": ""}], "each added token must be a distinct, non-empty string"),
        ([{"id": 2000, "content": "<a>"}, {"id": 2001, "content": "<a>"}], "distinct"),
    ],
)
def test_malformed_added_tokens_are_named(tmp_path, added_tokens, message):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added_tokens}))
    with pytest.raises(CheckpointError, match=message):
        read_added_tokens(tmp_path, 2000)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json: not valid JSON"):
        read_added_tokens(tmp_path, 2000)


def chat_ids(theirs, messages):
    """transformers' ids of its chat template's text (with the generation prompt), as the serving peers send them."""
    text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return theirs.encode(text, add_special_tokens=False)


def test_a_chatml_fine_tune_s_chat_turns_are_its_template_s(chatml_folder):
    """The server's chat prompt (BOS, then ChatML's text encoded whole) = transformers' rendering of
    the fine-tune's template; the command line's turns: the first = the template of one user message,
    a later one = the tail of the template after the answer before it."""
    from mixtral_infer.generation.chat import Conversation
    from mixtral_infer.serve.protocol import chat_prompt

    ours, theirs = Tokenizer.from_folder(chatml_folder), transformers_tokenizer(chatml_folder)
    assert ours.chat_format == "chatml" and Tokenizer.from_folder("tiny-mistral").chat_format == "v1"
    for end in (2, 4):
        assert chat_prompt(ours, MESSAGES[:end]) == [ours.bos_id] + chat_ids(theirs, MESSAGES[:end])
    assert chat_prompt(ours, MESSAGES[1:2]) == [ours.bos_id] + chat_ids(theirs, MESSAGES[1:2])
    conversation = Conversation(load_model(chatml_folder, dtype=torch.float32), ours, instruct=True, max_tokens=4)
    assert conversation._turn_tokens("Who art thou?") == [ours.bos_id] + chat_ids(theirs, MESSAGES[1:2])
    conversation.history = [ours.bos_id, 5]  # after a first turn and its answer
    later = conversation._turn_tokens("Say more.")
    assert chat_ids(theirs, MESSAGES[1:])[-len(later):] == later and later[:2] == ours.encode("\n", bos=False)
