#!/usr/bin/env python
"""Build a small RAN, read a real text with it as one long document, save it and load it back as remote code.

    python scripts/quickstart.py                       # reads the project's README.md
    python scripts/quickstart.py --text_file book.txt --output_dir outputs/quickstart

Steps: train a lower-cased WordPiece tokenizer on the text, build a `RANForMaskedLM`, run the whole text through it
in a single sequence (RAN reads it window by window), fill a masked word, then `save_pretrained` and reload the
folder with `AutoModelForMaskedLM.from_pretrained(..., trust_remote_code=True)` and check the logits are identical.
"""

import argparse
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoModelForMaskedLM, AutoTokenizer, PreTrainedTokenizerFast, pipeline, set_seed

from ran_hf import RANConfig, RANForMaskedLM

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_wordpiece(lines, vocab_size: int) -> PreTrainedTokenizerFast:
    """A lower-cased BERT-style WordPiece tokenizer trained on `lines`; [PAD] gets id 0 as RAN expects."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(
        lines, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS)
    )
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text_file", type=Path, default=Path(__file__).resolve().parents[1] / "README.md")
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/quickstart"))
    parser.add_argument("--vocab_size", type=int, default=1000)
    parser.add_argument("--window_size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.text_file.is_file():
        parser.error(f"--text_file {args.text_file} does not exist")
    text = args.text_file.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        parser.error(f"--text_file {args.text_file} holds no text")
    set_seed(args.seed)

    tokenizer = train_wordpiece(lines, args.vocab_size)
    config = RANConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        window_size=args.window_size,
        min_window_size=8,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = RANForMaskedLM(config).eval()
    print(f"RAN with {model.num_parameters():,} parameters, vocabulary {len(tokenizer)}, window {config.window_size}")

    encoded = tokenizer(" ".join(lines), return_tensors="pt")
    start = time.perf_counter()
    with torch.no_grad():
        outputs = model.model(**encoded)
        logits = model(**encoded).logits
    num_windows = int(outputs.cells_mask.sum())
    print(
        f"Read {args.text_file.name}: {encoded.input_ids.shape[1]:,} tokens as one sequence, {num_windows} windows, "
        f"in {time.perf_counter() - start:.2f}s; document cell {tuple(outputs.pooled_cell.shape)}, "
        f"token states {tuple(outputs.last_hidden_state.shape)}"
    )

    fill_mask = pipeline("fill-mask", model=model, tokenizer=tokenizer)
    prompt = f"the model reads long {tokenizer.mask_token} in windows ."
    guesses = ", ".join(f"{g['token_str']} ({g['score']:.3f})" for g in fill_mask(prompt, top_k=3))
    print(f"fill-mask (untrained weights) for {prompt!r}: {guesses}")

    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    reloaded = AutoModelForMaskedLM.from_pretrained(args.output_dir, trust_remote_code=True).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(args.output_dir)
    with torch.no_grad():
        reloaded_logits = reloaded(**reloaded_tokenizer(" ".join(lines), return_tensors="pt")).logits
    difference = (reloaded_logits - logits).abs().max().item()
    if difference != 0.0:
        raise SystemExit(f"Reloaded model disagrees with the saved one: max abs diff {difference:.3e}")
    saved = ", ".join(sorted(p.name for p in args.output_dir.iterdir()))
    print(f"Saved to {args.output_dir.resolve()} ({saved}); reloaded with AutoModelForMaskedLM, logits identical.")


if __name__ == "__main__":
    main()
