"""RAN as a sentence-transformers model: every pooling choice equals RANModel's own output, does not depend on the
batch or the padding, survives a save and reload, loads without `ran_hf`, and the folder still serves `AutoModel` and
`pipeline("feature-extraction")`."""

import json

import numpy as np
import pytest
import torch
from remote_code import run_without_ran_hf
from transformers import AutoModel, AutoModelForSequenceClassification, pipeline

from ran_hf import RANForMaskedLM, RANForSequenceClassification, RANModel
from ran_hf.integrations.sentence_embeddings import (
    SENTENCE_POOLINGS,
    ran_sentence_transformer,
    sentence_pooling,
    write_sentence_transformers_config,
)
from ran_hf.ran_model import masked_max, masked_mean


sentence_transformers = pytest.importorskip("sentence_transformers")
SentenceTransformer = sentence_transformers.SentenceTransformer

import run_classification  # noqa: E402
import run_mlm  # noqa: E402
import run_pipeline  # noqa: E402
import train_tokenizer  # noqa: E402


POOLINGS = [pytest.param(pooling, id=pooling) for pooling in SENTENCE_POOLINGS]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A WordPiece tokenizer trained by `train_tokenizer.py` on synthetic topic documents."""
    documents = run_pipeline.write_topic_documents(tmp_path_factory.mktemp("topics"), {"train": 24}, seed=3)
    folder = tmp_path_factory.mktemp("tokenizer")
    arguments = ["--train_files", str(documents["train"]), "--vocab_size", "300", "--output_dir", str(folder)]
    train_tokenizer.main(arguments)
    return folder


@pytest.fixture(scope="module")
def documents(tokenizer_dir):
    """Documents of 3 to about 60 tokens: one window, several windows, a merged tail (window 4, minimum 2)."""
    words = "the court heard the appeal and the committee wrote its report on the budget of the city".split()
    lengths = [1, 7, 30, 2, 13, 45, 5, 21]
    return [" ".join(words[(i + j) % len(words)] for j in range(n)) for i, n in enumerate(lengths)]


@pytest.fixture
def classifier_folder(make_config, tokenizer_dir, tmp_path):
    """A `RANForSequenceClassification` saved with its tokenizer, as `run_classification.py` saves one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = RANForSequenceClassification(
        make_config(vocab_size=len(tokenizer), num_labels=3, cell_pooling="mean")
    ).eval()
    folder = tmp_path / "ran-classifier"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, folder


def expected_embeddings(encoder, tokenizer, texts, pooling):
    """Each document alone through `RANModel`: the output that `pooling` names."""
    rows = []
    for text in texts:
        inputs = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            outputs = encoder(**inputs)
        mask = inputs["attention_mask"].bool()
        rows.append(
            {
                "cell_transform": outputs.pooler_output,
                "pooled_cell": outputs.pooled_cell,
                "mean": masked_mean(outputs.last_hidden_state, mask),
                "max": masked_max(outputs.last_hidden_state, mask),
            }[pooling][0]
        )
    return torch.stack(rows).numpy()


@pytest.mark.parametrize("pooling", POOLINGS)
def test_folder_loads_with_each_pooling(classifier_folder, documents, pooling):
    """`write_sentence_transformers_config` makes the saved classifier a SentenceTransformer whose embedding is the
    classifier's own `RANModel` output (its trained cell transform for `cell_transform`)."""
    model, folder = classifier_folder
    write_sentence_transformers_config(folder, pooling=pooling)
    embedder = SentenceTransformer(str(folder), trust_remote_code=True, device="cpu")
    assert sentence_pooling(embedder) == pooling
    assert embedder.get_embedding_dimension() == model.config.hidden_size
    embeddings = embedder.encode(documents, batch_size=len(documents), convert_to_numpy=True)
    expected = expected_embeddings(model.model, embedder.tokenizer, documents, pooling)
    np.testing.assert_allclose(embeddings, expected, atol=TOLERANCE, rtol=0)
    assert (folder / "1_Pooling").is_dir() == (pooling in ("mean", "max"))


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_embeddings_do_not_depend_on_batch_or_padding(classifier_folder, documents, pooling, padding_side):
    _, folder = classifier_folder
    write_sentence_transformers_config(folder, pooling=pooling)
    embedder = SentenceTransformer(str(folder), trust_remote_code=True, device="cpu")
    alone = embedder.encode(documents, batch_size=1, convert_to_numpy=True)
    embedder.tokenizer.padding_side = padding_side
    for batch_size in (3, len(documents)):
        batched = embedder.encode(documents, batch_size=batch_size, convert_to_numpy=True)
        np.testing.assert_allclose(batched, alone, atol=TOLERANCE, rtol=0)
    # The longest document spans many windows and pads every other one in the batch.
    assert len(embedder.tokenizer(documents[5])["input_ids"]) > 10 * 4


