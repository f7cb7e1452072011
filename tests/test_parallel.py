"""Two CPU processes (gloo, loopback) give the single-process logits, pipeline and tensor/expert parallel."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import WINDOW, random_model, tiny_args
from test_model import cached_logits, random_prompts

from mixtral_infer import ConfigError, load_model
from mixtral_infer.checkpoint.loading import save_consolidated
from mixtral_infer.generation.generate import prefill
from mixtral_infer.model.parallel import Parallel

LENGTHS = [3 * WINDOW + 27, WINDOW + 24, 5]  # each decodes 24 steps, the first two well past the window
PREFIXES = [3 * WINDOW + 3, WINDOW, 5]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world_size, port, jobs):
    """Each job ``(folder, parallel_kind, out_path)`` in turn, in one process group: what the rank
    computes of the model in ``folder`` cut by ``parallel_kind``, saved to ``out_path.RANK``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        for folder, parallel_kind, out_path in jobs:
            if parallel_kind == "tensor":
                parallel = Parallel(tensor_parallel=world_size, rank=rank)
            else:
                parallel = Parallel(num_pipeline_ranks=world_size, rank=rank)
            model = load_model(folder, max_batch_size=3, device="cpu", dtype=torch.float32, parallel=parallel)
            sequences = random_prompts(LENGTHS, model.args.vocab_size, seed=3)
            logits = cached_logits(model, sequences, PREFIXES, chunk_size=5)
            last_logits = last_logits_only(model, sequences)
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            cache_bytes = model.make_cache(3, max_seqlen=max(LENGTHS)).nbytes()
            torch.save({"logits": logits, "last_logits": last_logits, "weight_bytes": weight_bytes, "cache_bytes": cache_bytes}, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


def last_logits_only(model, sequences):
    """Each sequence's last logits from a chunked prefill that skips every other row (``logit_rows``)."""
    cache = model.make_cache(len(sequences), max_seqlen=max(LENGTHS))
    cache.start_sequences(len(sequences))
    with torch.no_grad():
        logits = prefill(model, cache, sequences, chunk_size=5)
    return logits  # (B, V)


MODELS = ["mistral", "mixtral", "ministral"]


def model_to_cut(name: str, folder):
    """3 layers, saved in ``folder``; ``ministral``: its first layer full attention, the others windowed
    (the pipeline's first stage holds both kinds, the second windowed layers only)."""
    args = dataclasses.replace(tiny_args(moe=name == "mixtral", max_batch_size=3), n_layers=3)
    if name == "ministral":
        args = dataclasses.replace(args, sliding_window=[None, WINDOW, WINDOW])
    model = random_model(args, seed=21)
    save_consolidated(model, folder)
    return model


@pytest.fixture(scope="module", params=MODELS)
def saved_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, model_to_cut(request.param, folder)


def test_two_processes_match_one(tmp_path):
    """Each model cut by each kind, in one pair of processes (starting a pair costs seconds): every
    rank's logits are one process's, and the ranks hold the weights and cache they should."""
    models = {name: model_to_cut(name, tmp_path / name) for name in MODELS}
    jobs = [(str(tmp_path / name), kind, str(tmp_path / f"{name}-{kind}")) for name in MODELS for kind in ("pipeline", "tensor")]
    mp.start_processes(worker, args=(2, free_port(), jobs), nprocs=2, start_method="spawn")
    for folder, parallel_kind, out_path in jobs:
        name = folder.rsplit("/", 1)[1]
        try:
            check_the_cut(models[name], parallel_kind, [torch.load(f"{out_path}.{rank}") for rank in range(2)])
        except AssertionError as error:
            raise AssertionError(f"{name} cut by {parallel_kind}: {error}") from error


def check_the_cut(model, parallel_kind, results):
    expected = cached_logits(model, random_prompts(LENGTHS, model.args.vocab_size, seed=3), PREFIXES, chunk_size=5)
    # Every rank sees the same logits. Tensor parallelism adds each product in two halves, so float32
    # sums differ in order: up to 1.0e-5 among logits of magnitude up to ~3 on a 2-core AMD EPYC, hence rtol too.
    for result in results:
        for got, want in zip(result["logits"], expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        last = torch.stack([rows[-1] for rows in expected])
        torch.testing.assert_close(result["last_logits"], last, atol=1e-5, rtol=1e-5)

    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    full_cache = model.make_cache(3, max_seqlen=max(LENGTHS)).nbytes()
    shares = [r["weight_bytes"] for r in results]
    if parallel_kind == "pipeline":
        assert sum(shares) == full_bytes  # every tensor lives on exactly one rank
        assert sum(r["cache_bytes"] for r in results) == full_cache
    else:
        replicated = 2 * model.args.vocab_size * model.args.dim * 4  # embeddings and output on both ranks
        replicated += sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith("norm.weight") or "gate" in n)
        assert all(share == (full_bytes - replicated) // 2 + replicated for share in shares)
        assert all(r["cache_bytes"] == full_cache // 2 for r in results)


@pytest.mark.parametrize("parallel", [Parallel(tensor_parallel=2, rank=1), Parallel(num_pipeline_ranks=2, rank=1)], ids=["tp", "pp"])
def test_a_rank_reads_only_its_share_from_either_format(saved_model, tmp_path, monkeypatch, parallel):
    """A rank's weights are the same from a Mistral folder (rows/columns cut by ``get_slice``) and from the
    converted Hugging Face folder (whole tensors cut after translation); neither reads another stage's layers."""
    from mixtral_infer.checkpoint import safetensors_reader
    from mixtral_infer.checkpoint.convert import convert

    folder, model = saved_model
    convert(folder, tmp_path / "hf", to="hf")
    read = []
    real_read = safetensors_reader._read
    monkeypatch.setattr(safetensors_reader, "_read", lambda handle, path, entry, selection: read.append(entry.name) or real_read(handle, path, entry, selection))
    ours = load_model(folder, device="cpu", dtype=torch.float32, parallel=parallel).state_dict()
    hf = load_model(tmp_path / "hf", device="cpu", dtype=torch.float32, parallel=parallel).state_dict()
    assert list(ours) == list(hf) and all(torch.equal(ours[name], hf[name]) for name in ours)
    first_layer = [name for name in read if name.startswith(("layers.0.", "model.layers.0."))]
    assert (first_layer == []) == (parallel.num_pipeline_ranks == 2)  # layers 0-1 are rank 0's stage
    if parallel.tensor_parallel == 2:
        full = model.state_dict()
        assert ours["layers.0.attention.wq.weight"].shape[0] * 2 == full["layers.0.attention.wq.weight"].shape[0]
        assert torch.equal(ours["layers.0.attention.wo.weight"], full["layers.0.attention.wo.weight"][:, full["layers.0.attention.wo.weight"].shape[1] // 2 :])


@pytest.mark.parametrize(
    "parallel, message",
    [
        (Parallel(tensor_parallel=3, rank=0), "tensor_parallel=3 does not divide n_heads=4"),
        (Parallel(num_pipeline_ranks=3, rank=0), "num_pipeline_ranks=3 exceeds n_layers=2"),
    ],
)
def test_a_rank_count_that_does_not_divide_is_refused_before_loading(tmp_path, monkeypatch, parallel, message):
    save_consolidated(random_model(tiny_args()), tmp_path)
    import mixtral_infer.checkpoint.loading as checkpoint

    monkeypatch.setattr(checkpoint, "iter_tensors", lambda *a: pytest.fail("weights read before the check"))
    with pytest.raises(ConfigError, match=message):
        load_model(tmp_path, device="cpu", parallel=parallel)


def test_kv_heads_and_experts_must_divide_too():
    args = tiny_args()
    with pytest.raises(ConfigError, match="tensor_parallel=4 does not divide n_kv_heads=2"):
        Parallel(tensor_parallel=4).check(args)
    odd_experts = dataclasses.replace(args, n_kv_heads=4, moe=dataclasses.replace(args.moe, num_experts=3))
    with pytest.raises(ConfigError, match="does not divide moe.num_experts=3"):
        Parallel(tensor_parallel=2).check(odd_experts)
    with pytest.raises(ConfigError, match="either tensor_parallel or num_pipeline_ranks"):
        Parallel(tensor_parallel=2, num_pipeline_ranks=2)
