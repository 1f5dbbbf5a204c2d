#!/usr/bin/env python
"""Training tokens per second on a corpus of short documents, with and without packing.

    python scripts/benchmarks/benchmark_packing.py                    # CPU, one thread, about three minutes
    python scripts/benchmarks/benchmark_packing.py --heads causal --documents_per_batch 64 --rounds 7

The corpus is AG News (`ag_news/test.csv` in the shared data folder, `--data_dir` or `RAN_HF_DATA_DIR`): 7,600 news
items, title and description, 20 to 200 words each. A word-level tokenizer is built from it (the `--vocab_size` most
frequent lowercased words and punctuation marks; a Transformers fast tokenizer, so that the scripts' collators run
unchanged), and every document is `[CLS] words [SEP]`. Both arms train the same model on the same batches of
`--documents_per_batch` documents, with the collators the scripts use:

  padded   one document a row, padded to the batch's longest (`DataCollatorForLanguageModeling`, as run_clm.py and
           run_mlm.py without `--packing`)
  packed   the batch's documents in one row, no padding (`--packing`: `DataCollatorWithFlattening`, and for the
           masked LM `PackedMaskedLMCollator`, which flattens, then masks)

A step is collation, forward, backward and an AdamW step. Throughput counts real tokens only (padding excluded). The
arms alternate round by round (`--rounds` rounds of `--steps` steps each, after `--warmup` steps per arm) so that a
machine shared with other work slows both alike; the median round is reported. The first batch's causal-LM loss is
also computed both ways: packing reads each document alone, so the two losses agree. Writes
`benchmarks/packing/packing_<device>.json` and `.md`.
"""

import argparse
import csv
import os
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from benchmark_utils import (
    NON_NEGATIVE,
    POSITIVE,
    command_line,
    machine_info,
    machine_line,
    result_record,
    write_json_and_table,
)
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, PreTrainedTokenizerFast


SCRIPTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(SCRIPTS))  # training_utils.py and its siblings, which lm_data.py imports
sys.path.insert(0, str(SCRIPTS / "language-modeling"))
from lm_data import PackedMaskedLMCollator  # noqa: E402

from ran_hf import RANConfig, RANForCausalLM, RANForMaskedLM  # noqa: E402


WORDS = re.compile(r"\w+|[^\w\s]")
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def read_documents(data_dir: Path, limit: int | None) -> list[str]:
    path = data_dir / "ag_news" / "test.csv"
    if not path.is_file():
        raise SystemExit(f"{path} not found: give --data_dir (the shared data folder, see its SOURCES.md).")
    with path.open(newline="", encoding="utf-8") as handle:
        texts = [f"{title}. {description}".replace("\\", " ") for _, title, description in csv.reader(handle)]
    return texts[:limit] if limit else texts


