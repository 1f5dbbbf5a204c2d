"""scripts/summarization/run_summarization.py: a prefix RAN and a causal RAN learn titles from bodies and are scored
with ROUGE; bad flags are named before any work."""

import json
import random
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, GPT2LMHeadModel

from ran_hf import RANForCausalLM, RANForPrefixLM
from ran_hf.integrations.convert_rannet import build_rannet_tokenizer


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS / "summarization"))

import run_summarization  # noqa: E402


pytestmark = pytest.mark.slow  # the training script end to end, three models

rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")  # the script's ROUGE (the `rouge-score` package)

QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--log_level", "warning", "--save_strategy", "no"]
TINY = "hidden_size=32,num_attention_heads=2,head_dim=16,window_size=8,min_window_size=2,num_hidden_layers=2"
WORDS = "court state law market trade rule water energy fish farm bank tax".split()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """EURLEX-like records: a title line (two words of the body), then the body."""
    folder = tmp_path_factory.mktemp("titles")
    build_rannet_tokenizer(Path(__file__).parent / "fixtures" / "rannet" / "tokenizer" / "vocab.txt").save_pretrained(
        folder / "tokenizer"
    )
    rng = random.Random(0)
    for split, count in (("train", 48), ("dev", 6)):
        with open(folder / f"{split}.jsonl", "w") as out:
            for _ in range(count):
                body = rng.sample(WORDS, 6)
                out.write(json.dumps({"text": " ".join(body[:2]) + "\n" + " ".join(body)}) + "\n")
    return folder


def arguments(data, output_dir, kind):
    return [
        "--model_kind", kind, "--tokenizer_name", str(data / "tokenizer"), "--config_overrides", TINY,
        "--train_file", str(data / "train.jsonl"), "--validation_file", str(data / "dev.jsonl"),
        "--title_from_first_line", "--max_source_length", "16", "--max_target_length", "6",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "4", "--max_steps", "12",
        "--learning_rate", "5e-3", "--do_train", "--do_eval", "--output_dir", str(output_dir),
    ] + QUIET  # fmt: skip


@pytest.mark.parametrize(
    "kind, model_class", [("prefix", RANForPrefixLM), ("causal", RANForCausalLM), ("gpt2", GPT2LMHeadModel)]
)
def test_trains_generates_titles_and_reports_rouge(data, tmp_path, kind, model_class):
    results = run_summarization.main(arguments(data, tmp_path / kind, kind))
    metrics = results["eval"]
    assert metrics["eval_loss"] < results["train"]["train_loss"] + 1.0  # trained, not diverged
    generations = [json.loads(line) for line in (tmp_path / kind / "generations.jsonl").read_text().splitlines()]
    assert len(generations) == 6 and all(g["reference"].count(" ") == 1 for g in generations)
    # The reported ROUGE is the mean F1 (x 100) of the generations written, each against its own reference.
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    scores = [scorer.score(g["reference"], g["prediction"]) for g in generations]
    for name in ("rouge1", "rouge2", "rougeL"):
        expected = 100 * sum(score[name].fmeasure for score in scores) / len(scores)
        assert metrics[f"eval_{name}"] == pytest.approx(expected), name
    config = json.loads((tmp_path / kind / "config.json").read_text())
    assert config["architectures"] == [model_class.__name__]
    sep = AutoTokenizer.from_pretrained(data / "tokenizer").sep_token_id
    assert config["eos_token_id"] == sep  # [SEP]: generation stops at the end of the title
    card = (tmp_path / kind / "README.md").read_text()
    # RAN's model card; the baseline gets Transformers' own
    assert ("summarisation-style generation" in card) == (kind != "gpt2") and "model-index" in card


@pytest.mark.parametrize(
    "change, message",
    [
        (["--model_kind", "encoder"], "--model_kind must be one of"),
        (["--summary_column", "summary"], "exactly one of --title_from_first_line and --summary_column"),
        (["--max_target_length", "2"], "--max_target_length must be at least 3"),
        (["--train_file", "missing.jsonl"], "no such file"),
    ],
)
def test_bad_flags_are_named(data, tmp_path, change, message):
    argv = arguments(data, tmp_path / "bad", "prefix")
    flag, value = change
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    with pytest.raises(ValueError, match=message):
        run_summarization.main(argv)
    assert not (tmp_path / "bad").exists()


def test_the_gpt2_baseline_is_trained_from_scratch_only(data, tmp_path):
    argv = arguments(data, tmp_path / "bad", "gpt2")
    at = argv.index("--config_overrides")
    del argv[at : at + 2]
    with pytest.raises(ValueError, match="--model_kind gpt2 trains the baseline from scratch"):
        run_summarization.main(argv + ["--model_name_or_path", str(data / "tokenizer")])
