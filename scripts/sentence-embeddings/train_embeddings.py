#!/usr/bin/env python
"""Fine-tune RAN as a long-document embedding model with sentence-transformers, once per pooling choice, and the same
recipe on a BERT-512 baseline; report retrieval quality on held-out documents before and after.

    python scripts/train_tokenizer.py --train_files ../shared/data/20newsgroups/train.jsonl.gz \\
        --vocab_size 8000 --output_dir outputs/tokenizer-20ng
    python scripts/sentence-embeddings/train_embeddings.py --tokenizer_name outputs/tokenizer-20ng \\
        --train_file ../shared/data/20newsgroups/train.jsonl.gz \\
        --test_file ../shared/data/20newsgroups/test.jsonl.gz --output_dir outputs/embeddings-20ng

Training pairs are two documents with the same label (20 Newsgroups: two posts of one newsgroup; a multi-label set
such as EURLEX-57K: two documents sharing a label), trained with `MultipleNegativesRankingLoss` (the other documents
of the batch are the negatives). Evaluation is retrieval among held-out documents: each query document should find
the corpus documents with its label (`InformationRetrievalEvaluator`: nDCG@10 and MAP@100, cosine similarity).

Every RAN run starts from the same weights: the RAN at `--model_name_or_path`, or a RAN built from scratch with
`--config_overrides` (random weights; a from-scratch RAN's pooler is random too). Each pooling choice of
`ran_hf.integrations.sentence_embeddings` (`cell_transform`, `pooled_cell`, `mean`, `max`) gets its own copy, trained with the same
data, steps and seed. The baseline is a `BertModel` of matching width and depth built from scratch with the same
tokenizer (nothing is downloaded), mean-pooled, reading at most `--baseline_max_length` (512) tokens. Each trained
model is saved under `--output_dir` and loads with `SentenceTransformer(path, trust_remote_code=True)`.

Results go to `--output_dir/results.json` and, with `--results_prefix benchmarks/embeddings/embeddings_cpu`, to
`benchmarks/embeddings/embeddings_cpu.{json,md}`: the JSON is one record in the benchmarks' one result format
(`benchmark_utils.result_record`), the run's setup under `settings` and one row per model under `results`.
"""

import dataclasses
import json
import logging
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import transformers
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.modules import Pooling
from transformers import AutoTokenizer, BertConfig, BertModel, set_seed

from ran_hf import RANConfig, RANModel
from ran_hf.files.data import load_records
from ran_hf.files.folder_locks import lock_folder, releases_folder_locks
from ran_hf.files.folders import write_folder
from ran_hf.files.paths import check_not_inputs, contents
from ran_hf.integrations.sentence_embeddings import SENTENCE_POOLINGS, ran_sentence_transformer


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the machine line of the benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the flags' ranges

from argument_checks import TRAINING_ARGUMENT_RANGES, apply_config_overrides, check_ranges, parse_arguments  # noqa: E402
from benchmark_utils import (  # noqa: E402
    command_line,
    machine_info,
    machine_line,
    result_path,
    result_record,
    write_result,
)
from data_loading import cut_for_tokenizer  # noqa: E402
from ran_trainer import StopsDivergedRuns, first_nonfinite_weight  # noqa: E402


logger = logging.getLogger(__name__)

DEFAULT_RAN = (
    "hidden_size=128,num_hidden_layers=2,num_attention_heads=4,head_dim=32,window_size=128,min_window_size=16"
)


