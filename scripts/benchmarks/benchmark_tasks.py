"""RAN against its ablations and the baselines on the paper's tasks: from scratch, matched size, equal budget.

Every model is trained from scratch on every task it applies to, with the same width, a parameter count matched to
RAN's (the recurrent baselines' widths are searched to match; embeddings excluded), the same number of optimiser
steps on the same batches in the same order, and the same optimiser. Then it is evaluated once, on the test split.

    python scripts/benchmarks/benchmark_tasks.py            # the CPU table: benchmarks/tasks/tasks_cpu.{md,json,png}
    python scripts/benchmarks/benchmark_tasks.py --tasks probe --models ran bert-512 --seeds 0
    python scripts/benchmarks/benchmark_tasks.py --budget_scale 8 --hidden_size 256 --num_heads 4 --device cuda \
        --output_name tasks_gpu                             # a larger run on a GPU (see docs/benchmarks.md)

Tasks (data from ../shared/data unless --data_dir says otherwise):
  probe          synthetic long-range probe: 4,096-token documents whose label is whether the key in the first
                 window matches the key in the last window; head or tail alone is at chance by construction
  hyperpartisan  Hyperpartisan news (train 516 / test 65 articles), accuracy
  20newsgroups   20 Newsgroups, a stratified subset (--train_documents / --test_documents), accuracy
  eurlex         EURLEX-57K, a subset restricted to its most frequent labels (--eurlex_labels), micro-F1
  conll          CoNLL-2003 NER, RAN window 64 as in the paper, entity F1 on test (seqeval)
  lm             causal LM trained on WikiText-2 *valid* (the train split is not available here), perplexity on
                 WikiText-2 test: our causal RAN against the official causal design and a Llama of its size
  window_study   RAN on Hyperpartisan at several window sizes: accuracy and training seconds per epoch (Figure 5)

Models: ran, its Table-4 ablations (ran-mean-pooling, ran-no-cell-residual, ran-no-memory-review, ran-no-rotary),
ran-bpie (window_overlap > 0), bilstm, srnn, bpie-bisrnn (baseline_models.py), longformer, bert-512
(Transformers' models, from scratch, BERT reading the first 512 tokens only); for lm: ran-causal,
ran-causal-official, ran-causal-associative (ran-causal with `config.associative_memory`), ran-causal-key-conv (the
same with `associative_key_conv=4`), ran-causal-long-memory (the associative memory, trained at drawn window sizes:
`training_window_sizes` of a quarter, half and all of the window, as ran-causal now is), ran-causal-one-window
(ran-causal trained at its window alone, the default before drawn sizes) and llama (Transformers' Llama of RAN's width, depth, heads and head size, its MLP sized to RAN's parameter
count; no dropout).

Runs execute in `--workers` fresh processes and are appended to `<output_name>_runs.jsonl` as they finish; an
interrupted benchmark resumes where it stopped (`--overwrite` starts afresh). The table is rebuilt from every run
recorded there (benchmark_tasks_report.py).
"""

import dataclasses
import functools
import hashlib
import json
import logging
import math
import multiprocessing
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import HfArgumentParser


ROOT = Path(__file__).resolve().parents[2]
# This folder (the baselines, the report), and the example scripts whose tokenizer, label alignment and metrics the
# benchmark reuses: train_tokenizer.py in scripts/, run_classification.py and run_ner.py in their task folders.
SCRIPTS = ROOT / "scripts"
sys.path[:0] = [str(SCRIPTS / folder) for folder in ("benchmarks", ".", "text-classification", "token-classification")]

from baseline_models import (  # noqa: E402
    BiLSTMForTokenClassification,
    baseline_for,
    count_parameters,
)
from benchmark_tasks_report import write_report  # noqa: E402
from benchmark_utils import command_line, machine_info  # noqa: E402
from causal_baselines import matched_llama  # noqa: E402

from ran_hf.cell_scan import RANScanInterface, reference_cell_scan  # noqa: E402


logger = logging.getLogger("benchmark_tasks")