@pytest.mark.parametrize("pooling", POOLINGS)
def test_save_and_reload_keeps_the_pooling(classifier_folder, documents, pooling, tmp_path):
    """A model built in memory from any RAN folder, saved by sentence-transformers, loads back with the same choice,
    and its folder still loads with `AutoModel`."""
    _, folder = classifier_folder
    embedder = ran_sentence_transformer(folder, pooling=pooling, device="cpu")
    before = embedder.encode(documents, convert_to_numpy=True)
    embedder.save(str(tmp_path / "saved"))
    reloaded = SentenceTransformer(str(tmp_path / "saved"), trust_remote_code=True, device="cpu")
    assert sentence_pooling(reloaded) == pooling
    np.testing.assert_allclose(reloaded.encode(documents, convert_to_numpy=True), before, atol=TOLERANCE, rtol=0)
    encoder = AutoModel.from_pretrained(tmp_path / "saved", trust_remote_code=True).eval()
    expected = expected_embeddings(encoder, reloaded.tokenizer, documents, pooling)
    np.testing.assert_allclose(before, expected, atol=TOLERANCE, rtol=0)


def test_folder_still_serves_transformers(classifier_folder, documents):
    """The sentence-transformers files sit beside the model: `AutoModel*` and the feature-extraction pipeline work."""
    model, folder = classifier_folder
    write_sentence_transformers_config(folder, pooling="mean")
    extractor = pipeline("feature-extraction", model=str(folder), trust_remote_code=True)
    for text in documents[:3]:
        features = np.array(extractor(text))[0]  # (tokens, D)
        inputs = extractor.tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            expected = model.model(**inputs).last_hidden_state[0].numpy()
        np.testing.assert_allclose(features, expected, atol=TOLERANCE, rtol=0)
    classifier = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)
    assert classifier.config.num_labels == 3


def test_sentence_transformers_files(classifier_folder):
    _, folder = classifier_folder
    write_sentence_transformers_config(folder, pooling="max", max_seq_length=64)
    modules = json.loads((folder / "modules.json").read_text())
    assert [module["path"] for module in modules] == ["", "1_Pooling"]
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "max"
    assert json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"] == 64
    assert SentenceTransformer(str(folder), trust_remote_code=True, device="cpu").max_seq_length == 64
    write_sentence_transformers_config(folder, pooling="pooled_cell")  # a cell choice drops the token pooling
    assert not (folder / "1_Pooling").exists()
    assert len(json.loads((folder / "modules.json").read_text())) == 1


def test_bad_requests_are_refused(classifier_folder, make_config, tmp_path):
    _, folder = classifier_folder
    with pytest.raises(ValueError, match="pooling"):
        write_sentence_transformers_config(folder, pooling="cls")
    with pytest.raises(FileNotFoundError, match="config.json"):
        write_sentence_transformers_config(tmp_path, pooling="mean")
    masked_lm = tmp_path / "masked-lm"
    RANForMaskedLM(make_config()).save_pretrained(masked_lm)
    with pytest.raises(ValueError, match="no cell transform"):  # a masked LM trains no pooler
        write_sentence_transformers_config(masked_lm, pooling="cell_transform")
    write_sentence_transformers_config(masked_lm, pooling="pooled_cell")
    causal = tmp_path / "causal"
    RANModel(make_config(is_causal=True)).save_pretrained(causal)
    with pytest.raises(ValueError, match="causal"):
        write_sentence_transformers_config(causal, pooling="mean")
    weights = masked_lm / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a copy cut short
    with pytest.raises(OSError, match="model.safetensors is damaged or cut short"):
        write_sentence_transformers_config(masked_lm, pooling="cell_transform")


