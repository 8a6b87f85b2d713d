"""The long-context task generator (swarmfs.models.tasks, issue 22)."""

import numpy as np
import pytest

from swarmfs import InvalidArgumentError
from swarmfs.models.tasks import TASKS, Templates, embed_tasks, make_sample, make_suite_sample


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    from swarmfs.models import DEFAULT_DECODER
    return Tokenizer.from_file(str(DEFAULT_DECODER / "tokenizer.json"))


@pytest.fixture(scope="module")
def t(tok):
    return Templates(lambda s: tok.encode(s).ids)


@pytest.fixture(scope="module")
def filler(tok):
    from swarmfs.models import heldout_texts
    return np.asarray(tok.encode(heldout_texts("prose")[:120_000]).ids)


@pytest.mark.parametrize("task", TASKS)
def test_sample_is_seeded_and_its_answer_is_in_the_context(task, tok, t, filler):
    a = make_sample(task, filler, 2048, 5, t)
    b = make_sample(task, filler, 2048, 5, t)
    assert a.ids.size == 2048 and np.array_equal(a.ids, b.ids)
    s, e = a.answer
    assert e == a.ids.size and 0 < e - s <= 40
    answer = tok.decode(a.ids[s:e].tolist()).strip()
    context = tok.decode(a.ids[:s].tolist())
    if task == "vartrack":                         # each variable name is in the context
        assert all(f"VAR {v} =" in context for v in answer.split())
    elif task == "multivalue":
        assert all(v in context for v in answer.split(", "))
    else:
        assert answer in context
    assert 0 < a.distance < s
    assert not np.array_equal(make_sample(task, filler, 2048, 6, t).ids, a.ids)


def test_depth_places_the_first_needle(t, filler, tok):
    a = make_sample("passkey", filler, 4096, 1, t, depth=0.25)
    b = make_sample("passkey", filler, 4096, 1, t, depth=0.75)
    assert a.depth == 0.25 and b.depth == 0.75
    assert a.distance > b.distance + 1500


def test_suite_sample_holds_every_task_once(t, filler, tok):
    s = make_suite_sample(filler, 4096, 3, t)
    assert s.ids.size == 4096 and len(s.answers) == len(TASKS)
    assert sorted(x[0] for x in s.answers) == sorted(TASKS)
    assert min(a for _, a, _ in s.answers) > s.context_end
    assert s.answers[-1][2] == s.ids.size
    passkey = next((a, b) for n, a, b in s.answers if n == "passkey")
    key = tok.decode(s.ids[passkey[0]:passkey[1]].tolist()).strip()
    assert f"The pass key is {key}." in tok.decode(s.ids[:s.context_end].tolist())
    assert np.array_equal(make_suite_sample(filler, 4096, 3, t).ids, s.ids)


def test_embed_tasks_keeps_the_length_and_masks_the_answers(t, filler):
    rng = np.random.default_rng(0)
    ids, mask = embed_tasks(filler[:2049], rng, t, 3)
    assert ids.shape == (2049,) and mask.shape == (2049,)
    assert 3 <= mask.sum() <= 3 * 40


def test_embed_tasks_carries_a_mask_with_its_tokens(t, filler):
    """``carry`` moves with the text the splice shifts: a mask of the tokens
    equal to 7 comes back True exactly where 7 is in the filler that is kept,
    and False on every spliced-in token."""
    row = np.asarray(filler[:2049], np.int64).copy()
    row[::5] = 7                                        # a marker token
    ids, mask = embed_tasks(row, np.random.default_rng(0), t, 3)
    ids2, mask2, moved = embed_tasks(row, np.random.default_rng(0), t, 3, carry=row == 7)
    assert np.array_equal(ids, ids2) and np.array_equal(mask, mask2)
    assert moved.shape == (2049,) and moved.dtype == bool
    assert moved.sum() > 300 and (ids[moved] == 7).all() and not (moved & mask).any()
    kept = ids.size - (ids != row[:ids.size]).sum()
    assert kept < ids.size                              # the splice did shift text


@pytest.mark.parametrize("call", [
    lambda t, f: make_sample("nope", f, 1024, 0, t),
    lambda t, f: make_sample("passkey", f, 1024, 0, t, depth=1.5),
    lambda t, f: make_sample("passkey", f[:100], 1024, 0, t),
    lambda t, f: make_sample("multivalue", f, 40, 0, t),
    lambda t, f: make_suite_sample(f, 1024, 0, t, tasks=["passkey", "passkey"]),
    lambda t, f: make_suite_sample(f, 1024, 0, t, tasks=[]),
    lambda t, f: make_suite_sample(f[:1500], 1024, 0, t),
    lambda t, f: make_suite_sample(f, 200, 0, t),
])
def test_bad_input_is_an_invalid_argument(call, t, filler):
    with pytest.raises(InvalidArgumentError):
        call(t, filler)