TASKS = ("hyperpartisan", "20newsgroups", "eurlex", "conll", "lm", "window_study", "probe")
RAN_VARIANTS = {
    # name: RANConfig overrides (the paper's Table 4 ablations and BPIE applied to RAN)
    "ran": {},
    "ran-mean-pooling": {"token_pooling": "mean"},
    "ran-no-cell-residual": {"use_cell_residual": False},
    "ran-no-memory-review": {"memory_review": False},
    "ran-no-rotary": {"use_rotary": False},
    "ran-bpie": {"window_overlap": None},  # None: --window_overlap
}
CLASSIFIERS = (*RAN_VARIANTS, "bilstm", "srnn", "bpie-bisrnn", "longformer", "bert-512")
TAGGERS = ("ran", "ran-bpie", "bilstm", "longformer", "bert-512")
OFFICIAL_CAUSAL_SCAN = "official-causal"  # registered below
# causal LM name -> the fields it sets besides is_causal (the official design: its post-norm layer and causal scan)
LANGUAGE_MODELS = {
    "ran-causal": {},
    "ran-causal-official": {"layer_design": "official", "scan_implementation": OFFICIAL_CAUSAL_SCAN},
    "ran-causal-associative": {"associative_memory": True},
    "ran-causal-key-conv": {"associative_memory": True, "associative_key_conv": 4},
    "ran-causal-long-memory": {"associative_memory": True, "training_window_sizes": None},  # None: from the window
    "ran-causal-one-window": {"training_window_sizes": None},  # the window alone (the default before drawn sizes)
    "llama": None,  # causal_baselines.py, matched to ran-causal
}
BERT_MAX_LENGTH = 512


@dataclass
class BenchmarkArguments:
    tasks: list[str] = field(default_factory=lambda: list(TASKS), metadata={"help": f"Any of {TASKS}."})
    models: list[str] | None = field(default=None, metadata={"help": "Only these models (default: all that apply)."})
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"help": "One run per seed."})
    data_dir: str = field(default=str(ROOT.parent / "shared" / "data"), metadata={"help": "The benchmark sets."})
    output_dir: str = field(default=str(ROOT / "benchmarks" / "tasks"), metadata={"help": "Where results go."})
    output_name: str = field(default="tasks_cpu", metadata={"help": "File stem of the results."})
    cache_dir: str = field(default=str(ROOT / ".cache" / "benchmark_tasks"), metadata={"help": "Prepared data."})
    overwrite: bool = field(default=False, metadata={"help": "Forget earlier runs of this output_name."})
    workers: int = field(default=2, metadata={"help": "Runs in parallel, each in its own process."})
    threads_per_worker: int = field(default=1, metadata={"help": "torch threads of each run."})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda."})
    # model size
    hidden_size: int = field(default=64, metadata={"help": "Width of every model (embeddings included)."})
    num_layers: int = field(default=2, metadata={"help": "RAN / Transformer / BiLSTM layers."})
    num_heads: int = field(default=2, metadata={"help": "Attention heads (head size = hidden_size / heads)."})
    window_size: int = field(default=256, metadata={"help": "RAN window and Longformer attention window."})
    ner_window_size: int = field(default=64, metadata={"help": "RAN window on CoNLL (64 in the paper)."})
    lm_window_size: int = field(default=128, metadata={"help": "RAN window for language modelling."})
    window_overlap: int = field(default=32, metadata={"help": "Enrichment tokens of ran-bpie."})
    slice_length: int = field(default=32, metadata={"help": "SRNN / BPIE-BiSRNN slice length z (paper: 32)."})
    enrichment: int = field(default=5, metadata={"help": "BPIE-BiSRNN enrichment m (paper: 5)."})
    study_windows: list[int] = field(default_factory=lambda: [32, 64, 128, 256, 512])
    dropout: float = field(default=0.1, metadata={"help": "Dropout of every model on the real tasks."})
    # budget
    vocab_size: int = field(default=8192, metadata={"help": "WordPiece vocabulary learned from the training sets."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Use this tokenizer (Hub id or folder) instead of learning one."}
    )
    max_length: int = field(default=1024, metadata={"help": "Tokens read per document (BERT: 512)."})
    probe_length: int = field(default=4096, metadata={"help": "Tokens per probe document."})
    batch_size: int = field(default=8, metadata={"help": "Documents per step (CoNLL: 2x, sentences are short)."})
    classification_steps: int = field(default=250, metadata={"help": "Optimiser steps per classification run."})
    probe_steps: int = field(default=100, metadata={"help": "Optimiser steps per probe run."})
    ner_steps: int = field(default=300, metadata={"help": "Optimiser steps per CoNLL run."})
    lm_steps: int = field(default=150, metadata={"help": "Optimiser steps per LM run."})
    lm_block_size: int = field(default=512, metadata={"help": "Tokens per LM training / evaluation block."})
    budget_scale: float = field(default=1.0, metadata={"help": "Multiplies every step count (GPU runs: > 1)."})
    learning_rate: float = field(default=1e-3, metadata={"help": "Peak AdamW learning rate, every model."})
    train_documents: int = field(default=2000, metadata={"help": "20 Newsgroups / EURLEX training subset."})
    test_documents: int = field(default=1000, metadata={"help": "20 Newsgroups / EURLEX test subset."})
    eurlex_labels: int = field(default=20, metadata={"help": "EURLEX: keep the most frequent labels."})
    probe_train_documents: int = field(default=1200, metadata={"help": "Probe training documents."})
    probe_test_documents: int = field(default=400, metadata={"help": "Probe test documents."})
    test_limit: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many test examples (quick checks only)."}
    )
    probe_fillers: int = field(default=2, metadata={"help": "Distinct filler pieces of probe documents."})

    def __post_init__(self):
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"--tasks: unknown {unknown}; choose from {TASKS}.")
        known = {*CLASSIFIERS, *LANGUAGE_MODELS}
        if self.models is not None and set(self.models) - known:
            raise ValueError(f"--models: unknown {sorted(set(self.models) - known)}; choose from {sorted(known)}.")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"--hidden_size {self.hidden_size} must be divisible by --num_heads {self.num_heads}.")
        if not self.seeds:
            raise ValueError("--seeds: give at least one seed.")
        if self.workers < 1 or self.threads_per_worker < 1:
            raise ValueError("--workers and --threads_per_worker must be >= 1.")
        if self.budget_scale <= 0:
            raise ValueError(f"--budget_scale must be > 0, got {self.budget_scale}.")
        for window in self.study_windows:
            if window < 2:
                raise ValueError(f"--study_windows: windows must be >= 2, got {window}.")

    def steps(self, task: str) -> int:
        base = {"probe": self.probe_steps, "conll": self.ner_steps, "lm": self.lm_steps}
        return max(1, round(base.get(task, self.classification_steps) * self.budget_scale))