@dataclass
class ModelArguments:
    tokenizer_name: str | None = field(
        default=None,
        metadata={"help": "Tokenizer folder (scripts/train_tokenizer.py); defaults to --model_name_or_path's."},
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A saved RAN (any head) to start from. Leave out to start from scratch."}
    )
    config_overrides: str = field(
        default=DEFAULT_RAN, metadata={"help": "From scratch: RANConfig fields; the baseline BERT copies the size."}
    )
    poolings: list[str] = field(
        default_factory=lambda: list(SENTENCE_POOLINGS),
        metadata={"help": f"RAN pooling choices to train, each from the same start: {', '.join(SENTENCE_POOLINGS)}."},
    )
    baseline: bool = field(default=True, metadata={"help": "Also train the BERT-512 baseline (from scratch)."})
    baseline_max_length: int = field(
        default=512, metadata={"at_least": 2, "help": "The baseline reads at most this many tokens."}
    )
    max_seq_length: int = field(
        default=4096, metadata={"at_least": 2, "help": "RAN reads at most this many tokens per document."}
    )

    def __post_init__(self):
        if self.tokenizer_name is None and self.model_name_or_path is None:
            raise ValueError("Give --tokenizer_name (see scripts/train_tokenizer.py) or --model_name_or_path.")
        unknown = set(self.poolings) - set(SENTENCE_POOLINGS)
        if unknown:
            raise ValueError(f"--poolings must be among {SENTENCE_POOLINGS}, got {sorted(unknown)}.")


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "Training documents: jsonl(.gz) or csv with text and label columns."})
    test_file: str = field(metadata={"help": "Held-out documents: the queries and the corpus of the evaluation."})
    text_column_name: str = field(default="text", metadata={"help": "Column with the document."})
    label_column_name: str = field(default="label", metadata={"help": "Column with the label, or list of labels."})
    strip_headers: bool = field(
        default=True,
        metadata={"help": "Drop everything up to the first blank line (20 Newsgroups' From/Subject/... headers)."},
    )
    num_train_pairs: int = field(
        default=2000, metadata={"at_least": 1, "help": "Training pairs (documents sharing a label)."}
    )
    num_queries: int = field(default=200, metadata={"at_least": 1, "help": "Held-out documents used as queries."})
    num_corpus: int = field(
        default=1000, metadata={"at_least": 1, "help": "Other held-out documents forming the corpus."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Run into an --output_dir that holds a previous run: its models and results are replaced."},
    )
    results_prefix: str | None = field(
        default=None,
        metadata={"help": "Also write PREFIX.json and PREFIX.md (e.g. benchmarks/embeddings/embeddings_cpu)."},
    )
    max_nonfinite_steps: int = field(
        default=3,
        metadata={
            "at_least": 1,
            "help": "Stop a model's training, before it is saved, when this many optimizer steps in a row had a NaN "
            "or infinite loss or gradient norm (as the training scripts' flag of that name).",
        },
    )


def read_documents(
    path: str, data_args: DataTrainingArguments, tokenizer=None, max_tokens: int | None = None
) -> list[tuple[str, frozenset]]:
    """(text, labels) for every document with a non-blank text and a label; a label list becomes a set of labels.
    The others (a null or blank text, a null label or an empty list) are skipped and counted in the log. With a
    `tokenizer`, a text longer than `max_tokens` of its tokens is cut to a part that still gives more
    (`cut_for_tokenizer`): no model reads further, and a fast tokenizer holds some 150 bytes per character of a text
    it tokenizes whole, before it truncates."""
    documents, without_text, without_label = [], 0, 0
    columns = [data_args.text_column_name, data_args.label_column_name]
    for batch in load_records(path, columns).iter(batch_size=1000):
        for text, label in zip(*(batch[column] for column in columns)):
            if not isinstance(text, str):  # null: not the word "None"
                text = "" if text is None else str(text)
            if data_args.strip_headers and "\n\n" in text:
                text = text.split("\n\n", 1)[1]
            items = label if isinstance(label, list) else [label]
            labels = frozenset(str(item) for item in items if item is not None and item != "")
            if not text.strip():
                without_text += 1
            elif not labels:
                without_label += 1
            else:
                documents.append((text.strip(), labels))
    if tokenizer is not None:
        texts = cut_for_tokenizer(tokenizer, [text for text, _ in documents], max_tokens)
        documents = [(text, labels) for text, (_, labels) in zip(texts, documents)]
    if without_text or without_label:
        logger.warning(
            f"{path}: skipped {without_text:,} documents without text (null or blank"
            f"{' after --strip_headers' if data_args.strip_headers else ''}) and {without_label:,} without a label "
            f"(null or empty); {len(documents):,} remain."
        )
    if not documents:
        raise ValueError(
            f"{path} has no document with both a text in column {data_args.text_column_name!r} and a label in "
            f"column {data_args.label_column_name!r}."
        )
    return documents


def training_pairs(documents, count: int, rng: random.Random) -> Dataset:
    """`count` (anchor, positive) pairs of different documents that share a label."""
    by_label = defaultdict(list)
    for index, (_, labels) in enumerate(documents):
        for label in labels:
            by_label[label].append(index)
    if all(len(indices) < 2 for indices in by_label.values()):  # the loop below would never find a pair
        raise ValueError(
            f"No two of the {len(documents):,} training documents share a label: every label is unique, so no "
            "training pair (two documents of one label) can be made. Check --label_column_name."
        )
    anchors, positives = [], []
    while len(anchors) < count:
        index = rng.randrange(len(documents))
        label = rng.choice(sorted(documents[index][1]))
        if len(by_label[label]) < 2:
            continue
        other = rng.choice(by_label[label])
        if other != index:
            anchors.append(documents[index][0])
            positives.append(documents[other][0])
    return Dataset.from_dict({"anchor": anchors, "positive": positives})


def retrieval_evaluator(documents, data_args: DataTrainingArguments, rng: random.Random, batch_size: int):
    """Queries and corpus drawn from the held-out documents; a corpus document is relevant when it shares a label."""
    order = list(range(len(documents)))
    rng.shuffle(order)
    queries = {f"q{i}": documents[i][0] for i in order[: data_args.num_queries]}
    corpus_ids = order[data_args.num_queries : data_args.num_queries + data_args.num_corpus]
    corpus = {f"d{i}": documents[i][0] for i in corpus_ids}
    relevant = {
        f"q{q}": {f"d{d}" for d in corpus_ids if documents[q][1] & documents[d][1]}
        for q in order[: data_args.num_queries]
    }
    if not corpus or not any(relevant.values()):
        held_out = f"--test_file holds {len(documents):,} documents with a text and a label"
        problem = (
            f"{held_out}: after --num_queries {data_args.num_queries} queries none is left for the corpus"
            if not corpus
            else f"{held_out}, and no query shares a label with one of the {len(corpus):,} corpus documents"
        )
        fix = "Lower --num_queries" if not corpus else "Raise --num_corpus"
        raise ValueError(f"{problem}, so retrieval cannot be scored. {fix} or give a larger --test_file.")
    return InformationRetrievalEvaluator(
        queries, corpus, relevant, ndcg_at_k=[10], map_at_k=[100], mrr_at_k=[10], accuracy_at_k=[1],
        precision_recall_at_k=[10], batch_size=batch_size, show_progress_bar=True, write_csv=False, name="heldout",
    )  # fmt: skip


def retrieval_scores(model: SentenceTransformer, evaluator) -> dict:
    scores = evaluator(model)
    return {
        "ndcg@10": scores[f"{evaluator.name}_cosine_ndcg@10"],
        "map@100": scores[f"{evaluator.name}_cosine_map@100"],
    }


def scratch_config(model_args: ModelArguments, tokenizer) -> RANConfig | None:
    """From scratch, the RAN's config: the tokenizer's vocabulary and padding id, then --config_overrides, each value
    read by its field's type (`argument_checks.apply_config_overrides`), so that an unknown field or a bad value is refused,
    naming it, before any document is read. None with --model_name_or_path, whose own config is used."""
    if model_args.model_name_or_path is not None:
        return None
    fixed = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    config = RANConfig(**fixed)
    try:
        apply_config_overrides(config, model_args.config_overrides)
    except ValueError as error:
        raise ValueError(f"--config_overrides {model_args.config_overrides!r}: {error}") from error
    if changed := [name for name, value in fixed.items() if getattr(config, name) != value]:
        # the model reads the tokenizer's ids: another vocabulary size or padding id breaks it
        names = ", ".join(f"`{name}`" for name in changed)
        values = ", ".join(f"{name}={fixed[name]!r}" for name in changed)
        raise ValueError(
            f"--config_overrides sets {names}, which the script takes from the tokenizer ({values}): leave "
            f"{'it' if len(changed) == 1 else 'them'} out of --config_overrides."
        )
    return config


def starting_ran(model_args: ModelArguments, config: RANConfig | None, tokenizer, folder: Path) -> Path:
    """The folder every RAN run starts from: --model_name_or_path, or a RAN from scratch (`config`, from
    `scratch_config`) saved into `folder`."""
    if model_args.model_name_or_path is not None:
        return Path(model_args.model_name_or_path)
    RANModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def baseline_bert(ran_config, tokenizer, max_length: int, folder: Path) -> SentenceTransformer:
    """A BertModel of RAN's width and depth, from scratch, mean-pooled, reading at most `max_length` tokens."""
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=ran_config.hidden_size,
        num_hidden_layers=ran_config.num_hidden_layers,
        num_attention_heads=ran_config.num_attention_heads,
        intermediate_size=4 * ran_config.hidden_size,
        max_position_embeddings=max_length,
        pad_token_id=tokenizer.pad_token_id,
    )
    BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    transformer = Transformer(str(folder), max_seq_length=max_length)
    return SentenceTransformer(modules=[transformer, Pooling(config.hidden_size, "mean")], similarity_fn_name="cosine")


