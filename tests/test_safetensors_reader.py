"""A safetensors header is hostile input: every way it can lie gets one CheckpointError line, before any byte is read."""

from __future__ import annotations

import json
import resource
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixtral_infer import CheckpointError
from mixtral_infer.checkpoint import safetensors_reader as reader
from mixtral_infer.checkpoint.safetensors_reader import DTYPES, iter_tensors, parse_header, read_header
from mixtral_infer.checkpoint.shares import Selection

REPO = Path(__file__).resolve().parents[1]

# Three tensors, back to back: a F32 (2, 3) at [0, 24), b BF16 (4,) at [24, 32), c I64 (1,) at [32, 40).
VALID = [
    ("a", {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}),
    ("b", {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}),
    ("c", {"dtype": "I64", "shape": [1], "data_offsets": [32, 40]}),
]
DATA = bytes(range(40))


def header_text(pairs) -> str:
    """JSON text of an object from (key, value) pairs, repeated keys kept (json.dumps of a dict cannot)."""
    return "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pairs) + "}"


def file_bytes(pairs=VALID, data=DATA, header: str | None = None) -> bytes:
    raw = (header if header is not None else header_text(pairs)).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def with_entry(name, **changes):
    return [(n, {**info, **changes}) if n == name else (n, info) for n, info in VALID]


def load(tmp_path, content: bytes):
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    return dict(iter_tensors(path))


def test_a_valid_file_gives_its_tensors(tmp_path):
    tensors = load(tmp_path, file_bytes())
    assert tensors["a"].shape == (2, 3) and tensors["a"].dtype == torch.float32
    assert bytes(tensors["a"].view(-1).view(torch.uint8).tolist()) == DATA[:24]
    assert tensors["c"].tolist() == [int.from_bytes(DATA[32:40], "little")]


@pytest.mark.parametrize(
    "pairs, message",
    [
        (with_entry("b", data_offsets=[16, 24]), r"tensors a and b share bytes \[16, 24\)"),
        (with_entry("c", data_offsets=[0, 8]), r"tensors c and a share bytes \[0, 8\)"),
        (VALID + [("a", VALID[0][1])], "key 'a' appears twice"),
        (with_entry("a", shape=[2.0, 3]), r"shape \[2.0, 3\] must be a list of at most 16 integers >= 0"),
        (with_entry("a", shape=["2", 3]), r"shape \['2', 3\] must be a list"),
        (with_entry("a", shape=[-2, -3]), r"shape \[-2, -3\] must be a list"),
        (with_entry("a", shape=[True, 3]), "must be a list"),
        (with_entry("a", shape=6), "shape 6 must be a list"),
        (with_entry("a", dtype="F8"), "dtype 'F8' is not one of"),
        (with_entry("a", data_offsets=[0, 24.0]), r"data_offsets \[0, 24.0\] must be \[begin, end\]"),
        (with_entry("a", data_offsets=[24, 0]), r"data_offsets \[24, 0\] must have 0 <= begin <= end"),
        (with_entry("a", data_offsets=[-8, 16]), "must have 0 <= begin <= end"),
        (with_entry("a", shape=[2, 4]), r"tensor 'a' has 24 bytes, its shape \(2, 4\) in F32 needs 32"),
        (with_entry("c", shape=[2**40], data_offsets=[32, 32 + 8 * 2**40]), "truncated: tensor c ends past the end"),
        ([("", VALID[0][1])], "a tensor has an empty name"),
        ([("a", {**VALID[0][1], "extra": 1})], "expected the keys"),
        ([("a", [1, 2])], "expected the keys"),
        (VALID + [("__metadata__", {"format": 5})], "__metadata__ must map names to strings"),
    ],
)
def test_hostile_headers_get_one_line(tmp_path, pairs, message):
    with pytest.raises(CheckpointError, match=message) as error:
        load(tmp_path, file_bytes(pairs))
    assert str(error.value).startswith(str(tmp_path / "x.safetensors"))
    assert "\n" not in str(error.value)


