"""A cut head whose base is the tokenizer's most frequent ids (head_ids: frequent): the base is the ranking's top ids
then the lowest others, the draft keeps greedy output exact, and the option is keyed, recorded, searched and ablated
apart from the lowest-ids head."""

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.assets.models import load_model
from selfspec.assets.tiny import tiny_model
from selfspec.assets.vocab import TokenRank, attach, frequent_base, rank_ids
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.errors import SelfSpecError
from tests.helpers import PROMPT


def test_the_base_is_the_ranked_ids_first_then_the_lowest_others():
    rank = torch.tensor([9, 4, 300, 7])  # 300 lies outside a vocabulary of 12
    assert frequent_base(rank, 2, 12) == [9, 4]
    assert frequent_base(rank, 6, 12) == [9, 4, 7, 0, 1, 2]
    assert sorted(frequent_base(rank, 12, 12)) == list(range(12))


def test_ids_rank_by_count_then_by_id():
    class Tok:  # a plain tokenizer: one call a text, no keyword arguments
        def __call__(self, text):
            return {"input_ids": [int(c) for c in text]}

    assert rank_ids(Tok(), ["5331", "13", "9"]) == [3, 1, 5, 9]  # 3 thrice, 1 twice, then 5 and 9 once


def test_a_frequent_head_scores_the_ranked_ids_and_keeps_greedy_output_exact():
    from selfspec.search.rounds import forward_key

    lm = load_model("tiny-qwen2")  # its ranking counts a few built-in texts (no download)
    model, plan, prompt = lm.model, SkipPlan(4, attn=(1,)), PROMPT + PROMPT
    vocab = model.get_output_embeddings().out_features
    rank = TokenRank(lm.tokenizer, texts=["aaab", "ccd"])  # a, c, b, d: ids 101, 103, 102, 104 (bytes + 4)
    attach(model, rank)
    cfg = DecodeConfig(max_new_tokens=32, k=3, fallback=False)
    ar = autoregressive(model, prompt, cfg).tokens
    opts = {ids: DraftOptions(weights="int4", group_size=32, head_tokens=6, head_ids=ids, head_weights="int4",
                              head_rescore=2) for ids in ("lowest", "frequent")}
    paths = {ids: DraftPath(model, plan, o, stop_ids=(2,)) for ids, o in opts.items()}
    assert paths["frequent"].base_ids.tolist() == [0, 1, 2, 101, 102, 103, 104]  # 4 ranked, 2 lowest, the stop id
    assert paths["lowest"].base_ids.tolist() == [0, 1, 2, 3, 4, 5]
    assert set(frequent_base(rank(), 6, vocab)) <= set(paths["frequent"].base_ids.tolist())
    for ids in ("frequent", "lowest", "frequent"):
        assert self_speculative(model, prompt, plan, cfg, draft=paths[ids]).tokens == ar
    spec, low = (DraftSpec(plan, opts[ids], k=3) for ids in ("frequent", "lowest"))
    assert spec.key != low.key and forward_key(spec) != forward_key(low)
    assert "head 6 frequent int4" in spec.describe() and "frequent" not in low.describe()
    assert DraftSpec.from_dict(spec.to_dict()) == spec
    assert "head_ids" not in opts["lowest"].record() and opts["frequent"].record()["head_ids"] == "frequent"


def test_a_frequent_head_needs_a_cut_head_and_a_ranking():
    with pytest.raises(SelfSpecError, match="head_ids must be one of"):
        DraftOptions(head_tokens=8, head_ids="common")
    with pytest.raises(SelfSpecError, match="needs head_tokens"):
        DraftOptions(head_ids="frequent")  # the full head has no base to choose
    bare = tiny_model("qwen2", vocab_size=96)  # built directly: no tokenizer, so no ranking
    with pytest.raises(SelfSpecError, match="load_model"):
        DraftPath(bare, SkipPlan(4), DraftOptions(head_tokens=8, head_ids="frequent"))


def test_the_ranking_is_cached_on_disk_once_per_tokenizer(tmp_path, monkeypatch):
    import selfspec.assets.vocab as vocab

    class Tok:
        def __init__(self, words):
            self.words = words

        def get_vocab(self):
            return {w: i for i, w in enumerate(self.words)}

        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [[self.words.index(w) for w in t.split()] for t in texts]}

    calls = []
    monkeypatch.setattr(vocab, "assistant_turns", lambda cache_dir: calls.append(cache_dir) or ["b c c", "c a"])
    tok = Tok(["a", "b", "c"])
    assert TokenRank(tok, tmp_path)().tolist() == [2, 0, 1]
    assert TokenRank(tok, tmp_path)().tolist() == [2, 0, 1] and len(calls) == 1  # the second read the file
    files = list((tmp_path / "vocab").iterdir())
    assert [f.suffix for f in files] == [".json"]  # one whole file, no partial one left
    assert TokenRank(Tok(["a", "b", "c", "d"]), tmp_path)().tolist() == [2, 0, 1] and len(calls) == 2  # another vocab
    files[0].write_text("{not json")  # a damaged file is ranked again and replaced
    assert TokenRank(tok, tmp_path)().tolist() == [2, 0, 1] and len(calls) == 3


def test_the_search_chooses_the_base_of_a_cut_head_only():
    from selfspec.search.space import DraftDims, SearchSpace
    from selfspec.search.variants import ablation_variants

    space = SearchSpace(4, dims=DraftDims(weights=("int4",), group_size=(32,), head_tokens=(0, 40),
                                          head_ids=("lowest", "frequent"), head_weights=("int4",)))
    spec = space.spec_of({"head_tokens": 40, "head_ids": "frequent"})
    assert spec.options.head_ids == "frequent" and space.spec_of(space.params_of(spec)) == spec
    full = space.spec_of({"head_tokens": 0, "head_ids": "frequent"})
    assert full.options.head_ids == "lowest"  # the full head: no base to choose
    assert space.describe()["dims"]["head_ids"] == ["lowest", "frequent"]
    # studies made before the option still resume where it is fixed at lowest
    assert "head_ids" not in SearchSpace(4, dims=DraftDims(head_ids=("lowest",))).describe()["dims"]
    assert SearchSpace(4).describe()["dims"]["head_ids"] == ["lowest", "frequent"]  # searched by default
    labels = dict(ablation_variants(spec))
    assert labels["the lowest ids as the head's base"].options.head_ids == "lowest"
    assert labels["without the cut head"].options == DraftOptions(weights="int4", group_size=32,
                                                                  head_weights="int4", head_rescore=8)
