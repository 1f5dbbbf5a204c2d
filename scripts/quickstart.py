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
from argument_checks import in_range
from train_tokenizer import SPECIAL_TOKENS, TokenizerArguments, build_tokenizer
from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline, set_seed

from ran_hf import RANConfig, RANForMaskedLM


MIN_WINDOW_SIZE = 8


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text_file", type=Path, default=Path(__file__).resolve().parents[1] / "README.md")
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/quickstart"))
    parser.add_argument("--vocab_size", type=in_range(int, above=len(SPECIAL_TOKENS)), default=1000)
    parser.add_argument("--window_size", type=in_range(int, above=MIN_WINDOW_SIZE), default=64)
    parser.add_argument("--seed", type=in_range(int, at_least=0, below=2**32), default=0)
    args = parser.parse_args()
    if not args.text_file.is_file():
        parser.error(f"--text_file {args.text_file} does not exist")
    text = args.text_file.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        parser.error(f"--text_file {args.text_file} holds no text")
    set_seed(args.seed)

    tokenizer_args = TokenizerArguments(train_files=[str(args.text_file)], output_dir=str(args.output_dir))
    tokenizer_args.vocab_size, tokenizer_args.min_frequency = args.vocab_size, 1
    tokenizer = build_tokenizer(tokenizer_args, lines)
    config = RANConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        window_size=args.window_size,
        min_window_size=MIN_WINDOW_SIZE,
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
    # Identical weights; float sums may still differ in the last bits with the memory layout of the loaded tensors.
    difference = (reloaded_logits - logits).abs().max().item()
    if difference > 1e-5:
        raise SystemExit(f"Reloaded model disagrees with the saved one: max abs diff {difference:.3e}")
    saved = ", ".join(sorted(p.name for p in args.output_dir.iterdir()))
    print(
        f"Saved to {args.output_dir.resolve()} ({saved}); reloaded with AutoModelForMaskedLM, "
        f"logits equal within {difference:.1e}."
    )


if __name__ == "__main__":
    main()