# ---------------------------------------------------------------------------------------------------------------------
# Data: every task becomes lists of token ids and labels, prepared once and cached
# ---------------------------------------------------------------------------------------------------------------------


def stratified_subset(records: list[dict], size: int, key, seed: int = 0) -> list[dict]:
    """`size` records with the label proportions of `records` (a fixed subset: same for every model and seed)."""
    if size >= len(records):
        return records
    rng = random.Random(seed)
    by_label = {}
    for record in records:
        by_label.setdefault(key(record), []).append(record)
    chosen = []
    for group in by_label.values():
        rng.shuffle(group)
        chosen.extend(group[: max(1, round(size * len(group) / len(records)))])
    rng.shuffle(chosen)
    return chosen[:size]


def make_probe(tokenizer, num_documents: int, length: int, window: int, fillers: int, seed: int) -> dict:
    """Long-range probe: documents of `length` tokens, one key in the first `window` tokens and one in the last
    `window`; the label says whether the two keys belong together.

    The first key is A or B, the last key C or D, each drawn at random; A belongs with C and B with D, so the label is
    the XNOR of the two ends. A reader of only the head (or only the tail) sees one key and is at chance; a linear
    read-out of which keys occur is not enough either: the two ends must meet. The rest of the document is drawn
    from `fillers` word pieces that are never keys.
    """
    rng = np.random.default_rng(seed)
    pieces = np.arange(len(tokenizer.all_special_ids) + 100, len(tokenizer))
    first_keys, last_keys, filler_pieces = pieces[:2], pieces[2:4], pieces[4 : 4 + fillers]
    documents, labels = [], []
    for _ in range(num_documents):
        ids = rng.choice(filler_pieces, size=length)
        ids[0] = tokenizer.cls_token_id
        first, last = rng.integers(0, 2, size=2)
        ids[rng.integers(1, window)] = first_keys[first]
        ids[length - 1 - rng.integers(0, window - 1)] = last_keys[last]
        documents.append(ids.tolist())
        labels.append(int(first == last))
    return {"input_ids": documents, "labels": labels}


def tokenize_documents(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    return tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]