def test_deep_nesting_is_one_line(tmp_path):
    metadata = "[" * 100_000 + "]" * 100_000
    header = header_text(VALID)[:-1] + f', "__metadata__": {metadata}}}'
    with pytest.raises(CheckpointError, match="nested too deeply") as error:
        load(tmp_path, file_bytes(header=header))
    assert str(error.value).startswith(str(tmp_path / "x.safetensors")) and "\n" not in str(error.value)


def test_a_header_of_90_mb_of_metadata_loads_in_seconds(tmp_path):
    """Within the format's 100 MB: its check took 30-140 s and 11 GB (a regular expression ran over the
    whole header text), now a few seconds and a few hundred MB."""
    head, tail = b'{"__metadata__": {"note": "', ('"}, ' + header_text(VALID)[1:]).encode()
    size = 90_000_000
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(head) + size + len(tail)) + head)
        handle.write(b"x" * size)
        handle.write(tail + DATA)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    tensors = dict(iter_tensors(path))
    seconds = time.perf_counter() - start
    assert list(tensors) == ["a", "b", "c"] and bytes(tensors["a"].view(-1).view(torch.uint8).tolist()) == DATA[:24]
    assert seconds < 20, f"{seconds:.1f} s"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 1 << 20, "peak RSS grew by more than 1 GB"  # KB


def test_brackets_inside_strings_are_not_nesting():
    header = header_text(VALID[:1] + [("__metadata__", {"note": "[[[[" * 50 + '\\"{{'})]).encode()
    assert [e.name for e in parse_header(header, 24)] == ["a"]


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x05\x00", r"truncated \(no safetensors header\)"),
        (struct.pack("<Q", 10**12) + b"{}", "not a safetensors file, or truncated"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", "not UTF-8 JSON"),
        (struct.pack("<Q", 2) + b"[]", "a JSON list, expected an object"),
        (struct.pack("<Q", 3) + b"{x}", r"corrupt safetensors header \(invalid JSON in header: key must be a string at line 1 column 2\)"),
    ],
)
def test_broken_framing(tmp_path, content, message):
    with pytest.raises(CheckpointError, match=message):
        load(tmp_path, content)


@pytest.mark.parametrize(
    "header, message",
    [
        # Python's json takes a lone surrogate; the library does not, and its reason stands.
        ('{"a\\ud800": ' + json.dumps(VALID[0][1]) + "}", r"invalid JSON in header: .*hex escape at line 1 column 10"),
        # Not JSON: the library says what and where.
        ('{"a": ' + json.dumps(VALID[0][1]) + ",}", r"\(invalid JSON in header: trailing comma at line 1 column \d+\)"),
    ],
)
def test_what_the_library_alone_refuses_is_one_line_with_its_reason(tmp_path, header, message):
    with pytest.raises(CheckpointError, match=message) as error:
        load(tmp_path, file_bytes(header=header, data=DATA[:24]))
    assert str(error.value).startswith(f"{tmp_path / 'x.safetensors'}: corrupt safetensors header (") and "\n" not in str(error.value)


def test_a_large_header_the_library_finds_not_json_of_its_schema_is_not_built_here(tmp_path, monkeypatch):
    """Millions of empty lists under __metadata__ (94 MB of them: 20 s and 2.5 GB in json.loads): the
    library stops at the first one, and its reason stands."""
    metadata = "[" + "[]," * 700_000 + "[]]"  # 2 MB, past DIAGNOSED_HEADER_BYTES
    header = header_text(VALID)[:-1] + f', "__metadata__": {{"x": {metadata}}}}}'
    monkeypatch.setattr(reader, "parse_header_and_metadata", lambda *a: pytest.fail("the header was parsed in Python"))
    with pytest.raises(CheckpointError, match=r"\(invalid JSON in header: invalid type: sequence, expected a string at line 1 column \d+\)"):
        load(tmp_path, file_bytes(header=header))