def count_parameters(model: SentenceTransformer) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


class EmbeddingTrainer(StopsDivergedRuns, SentenceTransformerTrainer):
    """sentence-transformers' trainer, stopped when training diverges (`ran_trainer.StopsDivergedRuns`)."""


def train_and_evaluate(
    name, model, train_dataset, evaluator, training_args, output_dir: Path, max_nonfinite_steps: int = 3
) -> dict:
    logger.info(f"*** {name}: before training ***")
    before = retrieval_scores(model, evaluator)
    args = dataclasses.replace(training_args, output_dir=str(output_dir / name), save_strategy="no")
    trainer = EmbeddingTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        loss=MultipleNegativesRankingLoss(model),
        max_nonfinite_steps=max_nonfinite_steps,
    )
    start = time.perf_counter()
    train_result = trainer.train()
    seconds = time.perf_counter() - start
    logger.info(f"*** {name}: after training ***")
    after = retrieval_scores(model, evaluator)
    trainer.refuse_nonfinite_weights(str(output_dir / name))
    with write_folder(output_dir / name, "saving") as staging:
        model.save(str(staging))
    row = {
        "model": name,
        "parameters": count_parameters(model),
        "max_tokens": model.max_seq_length,
        "before": before,
        "after": after,
        "train_loss": train_result.training_loss,
        "train_steps": train_result.global_step,
        "train_seconds": round(seconds, 1),
    }
    logger.info(json.dumps(row))
    return row


