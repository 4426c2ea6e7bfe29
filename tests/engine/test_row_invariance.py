"""Row-invariance: a row's result does not depend on how many rows share its forward, where it sits among them,
or how many keys the cache holds past it. Greedy self-speculative output equals greedy AR output in bf16 when
every full-model forward has this property (a verify's rows then compute what AR's steps compute)."""

import pytest
import torch

from selfspec.engine.attention import CHUNK, attention_forward
from selfspec.kernels import vnni
from selfspec.kernels.packed import packing_supported

# shapes of the packaged models' attention: query heads, key/value heads, head dim
SHAPES = [(12, 2, 128), (14, 2, 64), (4, 1, 64)]
# positions around the chunk boundaries and far from them
POSITIONS = sorted({0, 5, 37, 255, 256, 257, 700, 1023, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK - 2})


# each path of the decode attention: the C++ kernel where it runs here, and the matrix products (every CPU)
PATHS = [pytest.param(True, id="kernel", marks=pytest.mark.skipif(not vnni.available(), reason="no C++ kernel here")),
         pytest.param(False, id="products")]


def _attend(q, k, v, start, n, capacity=0, kernel=True):
    """Rows at positions ``start..start+n-1`` over keys ``0..start+n-1`` (and ``capacity`` masked keys past them)."""
    keys = start + n + capacity
    mask = torch.ones(n, keys, dtype=torch.bool).tril(diagonal=start)[None, None]
    out, _ = attention_forward(None, q[:, :, start : start + n], k[:, :, :keys], v[:, :, :keys], mask, kernel=kernel)
    return out[0]


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("heads, kv_heads, dim", SHAPES)
def test_a_rows_attention_is_the_same_in_any_forward(heads, kv_heads, dim, kernel):
    g = torch.Generator().manual_seed(heads * dim)
    length = max(POSITIONS) + 40
    q, k, v = (torch.randn(1, h, length, dim, generator=g).bfloat16() for h in (heads, kv_heads, kv_heads))
    differ = []
    for pos in POSITIONS:
        alone = _attend(q, k, v, pos, 1, kernel=kernel)[0]
        for n in (2, 3, 5, 6, 8, 11, 16):
            for j in range(min(n, pos + 1)):
                for capacity in (0, 9):
                    if not torch.equal(_attend(q, k, v, pos - j, n, capacity, kernel)[j], alone):
                        differ.append((pos, n, j, capacity))
    assert not differ, f"{len(differ)} (position, rows, row, extra keys) differ from the one-row result: {differ[:5]}"


def _tree(g: torch.Generator, nodes: int) -> list[int]:
    """A random draft tree's parents in slot order (node 0 the root; a parent before its children)."""
    return [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, nodes)]


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("heads, kv_heads, dim", SHAPES)
def test_a_tree_rows_attention_is_an_ar_steps_at_its_position(heads, kv_heads, dim, kernel):
    """A tree's node attends the committed keys, then its ancestors in slots among other nodes': its result equals
    the one-row result over the same keys laid out in order, as AR would hold them."""
    g = torch.Generator().manual_seed(7 * heads + dim)
    differ = []
    for start in sorted({0, 3, 30, 31, 32, 60, 250, 255, 256, 500, 1000}):
        parent = _tree(g, int(torch.randint(2, 25, (), generator=g)))
        n = len(parent)
        q, k, v = (torch.randn(1, h, start + n, dim, generator=g).bfloat16() for h in (heads, kv_heads, kv_heads))
        allowed = torch.zeros(n, start + n, dtype=torch.bool)
        allowed[:, :start] = True
        lines = []
        for i in range(n):
            line, j = [], i
            while j >= 0:
                allowed[i, start + j] = True
                line.insert(0, start + j)
                j = parent[j]
            lines.append(list(range(start)) + line)
        out, _ = attention_forward(None, q[:, :, start:], k, v, allowed[None, None], kernel=kernel)
        for i, line in enumerate(lines):
            keys = torch.tensor(line)
            alone, _ = attention_forward(None, q[:, :, start + i : start + i + 1], k[:, :, keys], v[:, :, keys], None,
                                         kernel=kernel)
            if not torch.equal(out[0, i], alone[0, 0]):
                differ.append((start, n, i, len(line) - start))
    assert not differ, f"{len(differ)} (start, nodes, node, depth + 1) differ from the one-row result: {differ[:5]}"


