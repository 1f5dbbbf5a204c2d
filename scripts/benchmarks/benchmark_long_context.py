#!/usr/bin/env python
"""Passkey retrieval far beyond the training length, and multi-query associative recall (MQAR).

**Passkey.** A random 5-digit key (`--key_digits`) follows a `KEY` marker somewhere in real text (WikiText-2
sentences: the validation split for training, the test split for evaluation); the text ends with a `QUESTION`
marker, after which the model must produce the digits. Models train on about 1K-token examples only and are
evaluated at 1K, 4K, 16K and 64K tokens with the key at several depths. A result is an exact match of all digits
under greedy decoding (read from one teacher-forced forward: greedy decoding emits the key exactly when every
forced step's argmax is right); each digit's accuracy is reported too. With `--key_curriculum_steps N`, training
keys start at one digit and gain one every N steps: asked for five digits from the first step, the causal RAN
learns none of them in real text. With `--short_train_steps N`, the first N steps train on shorter texts
(`--short_train_length`, 512): over 16 windows from the start, it learned three digits of five.

**MQAR** (Zoology's multi-query associative recall): key-value pairs open the sequence, real text follows, and
the sequence ends by querying every key once in a random order; the model must produce each key's value. Models
train at 256 tokens with 4-16 pairs and are evaluated at 256 to 2K tokens; `--mqar_spacing 64` puts one pair in
each window instead, and `--mqar_curriculum_steps N` trains on one pair first.

Models, at matched width, depth and budget: the causal RAN as it is now, the causal RAN before the memory fixes of
docs/memory.md (`ran-before`: official layer), the official causal design (its cell reads only itself), the
causal RAN with its associative memory (`ran-associative`: `config.associative_memory`), and a
GPT-2 whose context is 1K for the passkey (longer inputs keep their last 1K tokens, as a user of such a model
would) and 2K for MQAR. Also measured: decoding time per token and cache size after reading each passkey length.

    python scripts/benchmarks/benchmark_long_context.py            # CPU default: 28 minutes on 2 cores
    # the recipe that reads a 5-digit key to 64K on CPU (docs/memory.md, cause 12: 58 minutes), on a GPU and to
    # 256K (not yet run)
    python scripts/benchmarks/benchmark_long_context.py --device cuda --jobs 1 --models ran gpt2 --batch_size 16 \
        --warmup_steps 300 --passkey_steps 6000 --short_train_steps 4500 --decay_steps 1000 \
        --key_curriculum_steps 200 --memory_review_cells 16 --memory_salient_cells 4 --mqar_steps 0 \
        --eval_lengths 1024 4096 16384 65536 262144 --max_ran_length 262144 --output benchmarks/cuda/long_context_cuda

Writes benchmarks/long_context/long_context.{json,md,png}. Running some `--models` again with otherwise equal arguments
replaces their results and keeps the others'. `--save_models DIR` keeps the trained passkey models; given the same
training arguments, `--load_models DIR --mqar_steps 0` evaluates them again without training, for example on more or
other examples (`--eval_examples`, `--eval_seed`).
"""

import argparse
import json
import math
import multiprocessing
import statistics
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from benchmark_tasks import OFFICIAL_CAUSAL_SCAN  # importing it registers the official causal scan
from benchmark_utils import command_line, machine_info, machine_line, result_path, result_record, write_result
from causal_baselines import causal_baseline
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from ran_hf import RANConfig, RANForCausalLM


PAD, KEY, QUESTION, FIRST_DIGIT = 0, 1, 2, 3  # digits are 3..12
NUM_WORDS = 2000  # the most frequent words of the training text; the rest becomes <unk>, numbers become <num>
NUM_SYMBOLS = 64  # MQAR keys and values each come from their own 64 symbols

# name -> RAN fields that differ from the causal defaults (the official causal scan: the cell reads only itself);
# None: a matched-size baseline of causal_baselines.py, with a context that holds the whole sequence
MODELS = {
    "ran": {},
    "ran-before": {"layer_design": "official"},
    "ran-official-causal": {"layer_design": "official", "scan_implementation": OFFICIAL_CAUSAL_SCAN},
    "ran-associative": {"associative_memory": True},  # + the delta-rule memory of ran_hf.associative_memory
    "gpt2": None,
    "llama": None,
    "gla": None,  # gated linear attention: a recurrent anchor (no save_pretrained: not with --save/--load_models)
}
DEFAULT_MODELS = [name for name in MODELS if name not in ("llama", "gla")]  # the MQAR anchors run when named


# ---- data -----------------------------------------------------------------------------------------------------------