def markdown(rows, info, setup, command: str) -> str:
    lines = [
        f"Machine: {machine_line(info)}",
        "",
        f"{setup['data']}; {setup['pairs']:,} training pairs, {setup['queries']} queries over {setup['corpus']:,} "
        f"held-out documents (a document is relevant when it shares the query's label). {setup['start']}. "
        f"{setup['steps']} steps of batch {setup['batch_size']}, learning rate {setup['learning_rate']}, "
        f"MultipleNegativesRankingLoss, seed {setup['seed']}. Held-out documents: {setup['token_stats']}. "
        f"On average {setup['relevant_share']:.1%} of the corpus is relevant to a query (a random ranking's "
        f"precision).",
        "",
        "| model | pooling | parameters | reads | nDCG@10 before | nDCG@10 after | MAP@100 before | MAP@100 after | "
        "train s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        model, _, pooling = row["model"].partition("-")
        lines.append(
            f"| {model} | {pooling} | {row['parameters']:,} | {row['max_tokens']:,} tokens | "
            f"{row['before']['ndcg@10']:.3f} | {row['after']['ndcg@10']:.3f} | {row['before']['map@100']:.3f} | "
            f"{row['after']['map@100']:.3f} | {row['train_seconds']:.0f} |"
        )
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def check_output_dir(output_dir: Path, model_args: ModelArguments, data_args: DataTrainingArguments) -> None:
    """Before any work: refuse an --output_dir that is, holds or lies inside what the run reads, or that already
    holds a run's models (unless --overwrite_output_dir), and lock it for the run (`ran_hf.files.folders`)."""
    inputs = [("--model_name_or_path", model_args.model_name_or_path), ("--tokenizer_name", model_args.tokenizer_name)]
    inputs += [("--train_file", data_args.train_file), ("--test_file", data_args.test_file)]
    check_not_inputs(output_dir, "--output_dir", inputs)
    if data_args.results_prefix is not None:
        for suffix in (".json", ".md"):
            path = result_path(data_args.results_prefix, suffix)
            check_not_inputs(path, f"--results_prefix's {suffix} file", inputs)
    lock_folder(output_dir)
    entries = contents(output_dir)
    if entries and not data_args.overwrite_output_dir:
        shown = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "")
        raise ValueError(
            f"--output_dir {output_dir} already holds a previous run ({shown}); this run would replace its models "
            "and results. Pass --overwrite_output_dir to replace them, or choose another --output_dir."
        )


