#!/usr/bin/env python
"""The whole job in one command: train a tokenizer, pretrain a small RAN with masked language modelling, fine-tune it
on long-document classification, evaluate it, and save it with its code and model card.

    python scripts/run_pipeline.py                                   # built-in synthetic data, a few minutes on CPU
    python scripts/run_pipeline.py --train_file ../shared/data/hyperpartisan/train.jsonl \\
        --validation_file ../shared/data/hyperpartisan/dev.jsonl --test_file ../shared/data/hyperpartisan/test.jsonl \\
        --output_dir outputs/pipeline-hyperpartisan
    python scripts/run_pipeline.py --dataset_name <hub dataset> --text_column_name text --label_column_name label

Steps, each one of the example scripts run in the same process (so every flag they document also works when running
them alone): `train_tokenizer.py` on the training texts -> `language-modeling/run_mlm.py` from scratch on the training
texts -> `text-classification/run_classification.py` from that checkpoint (train, validation, test). Everything lands
under `--output_dir`: `tokenizer/`, `mlm/`, `classifier/` (the final model: weights, `modeling_ran.py`, tokenizer,
README.md model card, metrics as JSON), `pipeline_results.json` and, for the built-in data, `data/`. Tokenizer training
is not bit-reproducible (huggingface/tokenizers issue 1794); `--tokenizer_name` reuses a tokenizer for identical
reruns.

Built-in data (no network needed): synthetic "topic documents", written by `write_topic_documents`. Every document
is 25 to 45 sentences (300 to 550 tokens) built from one shared filler vocabulary, into which 4 to 8 words of one of
six topic word lists (astronomy, cooking, football, finance, medicine, sailing) are mixed, never in the first quarter
of the document; the label is that topic. The opening window of a document therefore never shows its label, and a
model reading only the start of a document cannot classify it. These documents are generated, not real text: they
check the plumbing and that a RAN learns a decision spread over a whole document, nothing about language.
"""

import json
import logging
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import train_tokenizer
from argument_checks import check_ranges, parse_arguments
from datasets import get_dataset_split_names, load_dataset
from huggingface_hub.errors import StrictDataclassError

from ran_hf import RANConfig


# The example scripts it runs, each in its task folder (in the style of Transformers' examples/pytorch/<task>/).
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "language-modeling"), str(HERE / "text-classification")]

import run_classification  # noqa: E402
import run_mlm  # noqa: E402


logger = logging.getLogger(__name__)

TOPICS = {
    "astronomy": "planet star galaxy telescope orbit comet nebula asteroid moon eclipse meteor crater cosmos "
    "supernova quasar observatory astronaut satellite rocket solar lunar gravity spectrum constellation",
    "cooking": "recipe oven flour butter garlic onion simmer roast pepper sauce kitchen spoon dough bake salt "
    "skillet broth herb vinegar whisk grill pastry chef olive",
    "football": "goal striker referee stadium penalty midfielder goalkeeper league match tackle dribble corner "
    "offside coach fans tournament header pitch defender kickoff trophy whistle jersey score",
    "finance": "market stock bond investor dividend portfolio inflation interest bank loan equity revenue profit "
    "currency audit budget credit asset broker hedge merger shares tax earnings",
    "medicine": "patient doctor surgery vaccine clinic diagnosis symptom therapy nurse hospital dose infection "
    "fever antibiotic tumor scan prescription pulse allergy cardiology recovery virus wound ward",
    "sailing": "boat sail harbor anchor mast keel wind tide captain deck rudder voyage crew island compass "
    "storm knot ocean port hull yacht regatta lighthouse coast",
}
FILLER = {
    "determiner": ["the", "a", "this", "that", "every", "another", "each", "some"],
    "adjective": [
        "old",
        "new",
        "quiet",
        "bright",
        "small",
        "large",
        "early",
        "late",
        "strange",
        "simple",
        "careful",
        "busy",
        "open",
        "famous",
        "curious",
        "rare",
        "common",
        "long",
        "short",
        "gentle",
    ],
    "noun": [
        "report",
        "story",
        "morning",
        "week",
        "plan",
        "question",
        "answer",
        "group",
        "member",
        "city",
        "village",
        "road",
        "window",
        "letter",
        "meeting",
        "evening",
        "record",
        "picture",
        "journey",
        "problem",
        "idea",
        "friend",
        "family",
        "teacher",
        "student",
        "season",
    ],
    "verb": [
        "describes",
        "mentions",
        "follows",
        "shows",
        "changes",
        "reaches",
        "explains",
        "remembers",
        "considers",
        "discusses",
        "includes",
        "suggests",
        "watches",
        "meets",
        "finds",
        "visits",
    ],
    "preposition": ["about", "near", "after", "before", "during", "with", "without", "beyond", "around", "across"],
    "connector": ["and", "then", "meanwhile", "however", "also", "still", "later"],
}