def prepare_classification(name: str, args: BenchmarkArguments, tokenizer) -> dict:
    from ran_hf.files.data import load_records, read_records

    data = Path(args.data_dir)
    if name == "probe":
        window, fillers = args.window_size, args.probe_fillers
        return {
            "problem_type": "single_label_classification",
            "num_labels": 2,
            "train": make_probe(tokenizer, args.probe_train_documents, args.probe_length, window, fillers, seed=1),
            "test": make_probe(tokenizer, args.probe_test_documents, args.probe_length, window, fillers, seed=2),
            "about": f"{args.probe_train_documents} / {args.probe_test_documents} synthetic documents of "
            f"{args.probe_length} tokens ({fillers} filler pieces); keys in the first and the last {window} tokens",
        }
    if name == "hyperpartisan":
        train, test = (
            read_records(data / "hyperpartisan" / "train.jsonl"),
            read_records(data / "hyperpartisan" / "test.jsonl"),
        )
        label_names = ["false", "true"]
        encode = lambda record: label_names.index(str(record["label"]).lower())  # noqa: E731
        about = "Hyperpartisan by-article, train 516 / test 65"
    elif name == "20newsgroups":
        train = stratified_subset(
            read_records(data / "20newsgroups" / "train.jsonl.gz"), args.train_documents, lambda r: r["label"]
        )
        test = stratified_subset(
            read_records(data / "20newsgroups" / "test.jsonl.gz"), args.test_documents, lambda r: r["label"]
        )
        label_names = [str(i) for i in range(20)]
        encode = lambda record: int(record["label"])  # noqa: E731
        about = f"20 Newsgroups bydate, stratified subsets train {len(train)} / test {len(test)}"
    else:  # eurlex
        rng = random.Random(0)
        splits = {
            split: load_records(data / "eurlex57k" / f"{split}.jsonl.gz", ["text", "label"])
            for split in ("train", "test")
        }
        labels = {split: dataset["label"][:] for split, dataset in splits.items()}  # lists, not row-by-row columns
        counts = {}
        for row in labels["train"]:
            for label in row:
                counts[label] = counts.get(label, 0) + 1
        label_names = sorted(counts, key=lambda label: (-counts[label], label))[: args.eurlex_labels]
        kept = set(label_names)
        chosen = {}
        for split, limit in (("train", args.train_documents), ("test", args.test_documents)):
            order = list(range(len(splits[split])))
            rng.shuffle(order)  # the order shuffling the records themselves gave: it depends on their number only
            chosen[split] = splits[split].select([i for i in order if kept & set(labels[split][i])][:limit]).to_list()
        train, test = chosen["train"], chosen["test"]
        encode = lambda record: [float(label in record["label"]) for label in label_names]  # noqa: E731
        about = (
            f"EURLEX-57K, the {len(label_names)} most frequent labels, documents with at least one of them: "
            f"train {len(train)} / test {len(test)}"
        )
    return {
        "problem_type": "multi_label_classification" if name == "eurlex" else "single_label_classification",
        "num_labels": len(label_names),
        "train": {
            "input_ids": tokenize_documents(tokenizer, [r["text"] for r in train], args.max_length),
            "labels": [encode(r) for r in train],
        },
        "test": {
            "input_ids": tokenize_documents(tokenizer, [r["text"] for r in test], args.max_length),
            "labels": [encode(r) for r in test],
        },
        "about": about,
    }


def prepare_conll(args: BenchmarkArguments, tokenizer) -> dict:
    from run_ner import align_tags

    from ran_hf.files.data import read_conll
    from ran_hf.files.labels import TagLabels

    data = Path(args.data_dir) / "conll2003"
    splits = {split: read_conll(data / f"{split}.txt") for split in ("train", "test")}
    tags = TagLabels.from_splits({split: [s["ner_tags"] for s in sentences] for split, sentences in splits.items()})
    tag_ids = tags.label2id
    inside_of = {
        tag_ids[name]: tag_ids["I-" + name[2:]]
        for name in tags.names
        if name.startswith("B-") and "I-" + name[2:] in tag_ids
    }
    prepared = {"problem_type": "token_classification", "num_labels": len(tags.names), "label_names": tags.names}
    for split, sentences in splits.items():
        encoded = tokenizer(
            [s["tokens"] for s in sentences], is_split_into_words=True, truncation=True, max_length=args.max_length
        )
        prepared[split] = {
            "input_ids": encoded["input_ids"],
            "labels": [
                align_tags(encoded.word_ids(i), [tag_ids[t] for t in s["ner_tags"]], inside_of, label_all_tokens=False)
                for i, s in enumerate(sentences)
            ],
        }
    prepared["about"] = f"CoNLL-2003 sentences, train {len(splits['train'])} / test {len(splits['test'])}"
    return prepared


def prepare_lm(args: BenchmarkArguments, tokenizer) -> dict:
    """WikiText-2 valid as the training stream, test as the evaluation stream, in blocks of `lm_block_size`."""
    data = Path(args.data_dir) / "wikitext-2"
    prepared = {"problem_type": "causal_lm", "about": "trained on WikiText-2 valid, evaluated on WikiText-2 test"}
    for split, file in (("train", "valid.txt"), ("test", "test.txt")):
        lines = [line.strip() for line in (data / file).read_text(encoding="utf-8").splitlines() if line.strip()]
        # One end-of-line token per line, as the published word counts do.
        words = sum(len(line.split()) + 1 for line in lines)
        ids = []
        for encoded in tokenizer([line.replace("<unk>", "[UNK]") for line in lines], add_special_tokens=False)[
            "input_ids"
        ]:
            ids.extend(encoded + [tokenizer.sep_token_id])
        size = args.lm_block_size
        blocks = [ids[start : start + size] for start in range(0, len(ids) - size + 1, size)]
        prepared[split] = {"input_ids": blocks, "words": words * len(blocks) * size / len(ids), "tokens": len(ids)}
    return prepared


