"""Models whose layers have their own windows (Ministral 8B: one full-attention layer, then three
windowed ones): the per-layer cache rule's worked example, logits and tokens equal to transformers'
``MinistralForCausalLM`` on every path, the Mistral layout's list of windows, the serving engine,
and one-line errors for files that get the windows wrong."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import MINISTRAL_WINDOWS, WINDOW, hf_model, ministral_args, ours_from_hf, random_model, tiny_args
from test_model import cached_logits, hf_logits, random_prompts

from mixtral_infer import RotatingBufferCache, generate, load_model, unrotate
from mixtral_infer.checkpoint.hf_format import args_from_hf_config, hf_config_from_args
from mixtral_infer.checkpoint.loading import save_consolidated
from mixtral_infer.checkpoint.params import args_from_params
from mixtral_infer.errors import CheckpointError, ConfigError, GenerationError
from mixtral_infer.model.cache import BufferKind, layer_cache_sizes
from mixtral_infer.model.xformers_bias import (
    BlockDiagonalCausalFromBottomRightMask,
    BlockDiagonalCausalLocalAttentionFromBottomRightMask,
)

TOLERANCE = 1e-4


# ---- the rule, on the article's example with a full-attention layer added ------------------------


def test_layer_cache_sizes_docstring_examples():
    assert layer_cache_sizes([None, 3], 10) == [10, 3]
    assert layer_cache_sizes([None, 3, 3, 3], 2) == [2, 2, 2, 2]  # a short sequence: no layer needs more
    assert layer_cache_sizes([4, 4], None) == [4, 4]
    with pytest.raises(GenerationError, match="full-attention layers needs max_seqlen"):
        layer_cache_sizes([None, 4], None)


def test_worked_example_full_layer_beside_a_window_of_three():
    """``layer_cache_sizes``' docstring: windows [None, 3], 10 tokens in chunks of 5. Each slot holds
    the position written there (a key of size 1), so the buffers can be read as positions."""
    cache = RotatingBufferCache(2, 1, [10, 3], n_kv_heads=1, head_dim=1, sliding_window=[None, 3])
    cache.start_sequences(1)
    assert cache.kinds == [BufferKind(10, None), BufferKind(3, 3)] and cache.layer_sizes == [10, 3]

    def layer(i):
        return cache.layer_keys[i][0, :, 0, 0].long().tolist()

    seen_chunk_1 = {}
    for chunk in range(2):
        metadata = cache.get_input_metadata([5])
        keys = metadata[0].positions.float()[:, None, None]  # (5, 1, 1) the positions, as keys
        for i in range(2):
            view = cache.get_view(i, metadata)
            if chunk == 1:
                seen_chunk_1[i] = (view.interleave_kv(keys, keys)[0][:, 0, 0].long().tolist(), view.mask)
            view.update(keys, keys)
        cache.advance([5])
        if chunk == 0:
            assert layer(0) == [0, 1, 2, 3, 4, 0, 0, 0, 0, 0] and layer(1) == [3, 4, 2]
    assert layer(0) == list(range(10)) and layer(1) == [9, 7, 8]
    (full_keys, full_mask), (window_keys, window_mask) = seen_chunk_1[0], seen_chunk_1[1]
    assert full_keys == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # [cached 0..4 | chunk 5..9], causal
    assert window_keys == [2, 3, 4, 5, 6, 7, 8, 9]  # [cached 2, 3, 4 | chunk 5..9], window 3
    assert type(full_mask) is BlockDiagonalCausalFromBottomRightMask
    assert isinstance(window_mask, BlockDiagonalCausalLocalAttentionFromBottomRightMask) and window_mask._window_size == 3
    assert unrotate(cache.layer_keys[1][0], 10)[:, 0, 0].long().tolist() == [7, 8, 9]


def test_a_cache_sums_its_layers_own_buffers():
    model = random_model(ministral_args())
    cache = model.make_cache(2, max_seqlen=40)
    assert cache.layer_sizes == [40, WINDOW, WINDOW, WINDOW] and len(cache.kinds) == 2
    per_slot = 2 * 2 * model.args.n_kv_heads * model.args.head_dim * 4  # K and V, 2 rows, float32
    assert cache.nbytes() == per_slot * (40 + 3 * WINDOW)
    assert [k.shape for k in cache.layer_keys] == [(2, 40, 2, 16)] + [(2, WINDOW, 2, 16)] * 3
    with pytest.raises(GenerationError, match=r"cache.cache_k: this cache's layers are of 2 kinds \(\[8, 40\] slots\)"):
        cache.cache_k
    with pytest.raises(GenerationError, match="full-attention layers needs max_seqlen"):
        model.make_cache(2)
    short = model.make_cache(1, max_seqlen=WINDOW + 2)
    with pytest.raises(GenerationError, match=rf"the cache holds {WINDOW + 2} slots per sequence, but sequence 0 needs 20"):
        generate([[1] * 12], model, max_tokens=8, cache=short)


# ---- parity with transformers' MinistralForCausalLM ----------------------------------------------


def test_the_transformers_config_reads_as_the_list_of_windows(ministral_pair):
    _, hf, args = ministral_pair
    config = hf.config.to_dict()
    assert config["layer_types"] == ["full_attention"] + 3 * ["sliding_attention"]
    assert args_from_hf_config(config).sliding_window == MINISTRAL_WINDOWS


@pytest.mark.parametrize("chunk_size", [3, WINDOW, 13], ids=["chunk<W", "chunk=W", "chunk>W"])
def test_chunked_prefill_and_decoding_match_transformers(ministral_pair, chunk_size):
    ours, hf, args = ministral_pair
    lengths = [4 * WINDOW + 5, 3 * WINDOW + 2, 7, 2 * WINDOW]
    prefixes = [3 * WINDOW + 1, 11, 7, 1]
    sequences = random_prompts(lengths, args.vocab_size)
    for sequence, logits in zip(sequences, cached_logits(ours, sequences, prefixes, chunk_size)):
        expected = hf_logits(hf, sequence)
        assert (logits - expected).abs().max().item() <= TOLERANCE


def test_forward_without_cache_matches_transformers_and_the_full_layer_matters(ministral_pair):
    """Without a cache, each layer gets its own mask; the same weights with every layer windowed
    differ past the window (the full-attention layer sees what a windowed one cannot)."""
    ours, hf, args = ministral_pair
    sequences = random_prompts([5 * WINDOW, 9, 1], args.vocab_size, seed=1)
    with torch.no_grad():
        logits = ours(torch.tensor(sum(sequences, [])), [len(s) for s in sequences])
        ours.args.sliding_window = WINDOW
        try:
            windowed = ours(torch.tensor(sequences[0]), [len(sequences[0])])
        finally:
            ours.args.sliding_window = list(MINISTRAL_WINDOWS)
    for sequence, part in zip(sequences, torch.split(logits, [len(s) for s in sequences])):
        assert (part - hf_logits(hf, sequence)).abs().max().item() <= TOLERANCE
    assert torch.equal(windowed[:WINDOW], logits[:WINDOW])  # within the window all layers agree
    assert (windowed[WINDOW + 1 :] - logits[WINDOW + 1 : 5 * WINDOW]).abs().max() > 1e-2


@pytest.mark.parametrize("decode", ["eager", "static", "compiled"])
def test_greedy_tokens_equal_transformers_generate(ministral_pair, decode):
    ours, hf, args = ministral_pair
    hf.generation_config.eos_token_id = None  # both run all 3 * WINDOW tokens, EOS or not
    prompts = random_prompts([2 * WINDOW + 3, 5, 1], args.vocab_size, seed=9)
    generated, _ = generate(prompts, ours, max_tokens=3 * WINDOW, chunk_size=WINDOW, decode=decode, temperature=0)
    for prompt, tokens in zip(prompts, generated):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=3 * WINDOW, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        assert tokens == out[0, len(prompt) :].tolist()


def test_static_decode_continues_a_cache_like_eager():
    """A cache kept between calls (a conversation): the static step writes each layer's own slots."""
    model = random_model(ministral_args(max_batch_size=2), seed=4)
    prompts = random_prompts([WINDOW + 3, 2], model.args.vocab_size, seed=3)
    follow_ups = random_prompts([4, 2 * WINDOW], model.args.vocab_size, seed=5)
    results = {}
    for mode in ("eager", "static"):
        cache = model.make_cache(2, max_seqlen=8 * WINDOW)
        first = generate(prompts, model, max_tokens=WINDOW + 3, cache=cache, decode=mode, temperature=0.7, seed=3)
        second = generate(follow_ups, model, max_tokens=2 * WINDOW, cache=cache, decode=mode, temperature=0.7, seed=4)
        results[mode] = (first[0], second[0], [k.clone() for k in cache.layer_keys])
    assert results["eager"][:2] == results["static"][:2]
    for eager, static in zip(results["eager"][2], results["static"][2]):
        torch.testing.assert_close(static, eager, atol=1e-5, rtol=0)