def word_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A fast tokenizer over the `vocab_size` most frequent lowercased words and marks of `texts`."""
    counts = Counter(word for text in texts for word in WORDS.findall(text.lower()))
    words = [word for word, _ in counts.most_common(vocab_size - len(SPECIAL))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(SPECIAL + words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation(), pre_tokenizers.Digits()]
    )
    backend.normalizer = normalizers.Lowercase()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    )  # fmt: skip


def make_model(head: str, args, vocab_size: int):
    torch.manual_seed(args.seed)
    config = RANConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        head_dim=args.hidden_size // args.num_heads,
        window_size=args.window_size,
        min_window_size=min(16, args.window_size // 4),
        is_causal=head == "causal",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    model = (RANForCausalLM if head == "causal" else RANForMaskedLM)(config).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def collators(head: str, tokenizer) -> dict:
    if head == "causal":
        return {
            "padded": DataCollatorForLanguageModeling(tokenizer, mlm=False),
            "packed": DataCollatorWithFlattening(),
        }
    return {
        "padded": DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15),
        "packed": PackedMaskedLMCollator(DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)),
    }


def train_steps(model, optimizer, collate, batches) -> tuple[float, int, int]:
    """Seconds for one training step per batch, with the real and the padded positions they held."""
    real = positions = 0
    start = time.perf_counter()
    for features in batches:
        batch = collate(features)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        real += sum(len(feature["input_ids"]) for feature in features)
        positions += batch["input_ids"].numel()
    return time.perf_counter() - start, real, positions


def same_loss(tokenizer, features, args, vocab_size) -> float:
    """|packed - padded| causal-LM loss of one batch: packing reads each document alone."""
    model, _ = make_model("causal", args, vocab_size)
    arms = collators("causal", tokenizer)
    with torch.no_grad():
        losses = [model(**arms[arm](features)).loss.item() for arm in ("padded", "packed")]
    return abs(losses[0] - losses[1])


def measure(head: str, tokenizer, documents: list, args) -> dict:
    per_batch = args.documents_per_batch
    batches = [documents[i : i + per_batch] for i in range(0, len(documents) - per_batch + 1, per_batch)]
    needed = args.warmup + args.rounds * args.steps
    if len(batches) < needed:
        raise SystemExit(f"{len(batches)} batches of {per_batch} documents, but the run needs {needed}.")
    arms = collators(head, tokenizer)
    models = {arm: make_model(head, args, len(tokenizer)) for arm in arms}  # the same start for both
    for arm, (model, optimizer) in models.items():
        train_steps(model, optimizer, arms[arm], batches[: args.warmup])
    rounds = {arm: [] for arm in arms}
    totals = {arm: [0.0, 0, 0] for arm in arms}
    for r in range(args.rounds):
        chunk = batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]
        for arm in arms:
            model, optimizer = models[arm]
            seconds, real, positions = train_steps(model, optimizer, arms[arm], chunk)
            rounds[arm].append(real / seconds)
            totals[arm] = [totals[arm][0] + seconds, totals[arm][1] + real, totals[arm][2] + positions]
    result = {"head": head}
    for arm in arms:
        seconds, real, positions = totals[arm]
        result[arm] = {
            "real_tokens_per_second": statistics.median(rounds[arm]),
            "rounds_real_tokens_per_second": rounds[arm],
            "seconds_per_step": seconds / (args.rounds * args.steps),
            "real_tokens": real,
            "positions": positions,
            "padding_share": 1 - real / positions,
        }
    result["speedup"] = result["packed"]["real_tokens_per_second"] / result["padded"]["real_tokens_per_second"]
    return result


def markdown_table(results: list, corpus: dict, info: dict, command: str, loss_gap: float) -> str:
    rows = [
        "| head | arm | real tokens/s (median round) | s/step | padding share | packed / padded |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for result in results:
        for arm in ("padded", "packed"):
            figures = result[arm]
            ratio = f"{result['speedup']:.2f}x" if arm == "packed" else ""
            rows.append(
                f"| {result['head']} | {arm} | {figures['real_tokens_per_second']:,.0f} | "
                f"{figures['seconds_per_step']:.3f} | {figures['padding_share']:.1%} | {ratio} |"
            )
    return (
        f"# Packed documents: training tokens per second\n\n`{command}`\n\n{machine_line(info)}\n\n"
        f"AG News ({corpus['documents']:,} documents, {corpus['mean_tokens']:.1f} tokens on average, "
        f"{corpus['min_tokens']} to {corpus['max_tokens']}); the same batches of documents in both arms. Causal-LM "
        f"loss of the first batch, packed against padded: |difference| = {loss_gap:.1e}.\n\n" + "\n".join(rows) + "\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", choices=["causal", "masked"], default=["causal", "masked"])
    parser.add_argument("--data_dir", type=Path, default=Path(os.environ.get("RAN_HF_DATA_DIR", "../shared/data")))
    parser.add_argument("--max_documents", type=POSITIVE, default=None, help="read only the first N documents")
    parser.add_argument("--vocab_size", type=POSITIVE, default=8192)
    parser.add_argument("--documents_per_batch", type=POSITIVE, default=32)
    parser.add_argument("--warmup", type=NON_NEGATIVE, default=3, help="untimed steps per arm")
    parser.add_argument("--rounds", type=POSITIVE, default=5, help="timed rounds; the arms alternate")
    parser.add_argument("--steps", type=POSITIVE, default=8, help="steps per arm in a round")
    parser.add_argument("--hidden_size", type=POSITIVE, default=128)
    parser.add_argument("--num_layers", type=POSITIVE, default=2)
    parser.add_argument("--num_heads", type=POSITIVE, default=4)
    parser.add_argument("--window_size", type=POSITIVE, default=64)
    parser.add_argument("--threads", type=POSITIVE, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=NON_NEGATIVE, default=0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/packing/packing_cpu"), help="result prefix")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    info = machine_info("cpu")
    print(machine_line(info))
    texts = read_documents(args.data_dir, args.max_documents)
    tokenizer = word_tokenizer(texts, args.vocab_size)
    ids = tokenizer(texts, return_attention_mask=False)["input_ids"]
    generator = torch.Generator().manual_seed(args.seed)
    documents = [{"input_ids": ids[i]} for i in torch.randperm(len(ids), generator=generator).tolist()]
    lengths = [len(row) for row in ids]
    corpus = {
        "set": "ag_news/test.csv (title. description)",
        "documents": len(lengths),
        "mean_tokens": sum(lengths) / len(lengths),
        "min_tokens": min(lengths),
        "max_tokens": max(lengths),
        "tokenizer": f"word level, {len(tokenizer)} ids, [CLS] text [SEP]",
    }
    print(f"AG News: {corpus['documents']:,} documents of {corpus['mean_tokens']:.1f} tokens on average")
    loss_gap = same_loss(tokenizer, documents[: args.documents_per_batch], args, len(tokenizer))
    print(f"first batch's causal-LM loss, |packed - padded| = {loss_gap:.1e}")
    print(f"{'head':<8} {'arm':<8} {'real tokens/s':>14} {'s/step':>8} {'padding':>8}")
    results = []
    for head in args.heads:
        result = measure(head, tokenizer, documents, args)
        results.append(result)
        for arm in ("padded", "packed"):
            figures = result[arm]
            print(
                f"{head:<8} {arm:<8} {figures['real_tokens_per_second']:>14,.0f} {figures['seconds_per_step']:>8.3f} "
                f"{figures['padding_share']:>8.1%}",
                flush=True,
            )
        print(f"{head:<8} packed / padded: {result['speedup']:.2f}x")

    command = command_line(__file__)
    settings = {**vars(args), "data_dir": "RAN_HF_DATA_DIR (the shared data folder)"}
    figures = {"corpus": corpus, "first_batch_causal_loss_gap": loss_gap, "heads": results}
    record = result_record(command, settings, figures, device="cpu", dtype="float32", info=info)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json_and_table(args.output, record, markdown_table(results, corpus, info, command, loss_gap))
    print(f"wrote {args.output}.json and .md")


if __name__ == "__main__":
    main()
