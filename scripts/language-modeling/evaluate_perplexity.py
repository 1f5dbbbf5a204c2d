#!/usr/bin/env python
"""Perplexity of a causal RAN language model over a long text, such as the WikiText-2 test set.

    python scripts/language-modeling/evaluate_perplexity.py --model_name_or_path outputs/ran-clm \\
        --text_file ../shared/data/wikitext-2/test.txt --output_file outputs/ran-clm/perplexity_wikitext2_test.json

The text is read as `run_clm.py` (in this folder) trains: every non-blank line is tokenized without special tokens
and ended by one end-of-text token (EOS, or SEP), and the lines are concatenated into one stream. Two ways to read it:

* `--mode stream` (default): the whole text is one sequence, fed `--chunk_length` tokens at a time with the
  recurrent `RANCache` carried from chunk to chunk. The logits equal those of a single forward pass over the whole
  text (RAN's causal mode is exactly recurrent), so every token but the first is predicted with all the text before it
  and memory stays bounded by one chunk plus one cell per finished window.
* `--mode chunks`: independent chunks of `--chunk_length` tokens, each read from an empty state; the first token of
  every chunk is not scored. This is the usual fixed-window evaluation of models without a recurrent state.

Reported: `token_perplexity` = exp(mean negative log-likelihood per scored token of this tokenizer) and
`word_perplexity` = exp(mean negative log-likelihood per scored token x tokens per word), where words are the
whitespace-separated tokens of the non-blank lines plus one end of line per non-blank line. Word perplexity does not
depend on the tokenizer, so models with different vocabularies can be compared; WikiText-2's published count (245,569
test tokens) also has an end of line for each of its 1,468 blank lines, which this script does not score.

Masked language models have no left-to-right likelihood: their `perplexity` from `run_mlm.py` is the
exponential of the masked-token loss, which is not comparable with these numbers.
"""

import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import ran_hf  # noqa: F401  (registers RAN with the Auto classes)
from ran_hf.files.paths import check_not_inputs
from ran_hf.files.text_files import read_lines


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: training_utils.py, shared by all examples

from argument_checks import parse_arguments  # noqa: E402
from checkpoints import is_run_file  # noqa: E402
from lm_data import end_of_text_id, token_ids  # noqa: E402
from training_utils import check_model_type, check_tokenizer_matches_config  # noqa: E402


logger = logging.getLogger(__name__)