# ---- files: the Mistral layout's list, the Hugging Face layout's layer_types ----------------------


def test_the_mistral_layout_stores_a_list_of_windows_and_loads_the_same_logits(ministral_pair, tmp_path):
    ours, _, args = ministral_pair
    save_consolidated(ours, tmp_path / "mistral")
    params = json.loads((tmp_path / "mistral" / "params.json").read_text())
    assert params["sliding_window"] == [None, WINDOW, WINDOW, WINDOW]
    loaded = load_model(tmp_path / "mistral", dtype=torch.float32, device="cpu")
    assert loaded.args.layer_windows == [None, WINDOW, WINDOW, WINDOW]
    ids = torch.tensor(random_prompts([3 * WINDOW], args.vocab_size, seed=2)[0])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, [len(ids)]), ours(ids, [len(ids)]), atol=1e-6, rtol=0)


def test_convert_writes_a_ministral_folder_that_transformers_reads(ministral_pair, tmp_path, tokenizer_path):
    """``convert --to hf``: config.json is MinistralForCausalLM with layer_types; transformers loads it
    and gives our logits; it converts back to the Mistral layout's list."""
    import shutil

    import transformers

    from mixtral_infer.checkpoint.convert import convert

    ours, _, args = ministral_pair
    mistral = tmp_path / "mistral"
    save_consolidated(ours, mistral)
    shutil.copyfile(tokenizer_path, mistral / "tokenizer.model")
    convert(mistral, tmp_path / "hf", to="hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MinistralForCausalLM"] and config["sliding_window"] == WINDOW
    assert config["layer_types"] == ["full_attention"] + 3 * ["sliding_attention"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    sequence = random_prompts([3 * WINDOW], args.vocab_size, seed=4)[0]
    with torch.no_grad():
        ours_logits = ours(torch.tensor(sequence), [len(sequence)])
    assert (hf_logits(hf, sequence) - ours_logits).abs().max().item() <= TOLERANCE
    convert(tmp_path / "hf", tmp_path / "back", to="mistral")
    assert json.loads((tmp_path / "back" / "params.json").read_text())["sliding_window"] == [None, WINDOW, WINDOW, WINDOW]


def test_experts_with_per_layer_windows_stay_in_the_mistral_layout():
    args = dataclasses.replace(tiny_args(moe=True), n_layers=4, sliding_window=[None, WINDOW])
    with pytest.raises(ConfigError, match=r"no transformers model has experts with per-layer attention; keep the Mistral layout"):
        hf_config_from_args(args, torch.float32)


# ---- bad input: one line naming the file and the field, before any weight is read ----------------


@pytest.mark.parametrize(
    "windows, message",
    [
        ([WINDOW, WINDOW, WINDOW], r"params.json: sliding_window lists 3 windows, which does not divide n_layers=4"),
        ([None, 0], r"params.json: sliding_window entry 0 must be a positive integer or null \(full attention\)"),
        ([-4, WINDOW], r"params.json: sliding_window entry -4 must be a positive integer or null"),
        ([None, True], r"params.json: sliding_window entry True must be"),
        ([], r"params.json: sliding_window lists 0 windows, which does not divide n_layers=4"),
        ("8", r"params.json: sliding_window='8' must be a positive integer or null, or a list of them"),
    ],
)
def test_a_bad_list_of_windows_is_one_line_naming_the_file(windows, message):
    params = {**json.loads(json.dumps(dataclasses.asdict(ministral_args()))), "sliding_window": windows}
    params.pop("max_batch_size"), params.pop("moe")
    with pytest.raises(ConfigError, match=message):
        args_from_params(params)


def test_unknown_layer_types_and_a_wrong_count_name_the_field():
    config = hf_config_from_args(ministral_args(), torch.float32)
    with pytest.raises(ConfigError, match=r"config.json: layer_types names 'chunked_attention', expected one of \['full_attention', 'sliding_attention'\]"):
        args_from_hf_config({**config, "layer_types": ["full_attention", "chunked_attention"] * 2})
    with pytest.raises(ConfigError, match=r"config.json: layer_types must list one type for each of the num_hidden_layers=4 layers"):
        args_from_hf_config({**config, "layer_types": ["full_attention"] * 3})


def test_a_bad_window_in_a_folder_is_refused_before_the_weights(model_folder):
    """load_model on a folder whose params.json lists a window of 0: ConfigError naming the file."""
    params_path = model_folder / "params.json"
    params = json.loads(params_path.read_text())
    params["sliding_window"] = [None, 0]
    params_path.write_text(json.dumps(params))
    (model_folder / "consolidated.safetensors").write_bytes(b"not read")  # nothing of the weights is read
    with pytest.raises((ConfigError, CheckpointError), match=r"params.json: sliding_window entry 0 must be"):
        load_model(model_folder, device="cpu")


# ---- serving: the engine's mixed step, sizing and prefix reuse over layers of two sizes ----------


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_path):
    """A Ministral-shaped model (vocabulary 400) in a folder with the shared sentencepiece tokenizer:
    (model, tokenizer, folder)."""
    import shutil

    from mixtral_infer import Tokenizer

    folder = tmp_path_factory.mktemp("ministral") / "model"
    save_consolidated(random_model(dataclasses.replace(ministral_args(), vocab_size=400), seed=8), folder)
    shutil.copyfile(tokenizer_path, folder / "tokenizer.model")
    return load_model(folder, dtype=torch.float32, device="cpu", max_batch_size=4), Tokenizer.from_folder(folder), folder