class Vocabulary:
    """Specials, digits, the most frequent training words, then MQAR's key and value symbols."""

    def __init__(self, training_words: list[str]):
        counts = Counter(w for w in training_words if not any(c.isdigit() for c in w))
        words = ["<unk>", "<num>"] + [w for w, _ in counts.most_common(NUM_WORDS) if w != "<unk>"][: NUM_WORDS - 2]
        self.first_word = FIRST_DIGIT + 10
        self.index = {word: self.first_word + i for i, word in enumerate(words)}
        self.first_key_symbol = self.first_word + len(words)
        self.first_value_symbol = self.first_key_symbol + NUM_SYMBOLS
        self.size = self.first_value_symbol + NUM_SYMBOLS

    def encode(self, words: list[str]) -> torch.Tensor:
        unk, num = self.index["<unk>"], self.index["<num>"]
        return torch.tensor(
            [num if any(c.isdigit() for c in w) else self.index.get(w, unk) for w in words], dtype=torch.long
        )


def read_words(path: Path) -> list[str]:
    words = path.read_text(encoding="utf-8").split()
    if len(words) < 100_000:
        raise ValueError(f"{path} holds {len(words)} words; the benchmark needs a WikiText-2 split (about 200K)")
    return words


def filler(stream: torch.Tensor, generator: torch.Generator, batch_size: int, length: int) -> torch.Tensor:
    """`batch_size` contiguous slices of real text; a stream shorter than `length` is repeated end to end."""
    repeats = math.ceil((length + 1) / len(stream)) + 1
    stream = stream.repeat(repeats) if repeats > 1 else stream
    starts = torch.randint(0, len(stream) - length, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def passkey_batch(stream, generator, batch_size: int, length: int, depth: float | None = None, key_digits: int = 5):
    """Ids (B, length) and the answer digits (B, key_digits). The key lies at `depth` (0..1) of the text before the
    question, or anywhere when `depth` is None; the last `key_digits + 1` tokens are the question and the answer."""
    ids = filler(stream, generator, batch_size, length)
    digits = torch.randint(0, 10, (batch_size, key_digits), generator=generator) + FIRST_DIGIT
    room = length - 2 * (key_digits + 1)  # text positions where the key (marker + digits) can start
    if depth is None:
        starts = torch.randint(0, room, (batch_size,), generator=generator)
    else:
        starts = torch.full((batch_size,), round(depth * (room - 1)))
    offsets = torch.arange(key_digits + 1)
    rows = torch.arange(batch_size)[:, None]
    ids[rows, starts[:, None] + offsets] = torch.cat([torch.full((batch_size, 1), KEY), digits], 1)
    ids[:, -(key_digits + 1) :] = torch.cat([torch.full((batch_size, 1), QUESTION), digits], 1)
    return ids, digits


def training_key_digits(step: int, args) -> int:
    """The key length of training step `step` (from 1): with `--key_curriculum_steps N`, keys start at one digit and
    gain one every N steps up to `--key_digits`. Asked for several digits from the first step, a model in real text
    learns none of them; once one digit is read back, more follow (docs/memory.md, cause 10)."""
    if not args.key_curriculum_steps:
        return args.key_digits
    return min(args.key_digits, 1 + (step - 1) // args.key_curriculum_steps)


def training_length(step: int, args) -> int:
    """The passkey length of training step `step` (from 1): `--short_train_length` for the first
    `--short_train_steps` steps, then `--train_length`. Over 8 windows the causal RAN learns all five digits of a key;
    over 16 from the start it learned three (docs/memory.md)."""
    return args.short_train_length if step <= args.short_train_steps else args.train_length


def training_mqar_pairs(step: int, args, generator: torch.Generator) -> int:
    """The number of pairs of MQAR training step `step` (from 1): one of `--mqar_pairs` at random, or with
    `--mqar_curriculum_steps N` one pair first and one more every N steps up to the most of `--mqar_pairs`."""
    if args.mqar_curriculum_steps:
        return min(max(args.mqar_pairs), 1 + (step - 1) // args.mqar_curriculum_steps)
    return args.mqar_pairs[int(torch.randint(len(args.mqar_pairs), (1,), generator=generator))]


def mqar_batch(
    stream, generator, vocabulary: Vocabulary, batch_size: int, length: int, num_pairs: int, spacing: int = 2
):
    """Ids (B, length) and the values (B, P) the final queries ask for, in query order. Pair i opens at token
    `i * spacing`: side by side with the default 2 (Zoology's layout), one pair per window with the window size."""
    ids = filler(stream, generator, batch_size, length)
    keys = torch.stack([torch.randperm(NUM_SYMBOLS, generator=generator)[:num_pairs] for _ in range(batch_size)])
    values = torch.randint(0, NUM_SYMBOLS, (batch_size, num_pairs), generator=generator)
    keys, values = keys + vocabulary.first_key_symbol, values + vocabulary.first_value_symbol
    starts = torch.arange(num_pairs) * spacing
    ids[:, starts], ids[:, starts + 1] = keys, values
    order = torch.stack([torch.randperm(num_pairs, generator=generator) for _ in range(batch_size)])
    asked, answers = keys.gather(1, order), values.gather(1, order)
    ids[:, -2 * num_pairs :: 2], ids[:, -2 * num_pairs + 1 :: 2] = asked, answers
    return ids, answers


# ---- models ---------------------------------------------------------------------------------------------------------


def build_model(name: str, vocab_size: int, context: int, args) -> torch.nn.Module:
    fields = MODELS[name]
    if fields is None:
        model = causal_baseline(name, vocab_size, args.hidden_size, args.num_layers, args.num_heads, context)
        return model.to(args.device)
    config = RANConfig(
        vocab_size=vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, head_dim=args.hidden_size // args.num_heads, window_size=args.window_size,
        min_window_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, is_causal=True, **fields,
    )  # fmt: skip
    return RANForCausalLM(config).to(args.device)


def answer_logits(model, ids: torch.Tensor, num_answers: int, context: int | None, stride: int = 1):
    """Logits at the positions that predict the last `num_answers` answer tokens (every `stride`-th token)."""
    if context is not None and ids.shape[1] > context:
        ids = ids[:, -context:]
    last = ids.shape[1] - 1
    positions = torch.arange(last - stride * (num_answers - 1), last + 1, stride) - 1
    logits = model(ids, logits_to_keep=ids.shape[1] - int(positions[0])).logits
    return logits[:, positions - int(positions[0])]


# ---- training and evaluation ----------------------------------------------------------------------------------------


def train(model, make_batch, answers_of, steps: int, args, description: str) -> dict:
    """Train; stop at the first step whose loss or gradient is not finite and say so (`diverged_at`).

    `make_batch(step)` gives the step's ids and answers; `answers_of(model, ids, count)` the logits that predict the
    batch's `count` answer tokens."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: learning_rate_factor(done, steps, args))
    losses, diverged_at = [], None
    model.train()
    for step in tqdm(range(1, steps + 1), desc=description, leave=False, disable=args.jobs > 1):
        ids, answers = (tensor.to(args.device) for tensor in make_batch(step))
        logits = answers_of(model, ids, answers.shape[1])
        loss = F.cross_entropy(logits.flatten(0, 1), answers.flatten())
        optimizer.zero_grad()
        loss.backward()
        gradient_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not (torch.isfinite(loss) and torch.isfinite(gradient_norm)):
            diverged_at = step
            break
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    curve = [round(statistics.mean(losses[i : i + 50]), 4) for i in range(0, len(losses), 50)]
    return {"losses": curve, "diverged_at": diverged_at}


def learning_rate_factor(done: int, steps: int, args) -> float:
    """The learning rate of the step after `done` steps, as a fraction of --learning_rate: a linear warmup over
    --warmup_steps, then constant, then for the last --decay_steps a linear decay towards 0. At a constant rate the
    causal RAN read each digit of a 5-digit key 94-99% right, and a decay at the end made it read whole keys
    (docs/memory.md, cause 12)."""
    warmup = min(1.0, (done + 1) / max(1, args.warmup_steps))
    decay = min(1.0, (steps - done) / args.decay_steps) if args.decay_steps else 1.0
    return warmup * decay


@torch.no_grad()
def decode_cost(model, ids: torch.Tensor, chunk: int, steps: int = 16) -> dict:
    """Read `ids` through the cache in chunks, then time `steps` greedy tokens; the cache's size at the end."""
    finish = torch.cuda.synchronize if ids.is_cuda else lambda: None  # a CUDA call returns before its work is done
    cache = None
    for offset in range(0, ids.shape[1], chunk):
        outputs = model(ids[:, offset : offset + chunk], past_key_values=cache, use_cache=True)
        cache = outputs.past_key_values
    token, times = outputs.logits[:, -1:].argmax(-1), []
    for _ in range(steps):
        finish()
        start = time.perf_counter()
        outputs = model(token, past_key_values=outputs.past_key_values, use_cache=True)
        finish()
        times.append(time.perf_counter() - start)
        token = outputs.logits[:, -1:].argmax(-1)
    return {"ms_per_token": round(1000 * statistics.median(times), 3), "cache_bytes": outputs.past_key_values.nbytes()}


@torch.no_grad()
def evaluate_passkey(model, eval_stream, evaluation: torch.Generator, context: int | None, args) -> list[dict]:
    """Exact match and each digit's accuracy per length and depth and, for a RAN, decoding cost per length; examples
    drawn by `evaluation`."""
    model.eval()
    rows = []
    for length in args.eval_lengths:
        if context is None and length > args.max_ran_length:
            continue
        for depth in args.depths:
            hits = []  # (examples, digits): each digit right or not
            for offset in range(0, args.eval_examples, args.eval_batch_size):
                batch = min(args.eval_batch_size, args.eval_examples - offset)
                ids, digits = passkey_batch(eval_stream, evaluation, batch, length, depth, args.key_digits)
                ids, digits = ids.to(args.device), digits.to(args.device)
                hits.append(answer_logits(model, ids, args.key_digits, context).argmax(-1) == digits)
            hits = torch.cat(hits).float()
            rows.append(
                {
                    "length": length,
                    "depth": depth,
                    "accuracy": hits.prod(-1).mean().item(),
                    "digit_accuracy": [round(x, 4) for x in hits.mean(0).tolist()],
                }
            )
        if context is None:  # GPT-2's cache never holds more than its 1K context
            ids, _ = passkey_batch(eval_stream, evaluation, 1, length, 0.5, args.key_digits)
            rows[-1] |= decode_cost(model, ids[:, : -args.key_digits].to(args.device), args.window_size * 4)
            rows[-1]["decode_at"] = length
    return rows


def run_model(name: str, args) -> dict:
    torch.set_num_threads(args.threads)
    streams = load_streams(args)
    generator = torch.Generator().manual_seed(args.seed + 1)  # training batches, passkey then MQAR
    evaluation = torch.Generator().manual_seed(args.eval_seed)  # evaluation examples, passkey then MQAR
    result = {"model": name}
    for task, steps, run in (("passkey", args.passkey_steps, run_passkey), ("mqar", args.mqar_steps, run_mqar)):
        if steps:
            torch.manual_seed(args.seed)  # each task's model starts from the same seed
            result |= run(name, args, streams, generator, evaluation)
        else:  # skipped
            result |= {f"{task}_training": {"losses": [], "diverged_at": None}, f"{task}_train_seconds": 0.0, task: []}
    return result


def run_passkey(name: str, args, streams, generator, evaluation) -> dict:
    """Train at --train_length (or read the model trained so from --load_models), evaluate at every length and depth
    (and with a bounded memory review)."""
    train_stream, eval_stream, vocabulary = streams
    context = args.train_length if MODELS[name] is None else None
    if args.load_models:
        model = load_model(name, args)
        result = {"parameters": sum(p.numel() for p in model.parameters())}
        result |= {"passkey_training": {"losses": [], "diverged_at": None}, "passkey_train_seconds": 0.0}
        result["passkey"] = evaluate_passkey(model, eval_stream, evaluation, context, args)
        return result | evaluate_bounded_memory(model, eval_stream, context, args)
    model = build_model(name, vocabulary.size, args.train_length, args)
    result = {"parameters": sum(p.numel() for p in model.parameters())}
    start = time.perf_counter()

    def passkey_training_batch(step):
        length, digits = training_length(step, args), training_key_digits(step, args)
        return passkey_batch(train_stream, generator, args.batch_size, length, None, digits)

    result["passkey_training"] = train(
        model,
        passkey_training_batch,
        lambda m, ids, answers: answer_logits(m, ids, answers, context),
        args.passkey_steps,
        args,
        f"{name} passkey",
    )
    result["passkey_train_seconds"] = round(time.perf_counter() - start, 1)
    if args.save_models:  # to study the trained model afterwards (--load_models, diagnose_memory.py, other lengths)
        model.save_pretrained(Path(args.save_models) / f"{name}-passkey")
    result["passkey"] = evaluate_passkey(model, eval_stream, evaluation, context, args)
    return result | evaluate_bounded_memory(model, eval_stream, context, args)


def load_model(name: str, args) -> torch.nn.Module:
    """A passkey model written by --save_models; its size must be the one the arguments describe."""
    model_class = AutoModelForCausalLM if MODELS[name] is None else RANForCausalLM
    model = model_class.from_pretrained(Path(args.load_models) / f"{name}-passkey").to(args.device)
    size = (model.config.hidden_size, model.config.num_hidden_layers, model.config.num_attention_heads)
    if size != (args.hidden_size, args.num_layers, args.num_heads):
        raise ValueError(
            f"{args.load_models}/{name}-passkey has hidden size, layers and heads {size}, not the "
            f"{(args.hidden_size, args.num_layers, args.num_heads)} of --hidden_size, --num_layers, --num_heads"
        )
    return model


def evaluate_bounded_memory(model, eval_stream, context: int | None, args) -> dict:
    """The same trained RAN on the same examples, its memory review (and cache) bounded to the last
    --memory_review_cells cells, and with --memory_salient_cells, also the most salient older ones."""
    result = {}
    if context is None and args.memory_review_cells:
        model.config.memory_review_cells = args.memory_review_cells
        same_examples = torch.Generator().manual_seed(args.eval_seed)
        result["passkey_bounded"] = evaluate_passkey(model, eval_stream, same_examples, context, args)
        result["memory_review_cells"] = args.memory_review_cells
        if args.memory_salient_cells and model.config.review_salience:
            model.config.memory_salient_cells = args.memory_salient_cells
            same_examples = torch.Generator().manual_seed(args.eval_seed)
            result["passkey_salient"] = evaluate_passkey(model, eval_stream, same_examples, context, args)
            result["memory_salient_cells"] = args.memory_salient_cells
            model.config.memory_salient_cells = None
        model.config.memory_review_cells = None
    return result


def run_mqar(name: str, args, streams, generator, evaluation) -> dict:
    """A fresh model of the same design, trained at --mqar_train_length and evaluated at every length and count."""
    train_stream, eval_stream, vocabulary = streams
    context = max(args.mqar_lengths) if MODELS[name] is None else None
    model = build_model(name, vocabulary.size, context or args.mqar_train_length, args)
    result = {"mqar_parameters": sum(p.numel() for p in model.parameters())}

    def mqar_training_batch(step):
        pairs = training_mqar_pairs(step, args, generator)
        return mqar_batch(
            train_stream, generator, vocabulary, args.batch_size, args.mqar_train_length, pairs, args.mqar_spacing
        )

    def mqar_logits(m, ids, pairs):
        return answer_logits(m, ids, pairs, context, stride=2)

    start = time.perf_counter()
    result["mqar_training"] = train(model, mqar_training_batch, mqar_logits, args.mqar_steps, args, f"{name} mqar")
    result["mqar_train_seconds"] = round(time.perf_counter() - start, 1)
    result["mqar"] = []
    for length in args.mqar_lengths:
        for pairs in args.mqar_pairs:
            ids, values = mqar_batch(
                eval_stream, evaluation, vocabulary, args.eval_examples, length, pairs, args.mqar_spacing
            )
            predicted = answer_logits(model, ids.to(args.device), pairs, context, stride=2).argmax(-1)
            accuracy = (predicted.cpu() == values).float().mean().item()
            result["mqar"].append({"length": length, "pairs": pairs, "accuracy": round(accuracy, 4)})
    return result


def load_streams(args):
    data = Path(args.data_dir) / "wikitext-2"
    training_words, evaluation_words = read_words(data / "valid.txt"), read_words(data / "test.txt")
    vocabulary = Vocabulary(training_words)
    return vocabulary.encode(training_words), vocabulary.encode(evaluation_words), vocabulary


# ---- report ---------------------------------------------------------------------------------------------------------


def markdown(results: list[dict], info: dict, args, command: str) -> str:
    lines = [f"Machine: {machine_line(info)}, {info['date']}", "", f"Command: `{command}`", ""]
    lines += passkey_tables(results, args) if args.passkey_steps else ["Passkey: not run (`--passkey_steps 0`)."]
    lines += mqar_table(results, args) if args.mqar_steps else ["", "MQAR: not run (`--mqar_steps 0`)."]
    if any(r[f"{task}_training"]["diverged_at"] for r in results for task in ("passkey", "mqar")):
        lines += ["", "\\* training stopped at that step: its loss or gradient was not finite (the model as it was)."]
    return "\n".join(lines) + "\n"


def passkey_tables(results: list[dict], args) -> list[str]:
    lengths = sorted({row["length"] for r in results for row in r["passkey"]})
    lines = [
        f"Passkey: trained {args.passkey_steps} steps at {args.train_length} tokens{short_words(args)} "
        f"(batch {args.batch_size}{decay_words(args)})"
        f"{curriculum_words(args)}{loaded_words(args)}; exact match of {args.key_digits} digits over "
        f"{args.eval_examples} examples per "
        f"depth {args.depths}, mean over depths.",
        "",
        "| model | parameters | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |",
        "|---|---:|" + "---:|" * len(lengths),
    ]
    for r in results:
        for label, passkey in passkey_runs(r):
            cells = []
            for length in lengths:
                rows = [row["accuracy"] for row in passkey if row["length"] == length]
                cells.append(f"{100 * statistics.mean(rows):.0f}%" if rows else "-")
            lines.append(f"| {label}{diverged(r, 'passkey')} | {r['parameters']:,} | " + " | ".join(cells) + " |")
    lines += depth_table(results, lengths, args)
    if args.key_digits > 1:
        lines += digit_table(results, lengths)
    lines += ["", "Decoding after reading the passkey text (median ms per token, cache size):", ""]
    lines += ["| model | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for r in results:
        for label, passkey in passkey_runs(r):
            decoded = {row["length"]: row for row in passkey if "ms_per_token" in row}
            if decoded:
                cells = [
                    f"{decoded[n]['ms_per_token']:.1f} ms, {decoded[n]['cache_bytes'] / 2**10:.0f} KiB"
                    if n in decoded
                    else "-"
                    for n in lengths
                ]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def depth_table(results: list[dict], lengths: list[int], args) -> list[str]:
    """Exact match per model, length and depth: where in the text a key is found, and where it is lost."""
    lines = ["", "Exact match by where the key lies (its depth in the text):", ""]
    lines += ["| model | depth | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |"]
    lines += ["|---|---:|" + "---:|" * len(lengths)]
    for r in results:
        for label, passkey in passkey_runs(r):
            for depth in args.depths:
                found = {row["length"]: row["accuracy"] for row in passkey if row["depth"] == depth}
                cells = [f"{100 * found[n]:.0f}%" if n in found else "-" for n in lengths]
                lines.append(f"| {label} | {100 * depth:.0f}% | " + " | ".join(cells) + " |")
    return lines


def digit_table(results: list[dict], lengths: list[int]) -> list[str]:
    """Each digit's accuracy per model and length, mean over depths: which digits a model reads where it does not
    read them all."""
    lines = ["", "Accuracy of each digit (first to last), mean over depths:", ""]
    lines += ["| model | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for r in results:
        for label, passkey in passkey_runs(r):
            cells = []
            for length in lengths:
                # Results saved before this table have no "digit_accuracy": a dash.
                rows = [row.get("digit_accuracy", []) for row in passkey if row["length"] == length]
                digits = [statistics.mean(column) for column in zip(*rows)]
                cells.append(" / ".join(f"{100 * x:.0f}" for x in digits) + "%" if digits else "-")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def short_words(args) -> str:
    if not args.short_train_steps:
        return ""
    return f", the first {args.short_train_steps} at {args.short_train_length}"


def decay_words(args) -> str:
    return f", the learning rate decaying to 0 over the last {args.decay_steps}" if args.decay_steps else ""


def loaded_words(args) -> str:
    return f" (the models saved in {args.load_models}, not trained again)" if args.load_models else ""


def curriculum_words(args) -> str:
    if not args.key_curriculum_steps or args.key_digits == 1:
        return ""
    return f", keys growing from 1 digit by one every {args.key_curriculum_steps} steps"


def pair_curriculum_words(args) -> str:
    if not args.mqar_curriculum_steps:
        return ""
    return f" (one pair first, one more every {args.mqar_curriculum_steps} steps)"


def mqar_table(results: list[dict], args) -> list[str]:
    lines = [
        "",
        f"MQAR: trained {args.mqar_steps} steps at {args.mqar_train_length} tokens with {args.mqar_pairs} pairs"
        f"{'' if args.mqar_spacing == 2 else f' opening every {args.mqar_spacing} tokens'}"
        f"{pair_curriculum_words(args)}{decay_words(args)}; "
        f"accuracy over all queries of {args.eval_examples} examples.",
        "",
        "| model | pairs | " + " | ".join(str(n) for n in args.mqar_lengths) + " |",
        "|---|---:|" + "---:|" * len(args.mqar_lengths),
    ]
    for r in results:
        for pairs in args.mqar_pairs:
            cells = [f"{100 * row['accuracy']:.0f}%" for row in r["mqar"] if row["pairs"] == pairs]
            lines.append(f"| {r['model']}{diverged(r, 'mqar')} | {pairs} | " + " | ".join(cells) + " |")
    return lines


def passkey_runs(result: dict) -> list[tuple[str, list[dict]]]:
    """(label, passkey rows) of a model: as trained, and with its memory review bounded (and keeping its salient
    cells) where that was evaluated."""
    runs = [(result["model"], result["passkey"])]
    bound = result.get("memory_review_cells", "M")
    if result.get("passkey_bounded"):
        runs.append((f"{result['model']}, last {bound} cells", result["passkey_bounded"]))
    if result.get("passkey_salient"):
        label = f"{result['model']}, last {bound} + {result['memory_salient_cells']} salient cells"
        runs.append((label, result["passkey_salient"]))
    return runs


def diverged(result: dict, task: str) -> str:
    step = result[f"{task}_training"]["diverged_at"]
    return f" (diverged at step {step}*)" if step else ""


def plot(results: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [task for task, steps in (("passkey", args.passkey_steps), ("mqar", args.mqar_steps)) if steps]
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    axis = dict(zip(tasks, axes[0]))
    passkey, mqar = axis.get("passkey"), axis.get("mqar")
    for i, r in enumerate(results):
        if passkey is not None:
            for (label, rows), style in zip(passkey_runs(r), ("o-", "s--", "^:")):
                lengths = sorted({row["length"] for row in rows})
                accuracy = [statistics.mean(x["accuracy"] for x in rows if x["length"] == n) for n in lengths]
                passkey.semilogx(lengths, accuracy, style, color=f"C{i}", label=label, base=2)
        if mqar is not None:
            rows = [row for row in r["mqar"] if row["pairs"] == max(args.mqar_pairs)]
            lengths, accuracy = [x["length"] for x in rows], [x["accuracy"] for x in rows]
            mqar.semilogx(lengths, accuracy, "o-", color=f"C{i}", label=r["model"], base=2)
    if passkey is not None:
        passkey.axvline(args.train_length, color="grey", linestyle=":", label="training length")
        passkey.set(xlabel="tokens", ylabel="exact match", title="passkey", ylim=(-0.02, 1.02))
        passkey.legend(fontsize=8)
        passkey.grid(alpha=0.3)
    if mqar is not None:
        mqar.set(xlabel="tokens", ylabel="accuracy", title=f"MQAR, {max(args.mqar_pairs)} pairs", ylim=(-0.02, 1.02))
        mqar.grid(alpha=0.3)
        if passkey is None:
            mqar.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=DEFAULT_MODELS)
    parser.add_argument("--data_dir", default="../shared/data", help="folder holding wikitext-2/{valid,test}.txt")
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--window_size", type=int, default=64)
    parser.add_argument("--train_length", type=int, default=1024)
    parser.add_argument("--passkey_steps", type=int, default=1000, help="0: MQAR only")
    parser.add_argument("--short_train_length", type=int, default=512, help="passkey length of the first steps")
    parser.add_argument(
        "--short_train_steps", type=int, default=0, help="passkey steps at --short_train_length before --train_length"
    )
    parser.add_argument("--key_digits", type=int, default=5, help="digits of the passkey")
    parser.add_argument(
        "--key_curriculum_steps",
        type=int,
        default=150,
        help="train on keys of one digit first, one more digit every N steps up to --key_digits (0: --key_digits "
        "from the first step, which the causal RAN does not learn in real text)",
    )
    parser.add_argument(
        "--memory_review_cells",
        type=int,
        default=None,
        help="also evaluate each trained RAN with memory review (and its cache) bounded to the last M windows' cells",
    )
    parser.add_argument(
        "--memory_salient_cells",
        type=int,
        default=None,
        help="with --memory_review_cells: evaluate each RAN with a salience prior once more, also keeping the S most "
        "salient older cells",
    )
    parser.add_argument("--eval_lengths", nargs="+", type=int, default=[1024, 4096, 16384, 65536])
    parser.add_argument("--max_ran_length", type=int, default=65536, help="longest passkey length for the RANs")
    parser.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    parser.add_argument("--mqar_train_length", type=int, default=256)
    parser.add_argument("--mqar_steps", type=int, default=1000, help="0: passkey only")
    parser.add_argument("--mqar_lengths", nargs="+", type=int, default=[256, 512, 1024, 2048])
    parser.add_argument("--mqar_pairs", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument(
        "--mqar_curriculum_steps",
        type=int,
        default=0,
        help="train on one pair first, one more every N steps up to the most of --mqar_pairs (0: each batch draws one "
        "of --mqar_pairs)",
    )
    parser.add_argument(
        "--mqar_spacing",
        type=int,
        default=2,
        help="tokens from one pair's key to the next's: 2 puts the pairs side by side (Zoology), the window size puts "
        "one pair in each window",
    )
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--warmup_steps", type=int, default=100, help="linear learning-rate warmup of each task")
    parser.add_argument(
        "--decay_steps", type=int, default=0, help="the last steps of each task, whose learning rate decays to 0"
    )
    parser.add_argument("--eval_examples", type=int, default=16)
    parser.add_argument("--eval_batch_size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval_seed", type=int, default=12_345, help="seed of the evaluation examples")
    parser.add_argument("--device", default="cpu", help="where models train and run: cpu, cuda, cuda:1, ...")
    # Two at once by default, one per core of a 2-core machine: the default run then took 28 minutes, and the machine
    # used at most 2.4 GB in all (evaluation in batches of 2).
    parser.add_argument("--jobs", type=int, default=2, help="models trained at the same time, one process each")
    parser.add_argument("--threads", type=int, default=1, help="threads per model")
    parser.add_argument("--save_models", default=None, help="folder to save each trained passkey model in")
    parser.add_argument(
        "--load_models",
        default=None,
        help="evaluate the passkey models that --save_models wrote to this folder, trained with the other arguments "
        "given here, instead of training them (needs --mqar_steps 0)",
    )
    parser.add_argument(
        "--output", default="benchmarks/long_context/long_context", help="path prefix of .json/.md/.png"
    )
    args = parser.parse_args(argv)
    positive = ("hidden_size", "num_layers", "num_heads", "window_size", "batch_size", "eval_examples", "jobs")
    for name in positive + ("eval_batch_size", "threads", "key_digits"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.passkey_steps < 0:
        parser.error("--passkey_steps must be >= 0 (0: no passkey)")
    if args.passkey_steps == 0 and args.mqar_steps == 0:
        parser.error("--passkey_steps 0 and --mqar_steps 0 leave nothing to run")
    if args.key_curriculum_steps < 0:
        parser.error("--key_curriculum_steps must be >= 0 (0: no curriculum)")
    if not 0 <= args.short_train_steps < max(1, args.passkey_steps):
        parser.error("--short_train_steps must be >= 0 and leave steps at --train_length")
    curriculum_steps = args.key_curriculum_steps * (args.key_digits - 1)
    if args.passkey_steps and args.key_curriculum_steps and curriculum_steps >= args.passkey_steps:
        parser.error("--key_curriculum_steps leaves no step for keys of --key_digits digits: lower it")
    if args.mqar_steps < 0:
        parser.error("--mqar_steps must be >= 0 (0: no MQAR)")
    if "gla" in args.models and (args.save_models or args.load_models) and args.passkey_steps:
        parser.error("gla is not a Transformers model (no save_pretrained): leave it out with --save/--load_models")
    if args.load_models:
        missing = [m for m in args.models if not (Path(args.load_models) / f"{m}-passkey" / "config.json").is_file()]
        if missing or args.mqar_steps or not args.passkey_steps:
            parser.error(
                "--load_models needs a saved passkey model per model (missing: "
                f"{', '.join(f'{args.load_models}/{m}-passkey' for m in missing) or 'none'}), --mqar_steps 0 and "
                "the --passkey_steps they were trained with"
            )
    if args.mqar_curriculum_steps < 0:
        parser.error("--mqar_curriculum_steps must be >= 0 (0: no curriculum)")
    if args.mqar_steps and args.mqar_curriculum_steps * (max(args.mqar_pairs) - 1) >= args.mqar_steps:
        parser.error("--mqar_curriculum_steps leaves no step for the most of --mqar_pairs: lower it")
    if args.memory_review_cells is not None and args.memory_review_cells < 1:
        parser.error("--memory_review_cells must be >= 1")
    if args.memory_salient_cells is not None and (args.memory_salient_cells < 1 or args.memory_review_cells is None):
        parser.error("--memory_salient_cells must be >= 1 and needs --memory_review_cells")
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device!r}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    if args.learning_rate <= 0:
        parser.error("--learning_rate must be positive")
    if args.warmup_steps < 0:
        parser.error("--warmup_steps must be >= 0")
    if not 0 <= args.decay_steps <= min(steps for steps in (args.passkey_steps, args.mqar_steps) if steps):
        parser.error("--decay_steps must be >= 0 and at most the steps of each task that runs")
    if args.hidden_size % args.num_heads:
        parser.error("--hidden_size must be a multiple of --num_heads")
    if any(not 0 <= depth <= 1 for depth in args.depths):
        parser.error("--depths are fractions between 0 and 1")
    if min(args.eval_lengths + [args.train_length, args.short_train_length]) < 4 * (args.key_digits + 1):
        parser.error(f"passkey lengths must be at least {4 * (args.key_digits + 1)} tokens")
    if args.mqar_spacing < 2:
        parser.error("--mqar_spacing must be >= 2 (a pair is two tokens)")
    most_pairs = max(args.mqar_pairs)
    mqar_room = args.mqar_spacing * (most_pairs - 1) + 2 + 2 * most_pairs  # the pairs, then the queries
    if min(args.mqar_lengths + [args.mqar_train_length]) < mqar_room or most_pairs > NUM_SYMBOLS:
        parser.error(
            f"MQAR needs lengths >= --mqar_spacing x (pairs - 1) + 2 + 2 x pairs ({mqar_room} tokens) and at most "
            f"{NUM_SYMBOLS} pairs"
        )
    for split in ("valid.txt", "test.txt"):
        if not (Path(args.data_dir) / "wikitext-2" / split).is_file():
            parser.error(f"{Path(args.data_dir) / 'wikitext-2' / split} not found (--data_dir)")
    return args


# Arguments that do not change what a model's result means: results of other models with the same rest are kept.
PER_RUN_ARGUMENTS = ("models", "jobs", "threads", "output", "save_models", "load_models")
# Arguments added after results were saved, with the value those results were run with.
ARGUMENTS_ADDED_LATER = {
    "warmup_steps": 100,
    "key_digits": 5,
    "memory_review_cells": None,
    "memory_salient_cells": None,
    "key_curriculum_steps": 0,
    "mqar_spacing": 2,
    "mqar_curriculum_steps": 0,
    "device": "cpu",
    "short_train_length": 512,
    "short_train_steps": 0,
    "eval_seed": 12_345,
    "decay_steps": 0,
}


def earlier_results(path: Path, args) -> dict:
    """Results of models not run this time, from an earlier run of the same benchmark at this path."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    settings = ARGUMENTS_ADDED_LATER | earlier["settings"]
    compared = (vars(args).keys() | settings.keys()) - set(PER_RUN_ARGUMENTS)
    differing = sorted(k for k in compared if settings.get(k) != vars(args).get(k))
    if differing:
        print(f"{path} was run with other {', '.join(differing)}: its results are replaced, not merged")
        return {}
    return {r["model"]: r for r in earlier["results"] if r["model"] not in args.models}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    info = machine_info(args.device)
    print(machine_line(info))
    output = Path(args.output)
    results = earlier_results(result_path(output, ".json"), args)
    # A forked child cannot use CUDA once its parent has; spawned ones start clean.
    start = multiprocessing.get_context("spawn") if torch.device(args.device).type == "cuda" else None
    with ProcessPoolExecutor(args.jobs, mp_context=start) as pool:
        futures = {pool.submit(run_model, name, args): name for name in args.models}
        for future in tqdm(futures, desc="models"):
            result = future.result()
            results[result["model"]] = result
            seconds = result["passkey_train_seconds"] + result["mqar_train_seconds"]
            tqdm.write(f"{result['model']}: trained in {seconds:.0f} s")
    results = [results[name] for name in MODELS if name in results]
    output.parent.mkdir(parents=True, exist_ok=True)
    command = command_line(__file__, argv)
    device = torch.device(args.device).type
    payload = result_record(command, vars(args), results, device=device, dtype="float32", info=info)
    write_result(result_path(output, ".json"), json.dumps(payload, indent=1))
    table = markdown(results, info, args, command)
    write_result(result_path(output, ".md"), table)
    plot(results, args, result_path(output, ".png"))
    print(table)
    return results


if __name__ == "__main__":
    main()