def test_the_whole_header_is_checked_before_a_byte_of_data_is_read(tmp_path, monkeypatch):
    """A bad last entry stops the load before the first tensor is read."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(file_bytes(with_entry("c", dtype="F8")))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("a tensor was allocated"))
    with pytest.raises(CheckpointError, match="dtype 'F8'"):
        next(iter_tensors(path))


@pytest.mark.parametrize(
    "pairs, data, message",
    [
        ([VALID[0], (VALID[1][0], {**VALID[1][1], "data_offsets": [32, 40]})], DATA, r"data bytes \[24, 32\) before tensor b belong to no tensor"),
        (VALID, DATA + bytes(8), "the last 8 data bytes belong to no tensor"),
        ([], DATA, "the last 40 data bytes belong to no tensor"),
    ],
    ids=["gap", "trailing", "no-tensors"],
)
def test_data_must_be_covered_exactly_as_the_library_requires(tmp_path, pairs, data, message):
    with pytest.raises(CheckpointError, match=message) as error:
        load(tmp_path, file_bytes(pairs, data))
    assert str(error.value).startswith(str(tmp_path / "x.safetensors")) and "\n" not in str(error.value)


def test_a_file_cut_after_its_check_is_one_line_naming_the_file(tmp_path):
    """The file can change between the header's check and the reads: still one CheckpointError line."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(file_bytes())

    def cut(name, shape):
        path.write_bytes(file_bytes()[:-20])  # after every shape was approved, before a byte is read

    with pytest.raises(CheckpointError) as error:
        dict(iter_tensors(path, check=cut))
    assert str(error.value) == f"{path}: truncated: tensor a ends past the end of the file (24 > 20 data bytes)"


def test_the_header_is_parsed_once_however_many_tensors(tmp_path, monkeypatch):
    """2,000 tensors: one parse of the header (a 90 MB header parsed per tensor took minutes)."""
    from safetensors.torch import save_file

    tensors = {f"t{i}": torch.full((3,), float(i)) for i in range(2000)}
    path = tmp_path / "many.safetensors"
    save_file(tensors, path)
    parses = []
    parse = reader.parse_header_and_metadata
    monkeypatch.setattr(reader, "parse_header_and_metadata", lambda *a: parses.append(1) or parse(*a))
    read = dict(iter_tensors(path))
    assert len(parses) == 1 and all(torch.equal(read[k], v) for k, v in tensors.items())


def test_a_file_rewritten_after_its_check_is_refused_before_reading(tmp_path):
    """The shape check approved the file; rewritten in place, its tensor is bigger: refused from its
    header, read again. A file replaced by another (a new inode) is read as it was checked."""
    from safetensors.torch import save_file

    path = tmp_path / "x.safetensors"
    save_file({"w": torch.zeros(2, 3)}, path)
    bigger = tmp_path / "bigger.safetensors"
    save_file({"w": torch.zeros(2000, 3)}, bigger)

    def rewrite(name, shape):
        with open(path, "r+b") as handle:  # the same file, new bytes
            handle.write(bigger.read_bytes())

    with pytest.raises(CheckpointError, match=r"tensor w changed while loading \(now \(2000, 3\)\)"):
        next(iter_tensors(path, check=rewrite))
    save_file({"w": torch.zeros(2, 3)}, path)
    replaced = lambda name, shape: bigger.replace(path)  # noqa: E731 - the path now names another file
    assert torch.equal(dict(iter_tensors(path, check=replaced))["w"], torch.zeros(2, 3))


@pytest.mark.parametrize(
    "selection, expected",
    [
        (Selection(), slice(None)),
        (Selection(rows=slice(2, 5)), (slice(2, 5),)),
        (Selection(columns=slice(1, 3)), (slice(None), slice(1, 3))),
        (Selection(rows=slice(4, 6), columns=slice(0, 2)), (slice(4, 6), slice(0, 2))),
    ],
    ids=["whole", "rows", "columns", "both"],
)
def test_a_rank_gets_its_rows_and_columns_as_tensors_of_their_own(tmp_path, selection, expected):
    from safetensors.torch import save_file

    weight = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)  # (rows, columns)
    save_file({"w": weight, "n": torch.ones(4)}, tmp_path / "x.safetensors")
    tensors = dict(iter_tensors(tmp_path / "x.safetensors", select=lambda name: selection if name == "w" else None))
    assert list(tensors) == ["w"]  # "n" is skipped
    part = tensors["w"]
    assert torch.equal(part, weight[expected]) and part.is_contiguous()
    assert part.untyped_storage().nbytes() == part.nbytes  # its own memory, not a view of the file's map