def engine_tokens(engine, prompts, settings):
    from mixtral_infer.serve.engine import TokenEvent

    events = {i: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, settings, events[i].append)
    while engine.step():
        pass
    return [[e.token for e in events[i] if isinstance(e, TokenEvent)] for i in range(len(prompts))]


@pytest.mark.parametrize("decode", ["eager", "static", "compiled"])
def test_the_engine_decodes_as_generate_does(served, decode):
    """Four requests on three rows, prompts past the window, read in chunks beside decoding rows (the
    mixed step): each gets the tokens ``generate`` gives it alone."""
    from mixtral_infer.serve.engine import Engine, RequestSettings

    model, tokenizer, folder = served
    prompts = random_prompts([3 * WINDOW + 1, 5, 2 * WINDOW, 11], 400, seed=12)
    settings = RequestSettings(max_tokens=2 * WINDOW, temperature=0.0, ignore_eos=True)
    engine = Engine(model, tokenizer, rows=3, prefill_tokens=WINDOW, max_model_len=6 * WINDOW, decode=decode)
    assert engine.cache.layer_sizes == [6 * WINDOW, WINDOW, WINDOW, WINDOW]
    got = engine_tokens(engine, prompts, settings)
    for prompt, tokens in zip(prompts, got):
        alone, _ = generate([prompt], model, max_tokens=2 * WINDOW, temperature=0, decode="eager")
        assert tokens == alone[0]


