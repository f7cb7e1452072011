"""linear() equals F.linear, whatever the rows, the layout and the few-row path (bmm blocks or not)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixtral_infer.kernels.linear import linear
from mixtral_infer.tuning import Tuning


@pytest.fixture(autouse=True, params=[True, False], ids=["bmm-blocks", "f-linear"])
def tuning(request):
    """Both few-row paths (``Tuning.few_row_blocks``); the bmm path needs at least 2 threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield Tuning(few_row_blocks=request.param)
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", list(range(0, 11)))
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_equals_f_linear(rows, transposed, tuning):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)  # (OUT, IN)
    x = torch.randn(40, rows, generator=g).T if transposed else torch.randn(rows, 40, generator=g)  # (M, IN)
    got = linear(x, weight, tuning)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_odd_output_size_falls_back_to_f_linear(tuning):
    weight = torch.randn(7, 5)  # 7 rows do not split into 2 blocks
    x = torch.randn(2, 5)
    torch.testing.assert_close(linear(x, weight, tuning), F.linear(x, weight))


def test_the_bmm_blocks_are_taken_when_asked(monkeypatch, tuning):
    calls = []
    monkeypatch.setattr(torch, "bmm", lambda *a: calls.append(1) or torch.matmul(*a))
    linear(torch.randn(1, 40), torch.randn(96, 40), tuning)
    assert calls == ([1] if tuning.few_row_blocks else [])
    linear(torch.randn(1, 40), torch.randn(96, 40))  # no tuning given: Tuning()'s, F.linear
    assert calls == ([1] if tuning.few_row_blocks else [])


@pytest.mark.parametrize("rows", [3, 8])
def test_compiled_code_multiplies_few_rows_as_reductions_not_bmm_blocks(rows, tuning):
    """The static decode step is compiled: its float32 products of up to 8 rows are multiply-and-sum
    reductions (fast.cpu_reductions: 1.5-1.8x the bmm blocks' speed there), where op by op they take the
    bmm blocks when those are on; both equal F.linear."""
    torch._dynamo.reset()
    graphs = []

    def keep_graph(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(lambda x, w: linear(x, w, tuning), backend=keep_graph, fullgraph=True)
    x, weight = torch.randn(rows, 40), torch.randn(96, 40)
    torch.testing.assert_close(compiled(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear(x, weight, tuning), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    called = {node.target for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert torch.bmm not in called and torch.stack in called
