"""The C++ decode attention (csrc/row_attention.cpp): its numbers, its key lists, its checks, and that the full
model's decode attention runs on it for bf16 rows."""

import pytest
import torch

from selfspec.engine import attention as attn
from selfspec.kernels import vnni

pytestmark = pytest.mark.skipif(not vnni.available(), reason=f"C++ kernels: {vnni.unavailable_reason()}")


def _reference(q, k, v, cols, scale):
    """Row r, head h over the keys ``cols[r]`` in float64: [R, H, D]."""
    heads, rows, _ = q.shape
    group = heads // k.shape[0]
    out = torch.empty(rows, heads, q.shape[-1], dtype=torch.float64)
    for r in range(rows):
        for h in range(heads):
            kk, vv = k[h // group, cols[r]].double(), v[h // group, cols[r]].double()
            out[r, h] = ((kk @ q[h, r].double()) * scale).softmax(-1) @ vv
    return out


@pytest.mark.parametrize("heads, kv_heads, dim", [(12, 2, 128), (9, 3, 64), (4, 4, 16), (20, 2, 32)])
def test_each_row_and_head_is_softmax_attention_over_its_own_keys(heads, kv_heads, dim):
    g = torch.Generator().manual_seed(dim + heads)
    keys, rows = 90, 7
    q = torch.randn(heads, rows, dim, generator=g).bfloat16()
    k, v = (torch.randn(kv_heads, keys + 10, dim, generator=g).bfloat16()[:, :keys] for _ in range(2))  # cache views
    count = torch.tensor([1, 5, 17, 33, 64, 89, 90])
    got = vnni.row_attention(q, k, v, count, None, 0.2)
    want = _reference(q, k, v, [list(range(int(c))) for c in count], 0.2)
    assert got.shape == (rows, heads, dim) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)  # bf16's rounding of the output
    # keys from a list: any columns, in the list's order
    cols = [torch.randperm(keys, generator=g)[: int(c)].tolist() for c in count]
    index = torch.full((rows, keys), keys - 1, dtype=torch.long)
    for r, c in enumerate(cols):
        index[r, : len(c)] = torch.tensor(c)
    got = vnni.row_attention(q, k, v, count, index, 0.2)
    torch.testing.assert_close(got.double(), _reference(q, k, v, cols, 0.2), rtol=1e-2, atol=1e-2)


def test_a_row_is_computed_alone():
    """Row-invariant by construction: a row's bits do not depend on the other rows, where its keys sit, or the
    cache's length."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(12, 13, 128, generator=g).bfloat16()
    k, v = (torch.randn(2, 400, 128, generator=g).bfloat16() for _ in range(2))
    count = torch.arange(300, 313)
    full = vnni.row_attention(q, k, v, count, None, 0.09)
    for r in range(13):
        alone = vnni.row_attention(q[:, r : r + 1], k[:, : int(count[r])], v[:, : int(count[r])], count[r : r + 1],
                                   None, 0.09)
        assert torch.equal(alone[0], full[r]), r
        moved = torch.cat([torch.randn(2, 7, 128, generator=g).bfloat16(), k[:, : int(count[r])]], 1)  # keys elsewhere
        moved_v = torch.cat([torch.randn(2, 7, 128, generator=g).bfloat16(), v[:, : int(count[r])]], 1)
        index = torch.arange(7, 7 + int(count[r]))[None]
        assert torch.equal(vnni.row_attention(q[:, r : r + 1], moved, moved_v, count[r : r + 1], index, 0.09)[0],
                           full[r]), r


@pytest.mark.parametrize("keys", [1, 15, 16, 17, 33, 50])
def test_a_block_of_keys_scores_as_a_single_key_does(keys):
    """Whole blocks of keys add their lanes together, the rest one key at a time, with the same additions: with every
    key the same, every score is the same to the bit, so each weight is exactly 1 and a head's output is the values'
    fp32 sum in key order times 1/keys, rounded to bf16."""
    g = torch.Generator().manual_seed(keys)
    q = torch.randn(12, 1, 128, generator=g).bfloat16()
    k = torch.randn(2, 1, 128, generator=g).bfloat16().expand(2, keys, 128).contiguous()
    v = torch.randn(2, keys, 128, generator=g).bfloat16()
    got = vnni.row_attention(q, k, v, torch.tensor([keys]), None, 0.3)
    total = torch.zeros(2, 128)
    for t in range(keys):
        total = total + v[:, t].float()
    want = (total * (torch.tensor(1.0) / torch.tensor(float(keys)))).bfloat16()  # fp32, as the kernel divides
    assert torch.equal(got[0], want.repeat_interleave(6, 0))


def test_bad_inputs_are_refused():
    q = torch.randn(4, 2, 16).bfloat16()
    k = torch.randn(2, 10, 16).bfloat16()
    with pytest.raises(RuntimeError, match="attends"):
        vnni.row_attention(q, k, k, torch.tensor([3, 11]), None, 1.0)  # more keys than the cache holds
    with pytest.raises(RuntimeError, match="index within"):
        vnni.row_attention(q, k, k, torch.tensor([1, 2]), torch.tensor([[0, 0], [3, 10]]), 1.0)
    with pytest.raises(RuntimeError, match="bf16"):
        vnni.row_attention(q.float(), k.float(), k.float(), torch.tensor([1, 2]), None, 1.0)


def test_the_decode_attention_runs_bf16_rows_on_it(monkeypatch):
    calls = []
    kernel = vnni.row_attention
    monkeypatch.setattr(vnni, "row_attention", lambda *a: calls.append(a[3].tolist()) or kernel(*a))
    q = torch.randn(1, 4, 3, 16).bfloat16()
    k = torch.randn(1, 2, 20, 16).bfloat16()
    mask = torch.ones(3, 20, dtype=torch.bool).tril(diagonal=17)[None, None]
    out, _ = attn.attention_forward(None, q, k, k, mask)
    assert calls == [[18, 19, 20]] and out.shape == (1, 3, 4, 16)
    attn.attention_forward(None, q.float(), k.float(), k.float(), mask)  # another dtype: the matrix products
    attn.attention_forward(None, q, k, k, mask, kernel=False)
    attn.attention_forward(None, q, k, k, mask, chunk=1)  # not row-invariant: the products, keys as they come
    assert calls == [[18, 19, 20]]