def test_the_engine_needs_max_model_len_and_says_each_layers_slots(served):
    from mixtral_infer.serve.engine import Engine
    from mixtral_infer.serve.sizing import plan_rows

    model, tokenizer, folder = served
    with pytest.raises(GenerationError, match="a model with full-attention layers needs max_model_len"):
        Engine(model, tokenizer, rows=2)
    plan = plan_rows(model, prefill_tokens=16, max_rows=2, max_model_len=64)
    row = 2 * model.args.n_kv_heads * model.args.head_dim * 4 * (64 + 3 * WINDOW)  # K and V, float32
    assert plan.row_bytes == row
    assert plan.describe().startswith(f"2 cache rows of 64 (1 full-attention layer) / {WINDOW} (3 windowed) slots")


def test_a_chat_continues_its_row_in_every_kind_of_layer(served):
    """Four turns past the window: with reuse each turn reads only its new tokens from its row (the
    full-attention layer's slots hold the whole chat, the windowed ones the window), and every token
    and logprob equals an engine's that reads the whole conversation again."""
    from test_prefix_reuse import run_turns, user_turns

    from mixtral_infer.serve.engine import Engine

    model, tokenizer, folder = served
    turns = [[t % 400 for t in turn] for turn in user_turns(4, 12, seed=2)]
    engines = {reuse: Engine(model, tokenizer, rows=2, max_model_len=12 * WINDOW, decode="eager", prefix_reuse=reuse)
               for reuse in (True, False)}  # fmt: skip
    results = {reuse: run_turns(engine, turns, max_tokens=5) for reuse, engine in engines.items()}
    for (tokens, logprobs, _), (again, logprobs_again, _) in zip(results[True], results[False]):
        assert tokens == again and logprobs == pytest.approx(logprobs_again, abs=1e-5)
    assert results[True][-1][2] > 2 * WINDOW
    assert engines[True].prefix_hits == 3 and engines[True].reused_tokens > 2 * WINDOW


