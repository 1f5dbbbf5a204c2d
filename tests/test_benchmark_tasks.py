"""The task benchmark: its probe, its models at matched size, the official causal design, and one tiny run."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))  # also done by conftest.py

import benchmark_tasks  # noqa: E402
from baseline_models import count_parameters  # noqa: E402
from benchmark_tasks import BenchmarkArguments, build_model, make_probe  # noqa: E402
from benchmark_utils import check_result  # noqa: E402
from saved_plots import assert_png_of, record_saved_figures  # noqa: E402


needs_data = pytest.mark.needs_data("wikitext-2", "conll2003")  # the tokenizer's corpus


@needs_data
def test_probe_label_needs_both_ends(wordpiece_tokenizer):
    """One key in the first window (A or B), one in the last (C or D); the label is whether they belong together
    (A with C, B with D), and either end alone says nothing about it."""
    tokenizer, window, length = wordpiece_tokenizer, 16, 128
    probe = make_probe(tokenizer, 600, length, window, fillers=3, seed=0)
    base = len(tokenizer.all_special_ids) + 100
    first_keys, last_keys = (base, base + 1), (base + 2, base + 3)
    ends = []
    for ids, label in zip(probe["input_ids"], probe["labels"]):
        assert len(ids) == length and ids[0] == tokenizer.cls_token_id
        assert set(ids[1:]) <= {*first_keys, *last_keys, base + 4, base + 5, base + 6}
        firsts = [i for i, token in enumerate(ids) if token in first_keys]
        lasts = [i for i, token in enumerate(ids) if token in last_keys]
        assert len(firsts) == 1 and firsts[0] < window and len(lasts) == 1 and lasts[0] >= length - window
        first, last = first_keys.index(ids[firsts[0]]), last_keys.index(ids[lasts[0]])
        assert label == int(first == last)
        ends.append((first, last, label))
    assert 0.4 < sum(probe["labels"]) / len(ends) < 0.6
    for end in (0, 1):  # P(label | one end's key) stays near 1/2: a head-only or tail-only reader is at chance
        for key in (0, 1):
            given = [label for *keys, label in ends if keys[end] == key]
            assert 0.35 < sum(given) / len(given) < 0.65


def tiny_task(problem_type="single_label_classification", num_labels=3):
    return {"problem_type": problem_type, "num_labels": num_labels, "vocab_size": 97}


@pytest.mark.parametrize("name", ["bilstm", "srnn", "bpie-bisrnn"])
def test_recurrent_baselines_match_ran_size(name):
    args = BenchmarkArguments(hidden_size=32, num_heads=2)
    ran = count_parameters(build_model("ran", "hyperpartisan", tiny_task(), args))
    baseline = count_parameters(build_model(name, "hyperpartisan", tiny_task(), args))
    assert abs(baseline - ran) / ran < 0.1, (name, baseline, ran)


def test_ablations_change_the_model():
    args = BenchmarkArguments(hidden_size=32, num_heads=2)
    configs = {
        name: build_model(name, "hyperpartisan", tiny_task(), args).config for name in benchmark_tasks.RAN_VARIANTS
    }
    assert configs["ran-mean-pooling"].token_pooling == "mean"
    assert not configs["ran-no-cell-residual"].use_cell_residual
    assert not configs["ran-no-memory-review"].memory_review
    assert not configs["ran-no-rotary"].use_rotary
    assert configs["ran-bpie"].window_overlap == args.window_overlap
    assert configs["ran"].to_diff_dict() != configs["ran-no-rotary"].to_diff_dict()


def first_window_influence(model_name: str) -> float:
    """How much the logits of later windows move when only the first window's tokens change."""
    args = BenchmarkArguments(hidden_size=32, num_heads=2, lm_window_size=8, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(model_name, "lm", {"problem_type": "causal_lm", "vocab_size": 97}, args).eval()
    ids = torch.randint(5, 97, (1, 40))
    changed = ids.clone()
    changed[0, :8] = torch.randint(5, 97, (8,))
    with torch.no_grad():
        return (model(ids).logits[0, 8:] - model(changed).logits[0, 8:]).abs().max().item()


def test_official_causal_design_carries_nothing_across_windows():
    """The official design's cell reads only itself (exactly no influence); ours carries the first window along."""
    assert first_window_influence("ran-causal-official") == 0.0
    # At initialisation the cells reach later tokens as small branches on the residual stream: ~1e-3, not 0.
    assert first_window_influence("ran-causal") > 1e-4


@pytest.mark.parametrize(
    "name", ["ran-causal", "ran-causal-official", "ran-causal-associative", "ran-causal-key-conv"]
)
def test_every_causal_design_get_finite_gradients(name):
    """The official design's cell reads nothing but itself; it must still train (no overflow in its norms)."""
    args = BenchmarkArguments(hidden_size=32, num_heads=2, lm_window_size=8, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(name, "lm", {"problem_type": "causal_lm", "vocab_size": 97}, args)
    ids = torch.randint(5, 97, (2, 40))
    model(ids, labels=ids).loss.backward()
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is None or torch.isfinite(parameter.grad).all(), parameter_name


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="--tasks"):
        BenchmarkArguments(tasks=["arxiv"])
    with pytest.raises(ValueError, match="--models"):
        BenchmarkArguments(models=["gpt-5"])
    with pytest.raises(ValueError, match="--hidden_size"):
        BenchmarkArguments(hidden_size=30, num_heads=4)


@pytest.mark.slow
@needs_data
def test_a_tiny_benchmark_writes_its_table_and_resumes(tmp_path, wordpiece_tokenizer_dir, monkeypatch):
    figures = record_saved_figures(monkeypatch)
    arguments = [
        "--tasks", "hyperpartisan", "lm",
        "--models", "ran", "bert-512", "ran-causal", "ran-causal-official",
        "--seeds", "0", "1",
        "--workers", "1",
        "--budget_scale", "0.02",
        "--hidden_size", "32",
        "--tokenizer_name", str(wordpiece_tokenizer_dir),
        "--test_limit", "24",
        "--max_length", "256",
        "--lm_block_size", "128",
        "--output_dir", str(tmp_path / "out"),
        "--cache_dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    payload = benchmark_tasks.main(arguments)
    runs = [json.loads(line) for line in (tmp_path / "out" / "tasks_cpu_runs.jsonl").read_text().splitlines()]
    assert sorted((r["task"], r["model"], r["seed"]) for r in runs) == sorted(
        (task, model, seed)
        for task, models in (("hyperpartisan", ("ran", "bert-512")), ("lm", ("ran-causal", "ran-causal-official")))
        for model in models
        for seed in (0, 1)
    )
    for run in runs:  # each run's main metric, checked against what it is computed from
        assert run["steps"] >= 1 and run["train_tokens"] > 0
        name, value = next(iter(run["metrics"].items()))
        if run["task"] == "lm":
            # exp of the mean token loss on the test blocks: a model trained for three steps scores test text as it
            # scored its last training batches (a perplexity from summed losses, or in bits, is far from it)
            assert name == "perplexity" and abs(math.log(value) - run["last_loss"]) < 0.25, (value, run["last_loss"])
        else:  # a share of the 24 test documents
            assert name == "accuracy" and value * 24 == pytest.approx(round(value * 24), abs=1e-9), run["metrics"]
    # Every LM run reads the same test text: its word perplexity is the token perplexity to the power of the same
    # tokens per word (more than one: WordPiece splits words).
    tokens_per_word = [
        math.log(run["metrics"]["word_perplexity"]) / math.log(run["metrics"]["perplexity"])
        for run in runs
        if run["task"] == "lm"
    ]
    assert tokens_per_word == pytest.approx([tokens_per_word[0]] * 4, rel=1e-9) and tokens_per_word[0] > 1
    check_result(payload)
    summary = payload["results"]["summary"]
    for task in ("hyperpartisan", "lm"):  # the summary is the runs' own figures
        for model, entry in summary[task].items():
            values = [r["metrics"][entry["metric"]] for r in runs if (r["task"], r["model"]) == (task, model)]
            assert len(values) == 2 and entry["values"] == values
            assert entry["mean"] == pytest.approx(sum(values) / 2)
            assert (entry["min"], entry["max"]) == (min(values), max(values))
    assert summary["lm"]["ran-causal"]["mean"] > 1.0
    for run in (r for r in runs if r["task"] == "lm"):  # the same tokens, with and without the carried cache
        assert run["metrics"]["stream_perplexity"] > 1.0
        assert run["metrics"]["stream_perplexity"] != run["metrics"]["perplexity"]
    table = (tmp_path / "out" / "tasks_cpu.md").read_text()
    assert "| ran |" in table and "ran-causal-official" in table and "token perplexity, stream" in table
    # The plot: a panel per task, a bar per model at its mean over the seeds.
    [(path, figure, dpi)] = figures
    assert path == tmp_path / "out" / "tasks_cpu.png"
    assert_png_of(path, figure, dpi)
    panels = {axis.get_title().split(":")[0]: axis for axis in figure.axes if ":" in axis.get_title()}
    assert panels.keys() == {"hyperpartisan", "lm"}  # (and the window study's, from the hyperpartisan runs)
    for task, axis in panels.items():
        drawn = {label.get_text(): bar.get_width() for label, bar in zip(axis.get_yticklabels(), axis.patches)}
        assert drawn == pytest.approx({model: entry["mean"] for model, entry in summary[task].items()})

    # A second call finds every run recorded and trains nothing.
    benchmark_tasks.main(arguments)
    assert len((tmp_path / "out" / "tasks_cpu_runs.jsonl").read_text().splitlines()) == len(runs)


def test_a_table_of_runs_from_two_checkouts_names_both_commits():
    """A resumed benchmark adds runs of a later checkout to earlier ones: its table says so, and the associative
    memory's LM row is checked against the plain model's seed spread."""
    from benchmark_tasks_report import markdown, summarize

    def run(model, seed, perplexity, commit):
        return {
            "task": "lm", "model": model, "window": None, "seed": seed, "train_seconds": 1.0, "seconds_per_epoch": 1.0,
            "parameters_without_embeddings": 1000, "parameters": 2000, "about": "WikiText-2",
            "metrics": {"perplexity": perplexity, "word_perplexity": 2 * perplexity, "stream_perplexity": perplexity},
            "machine": {"git_sha": commit},
        }  # fmt: skip

    results = [
        run("ran-causal", 0, 550.0, "aaaaaaa"), run("ran-causal", 1, 570.0, "bbbbbbb"),
        run("ran-causal-associative", 0, 560.0, "aaaaaaa"), run("ran-causal-associative", 1, 566.0, "bbbbbbb"),
    ]  # fmt: skip
    info = {"cpu": "x86_64", "threads": 2, "torch": "2", "transformers": "5", "git_sha": "bbbbbbb"}
    table = markdown(summarize(results), results, BenchmarkArguments(), info, "python benchmark_tasks.py")
    assert "runs from commits aaaaaaa, bbbbbbb" in table
    assert "the associative memory no worse than without it: **holds** (token perplexity 563.0 vs 560.0" in table
    worse = results[:2] + [run("ran-causal-associative", 0, 575.0, "bbbbbbb")]
    table = markdown(summarize(worse), worse, BenchmarkArguments(), info, "python benchmark_tasks.py")
    assert "no worse than without it: **does not hold** (token perplexity 575.0" in table
    assert "runs from commits aaaaaaa, bbbbbbb" in table