@releases_folder_locks
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    model_args, data_args, training_args = parse_arguments(
        (ModelArguments, DataTrainingArguments, SentenceTransformerTrainingArguments), argv
    )
    check_ranges(training_args, TRAINING_ARGUMENT_RANGES)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    transformers.utils.logging.set_verbosity_warning()
    set_seed(training_args.seed)
    # The tokenizer and the from-scratch config first: a bad --config_overrides is named before any folder is made
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    config = scratch_config(model_args, tokenizer)
    output_dir = Path(training_args.output_dir)
    check_output_dir(output_dir, model_args, data_args)
    output_dir.mkdir(parents=True, exist_ok=True)

    # Data: training pairs from the train file, queries and corpus from the held-out file, each text cut to what the
    # models read (the RAN's --max_seq_length, the baseline's --baseline_max_length)
    rng = random.Random(training_args.seed)
    read_tokens = max(model_args.max_seq_length, model_args.baseline_max_length if model_args.baseline else 0)
    train_documents = read_documents(data_args.train_file, data_args, tokenizer, read_tokens)
    test_documents = read_documents(data_args.test_file, data_args, tokenizer, read_tokens)
    train_dataset = training_pairs(train_documents, data_args.num_train_pairs, rng)
    evaluator = retrieval_evaluator(test_documents, data_args, rng, training_args.per_device_eval_batch_size)
    relevant_share = sum(len(evaluator.relevant_docs[q]) for q in evaluator.queries_ids) / (
        len(evaluator.queries_ids) * len(evaluator.corpus)
    )  # what a random ranking puts in its top 10, on average
    logger.info(
        f"{len(train_dataset):,} training pairs from {len(train_documents):,} documents; "
        f"{len(evaluator.queries)} queries, {len(evaluator.corpus):,} corpus documents, {relevant_share:.1%} of the "
        f"corpus relevant to a query on average"
    )

    # The RAN every pooling choice starts from; all models share the tokenizer
    start = starting_ran(model_args, config, tokenizer, output_dir / "ran-initial")
    ran_config = RANConfig.from_pretrained(start)
    lengths = [len(ids) for ids in tokenizer(evaluator.queries + evaluator.corpus)["input_ids"]]
    token_stats = (
        f"{sum(lengths) / len(lengths):.0f} tokens on average, longest {max(lengths):,}, "
        f"{sum(length > model_args.baseline_max_length for length in lengths) / len(lengths):.0%} longer than "
        f"{model_args.baseline_max_length}"
    )
    logger.info(f"Held-out documents: {token_stats}")

    rows = []
    trained_as = (training_args, output_dir, data_args.max_nonfinite_steps)
    for pooling in model_args.poolings:
        set_seed(training_args.seed)
        model = ran_sentence_transformer(start, pooling=pooling, max_seq_length=model_args.max_seq_length)
        broken = first_nonfinite_weight(model)
        if broken is not None:
            raise ValueError(
                f"--model_name_or_path {start}: its weight {broken} holds NaN or infinite values (a diverged or "
                "damaged model); training it would give NaN. Use another checkpoint."
            )
        rows.append(train_and_evaluate(f"ran-{pooling}", model, train_dataset, evaluator, *trained_as))
    if model_args.baseline:
        set_seed(training_args.seed)
        model = baseline_bert(ran_config, tokenizer, model_args.baseline_max_length, output_dir / "bert-initial")
        rows.append(train_and_evaluate("bert-mean", model, train_dataset, evaluator, *trained_as))

    device = training_args.device.type
    info = machine_info(device)
    setup = {
        "data": f"{data_args.train_file} -> {data_args.test_file}",
        "pairs": len(train_dataset),
        "queries": len(evaluator.queries),
        "corpus": len(evaluator.corpus),
        "start": f"RAN from {model_args.model_name_or_path}"
        if model_args.model_name_or_path
        else f"RAN and BERT from scratch (random weights; RAN {model_args.config_overrides})",
        "steps": rows[0]["train_steps"] if rows else 0,
        "batch_size": training_args.per_device_train_batch_size,
        "learning_rate": training_args.learning_rate,
        "seed": training_args.seed,
        "token_stats": token_stats,
        "relevant_share": relevant_share,
    }
    # The Trainer keeps float32 weights and computes under autocast with --bf16 / --fp16
    dtype = "bfloat16 autocast" if training_args.bf16 else "float16 autocast" if training_args.fp16 else "float32"
    command = command_line(__file__, argv)
    record = result_record(command, setup, rows, device=device, dtype=dtype, info=info)
    text = json.dumps(record, indent=2) + "\n"
    write_result(output_dir / "results.json", text)
    table = markdown(rows, info, setup, command)
    print(table)
    if data_args.results_prefix:
        json_path, table_path = (result_path(data_args.results_prefix, suffix) for suffix in (".json", ".md"))
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_result(json_path, text)
        write_result(table_path, table)
    return record


if __name__ == "__main__":
    main()