def test_n_choices_copy_a_row_of_both_kinds_and_sample_as_alone(served):
    """Two choices of a prompt past the window: the second takes a copy of the first's row (each
    layer's slots) and samples as the same seed alone."""
    from mixtral_infer.serve.engine import Engine, RequestSettings, TokenEvent

    model, tokenizer, folder = served
    prompt = random_prompts([3 * WINDOW + 2], 400, seed=21)[0]
    engine = Engine(model, tokenizer, rows=2, max_model_len=8 * WINDOW, decode="eager", prefix_reuse=False)
    events = [[], []]
    first = engine.submit(prompt, RequestSettings(max_tokens=6, temperature=0.9, seed=10), events[0].append)
    engine.submit(prompt, RequestSettings(max_tokens=6, temperature=0.9, seed=11), events[1].append, follows=first)
    while engine.step():
        pass
    assert engine.reused_tokens == len(prompt)  # read once
    for i, seed in enumerate((10, 11)):
        alone = Engine(model, tokenizer, rows=1, max_model_len=8 * WINDOW, decode="eager")
        solo = []
        alone.submit(prompt, RequestSettings(max_tokens=6, temperature=0.9, seed=seed), solo.append)
        while alone.step():
            pass
        assert [e.token for e in events[i] if isinstance(e, TokenEvent)] == [e.token for e in solo if isinstance(e, TokenEvent)]


def test_the_llm_api_and_quantized_weights_run_a_folder_of_per_layer_windows(served):
    """``LLM`` on the folder: a batch equals ``generate``; int8 weights decode alike eager and static."""
    from mixtral_infer import LLM, SamplingParams

    model, tokenizer, folder = served
    llm = LLM(str(folder), dtype=torch.float32)
    outputs = llm.generate(["torch module", "the parameters of"], SamplingParams(max_tokens=2 * WINDOW, temperature=0, ignore_eos=True))
    for out in outputs:
        alone, _ = generate([tokenizer.encode(out.prompt)], model, max_tokens=2 * WINDOW, temperature=0, decode="eager")
        assert out.token_ids == alone[0]
    quantized = load_model(folder, dtype=torch.bfloat16, device="cpu", quantize="int8", max_batch_size=2)
    prompts = random_prompts([2 * WINDOW + 1, 4], 400, seed=3)
    eager = generate(prompts, quantized, max_tokens=2 * WINDOW, temperature=0, decode="eager")
    static = generate(prompts, quantized, max_tokens=2 * WINDOW, temperature=0, decode="static")
    assert eager[0] == static[0]