def test_shape_check_runs_for_every_tensor_before_reading(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(file_bytes())
    seen = []

    def check(name, shape):
        seen.append((name, shape))
        if name == "c":
            raise CheckpointError(f"tensor {name} has shape {shape}")

    with pytest.raises(CheckpointError, match=r"tensor c has shape \(1,\)"):
        next(iter_tensors(path, check=check))
    assert seen == [("a", (2, 3)), ("b", (4,)), ("c", (1,))]


# ------------------------------------------------------------------ memory


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, struct, sys
    import torch
    from mixtral_infer import ModelArgs, Transformer, load_model
    from mixtral_infer.checkpoint.loading import save_consolidated
    args = ModelArgs(dim=64, n_layers=1, head_dim=16, hidden_dim=96, n_heads=4, n_kv_heads=2, norm_eps=1e-5,
                     vocab_size=128)
    cases = json.loads(sys.argv[2])
    for index, (rows, short) in enumerate(cases):
        folder = os.path.join(sys.argv[1], str(index))
        save_consolidated(Transformer(args), folder)
        # Replace the file by one whose tok_embeddings.weight is declared rows x 64 float32, in a sparse file.
        path = os.path.join(folder, "consolidated.safetensors")
        n_bytes = rows * 64 * 4
        header = json.dumps({"tok_embeddings.weight": {"dtype": "F32", "shape": [rows, 64], "data_offsets": [0, n_bytes]}}).encode()
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
        os.truncate(path, 8 + len(header) + n_bytes // short)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for index in range(len(cases)):
        try:
            load_model(os.path.join(sys.argv[1], str(index)), device="cpu", dtype=torch.float32)
            print("loaded")
        except Exception as error:
            print(type(error).__name__ + ": " + str(error))
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """
)

HUGE_CASES = [
    # 2.3 GB declared for a tensor the model wants as (128, 64): refused from the header.
    (9_000_000, 1, r"tensor tok_embeddings.weight has shape \(9000000, 64\), the model config implies \(128, 64\)"),
    # 1 TB declared, in a (sparse) file that long: refused from the header, nothing allocated.
    (4_000_000_000, 1, r"tensor tok_embeddings.weight has shape \(4000000000, 64\), the model config implies"),
    # 1 TB declared, file far shorter: refused as truncated.
    (4_000_000_000, 1000, "truncated: tensor tok_embeddings.weight ends past the end of the file"),
]


def test_huge_declared_tensors_are_refused_with_little_memory(tmp_path):
    """The three files loaded one after another in one fresh process: its peak RSS, which only grows,
    bounds what any of them allocated."""
    import json

    cases = json.dumps([[rows, short] for rows, short, _ in HUGE_CASES])
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(tmp_path), cases], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    *errors, peak_mb = result.stdout.strip().splitlines()
    assert len(errors) == len(HUGE_CASES), result.stdout
    for error, (_, _, message) in zip(errors, HUGE_CASES):
        assert error.startswith("CheckpointError: ") and "\n" not in error
        assert __import__("re").search(message, error), error
    assert int(peak_mb) < 50, f"peak RSS grew by {peak_mb} MB"


# ------------------------------------------------------------------ fuzzing


def _mutations():
    names = st.sampled_from(["a", "b", "c"])
    ints = st.one_of(st.integers(-50, 80), st.integers(-(2**70), 2**70))
    odd = st.one_of(ints, st.floats(allow_nan=False), st.text(max_size=3), st.none(), st.booleans(), st.lists(ints, max_size=3))
    return st.one_of(
        st.tuples(st.just("offset"), names, st.integers(0, 1), odd),
        st.tuples(st.just("shape"), names, st.integers(0, 3), odd),
        st.tuples(st.just("rank"), names, st.lists(st.integers(0, 8), max_size=4), st.none()),
        st.tuples(st.just("dtype"), names, st.sampled_from([*DTYPES, "F8", "", "f32"]), st.none()),
        st.tuples(st.just("rename"), names, st.sampled_from(["a", "b", "c", "d", "", "__metadata__"]), st.none()),
        st.tuples(st.just("drop"), names, st.none(), st.none()),
        st.tuples(st.just("nesting"), st.none(), st.integers(0, 200), st.none()),
        st.tuples(st.just("length"), st.none(), st.integers(-20, 20), st.none()),
        st.tuples(st.just("data"), st.none(), st.integers(-41, 16), st.none()),
        st.tuples(st.just("byte"), st.none(), st.integers(0, 400), st.integers(0, 255)),
    )


def mutate(mutations) -> bytes:
    pairs = [(name, json.loads(json.dumps(info))) for name, info in VALID]
    data, length_delta, flips, metadata = DATA, 0, [], None
    for kind, name, a, b in mutations:
        info = next((i for n, i in pairs if n == name), None)
        if kind == "offset" and info is not None:
            info["data_offsets"][a] = b
        elif kind == "shape" and info is not None and a < len(info["shape"]):
            info["shape"][a] = b
        elif kind == "rank" and info is not None:
            info["shape"] = a
        elif kind == "dtype" and info is not None:
            info["dtype"] = a
        elif kind == "rename":
            pairs = [(a if n == name else n, i) for n, i in pairs]
        elif kind == "drop":
            pairs = [(n, i) for n, i in pairs if n != name]
        elif kind == "nesting":
            metadata = "[" * a + "]" * a
        elif kind == "length":
            length_delta = a
        elif kind == "data":
            data = DATA[:a] if a < 0 else DATA + bytes(a)
        elif kind == "byte":
            flips.append((a, b))
    header = header_text(pairs)
    if metadata is not None:
        header = header[:-1] + (", " if pairs else "") + f'"__metadata__": {{"x": {metadata or "null"}}}}}'
    raw = bytearray(struct.pack("<Q", max(len(header.encode()) + length_delta, 0)) + header.encode() + data)
    for position, value in flips:
        if position < len(raw):
            raw[position] = value
    return bytes(raw)


def check_loaded(content: bytes, tensors) -> None:
    """A file that loads: each tensor is exactly the bytes its header entry names, and no two share bytes."""
    (size,) = struct.unpack("<Q", content[:8])
    header = json.loads(content[8 : 8 + size])
    data = content[8 + size :]
    assert set(tensors) == set(header) - {"__metadata__"}
    ranges = []
    for name, tensor in tensors.items():
        begin, end = header[name]["data_offsets"]
        assert tuple(tensor.shape) == tuple(header[name]["shape"]) and tensor.dtype == DTYPES[header[name]["dtype"]]
        assert tensor.nbytes == end - begin
        assert bytes(tensor.reshape(-1).view(torch.uint8).tolist()) == data[begin:end]
        ranges.append((begin, end))
    ranges.sort()
    assert all(previous[1] <= current[0] for previous, current in zip(ranges, ranges[1:]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_mutations(), min_size=1, max_size=4))
def test_fuzzed_headers_load_right_or_fail_with_one_checkpoint_error(tmp_path, mutations):
    content = mutate(mutations)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        tensors = load(tmp_path, content)
    except CheckpointError as error:
        assert "\n" not in str(error) and str(error).startswith(str(tmp_path))
    else:
        check_loaded(content, tensors)
        assert sum(t.nbytes for t in tensors.values()) <= len(content)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 100 * 1024  # KB: < 100 MB


def test_read_header_names_the_file(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(file_bytes())
    assert [(e.name, e.begin) for e in read_header(path)] == [("a", 8 + len(header_text(VALID))), ("b", 8 + len(header_text(VALID)) + 24), ("c", 8 + len(header_text(VALID)) + 32)]