LOAD_WITHOUT_RAN_HF = r"""
from sentence_transformers import SentenceTransformer

folder, texts = sys.argv[1], json.loads(sys.argv[2])
model = SentenceTransformer(folder, trust_remote_code=True, device="cpu")
report["embeddings"] = model.encode(texts, batch_size=len(texts), convert_to_numpy=True).tolist()
report["alone"] = model.encode(texts, batch_size=1, convert_to_numpy=True).tolist()
report["model_class"] = type(model[0].model).__module__
"""


@pytest.mark.slow
@pytest.mark.parametrize("pooling", [pytest.param(pooling, id=pooling) for pooling in ("cell_transform", "max")])
def test_loads_where_ran_hf_is_not_installed(classifier_folder, documents, pooling, tmp_path):
    """sentence-transformers needs no code of ours beyond the RAN model code already in the folder."""
    model, folder = classifier_folder
    write_sentence_transformers_config(folder, pooling=pooling)
    report = run_without_ran_hf(LOAD_WITHOUT_RAN_HF, [folder, json.dumps(documents)], tmp_path)
    assert report["model_class"].startswith("transformers_modules.")
    from transformers import AutoTokenizer

    expected = expected_embeddings(model.model, AutoTokenizer.from_pretrained(folder), documents, pooling)
    np.testing.assert_allclose(np.array(report["embeddings"]), expected, atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(np.array(report["alone"]), expected, atol=TOLERANCE, rtol=0)


def test_training_scripts_write_the_files(tokenizer_dir, tmp_path):
    """`--sentence_transformers_pooling` on an encoder script: the saved classifier loads as a SentenceTransformer; a
    masked LM, which trains no cell transform, is refused before training."""
    topics = run_pipeline.write_topic_documents(tmp_path, {"train": 12}, seed=2)
    tiny = "hidden_size=16,num_attention_heads=2,head_dim=8,window_size=16,min_window_size=4"
    quiet = ["--report_to", "none", "--disable_tqdm", "true", "--log_level", "warning", "--max_steps", "1"]
    common = ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", tiny, "--train_file", str(topics["train"])]
    output_dir = tmp_path / "classifier"
    run_classification.main(
        common + ["--output_dir", str(output_dir), "--do_train", "--max_seq_length", "96"]
        + ["--sentence_transformers_pooling", "cell_transform"] + quiet
    )  # fmt: skip
    embedder = SentenceTransformer(str(output_dir), trust_remote_code=True, device="cpu")
    assert sentence_pooling(embedder) == "cell_transform"
    assert embedder.encode(["the court heard the appeal"]).shape == (1, 16)
    with pytest.raises(ValueError, match="needs a trained pooler"):
        run_mlm.main(
            common + ["--output_dir", str(tmp_path / "mlm"), "--do_train", "--max_seq_length", "64"]
            + ["--sentence_transformers_pooling", "cell_transform"] + quiet
        )  # fmt: skip


@pytest.mark.parametrize(
    "overrides, message",
    [
        ("hidden_size=16,windw_size=16", r"`windw_size` is not a field of RANConfig \(did you mean 'window_size'\?\)"),
        ("hidden_size=16,window_size=abc", r"Field 'window_size' expected int, got str \(value: 'abc'\)"),
        ("vocab_size=5", r"sets `vocab_size`, which the script takes from the tokenizer"),
    ],
)
def test_train_embeddings_names_a_bad_override_before_any_work(tokenizer_dir, tmp_path, overrides, message):
    """`--config_overrides` had its own parser, which guessed each value's type and split lists at their commas
    (`cutoffs=[2000,10000]` failed to unpack); a bad field was refused only after the documents were read and
    tokenized. Now each value is read by its field's type (`RANConfig.update_from_string`), and a bad one is named
    before any data is read (the files here do not exist) and before the output folder is made."""
    import train_embeddings

    missing = str(tmp_path / "not-there.jsonl")
    argv = ["--tokenizer_name", str(tokenizer_dir), "--train_file", missing, "--test_file", missing]
    argv += ["--output_dir", str(tmp_path / "out"), "--config_overrides", overrides, "--report_to", "none"]
    with pytest.raises(ValueError, match=message) as raised:
        train_embeddings.main(argv)
    assert str(raised.value).startswith("--config_overrides")  # the flag, then the field
    assert not (tmp_path / "out").exists()


def test_train_embeddings_writes_results_in_the_one_result_format(tokenizer_dir, tmp_path):
    """`--results_prefix` wrote its own layout (machine_info, setup, results), which the benchmark files' check
    refuses; now both result files are one record of the benchmarks' format, with the typed overrides applied."""
    import train_embeddings
    from benchmark_utils import check_result

    topics = run_pipeline.write_topic_documents(tmp_path, {"train": 24}, seed=1)
    tiny = "hidden_size=16,num_attention_heads=2,head_dim=8,window_size=16,min_window_size=4,num_hidden_layers=1"
    record = train_embeddings.main(
        ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", tiny, "--output_dir", str(tmp_path / "out")]
        + ["--train_file", str(topics["train"]), "--test_file", str(topics["train"]), "--num_train_pairs", "8"]
        + ["--num_queries", "4", "--num_corpus", "12", "--poolings", "mean", "--no_baseline"]
        + ["--max_seq_length", "64", "--per_device_train_batch_size", "4", "--max_steps", "1"]
        + ["--report_to", "none", "--disable_tqdm", "true", "--results_prefix", str(tmp_path / "results" / "emb")]
    )  # fmt: skip
    saved = json.loads((tmp_path / "results" / "emb.json").read_text())
    check_result(saved)
    assert saved == record == json.loads((tmp_path / "out" / "results.json").read_text())
    assert record["device"] == "cpu" and record["dtype"] == "float32"
    assert record["command"].startswith("python scripts/sentence-embeddings/train_embeddings.py --tokenizer_name")
    assert [row["model"] for row in record["results"]] == ["ran-mean"] and record["settings"]["pairs"] == 8
    assert f"Command: `{record['command']}`" in (tmp_path / "results" / "emb.md").read_text()
    config = json.loads((tmp_path / "out" / "ran-initial" / "config.json").read_text())
    assert (config["window_size"], config["num_hidden_layers"]) == (16, 1)


@pytest.mark.slow
@pytest.mark.needs_data("20newsgroups", "wikitext-2", "conll2003")
def test_train_embeddings_on_20_newsgroups(data_dir, wordpiece_tokenizer_dir, tmp_path):
    """The example script end to end at toy size: RAN (two pooling choices) and the BERT baseline, scored before and
    after, saved as sentence-transformers folders that keep their pooling."""
    import train_embeddings
    from benchmark_utils import check_result

    newsgroups = data_dir / "20newsgroups"
    results = train_embeddings.main(
        ["--tokenizer_name", str(wordpiece_tokenizer_dir), "--output_dir", str(tmp_path / "out")]
        + ["--train_file", str(newsgroups / "train.jsonl.gz"), "--test_file", str(newsgroups / "test.jsonl.gz")]
        + ["--config_overrides", "hidden_size=16,num_attention_heads=2,head_dim=8,window_size=16,min_window_size=4"]
        + ["--poolings", "cell_transform", "mean", "--max_seq_length", "96", "--baseline_max_length", "32"]
        + ["--num_train_pairs", "8", "--num_queries", "4", "--num_corpus", "12", "--max_steps", "1"]
        + ["--per_device_train_batch_size", "4", "--report_to", "none", "--disable_tqdm", "true"]
        + ["--results_prefix", str(tmp_path / "embeddings")]
    )  # fmt: skip
    assert [row["model"] for row in results["results"]] == ["ran-cell_transform", "ran-mean", "bert-mean"]
    for row in results["results"]:  # scores of 4 queries, before and after the one training step
        assert set(row["before"]) == set(row["after"]) and {"ndcg@10", "map@100"} <= set(row["before"])
    assert "| ran | cell_transform |" in (tmp_path / "embeddings.md").read_text()
    saved = json.loads((tmp_path / "embeddings.json").read_text())
    assert saved["results"] == results["results"]
    check_result(saved)  # the benchmarks' one result format
    reloaded = SentenceTransformer(str(tmp_path / "out" / "ran-mean"), trust_remote_code=True, device="cpu")
    assert sentence_pooling(reloaded) == "mean" and reloaded.max_seq_length == 96