@dataclass
class PerplexityArguments:
    model_name_or_path: str = field(metadata={"help": "Causal RAN to evaluate: a folder or Hub id."})
    text_file: str = field(metadata={"help": "Text to score (.txt or .txt.gz), one line per paragraph."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer, if not the model's own."})
    mode: str = field(default="stream", metadata={"help": "`stream` (recurrent, whole text) or `chunks`."})
    chunk_length: int = field(default=1024, metadata={"at_least": 2, "help": "Tokens fed per forward pass."})
    max_tokens: int | None = field(default=None, metadata={"help": "Score only the first this many tokens."})
    output_file: str | None = field(default=None, metadata={"help": "Write the results here as JSON."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Load the model's own code (not needed for RAN)."}
    )

    def __post_init__(self):
        if self.mode not in ("stream", "chunks"):
            raise ValueError(f"--mode must be `stream` or `chunks`, got {self.mode!r}.")
        if self.max_tokens is not None and self.max_tokens < 2:  # the first token is never scored
            raise ValueError(f"--max_tokens must be at least 2 (leave it out to score all), got {self.max_tokens}.")


def check_output_file(args: PerplexityArguments) -> None:
    """Refuse an --output_file that is something the run reads (links resolved): the text, or a file of the model's
    or tokenizer's folder that a run wrote there (weights, config, tokenizer, code, model card, metrics). A new file
    beside them is fine."""
    output = Path(args.output_file)
    if output.is_dir():
        raise ValueError(f"--output_file {output} is a folder; name the .json file to write.")
    inputs = [("--text_file", args.text_file)]
    for flag in ("model_name_or_path", "tokenizer_name"):
        folder = getattr(args, flag)
        if folder is not None and Path(folder).is_dir():
            inputs += [(f"--{flag}'s {path.name}", path) for path in Path(folder).iterdir() if is_run_file(path.name)]
    check_not_inputs(output, "--output_file", inputs)


def write_results(path: Path, results: dict) -> None:
    """Write the JSON whole or not at all: into a temporary file beside it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(results, indent=2) + "\n")
    partial.replace(path)


def read_stream(path: str, tokenizer) -> tuple[torch.Tensor, int]:
    """(1, N) token ids of the whole text and the number of words it holds (see the module docstring)."""
    end_id = end_of_text_id(tokenizer)
    lines = [line.strip() for line in read_lines(path) if line.strip()]  # bytes that are not UTF-8: file and line
    if not lines:
        raise ValueError(f"{path} holds no text.")
    ids = np.concatenate([np.append(line_ids, end_id) for line_ids in token_ids(tokenizer, lines)])  # in pieces
    num_words = sum(len(line.split()) + 1 for line in lines)
    return torch.from_numpy(ids.astype(np.int64))[None], num_words


@torch.no_grad()
def negative_log_likelihood(model, input_ids: torch.Tensor, mode: str, chunk_length: int) -> tuple[float, int]:
    """Summed NLL (nats) and number of scored tokens over the (1, N) stream."""
    total, scored = 0.0, 0
    cache, carried_logits = None, None  # stream: the state after the text so far, and its last position's logits
    for start in tqdm(range(0, input_ids.shape[1], chunk_length), desc=f"Scoring ({mode})", unit="chunk"):
        chunk = input_ids[:, start : start + chunk_length]
        if mode == "stream":
            outputs = model(input_ids=chunk, past_key_values=cache, use_cache=True)
            cache = outputs.past_key_values
            logits = outputs.logits[0].float()  # (C, V)
            if carried_logits is not None:
                logits = torch.cat([carried_logits, logits])  # predicts chunk[0] from the previous chunk
                targets = chunk[0]
            else:
                targets = chunk[0, 1:]
            carried_logits = logits[-1:]
            logits = logits[: targets.shape[0]]
        else:
            logits = model(input_ids=chunk).logits[0, :-1].float()  # (C - 1, V)
            targets = chunk[0, 1:]
        total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        scored += targets.shape[0]
    return total, scored


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO, stream=sys.stdout
    )
    (args,) = parse_arguments(PerplexityArguments, argv)
    if args.output_file is not None:
        check_output_file(args)

    check_model_type(args.model_name_or_path, args.trust_remote_code)  # names the folder of an unknown model type
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or args.model_name_or_path)
    config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    architectures = config.architectures or []
    if architectures and not any(name.endswith("ForCausalLM") for name in architectures):
        # Loaded as a causal LM, a classifier's or MLM's weights get an output layer they were not trained with
        # (the tied embeddings, or random weights): a number, but no perplexity of that model.
        raise ValueError(
            f"{args.model_name_or_path} is a {', '.join(architectures)}, not a causal language model "
            "(`...ForCausalLM`): it has no next-token likelihood to score. Evaluate a run_clm.py model."
        )
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    if not getattr(model.config, "is_causal", False):
        raise ValueError(f"{args.model_name_or_path} is not a causal model (config.is_causal is False).")
    check_tokenizer_matches_config(tokenizer, model.config)
    model.eval()

    input_ids, num_words = read_stream(args.text_file, tokenizer)
    if args.max_tokens is not None and args.max_tokens < input_ids.shape[1]:
        num_words = round(num_words * args.max_tokens / input_ids.shape[1])  # words in the scored prefix, about
        input_ids = input_ids[:, : args.max_tokens]
    logger.info(f"Scoring {input_ids.shape[1]:,} tokens ({num_words:,} words) of {args.text_file} in {args.mode} mode")
    start = time.perf_counter()
    nll, scored = negative_log_likelihood(model, input_ids, args.mode, args.chunk_length)
    results = {
        "model": args.model_name_or_path,
        "text_file": args.text_file,
        "mode": args.mode,
        "chunk_length": args.chunk_length,
        "tokens": int(input_ids.shape[1]),
        "scored_tokens": scored,
        "words": num_words,
        "nll_nats": nll,
        "token_perplexity": math.exp(nll / scored),
        "word_perplexity": math.exp(nll / scored * input_ids.shape[1] / num_words),
        "runtime_s": round(time.perf_counter() - start, 2),
    }
    for key, value in results.items():
        logger.info(f"  {key} = {value}")
    if args.output_file:
        write_results(Path(args.output_file), results)
    return results


if __name__ == "__main__":
    main()