def training_texts(args: BenchmarkArguments) -> list[str]:
    """The text the shared WordPiece vocabulary is learned from: training splits only."""
    from ran_hf.files.data import read_conll, read_records

    data = Path(args.data_dir)
    texts = [r["text"] for r in read_records(data / "hyperpartisan" / "train.jsonl")]
    texts += [r["text"] for r in read_records(data / "20newsgroups" / "train.jsonl.gz", limit=4000)]
    texts += [r["text"] for r in read_records(data / "eurlex57k" / "train.jsonl.gz", limit=4000)]
    texts += [" ".join(s["tokens"]) for s in read_conll(data / "conll2003" / "train.txt")]
    texts += (data / "wikitext-2" / "valid.txt").read_text(encoding="utf-8").replace("<unk>", "[UNK]").splitlines()
    return texts


def prepare_data(args: BenchmarkArguments, tasks: list[str]) -> dict[str, Path]:
    """Tokenizer and tokenized tasks, cached under --cache_dir (keyed by the settings that shape them)."""
    from train_tokenizer import TokenizerArguments, build_tokenizer
    from transformers import AutoTokenizer

    def digest(names) -> str:
        return hashlib.sha256(json.dumps({name: getattr(args, name) for name in names}).encode()).hexdigest()[:10]

    # The vocabulary depends on the data and its size only, so other settings never retrain it.
    cache = Path(args.cache_dir) / digest(("data_dir", "vocab_size", "tokenizer_name"))
    cache.mkdir(parents=True, exist_ok=True)
    shaping = digest(
        (
            "max_length",
            "probe_length",
            "probe_fillers",
            "window_size",
            "lm_block_size",
            "train_documents",
            "test_documents",
            "eurlex_labels",
            "probe_train_documents",
            "probe_test_documents",
        )
    )
    tokenizer_dir = args.tokenizer_name or cache / "tokenizer"
    if args.tokenizer_name is None and not (tokenizer_dir / "tokenizer.json").is_file():
        logger.info("Learning a %d-piece WordPiece vocabulary from the training splits", args.vocab_size)
        tokenizer_args = TokenizerArguments(train_files=[], output_dir=str(tokenizer_dir), vocab_size=args.vocab_size)
        build_tokenizer(tokenizer_args, training_texts(args)).save_pretrained(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    paths = {}
    for task in {("hyperpartisan" if task == "window_study" else task) for task in tasks}:
        path = cache / f"{task}-{shaping}.pt"
        if not path.is_file():
            logger.info("Preparing %s", task)
            if task == "conll":
                prepared = prepare_conll(args, tokenizer)
            elif task == "lm":
                prepared = prepare_lm(args, tokenizer)
            else:
                prepared = prepare_classification(task, args, tokenizer)
            prepared["vocab_size"] = len(tokenizer)
            temporary = path.with_suffix(".tmp")
            torch.save(prepared, temporary)
            temporary.replace(path)  # never a half-written cache file
        paths[task] = path
    paths["window_study"] = paths.get("hyperpartisan")
    return paths


# ---------------------------------------------------------------------------------------------------------------------
# Models at matched size
# ---------------------------------------------------------------------------------------------------------------------


def sequence_problem_type(task: dict) -> str | None:
    """Transformers' `problem_type` of a sequence classification task (None for tagging and language modelling)."""
    kinds = ("single_label_classification", "multi_label_classification")
    return task["problem_type"] if task["problem_type"] in kinds else None


def ran_config(args: BenchmarkArguments, task: dict, model: str, window: int, **overrides):
    from ran_hf import RANConfig

    variant = dict(RAN_VARIANTS.get(model, {}))
    if "window_overlap" in variant:
        variant["window_overlap"] = min(args.window_overlap, window // 2)
    return RANConfig(
        vocab_size=task["vocab_size"],
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        head_dim=args.hidden_size // args.num_heads,
        window_size=window,
        min_window_size=max(1, min(16, window // 8)),
        hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout,
        num_labels=task.get("num_labels", 2),
        problem_type=sequence_problem_type(task),
        **variant,
        **overrides,
    )


def official_causal_scan(cell_scan, weights, cell, previous_raw, keys, values, layout):
    """The official causal design: the cell sits at position 0 under the triangular mask, so it reads only itself."""
    # The scan sees windows without token slots: the cell's attention is over itself alone.
    blind = dataclasses.replace(layout, slot_mask=layout.slot_mask[:, :0])
    return reference_cell_scan(cell_scan, weights, cell, previous_raw, keys[:, :, :0], values[:, :, :0], blind)


RANScanInterface.register(OFFICIAL_CAUSAL_SCAN, official_causal_scan)


def transformer_config(config_class, args: BenchmarkArguments, task: dict, **extra):
    return config_class(
        vocab_size=task["vocab_size"],
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        intermediate_size=4 * args.hidden_size,
        hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout,
        num_labels=task.get("num_labels", 2),
        problem_type=sequence_problem_type(task),
        pad_token_id=0,
        **extra,
    )


def matched_width(build, target: int) -> int:
    """The hidden width whose model has the non-embedding parameter count closest to `target`."""
    return min(range(4, 513, 2), key=lambda width: abs(count_parameters(build(width)) - target))


def build_model(name: str, task_name: str, task: dict, args: BenchmarkArguments, window: int | None = None):
    import transformers

    from ran_hf import RANForCausalLM, RANForSequenceClassification, RANForTokenClassification

    tagging = task["problem_type"] == "token_classification"
    if task_name == "lm":
        if name == "llama":
            ran = build_model("ran-causal", task_name, task, args)
            sizes = (task["vocab_size"], args.hidden_size, args.num_layers, args.num_heads, args.lm_block_size)
            # Matched without the token embeddings and the output layer (RAN: `decoder`, its own; Llama: tied).
            size = functools.partial(
                count_parameters, exclude=("embed_tokens", "word_embeddings", "lm_head", "decoder")
            )
            return matched_llama(*sizes, head_dim=ran.config.head_dim, target=size(ran), size=size)
        official = name == "ran-causal-official"
        fields = dict(LANGUAGE_MODELS[name])
        if "training_window_sizes" in fields:
            window = args.lm_window_size
            drawn = sorted({max(window // 4, 2), max(window // 2, 2), window})
            fields["training_window_sizes"] = [window] if name == "ran-causal-one-window" else drawn
        config = ran_config(args, task, "ran", args.lm_window_size, is_causal=True, **fields)
        model = RANForCausalLM(config)
        if official:
            for layer in model.model.layers:
                # A cell that reads only itself stays exactly zero from a zero start, where the normalisations'
                # gradients scale by 1 / sqrt(eps) per step and overflow; a random start carries no text either.
                torch.nn.init.normal_(layer.initial_cell.data)
        return model
    if name in RAN_VARIANTS:
        default_window = args.ner_window_size if tagging else args.window_size
        config = ran_config(args, task, name, window or default_window)
        return (RANForTokenClassification if tagging else RANForSequenceClassification)(config)
    max_length = args.probe_length if task_name == "probe" else args.max_length
    if name == "longformer":
        attention_window = args.ner_window_size if tagging else args.window_size
        config = transformer_config(
            transformers.LongformerConfig,
            args,
            task,
            attention_window=attention_window,
            max_position_embeddings=max_length + attention_window + 2,
        )
        auto = (
            transformers.LongformerForTokenClassification
            if tagging
            else transformers.LongformerForSequenceClassification
        )
        return auto(config)
    if name == "bert-512":
        config = transformer_config(transformers.BertConfig, args, task, max_position_embeddings=BERT_MAX_LENGTH)
        auto = transformers.BertForTokenClassification if tagging else transformers.BertForSequenceClassification
        return auto(config)

    # Recurrent baselines: width searched so that their parameters match RAN's (embeddings excluded).
    target = count_parameters(build_model("ran", task_name, task, args))
    common = {
        "vocab_size": task["vocab_size"],
        "embedding_size": args.hidden_size,
        "num_labels": task["num_labels"],
        "dropout": args.dropout,
    }
    if tagging:
        build = lambda width: BiLSTMForTokenClassification(**common, hidden_size=width)  # noqa: E731
    else:
        extra = {"problem_type": task["problem_type"]}
        if name != "bilstm":
            extra["slice_length"] = args.slice_length
        if name == "bpie-bisrnn":
            extra["enrichment"] = args.enrichment
        build = lambda width: baseline_for(name, **common, **extra, hidden_size=width)  # noqa: E731
    return build(matched_width(build, target))


# Where the ablations run: the paper ablates on one dataset (Table 4); on CPU they run on Hyperpartisan and
# 20 Newsgroups, and the two that bear on long-range memory also on the probe (EURLEX is the costliest task).
ABLATION_TASKS = {
    "ran-mean-pooling": ("hyperpartisan", "20newsgroups"),
    "ran-no-rotary": ("hyperpartisan", "20newsgroups"),
    "ran-no-cell-residual": ("hyperpartisan", "20newsgroups", "probe"),
    "ran-no-memory-review": ("hyperpartisan", "20newsgroups", "probe"),
}


def models_for(task: str, args: BenchmarkArguments) -> list[str]:
    names = {"conll": TAGGERS, "lm": LANGUAGE_MODELS, "window_study": ("ran",)}.get(task, CLASSIFIERS)
    names = [name for name in names if task in ABLATION_TASKS.get(name, (task,))]
    return [name for name in names if args.models is None or name in args.models]


def reuses_classification_run(task: str, window: int | None, args: BenchmarkArguments) -> bool:
    """The window study's point at the default window is the Hyperpartisan run of RAN: it is not trained twice."""
    return (
        task == "window_study"
        and window == args.window_size
        and "hyperpartisan" in args.tasks
        and "ran" in models_for("hyperpartisan", args)
    )


def with_window_study_reuse(results: list[dict], args: BenchmarkArguments) -> list[dict]:
    if not any(reuses_classification_run("window_study", window, args) for window in args.study_windows):
        return results
    reused = [
        {**result, "task": "window_study", "model": f"ran-w{args.window_size}", "window": args.window_size}
        for result in results
        if result["task"] == "hyperpartisan" and result["model"] == "ran"
    ]
    return results + reused


# ---------------------------------------------------------------------------------------------------------------------
# One run: train for the budget, evaluate once
# ---------------------------------------------------------------------------------------------------------------------


def batches(split: dict, batch_size: int, steps: int, seed: int, max_length: int | None):
    """`steps` batches drawn epoch by epoch in a seeded order (the same for every model), right-padded."""
    rng = random.Random(seed)
    order = []
    while len(order) < steps * batch_size:
        epoch = list(range(len(split["input_ids"])))
        rng.shuffle(epoch)
        order.extend(epoch)
    for step in range(steps):
        yield collate(split, order[step * batch_size : (step + 1) * batch_size], max_length)


def collate(split: dict, indices: list[int], max_length: int | None) -> dict:
    rows = [split["input_ids"][i][:max_length] for i in indices]
    width = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "labels" in split:
        labels = [split["labels"][i] for i in indices]
        if isinstance(labels[0], list) and isinstance(labels[0][0], int):  # token tags
            tags = torch.full((len(rows), width), -100, dtype=torch.long)
            for row, row_tags in enumerate(labels):
                row_tags = row_tags[:width]
                tags[row, : len(row_tags)] = torch.tensor(row_tags)
            batch["labels"] = tags
        else:
            batch["labels"] = torch.tensor(labels)
    else:  # language modelling
        batch["labels"] = input_ids.masked_fill(attention_mask == 0, -100)
    return batch


@torch.no_grad()
def stream_nll(model, blocks: list[list[int]], device) -> float:
    """Summed loss over the same tokens as the block-wise evaluation, with the `RANCache` carried from each block to
    the next: the text before a block is remembered, not cut off."""
    cache, total = None, 0.0
    for block in blocks:
        ids = torch.tensor([block], device=device)
        outputs = model(ids, labels=ids, past_key_values=cache, use_cache=True)
        total += outputs.loss.item() * (len(block) - 1)
        cache = outputs.past_key_values
    return total


def evaluate_model(model, task: dict, task_name: str, max_length: int | None, device, limit: int | None) -> dict:
    from run_classification import classification_metrics
    from run_ner import load_seqeval

    model.eval()
    split = task["test"]
    if task_name == "lm":
        words_per_token = split["words"] / (len(split["input_ids"]) * len(split["input_ids"][0]))
    if limit is not None:
        split = {key: value[:limit] if isinstance(value, list) else value for key, value in split.items()}
    logits, losses = [], []
    with torch.no_grad():
        for start in range(0, len(split["input_ids"]), 16):
            indices = list(range(start, min(start + 16, len(split["input_ids"]))))
            batch = {key: value.to(device) for key, value in collate(split, indices, max_length).items()}
            outputs = model(**batch)
            if task_name == "lm":
                losses.append(outputs.loss.item() * len(indices))
            elif task["problem_type"] == "token_classification":
                logits.extend(
                    (row[mask.bool()], labels[mask.bool()])
                    for row, mask, labels in zip(
                        outputs.logits.argmax(-1).cpu(), batch["attention_mask"].cpu(), batch["labels"].cpu()
                    )
                )
            else:
                logits.append(outputs.logits.float().cpu())
    if task_name == "lm":
        # Each block's loss is a mean over its (block - 1) predicted tokens.
        blocks = len(split["input_ids"])
        predicted = blocks * (len(split["input_ids"][0]) - 1)
        total_nll = sum(losses) * (len(split["input_ids"][0]) - 1)
        words = words_per_token * predicted
        metrics = {"perplexity": math.exp(total_nll / predicted), "word_perplexity": math.exp(total_nll / words)}
        if getattr(model.config, "model_type", None) == "ran":
            metrics["stream_perplexity"] = math.exp(stream_nll(model, split["input_ids"], device) / predicted)
        return metrics
    if task["problem_type"] == "token_classification":
        names = task["label_names"]
        predictions = [[names[p] for p, g in zip(pred, gold) if g != -100] for pred, gold in logits]
        references = [[names[g] for g in gold if g != -100] for _, gold in logits]
        scores = load_seqeval()(predictions=predictions, references=references)
        return {
            "f1": scores["overall_f1"],
            "precision": scores["overall_precision"],
            "recall": scores["overall_recall"],
        }
    labels = np.array(split["labels"])
    multi_label = task["problem_type"] == "multi_label_classification"
    return classification_metrics(torch.cat(logits).numpy(), labels, multi_label, threshold=0.5)


def run_once(spec: dict) -> dict:
    """Train one model on one task for the budget and evaluate it: runs in a worker process."""
    args = BenchmarkArguments(**spec["args"])
    if spec["task"] == "probe":  # a noiseless synthetic task: dropout only slows every model down
        args = dataclasses.replace(args, dropout=0.0)
    torch.set_num_threads(args.threads_per_worker)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    task_name, model_name, seed, window = spec["task"], spec["model"], spec["seed"], spec.get("window")
    task = torch.load(spec["data"], weights_only=False)
    device = torch.device(args.device)

    torch.manual_seed(seed)
    model = build_model(model_name, task_name, task, args, window=window).to(device)
    # BERT reads the first 512 tokens; every other model the whole (up to --max_length) document.
    max_length = BERT_MAX_LENGTH if model_name == "bert-512" else None
    steps = args.steps("hyperpartisan" if task_name == "window_study" else task_name)
    batch_size = args.batch_size * (2 if task_name == "conll" else 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, max(0.0, (steps - step) / (steps - warmup + 1)))
    )

    model.train()
    losses, tokens, started = [], 0, time.perf_counter()
    for batch in batches(task["train"], batch_size, steps, seed, max_length):
        batch = {key: value.to(device) for key, value in batch.items()}
        loss = model(**batch).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{model_name} on {task_name}: loss became {loss.item()} at step {len(losses)}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += int(batch["attention_mask"].sum())
    train_seconds = time.perf_counter() - started

    metrics = evaluate_model(model, task, task_name, max_length, device, args.test_limit)
    documents = len(task["train"]["input_ids"])
    return {
        "task": task_name,
        "model": model_name if window is None else f"ran-w{window}",
        "window": window,
        "seed": seed,
        "metrics": metrics,
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameters_without_embeddings": count_parameters(model),
        "steps": steps,
        "batch_size": batch_size,
        "train_tokens": tokens,
        "train_seconds": train_seconds,
        "seconds_per_epoch": train_seconds * documents / (steps * batch_size),
        "first_loss": float(np.mean(losses[: max(1, steps // 10)])),
        "last_loss": float(np.mean(losses[-max(1, steps // 10) :])),
        "about": task["about"],
        "key": spec["key"],
    }


# ---------------------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------------------


def plan_runs(args: BenchmarkArguments, data: dict[str, Path]) -> list[dict]:
    runs = []
    for task in args.tasks:
        windows = args.study_windows if task == "window_study" else [None]
        for model in models_for(task, args):
            for window in windows:
                if reuses_classification_run(task, window, args):
                    continue
                for seed in args.seeds:
                    spec = {"task": task, "model": model, "seed": seed, "window": window, "data": str(data[task])}
                    spec["args"] = dataclasses.asdict(args)
                    # Runs are recognised by everything that shapes them, not by what only says where to write.
                    shaping = {
                        k: v
                        for k, v in spec["args"].items()
                        if k not in ("tasks", "models", "seeds", "workers", "output_dir", "output_name", "overwrite")
                    }
                    spec["key"] = hashlib.sha256(
                        json.dumps([task, model, seed, window, shaping], sort_keys=True).encode()
                    ).hexdigest()[:16]
                    runs.append(spec)
    return runs


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    (args,) = HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses(args=argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    runs_file = output_dir / f"{args.output_name}_runs.jsonl"
    if args.overwrite and runs_file.exists():
        runs_file.unlink()

    info = machine_info(args.device)
    data = prepare_data(args, args.tasks)
    runs = plan_runs(args, data)
    done = set()
    if runs_file.exists():
        done = {json.loads(line)["key"] for line in runs_file.read_text().splitlines() if line.strip()}
    todo = [run for run in runs if run["key"] not in done]
    logger.info(
        "%d runs planned, %d already recorded in %s, %d to go", len(runs), len(runs) - len(todo), runs_file, len(todo)
    )

    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.workers, maxtasksperchild=1) as pool, runs_file.open("a") as sink:
        progress = tqdm(pool.imap_unordered(run_once, todo), total=len(todo), desc="runs", unit="run")
        for result in progress:
            result["machine"] = info
            sink.write(json.dumps(result) + "\n")
            sink.flush()
            main_metric = next(iter(result["metrics"].items()))
            progress.write(
                f"{result['task']:>14} {result['model']:>22} seed {result['seed']}: "
                f"{main_metric[0]} {main_metric[1]:.4f} ({result['train_seconds']:.0f} s)"
            )
    logger.info("Ran %d runs in %.1f min", len(todo), (time.perf_counter() - started) / 60)

    keys = {run["key"] for run in runs}
    results = [json.loads(line) for line in runs_file.read_text().splitlines() if line.strip()]
    results = with_window_study_reuse([result for result in results if result["key"] in keys], args)
    return write_report(results, args, info, output_dir / args.output_name, command_line(__file__, argv))


if __name__ == "__main__":
    main()
