#!/usr/bin/env python
"""Train a WordPiece or byte-level BPE tokenizer for RAN from text files, with `[PAD]` as id 0.

    python scripts/train_tokenizer.py --train_files corpus.txt more.jsonl.gz --vocab_size 8000 --output_dir tok
    python scripts/train_tokenizer.py --train_files ../shared/data/conll2003/train.txt --conll --output_dir tok

Files are read with `ran_hf.files.data` (plain text one document per line, jsonl / jsonl.gz / csv with a text column,
or CoNLL with `--conll`), through `datasets` into Arrow; `--max_documents N` reads only the first N of each file. The
saved folder loads with `AutoTokenizer.from_pretrained`. Special tokens, in id order: [PAD] [UNK] [CLS] [SEP] [MASK];
a single text becomes `[CLS] text [SEP]`, a pair `[CLS] a [SEP] b [SEP]`.
"""

import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from argument_checks import parse_arguments
from datasets import Dataset, concatenate_datasets
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from ran_hf.files.data import check_columns, check_texts, load_records, read_conll, read_records
from ran_hf.files.folder_locks import lock_folder, releases_folder_locks
from ran_hf.files.folders import write_folder
from ran_hf.files.paths import check_not_inputs, contents
from ran_hf.files.text_files import split_before_whitespace


logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# The trainer reads texts in pieces of at most this many characters: it holds some 90 bytes per character of the
# texts it is reading (a few hundred at once), and a 20 MB line read whole took 1.8 GB. Cut before whitespace, pieces
# hold the words the whole texts hold.
TRAINING_PIECE_CHARACTERS = 1 << 14


@dataclass
class TokenizerArguments:
    train_files: list[str] = field(metadata={"help": "Text files to learn the vocabulary from (see the docstring)."})
    output_dir: str = field(metadata={"help": "Folder to save the tokenizer to."})
    model: str = field(default="wordpiece", metadata={"help": "`wordpiece` (BERT-style) or `bpe` (byte-level)."})
    vocab_size: int = field(default=8000, metadata={"help": "Size of the vocabulary, special tokens included."})
    min_frequency: int = field(
        default=2, metadata={"at_least": 0, "help": "Least frequent pair or piece still merged."}
    )
    lowercase: bool = field(default=True, metadata={"help": "WordPiece only: lower-case and strip accents."})
    text_column_name: str = field(default="text", metadata={"help": "Column with the text in jsonl / csv files."})
    conll: bool = field(default=False, metadata={"help": "Read the files as CoNLL: the words of the first column."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Save into an --output_dir that already holds files (a trained model, another tokenizer): its "
            "tokenizer files are replaced, the rest stays. Without it such a folder is refused: a model's tokenizer "
            "replaced by one of another vocabulary would read every text wrongly."
        },
    )
    max_documents: int | None = field(
        default=None, metadata={"at_least": 1, "help": "Read at most this many documents per file."}
    )
    model_max_length: int | None = field(
        default=None,
        metadata={"at_least": 1, "help": "Length the tokenizer reports; RAN has no limit, so leave it unset."},
    )

    def __post_init__(self):
        if self.model not in ("wordpiece", "bpe"):
            raise ValueError(f"--model must be `wordpiece` or `bpe`, got {self.model!r}.")
        if self.vocab_size <= len(SPECIAL_TOKENS):
            raise ValueError(f"--vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens.")


def read_texts(args: TokenizerArguments) -> Dataset:
    """The documents of --train_files, as column "text". With --max_documents only the first documents of each file
    are read (`ran_hf.files.data.read_records`); otherwise a file goes through `datasets` into Arrow
    (`ran_hf.files.data.load_records`), so that its texts are held on disk, not as Python strings. A null or blank
    text is an error naming the file and line, not the word "None" in the vocabulary."""
    column = args.text_column_name
    parts = []
    for path in args.train_files:
        if args.conll:
            sentences = read_conll(path)[: args.max_documents]
            parts.append(Dataset.from_dict({"text": [" ".join(sentence["tokens"]) for sentence in sentences]}))
        elif args.max_documents is not None:
            records = read_records(path, text_columns=[column], limit=args.max_documents)
            check_columns(records, [column], str(path))
            parts.append(Dataset.from_dict({"text": [record[column] for record in records]}))
        else:
            documents = load_records(path, [column])
            check_texts(documents, [column], str(path), path)
            parts.append(documents.rename_column(column, "text") if column != "text" else documents)
    return concatenate_datasets(parts)


def build_tokenizer(args: TokenizerArguments, texts: Iterable[str]) -> PreTrainedTokenizerFast:
    if args.model == "wordpiece":
        backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        backend.normalizer = normalizers.BertNormalizer(lowercase=args.lowercase, strip_accents=args.lowercase)
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(
            vocab_size=args.vocab_size, min_frequency=args.min_frequency, special_tokens=SPECIAL_TOKENS
        )
    else:
        backend = Tokenizer(models.BPE(unk_token="[UNK]"))
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=args.vocab_size,
            min_frequency=args.min_frequency,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    pieces = (piece for text in texts for piece in split_before_whitespace(text, TRAINING_PIECE_CHARACTERS))
    backend.train_from_iterator(pieces, trainer=trainer)
    cls_id, sep_id = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    extra = {"model_max_length": args.model_max_length} if args.model_max_length else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "attention_mask"],
        **extra,
    )


def check_output_dir(args: TokenizerArguments) -> None:
    """Before reading anything: refuse an --output_dir that is or holds one of --train_files, or that already holds
    files (unless --overwrite_output_dir), and lock it for the run (`ran_hf.files.folders`)."""
    check_not_inputs(args.output_dir, "--output_dir", [("--train_files", path) for path in args.train_files])
    lock_folder(args.output_dir)
    entries = contents(args.output_dir)
    if entries and not args.overwrite_output_dir:
        shown = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "")
        raise ValueError(
            f"--output_dir {args.output_dir} already holds files ({shown}); a new tokenizer would replace the one a "
            "model there was trained with. Pass --overwrite_output_dir to replace its tokenizer files, or choose "
            "another --output_dir."
        )


@releases_folder_locks
def main(argv: list[str] | None = None) -> PreTrainedTokenizerFast:
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO, stream=sys.stdout
    )
    (args,) = parse_arguments(TokenizerArguments, argv)
    check_output_dir(args)

    documents = read_texts(args)
    logger.info(f"Training a {args.model} tokenizer (vocabulary {args.vocab_size}) on {len(documents):,} documents")
    texts = (text for batch in documents.iter(batch_size=1000) for text in batch["text"])
    tokenizer = build_tokenizer(args, texts)
    if tokenizer.pad_token_id != 0:
        raise RuntimeError(f"[PAD] got id {tokenizer.pad_token_id}; RAN configs expect 0.")
    with write_folder(args.output_dir, "saving", carry_over=lambda name: True) as staging:
        tokenizer.save_pretrained(staging)
    logger.info(f"Saved a tokenizer of {len(tokenizer):,} tokens to {args.output_dir}")
    return tokenizer


if __name__ == "__main__":
    main()