def write_topic_documents(folder: Path, sizes: dict[str, int], seed: int = 0) -> dict[str, Path]:
    """Write `{split}.jsonl` files of synthetic topic documents (`{"text", "label"}`); see the module docstring."""
    rng = random.Random(seed)
    topic_words = {topic: words.split() for topic, words in TOPICS.items()}
    folder.mkdir(parents=True, exist_ok=True)

    def sentence(object_word: str) -> str:
        words = [rng.choice(FILLER[kind]) for kind in ("determiner", "adjective", "noun", "verb", "determiner")]
        words += [object_word, rng.choice(FILLER["connector"]), rng.choice(FILLER["verb"])]
        words += [rng.choice(FILLER["determiner"]), rng.choice(FILLER["noun"])]
        return " ".join(words).capitalize() + "."

    def document(topic: str) -> dict:
        num_sentences = rng.randint(25, 45)
        # A handful of topic words, none in the first quarter of the document.
        mentions = set(rng.sample(range(num_sentences // 4, num_sentences), rng.randint(4, 8)))
        sentences = [
            sentence(rng.choice(topic_words[topic]) if index in mentions else rng.choice(FILLER["noun"]))
            for index in range(num_sentences)
        ]
        return {"text": " ".join(sentences), "label": topic}

    paths = {}
    for split, size in sizes.items():
        paths[split] = folder / f"{split}.jsonl"
        topics = [sorted(topic_words)[index % len(topic_words)] for index in range(size)]  # balanced classes
        rng.shuffle(topics)
        with paths[split].open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(document(topic)) + "\n" for topic in topics)
    return paths


@dataclass
class PipelineArguments:
    output_dir: str = field(default="outputs/pipeline", metadata={"help": "Folder for everything the pipeline makes."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Run again into an --output_dir that holds an earlier pipeline's models, replacing them."},
    )
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset instead of files or built-in data."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of the Hub dataset."})
    train_file: str | None = field(default=None, metadata={"help": "Training documents (jsonl(.gz), csv, tsv)."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation documents."})
    test_file: str | None = field(default=None, metadata={"help": "Test documents."})
    text_column_name: str = field(default="text", metadata={"help": "Column with the text."})
    label_column_name: str = field(default="label", metadata={"help": "Column with the label(s)."})
    synthetic_documents: str = field(
        default="600,150,150", metadata={"help": "Built-in data: train,validation,test document counts."}
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": "An existing tokenizer to use instead of training one (training is not bit-reproducible: "
            "huggingface/tokenizers issue 1794)."
        },
    )
    vocab_size: int = field(
        default=8000, metadata={"at_least": 6, "help": "Tokenizer vocabulary (WordPiece, lower-cased)."}
    )
    hidden_size: int = field(default=64, metadata={"at_least": 1, "help": "Model width."})
    num_hidden_layers: int = field(default=2, metadata={"at_least": 1, "help": "RAN layers."})
    num_attention_heads: int = field(
        default=4, metadata={"at_least": 1, "help": "Attention heads (head size = width / heads)."}
    )
    window_size: int = field(default=64, metadata={"at_least": 2, "help": "Tokens per window."})
    dropout: float = field(
        default=0.0,
        metadata={
            "at_least": 0,
            "below": 1,
            "help": "Hidden and attention dropout. The paper uses 0.1; a small RAN trained for minutes learns much "
            "faster without (its pooler takes a max over all token states, where dropout noise competes with sparse "
            "evidence).",
        },
    )
    max_seq_length: int = field(
        default=4096, metadata={"at_least": 1, "help": "Documents are cut to this many tokens."}
    )
    mlm_epochs: float = field(
        default=2.0, metadata={"above": 0, "help": "Epochs of masked-language-model pretraining."}
    )
    mlm_learning_rate: float = field(default=1e-3, metadata={"above": 0, "help": "Pretraining learning rate."})
    epochs: float = field(default=6.0, metadata={"above": 0, "help": "Epochs of fine-tuning."})
    learning_rate: float = field(default=1e-3, metadata={"above": 0, "help": "Fine-tuning learning rate."})
    batch_size: int = field(
        default=8, metadata={"at_least": 1, "help": "Documents per batch, pretraining and fine-tuning."}
    )
    seed: int = field(
        default=0,
        metadata={
            "at_least": 0,
            "below": 4294967296,
            "help": "Seed for data generation, initialisation and training.",
        },
    )
    torch_threads: int = field(
        default=1,
        metadata={
            "at_least": 0,
            "help": "CPU threads; a small model is fastest on one (0: PyTorch's default, all cores).",
        },
    )
    report_to: str = field(default="none", metadata={"help": "Experiment tracker for Trainer (`none`, `wandb`, ...)."})

    def __post_init__(self):
        """What the steps would find wrong only after the tokenizer was trained and the model pretrained."""
        check_ranges(self)  # first: the checks below combine flags
        for flag in ("train_file", "validation_file", "test_file"):
            path = getattr(self, flag)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--{flag} {path} does not exist or is not a file.")
        for parent in (Path(self.output_dir), *Path(self.output_dir).parents):
            if parent.exists() and not parent.is_dir():
                raise ValueError(f"--output_dir {self.output_dir}: {parent} is a file. Give the path of a folder.")
        if self.dataset_name is None and self.train_file is None:
            self.document_counts()
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden_size ({self.hidden_size}) must be a multiple of --num_attention_heads "
                f"({self.num_attention_heads}): each head gets hidden_size / num_attention_heads dimensions."
            )
        try:
            RANConfig(**self.model_fields())
        except (ValueError, StrictDataclassError) as error:
            reason = error.__cause__ if isinstance(error, StrictDataclassError) else error  # `@strict`'s: the rule
            raise ValueError(
                f"--hidden_size, --num_attention_heads and --window_size give no valid model: {reason}"
            ) from None

    def model_fields(self) -> dict:
        """The RANConfig fields of the model the pipeline pretrains (its --config_overrides)."""
        return {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "head_dim": self.hidden_size // self.num_attention_heads,
            "window_size": self.window_size,
            "min_window_size": max(1, self.window_size // 8),
            "hidden_dropout_prob": self.dropout,
            "attention_probs_dropout_prob": self.dropout,
        }

    def document_counts(self) -> dict[str, int]:
        """--synthetic_documents as {split: count}."""
        counts = self.synthetic_documents.split(",")
        if len(counts) != 3 or not all(count.strip().isdigit() and int(count) > 0 for count in counts):
            raise ValueError(
                f"--synthetic_documents must be three positive counts, train,validation,test (e.g. 600,150,150), "
                f"got {self.synthetic_documents!r}."
            )
        return dict(zip(("train", "validation", "test"), map(int, counts)))


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO, stream=sys.stdout
    )
    (args,) = parse_arguments(PipelineArguments, argv)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    start = time.perf_counter()
    output_dir = Path(args.output_dir)
    data = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
    # Checked before the tokenizer is retrained: the steps would refuse one by one, after the new tokenizer had
    # already replaced the one the earlier models were trained with.
    steps = (output_dir / "mlm", output_dir / "classifier")
    earlier = [folder for folder in steps if folder.is_dir() and any(folder.iterdir())]
    if earlier and not args.overwrite_output_dir:
        raise ValueError(
            f"{output_dir} holds an earlier pipeline's models ({', '.join(str(folder) for folder in earlier)}). Pass "
            "--overwrite_output_dir to replace them, or choose another --output_dir."
        )
    overwrite = ["--overwrite_output_dir"] if args.overwrite_output_dir else []

    # 1. Data: the user's, or generated (written once every step's flags are checked)
    synthetic = args.dataset_name is None and args.train_file is None
    if synthetic:
        data = {split: str(output_dir / "data" / f"{split}.jsonl") for split in args.document_counts()}
    if args.dataset_name:
        source = ["--dataset_name", args.dataset_name]
        source += ["--dataset_config_name", args.dataset_config_name] if args.dataset_config_name else []
        mlm_source = source
        available = get_dataset_split_names(args.dataset_name, args.dataset_config_name)
        has = {split: split in available for split in data}
    else:
        source = [arg for split, path in data.items() if path for arg in (f"--{split}_file", path)]
        mlm_source = ["--train_file", data["train"]]  # 5% of it held out to report the masked-LM perplexity
        has = {split: bool(data[split]) for split in data}
    common = ["--seed", str(args.seed), "--report_to", args.report_to, "--save_strategy", "no", *overwrite]
    tokenizer_dir = args.tokenizer_name or str(output_dir / "tokenizer")
    overrides = ",".join(f"{name}={value}" for name, value in args.model_fields().items())
    mlm_dir, classifier_dir = output_dir / "mlm", output_dir / "classifier"
    mlm_argv = (
        mlm_source
        + ["--tokenizer_name", tokenizer_dir, "--config_overrides", overrides]
        + ["--text_column_name", args.text_column_name, "--max_seq_length", "512"]
        + ["--do_train", "--do_eval", "--output_dir", str(mlm_dir), "--run_name", f"ran-{output_dir.name}-mlm"]
        + ["--num_train_epochs", str(args.mlm_epochs)]
        + ["--learning_rate", str(args.mlm_learning_rate), "--warmup_steps", "0.1", "--weight_decay", "0.01"]
        + ["--per_device_train_batch_size", str(args.batch_size), "--logging_steps", "20"]
        + common
    )
    classification_argv = (
        source
        + ["--model_name_or_path", str(mlm_dir), "--text_column_name", args.text_column_name]
        + ["--label_column_name", args.label_column_name, "--max_seq_length", str(args.max_seq_length)]
        + ["--do_train"]
        + (["--do_eval"] if has["validation"] else [])
        + (["--do_predict"] if has["test"] else [])
        + ["--output_dir", str(classifier_dir), "--run_name", f"ran-{output_dir.name}"]
        + ["--num_train_epochs", str(args.epochs)]
        + ["--learning_rate", str(args.learning_rate), "--warmup_steps", "0.1", "--weight_decay", "0.01"]
        + ["--per_device_train_batch_size", str(args.batch_size), "--train_sampling_strategy", "group_by_length"]
        + ["--logging_steps", "20"]
        + common
    )
    # Every step's flags (--report_to, say), parsed and checked now, not after the tokenizer and the pretraining
    for script, step_argv in ((run_mlm, mlm_argv), (run_classification, classification_argv)):
        parse_arguments((script.ModelArguments, script.DataTrainingArguments, script.RANTrainingArguments), step_argv)
    if synthetic:
        write_topic_documents(output_dir / "data", args.document_counts(), args.seed)
        logger.info(f"Wrote synthetic topic documents to {output_dir / 'data'}")

    # 2. Tokenizer, on the training texts (a Hub dataset: first exported to a file)
    if args.tokenizer_name is None:
        tokenizer_files = [data["train"]] if not args.dataset_name else [export_texts(args, output_dir / "data")]
        train_tokenizer.main(
            ["--train_files", *tokenizer_files, "--text_column_name", args.text_column_name]
            + ["--vocab_size", str(args.vocab_size), "--output_dir", tokenizer_dir]
            + ["--overwrite_output_dir"]  # no earlier models were trained with it (checked above), or replacing them
        )

    # 3. Masked-language-model pretraining from scratch, on the training texts
    mlm = run_mlm.main(mlm_argv)

    # 4. Fine-tuning on classification, evaluation and test predictions
    classification = run_classification.main(classification_argv)

    # 5. Report
    wall_time = time.perf_counter() - start
    summary = {
        "output_dir": str(classifier_dir.resolve()),
        "labels": classification["labels"],
        "mlm_perplexity": mlm.get("eval", {}).get("perplexity"),
        "validation": {
            k: v for k, v in classification.get("eval", {}).items() if k.startswith("eval_") and "_per_" not in k
        },
        "test": {
            k: v for k, v in classification.get("test", {}).items() if k.startswith("test_") and "_per_" not in k
        },
        "wall_time_s": round(wall_time, 1),
    }
    (output_dir / "pipeline_results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n==== RAN pipeline finished in {wall_time:.0f} s ====")
    print(f"masked-LM perplexity (held-out training text): {summary['mlm_perplexity']:.2f}")
    for split in ("validation", "test"):
        if summary[split]:
            shown = ", ".join(
                f"{k.split('_', 1)[1]} {v:.4f}"
                for k, v in summary[split].items()
                if k.split("_", 1)[1] in ("accuracy", "macro_f1", "micro_f1", "loss")
            )
            print(f"{split}: {shown}")
    print(f"classifier saved to {summary['output_dir']} (model card: README.md, metrics: all_results.json)")
    print(
        "load it anywhere with:\n"
        "  from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        f"  model = AutoModelForSequenceClassification.from_pretrained({summary['output_dir']!r}, "
        "trust_remote_code=True)\n"
        f"  tokenizer = AutoTokenizer.from_pretrained({summary['output_dir']!r})"
    )
    return summary


def export_texts(args: PipelineArguments, folder: Path) -> str:
    """The training texts of a Hub dataset as a jsonl file, for the tokenizer trainer."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer_texts.jsonl"
    train = load_dataset(args.dataset_name, args.dataset_config_name, split="train")
    with path.open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({args.text_column_name: text}) + "\n" for text in train[args.text_column_name])
    return str(path)


if __name__ == "__main__":
    main()
