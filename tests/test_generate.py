"""swarmfs generate: the CLI and swarmfs._generate on a small random Llama
with a real BPE tokenizer (trained here on the standard library's text)."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from click.testing import CliRunner  # noqa: E402

import swarmfs  # noqa: E402
from swarmfs import _generate as G  # noqa: E402
from swarmfs._cli import main  # noqa: E402


def _text() -> str:
    import inspect
    import json as j
    import textwrap
    return "\n\n".join(inspect.getsource(m) for m in (textwrap, j.decoder, j.encoder))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    d = tmp_path_factory.mktemp("model")
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([_text()], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<eos>")
    tok.save_pretrained(d)
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      vocab_size=len(tok), max_position_embeddings=4096,
                      eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompt") / "prompt.txt"
    p.write_text(_text()[:3000])
    return p


@pytest.mark.slow
def test_generate_streams_text_and_reports_steps(model_dir, prompt_file, tmp_path):
    r = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "--prompt-file",
                                  str(prompt_file), "--max-new-tokens", "5", "--ratio", "0.2",
                                  "--disks", "2", "--store", str(tmp_path / "st")])
    assert r.exit_code == 0, r.output
    assert "decode steps" in r.output and "I/O µs" in r.output
    with swarmfs.Store.open(tmp_path / "st") as s:       # the prompt is on the disks
        assert s.num_disks == 2 and s.num_tokens(0) >= 500


@pytest.mark.slow
def test_generate_json_matches_dense_greedy_at_full_budget(model_dir, prompt_file):
    r = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "--prompt-file",
                                  str(prompt_file), "--max-new-tokens", "4", "--ratio", "1",
                                  "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert len(rep["steps"]) == 3 and rep["steps"][0]["bytes_read"] > 0
    model, tok = G.load_model(model_dir)
    model.set_attn_implementation("sdpa")
    ids = tok(prompt_file.read_text(), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert rep["tokens"] == ref[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_evaluate_reports_both_perplexities_and_recall(model_dir, prompt_file):
    r = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "--prompt-file",
                                  str(prompt_file), "--evaluate", "6", "--ratio", "1",
                                  "--disks", "2", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    # r = 1 retrieves the whole context: swarmfs is dense attention
    assert math.isclose(rep["perplexity_swarm"], rep["perplexity_dense"], rel_tol=1e-4)
    assert rep["recall"] == pytest.approx(1.0, abs=1e-6)
    # the whole stored context holds all of each query's attention over it
    assert rep["mass"] == pytest.approx(1.0, abs=1e-5) == rep["oracle_mass"]
    r = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "--prompt-file",
                                  str(prompt_file), "--evaluate", "6", "--ratio", "0.1",
                                  "--json"])
    rep = json.loads(r.stdout)
    assert 0 < rep["recall"] < 1
    # absolute shares of the attention: SWARM's below the oracle's at one budget
    assert 0 < rep["mass"] < rep["oracle_mass"] < 1
    assert rep["perplexity_swarm"] != rep["perplexity_dense"]
    assert set(rep["recall_per_layer"]) == {"0", "1"}


def test_generate_errors(model_dir, prompt_file, tmp_path, monkeypatch):
    run = CliRunner().invoke
    r = run(main, ["generate", "--model", str(tmp_path), "--prompt-file", str(prompt_file)])
    assert r.exit_code == 1 and "not a model directory" in r.output
    r = run(main, ["generate", "--model", str(model_dir), "--prompt-file",
                   str(tmp_path / "none.txt")])
    assert r.exit_code == 1 and "--prompt-file" in r.output
    r = run(main, ["generate", "--model", str(model_dir), "--prompt-file", str(prompt_file),
                   "--disks", "2", "--disk", str(tmp_path / "d0")])
    assert r.exit_code == 2
    r = run(main, ["generate", "--model", str(model_dir), "--prompt-file", str(prompt_file),
                   "--evaluate", "100000"])
    assert r.exit_code == 1 and "--evaluate" in r.output
    r = run(main, ["generate", "--model", str(model_dir), "--prompt-file", str(prompt_file),
                   "--ratio", "0"])
    assert r.exit_code == 1
    monkeypatch.setattr(G, "default_model_dir",
                        lambda: (_ for _ in ()).throw(swarmfs.ModelError("no default decoder")))
    r = run(main, ["generate", "--prompt-file", str(prompt_file)])
    assert r.exit_code == 1 and "no default decoder" in r.output


# -- swarmfs demo: the main job, on the shipped decoder and held-out text -----------

def _shipped_decoder():
    from swarmfs.models import DEFAULT_DECODER
    if not (DEFAULT_DECODER / "model.safetensors").exists():
        pytest.fail(f"the trained decoder is not installed at {DEFAULT_DECODER}")
    return DEFAULT_DECODER


@pytest.mark.model
def test_demo_decodes_heldout_text_exactly_at_full_budget(tmp_path):
    """With r = 1 every stored entry is retrieved, so swarmfs's perplexity of
    the held-out continuation equals dense attention's, and recall is 1."""
    from conftest import DATA
    if not (DATA / "wikitext2_raw_test.raw").exists():
        pytest.skip("shared data not found")
    _shipped_decoder()
    r = CliRunner().invoke(main, ["demo", "--dir", str(tmp_path / "st"), "--kind", "python",
                                  "--context", "384", "--evaluate", "6", "--ratio", "1",
                                  "--json"])
    assert r.exit_code == 0, r.output
    run = json.loads(r.output)["runs"]["python"]
    assert run["context_tokens"] == 384 and run["continuation_tokens"] == 6
    assert math.isclose(run["perplexity_swarm"], run["perplexity_dense"], rel_tol=1e-3)
    assert run["recall"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.model
def test_demo_sparse_budget_reports_both_paths(tmp_path):
    from conftest import DATA
    if not (DATA / "wikitext2_raw_test.raw").exists():
        pytest.skip("shared data not found")
    _shipped_decoder()
    r = CliRunner().invoke(main, ["demo", "--dir", str(tmp_path / "st"), "--kind", "prose",
                                  "--context", "512", "--evaluate", "4", "--ratio", "0.1"])
    assert r.exit_code == 0, r.output
    for col in ("ppl dense", "ppl swarmfs", "recall", "CPU µs/step", "I/O µs/step"):
        assert col in r.output
    assert "prose" in r.output and "512" in r.output


@pytest.mark.slow
def test_heldout_input_refuses_bad_lengths():
    from transformers import AutoTokenizer

    from swarmfs._errors import InvalidArgumentError
    tok = AutoTokenizer.from_pretrained(_shipped_decoder())
    with pytest.raises(InvalidArgumentError):
        G.heldout_input(tok, "python", 2)
    with pytest.raises(InvalidArgumentError):
        G.heldout_input(tok, "python", 10 ** 9)
    with pytest.raises(InvalidArgumentError):
        G.heldout_input(tok, "poetry", 100)
