"""The serving bench's helpers: paired ratios, the tokenizer that folds a larger vocabulary, and
the load generator's clients."""

import asyncio
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_serve import FoldedTokenizer, make_requests, paired_ratios, run_clients  # noqa: E402


def test_paired_ratios_docstring_example():
    """Round 1: 300 / 100, round 2: 200 / 200: the median of 3.0 and 1.0 (not 250 / 150)."""
    assert paired_ratios({"engine": [300, 200], "static": [100, 200]}) == {"engine/static": 2.0}
    both = paired_ratios({"continuous": [4, 6, 8], "static": [2, 2, 2], "sequential": [1, 1, 2]})
    assert both == {"continuous/static": 3.0, "continuous/sequential": 4.0}


def test_folded_tokenizer_decodes_ids_beyond_its_vocabulary():
    tokenizer = FoldedTokenizer.from_folder("tiny-mixtral")
    n = tokenizer.n_words
    ids = tokenizer.encode("And the LORD spake", bos=False)
    assert tokenizer.decode([i + n for i in ids]) == tokenizer.decode(ids) == "And the LORD spake"
    assert tokenizer.id_to_piece(ids[0] + 3 * n) == tokenizer.id_to_piece(ids[0])


def sse_server(accepted: list):
    """A stand-in for the server on 127.0.0.1: each request gets a streamed completion of
    ``max_tokens`` tokens, in HTTP/1.1 chunks, on a connection kept alive. Returns its port."""

    async def handle(reader, writer):
        accepted.append(1)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed the connection
                return
            length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1])
            body = json.loads(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            events = [{"choices": [{"text": ""}]}] + [{"choices": [{"text": " a"}]}] * body["max_tokens"]
            events.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
            for data in [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]:
                writer.write(b"%x\r\n%s\r\n" % (len(data), data.encode()))
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return server.sockets[0].getsockname()[1]


def test_clients_read_every_stream_and_keep_their_connections():
    """6 requests, at most 2 in flight: every token counted, and no more than 2 connections opened."""
    accepted = []
    port = sse_server(accepted)
    requests = make_requests(6, rate=1000.0, seed=1)
    records = run_clients(requests, clients=2, port=port)
    assert [r["tokens"] for r in records] == [r["max_tokens"] for r in requests]
    assert all(0 <= r["sent"] <= r["first"] <= r["done"] for r in records)
    assert len(accepted) <= 2
