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


# -- issue 24: the CLI as a new user meets it ----------------------------------------

def _no_load(monkeypatch):
    """Make loading the weights fail loudly: a check must come before it."""
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the check")
    monkeypatch.setattr(G, "load_model", boom)


def test_prompt_past_the_models_positions_is_refused_before_loading(model_dir, prompt_file,
                                                                   tmp_path, monkeypatch):
    """A prompt longer than the model's positions ran for minutes before;
    now it is refused, and one past its trained length warned about, before
    the weights load."""
    long = tmp_path / "long.txt"
    long.write_text(prompt_file.read_text() * 3)            # ~6,500 tokens > 4,096
    _no_load(monkeypatch)
    r = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "--prompt-file",
                                  str(long)])
    assert r.exit_code == 1 and "4096 positions" in r.output
    monkeypatch.setattr(G, "trained_length", lambda *a: 1000)
    r = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "--prompt-file",
                                  str(prompt_file)])
    assert "warning:" in r.output and "the 1000 the model was trained on" in r.output
    assert r.exit_code == 3 and "before the check" in r.output   # warned, then loaded


def test_trained_length_of_the_shipped_decoder_and_of_rope_scaling():
    from transformers import LlamaConfig

    from swarmfs.models import DECODER_TRAINED_TOKENS, DEFAULT_DECODER
    cfg = LlamaConfig(max_position_embeddings=32768)
    assert G.trained_length(None, cfg) == G.trained_length(DEFAULT_DECODER, cfg) == \
        DECODER_TRAINED_TOKENS == 16384
    assert G.check_length(cfg, 16000, 384, model_dir=None) is None
    assert "16384 the model was trained on" in G.check_length(cfg, 16000, 385)
    with pytest.raises(swarmfs.InvalidArgumentError, match="32768 positions"):
        G.check_length(cfg, 32000, 769)
    scaled = LlamaConfig(max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                          "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    assert G.trained_length("/elsewhere", scaled) == 8192


def test_options_that_do_not_apply_are_refused_before_any_work(model_dir, prompt_file,
                                                               tmp_path, monkeypatch):
    _no_load(monkeypatch)
    run = CliRunner().invoke
    gen = ["generate", "--model", str(model_dir), "--prompt-file", str(prompt_file)]
    for args, code, what in (
            (["--evaluate", "6", "--max-new-tokens", "5"], 2, "--max-new-tokens"),
            (["--disks", "0"], 1, "disks must be an integer in [1, 256]"),
            (["--sinks", "-1"], 2, "--sinks")):
        r = run(main, gen + args)
        assert r.exit_code == code and what in r.output, r.output
    for args, code, what in (
            (["--tau", "0.5"], 2, "--tau does not apply without --minilm"),
            (["--metric", "eq2", "--hot-fraction", "0.1"], 2, "--metric, --hot-fraction"),
            (["--minilm", "--kind", "prose"], 2, "--kind does not apply with --minilm"),
            (["--disks", "0"], 1, "disks must be an integer in [1, 256]")):
        r = run(main, ["demo", "--dir", str(tmp_path / "d")] + args)
        assert r.exit_code == code and what in r.output, r.output
    assert not (tmp_path / "d").exists()


def test_generate_serves_an_existing_store(model_dir, prompt_file, tmp_path):
    """``--store`` naming a store serves its document (its fingerprint
    checked, no prefill): at r = 1 the tokens of a fresh run of the whole
    prompt.  A prompt that does not continue it, --disks, or --evaluate
    against it are refused."""
    st = str(tmp_path / "st")
    base = ["generate", "--model", str(model_dir), "--ratio", "1", "--json"]
    r = CliRunner().invoke(main, base + ["--prompt-file", str(prompt_file), "--store", st,
                                         "--max-new-tokens", "2", "--disks", "2"])
    assert r.exit_code == 0, r.output
    first = json.loads(r.stdout)
    assert first["reused"] is None
    with swarmfs.Store.open(st) as s:
        stored = s.num_tokens(0)
    assert stored == first["prompt_tokens"]                # the prompt alone is stored
    more = tmp_path / "more.txt"
    more.write_text(prompt_file.read_text() + "\ndef wrap(text, width=70):")
    r = CliRunner().invoke(main, base + ["--prompt-file", str(more), "--store", st,
                                         "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["reused"]["tokens"] == stored and rep["layout"] == {}
    fresh = json.loads(CliRunner().invoke(main, base + ["--prompt-file", str(more),
                                                        "--max-new-tokens", "4"]).stdout)
    assert rep["tokens"] == fresh["tokens"] and fresh["reused"] is None
    other = tmp_path / "other.txt"
    other.write_text("import os\n" + prompt_file.read_text())
    r = CliRunner().invoke(main, base + ["--prompt-file", str(other), "--store", st])
    assert r.exit_code == 1 and "not the stored prompt" in r.output
    for args in (["--disks", "3"], ["--evaluate", "4"]):
        r = CliRunner().invoke(main, base + ["--prompt-file", str(more), "--store", st] + args)
        assert r.exit_code == 2, r.output


def test_an_empty_run_gets_a_hint(model_dir, prompt_file, tmp_path):
    """The model's first token ends the text: no decode step runs, and the
    CLI says why instead of a table of zeros."""
    import shutil
    model, tok = G.load_model(model_dir)
    ids = tok(prompt_file.read_text(), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        first = int(model(ids).logits[0, -1].argmax())
    d = tmp_path / "eos-first"
    shutil.copytree(model_dir, d)
    for name in ("config.json", "generation_config.json"):
        if (d / name).exists():
            cfg = json.loads((d / name).read_text())
            cfg["eos_token_id"] = first
            (d / name).write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["generate", "--model", str(d), "--prompt-file",
                                  str(prompt_file), "--disks", "2"])
    assert r.exit_code == 0, r.output
    assert "no decode step ran" in r.output


def test_prefill_progress_bars(model_dir, prompt_file, tmp_path):
    """The prefill's three bars (rich, on stderr when it is a terminal):
    dense attention per layer, layout and write per layer."""
    import io

    from rich.console import Console

    from swarmfs import hf
    from swarmfs._cli import _PrefillBars
    out = io.StringIO()
    bars = _PrefillBars(True, console=Console(file=out, force_terminal=True, width=100))
    model, tok = G.load_model(model_dir)
    ids = tok(prompt_file.read_text(), return_tensors="pt")["input_ids"]
    with bars, hf.SwarmCache(tmp_path / "s", model.config, disks=2, progress=bars) as c, \
            torch.no_grad():
        model(ids, cache=c, use_cache=True)
    text = out.getvalue()
    for label in ("prefill (dense attention)", "layout (co-activation)", "write (disks)"):
        assert label in text
    assert "2/2" in text


def test_sigterm_removes_the_temporary_store(model_dir, prompt_file, tmp_path):
    """``timeout`` or ``kill`` (SIGTERM) left the swarmfs-generate-* store in
    the temporary folder; now it goes, as on Ctrl-C, and the exit status is
    143."""
    import os
    import signal
    import subprocess
    import sys
    import time
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    p = subprocess.Popen([sys.executable, "-m", "swarmfs._cli", "generate", "--model",
                          str(model_dir), "--prompt-file", str(prompt_file), "--disks", "2",
                          "--max-new-tokens", "1500"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while not list(tmp.glob("swarmfs-generate-*/store/manifest.json")):
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=300) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
    assert not list(tmp.glob("swarmfs-generate-*"))