def _bf16_linears():
    w = (torch.randn(1024, 512, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()
    kinds = {"torch": lambda x: torch.nn.functional.linear(x, w)}
    if packing_supported():  # oneDNN's prepacked bf16 weights, as our loop runs them on this CPU
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        kinds["packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return kinds


def test_our_fp16_panels_give_a_row_the_same_bits_in_any_forward():
    """The AVX2 CPUs' packed products (exact fp16 copies of bf16 weights): from one row up, whatever the row's place."""
    from selfspec.kernels import fp16

    if not fp16.available():
        pytest.skip(f"our fp16 kernel does not run here: {fp16.unavailable_reason()}")
    w = (torch.randn(1000, 512, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()
    panels = fp16.pack(w)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    full = fp16.linear(x, panels, None, 1000)
    differ = [n for n in range(1, 16) if not torch.equal(fp16.linear(x[:n], panels, None, 1000), full[:n])]
    differ += [f"row {i}" for i in range(16) if not torch.equal(fp16.linear(x[i : i + 1], panels, None, 1000), full[i : i + 1])]
    assert not differ, f"a row's product depends on the forward's rows ({differ})"


@pytest.mark.parametrize("kind", list(_bf16_linears()))
def test_a_rows_linear_product_is_the_same_in_any_forward_of_two_rows_or_more(kind):
    """One-row products may take another path (a matrix-vector kernel) and round differently: the decoding loop
    pads every full-model forward to ``rows`` >= 2 where it pads (DecodeConfig.rows), so only >= 2 rows meet."""
    f = _bf16_linears()[kind]
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    full = f(x)
    differ = [n for n in range(2, 16) if not torch.equal(f(x[:n]), full[:n])]
    differ += [f"rows {i},{i + 1}" for i in range(15) if not torch.equal(f(x[i : i + 2]), full[i : i + 2])]
    assert not differ, f"{kind}: a row's product depends on the forward's rows ({differ})"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_default_greedy_chains_and_trees_are_token_identical_to_ar_in_bf16(make_model, arch):
    """Nothing set, no rows to choose: the defaults. Drafts that skip, quantize, copy, exit adaptively, and verify
    trees of copies and of the draft's second-best tokens."""
    from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
    from selfspec.draft.path import DraftOptions, DraftPath

    model = make_model(arch, torch.bfloat16)
    prompt = list(range(3, 40))
    for k, adaptive in ((2, False), (5, True)):
        cfg = DecodeConfig(max_new_tokens=24, k=k, adaptive=adaptive, fallback=False)
        ar = autoregressive(model, prompt, cfg).tokens
        for plan, opts in ((SkipPlan(4, attn=(1,), mlp=(2,)), DraftOptions()),
                           (SkipPlan(4, attn=(0, 2)), DraftOptions(weights="int8")),
                           (SkipPlan(4, mlp=(1, 3)), DraftOptions(ngram=1, copy_tokens=k + 2)),
                           (SkipPlan(4, attn=(3,)), DraftOptions(ngram=1, copy_tokens=k + 2, copy_candidates=3)),
                           (SkipPlan(4, mlp=(0,)), DraftOptions(weights="int4", group_size=32, branch_below=0.6,
                                                                tree_nodes=10))):
            sp = self_speculative(model, prompt, plan, cfg, draft=DraftPath(model, plan, opts))
            assert sp.tokens == ar, (arch, k, plan.describe(), opts)
