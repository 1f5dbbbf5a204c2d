"""Can a RAN learn to carry a token? Key retrieval in, across one and across eight window boundaries.

Each example is random filler tokens with one `KEY` token followed by a key digit (10 classes); the last token asks
for the digit. Where the key lies decides the task: in the question's own window (`in-window`), in the window before
it (`across-1`), eight windows before it (`across-8`), or anywhere in those eight (`across-any`). Tiny models (hidden
64, 2 layers, 4 heads, window 64) are trained from scratch with AdamW (learning rate 2e-3 after a linear warmup of
300 steps), batch 16, gradient clipping 1.0 and evaluated on 256 held-out examples every `--eval_every` steps; a run
stops early once it is at 99% twice in a row.

Models: a GPT-2 of the same size, the causal RAN as it is now, and the designs that led to it from the official
layer, one config field at a time (`residual_stream`, `cell_input_residual`, `review_qk_norm`, then
`attention_qk_activation` and `memory_value_activation` together, then `cell_max_pool`, `review_salience` and
`token_shift`), and the RAN without one of its changes (`review_initial_cell`, memory review, an untied decoder), so
the table says what each change is worth. With `--key_digits K` the key has K digits, asked for in order (the text
ends with `QUESTION` and the first K - 1 digits, teacher-forced), and a run is right when all K are:

    python scripts/benchmarks/diagnose_memory.py --across_steps 1000  # 33 minutes on 2 CPU cores (2,000 steps: longer)
    python scripts/benchmarks/diagnose_memory.py --tasks in-window --models ran gpt2 --seeds 0
    python scripts/benchmarks/diagnose_memory.py --tasks across-any --key_digits 2 --models ran +review-salience

Writes benchmarks/memory_diagnosis/memory_diagnosis.{json,md,png}.
"""

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from benchmark_utils import (
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_FLOAT,
    command_line,
    machine_info,
    machine_line,
    result_path,
    result_record,
    write_result,
)
from tqdm.auto import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

from ran_hf import RANConfig, RANForCausalLM
from ran_hf.building_blocks import apply_interleaved_rotary, rotary_rotations


VOCAB_SIZE = 64
KEY, QUESTION, FIRST_DIGIT, FIRST_FILLER = 1, 2, 3, 13  # 0 is padding; digits are 3..12; filler 13..63
WINDOW = 64

# The official swish activations of the window attention's queries and keys and of the memory path.
ACTIVATED = {"attention_qk_activation": True, "memory_value_activation": True}

# The fields that came after `cell_max_pool`, off in the designs before them.
LATER = {"review_salience": False, "token_shift": False}

# name -> the RAN fields that differ from the causal defaults (None: GPT-2). From the official layer, one change at a
# time, to the causal RAN as it is; then the RAN without one of its changes.
MODELS = {
    "official-layer": {"layer_design": "official"},
    "+residual-stream": {"layer_design": "official", "residual_stream": True},
    "+cell-written-by-attention": ACTIVATED | {"review_qk_norm": False},
    "+review-qk-norm": ACTIVATED,  # + cosine scores in memory review
    "+plain-projections": {"cell_max_pool": False, **LATER},  # + plain attention scores and a linear memory path
    "+cell-max-pool": LATER,  # + the window's soft maximum written into its cell
    "+review-salience": {"token_shift": False},  # + a learned prior of every cell in memory review
    "ran": {},  # + each token reads its predecessor before the first layer
    "ran-without-initial-cell": {"review_initial_cell": False},
    "no-initial-cell-dot-review": {"review_initial_cell": False, "review_qk_norm": False},
    "ran-no-memory-review": {"memory_review": False},
    "ran-tied-embeddings": {"tie_word_embeddings": True},
    "gpt2": None,
}

# name -> (sequence length, range of the KEY token's position); the question is always the last token.
TASKS = {
    "in-window": (128, (WINDOW + 6, 2 * WINDOW - 8)),
    "across-1": (128, (10, WINDOW - 14)),
    "across-8": (9 * WINDOW, (10, WINDOW - 14)),
    "across-any": (9 * WINDOW, (10, 8 * WINDOW - 2)),  # anywhere in the eight windows before the question's
}


@dataclass
class RunResult:
    task: str
    model: str
    seed: int
    steps: int
    accuracy: float
    steps_to_99: int | None
    history: list
    seconds: float
    digit_accuracy: list  # final accuracy per key digit: a stalled run has usually merged some digits
    probe: dict | None = None  # per layer and key digit: where the key window's cell write and the question look


def make_batch(
    generator: torch.Generator, batch_size: int, length: int, key_range: tuple[int, int], key_digits: int = 1
):
    """Ids (B, length) and the answer digits (B, key_digits): `KEY d1 .. dK` at a position in `key_range` (the last
    digit too), and the text ends `QUESTION d1 .. dK-1`, so that the last K positions predict the K digits."""
    ids = torch.randint(FIRST_FILLER, VOCAB_SIZE, (batch_size, length), generator=generator)
    digits = FIRST_DIGIT + torch.randint(0, 10, (batch_size, key_digits), generator=generator)
    positions = torch.randint(key_range[0], key_range[1] - (key_digits - 1), (batch_size, 1), generator=generator)
    rows = torch.arange(batch_size)[:, None]
    ids[rows, positions] = KEY
    ids[rows, positions + 1 + torch.arange(key_digits)] = digits
    ids[:, -key_digits:] = torch.cat([torch.full((batch_size, 1), QUESTION), digits[:, :-1]], 1)
    return ids, digits


def build_model(name: str, max_length: int) -> torch.nn.Module:
    fields = MODELS[name]
    if fields is None:
        config = GPT2Config(
            vocab_size=VOCAB_SIZE, n_positions=max_length, n_embd=64, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = RANConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
        window_size=WINDOW, min_window_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        is_causal=True, **fields,
    )  # fmt: skip
    return RANForCausalLM(config)


@torch.no_grad()
def held_out_hits(model, length: int, key_range, examples: int = 256, key_digits: int = 1):
    """Whether each held-out example is answered right (every digit), and its (first) key digit (0-9)."""
    model.eval()
    ids, answers = make_batch(torch.Generator().manual_seed(10_000), examples, length, key_range, key_digits)
    hits = torch.cat(
        [
            (model(ids[i : i + 64]).logits[:, -key_digits:].argmax(-1) == answers[i : i + 64]).all(-1)
            for i in range(0, examples, 64)
        ]
    )
    model.train()
    return hits, answers[:, 0] - FIRST_DIGIT


def accuracy(model, length: int, key_range, examples: int = 256, key_digits: int = 1) -> float:
    hits, _ = held_out_hits(model, length, key_range, examples, key_digits)
    return hits.float().mean().item()


def accuracy_per_digit(model, length: int, key_range, examples: int = 1024, key_digits: int = 1) -> list[float]:
    hits, digits = held_out_hits(model, length, key_range, examples, key_digits)
    return [round(hits[digits == digit].float().mean().item(), 3) for digit in range(10)]


@torch.no_grad()
def probe_memory(model, length: int, key_range, examples: int = 1024) -> dict:
    """Per layer and key digit, on held-out examples: how much of the first window's cell write lands on the key
    digit (the largest share over heads), and how much of the question's memory review reads the cell of the key's
    window and the layer's starting cell. A RAN only; the key must lie in the first window.

    The first window's cell is written by the layer's starting cell, so its write attention is recomputed here from
    the layer's inputs exactly as the scan computes its first step (no dropout in eval mode).
    """
    model.eval()
    ids, answers = make_batch(torch.Generator().manual_seed(10_000), examples, length, key_range)
    digits = answers[:, 0] - FIRST_DIGIT
    digit_position = (ids == KEY).long().argmax(1) + 1
    outputs = model(ids, output_attentions=True, output_hidden_states=True)
    rows = torch.arange(examples)
    result = {}
    for index, layer in enumerate(model.model.layers):
        tokens = layer.input_norm(outputs.hidden_states[index][:, :WINDOW])  # (E, W, D): the first window
        cell = layer.input_norm(layer.initial_cell)[None]
        query, cell_key = layer.project(cell)[:, :2].unbind(1)  # (1, H, d) each; the cell sits at position 0
        token_keys = layer.project(tokens)[:, :, 1]  # (E, W, H, d), slot s at position s + 1
        rotations = rotary_rotations(WINDOW + 1, layer.head_dim, model.config.rope_theta, ids.device)[1:]
        if model.config.use_rotary:
            token_keys = apply_interleaved_rotary(token_keys.transpose(1, 2), rotations).transpose(1, 2)
        token_scores = torch.einsum("bhd,eshd->esh", query, token_keys)  # (E, W, H)
        scores = torch.cat([(query * cell_key).sum(-1)[:, None].expand(examples, 1, -1), token_scores], 1)
        write = (scores / layer.head_dim**0.5).softmax(1)  # (E, 1 + W, H)
        write_on_digit = write[rows, 1 + digit_position].amax(-1)  # (E,)
        review = outputs.memory_attentions[index][:, -1]  # (E, cells): the question's review
        has_initial = model.config.review_initial_cell
        on_key_cell = review[:, int(has_initial)]
        on_initial = review[:, 0] if has_initial else torch.zeros_like(on_key_cell)
        result[f"layer {index}"] = {
            name: [round(values[digits == digit].mean().item(), 3) for digit in range(10)]
            for name, values in (
                ("write_on_digit", write_on_digit),
                ("review_on_key_cell", on_key_cell),
                ("review_on_initial_cell", on_initial),
            )
        }
    model.train()
    return result


def train_once(task: str, model_name: str, seed: int, args) -> RunResult:
    torch.set_num_threads(args.threads)
    length, key_range = TASKS[task]
    max_steps = args.in_window_steps if task == "in-window" else args.across_steps
    key_digits = getattr(args, "key_digits", 1)
    torch.manual_seed(seed)
    model = build_model(model_name, length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    # Linear warmup, then constant: at the full rate from step 1, a RAN's write and review attention saturate on
    # whatever they pick first (docs/memory.md, cause 7).
    warmup = max(1, args.warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: min(1.0, (done + 1) / warmup))
    generator = torch.Generator().manual_seed(seed + 1)
    history, steps_to_99, above, start = [], None, 0, time.perf_counter()
    progress = tqdm(range(1, max_steps + 1), desc=f"{task} {model_name} s{seed}", leave=False, disable=args.jobs > 1)
    for step in progress:
        ids, answers = make_batch(generator, args.batch_size, length, key_range, key_digits)
        loss = F.cross_entropy(model(ids).logits[:, -key_digits:].flatten(0, 1), answers.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % args.eval_every == 0 or step == max_steps:
            score = accuracy(model, length, key_range, key_digits=key_digits)
            history.append([step, round(loss.item(), 4), score])
            progress.set_postfix(loss=f"{loss.item():.3f}", acc=f"{score:.3f}")
            above = above + 1 if score >= 0.99 else 0
            if score >= 0.99 and steps_to_99 is None:
                steps_to_99 = step
            if above == 2:
                break
    seconds = time.perf_counter() - start
    digits = accuracy_per_digit(model, length, key_range, key_digits=key_digits)
    probe = None
    if args.probe and MODELS[model_name] is not None and key_range[1] <= WINDOW and key_digits == 1:
        probe = probe_memory(model, length, key_range)
    return RunResult(task, model_name, seed, step, history[-1][2], steps_to_99, history, seconds, digits, probe)


def summarize(results: list[RunResult]) -> list[dict]:
    rows = []
    for task in TASKS:
        for model in MODELS:
            runs = [r for r in results if r.task == task and r.model == model]
            if not runs:
                continue
            reached = [r.steps_to_99 for r in runs if r.steps_to_99 is not None]
            rows.append(
                {
                    "task": task,
                    "model": model,
                    "seeds": len(runs),
                    "seeds_run": [r.seed for r in runs],
                    "accuracy": [r.accuracy for r in runs],
                    "reached_99": f"{len(reached)}/{len(runs)}",
                    "steps_to_99": reached,
                    "max_steps": max(r.steps for r in runs) if not reached else None,
                    "digits_missed": [missed_digits(r) for r in runs],
                }
            )
    return rows


def missed_digits(result: RunResult) -> list[int]:
    """Key digits answered right less than half the time at the end of a run."""
    return [digit for digit, score in enumerate(result.digit_accuracy) if score < 0.5]


def markdown(rows: list[dict], info: dict, args, command: str | None = None) -> str:
    lines = [
        f"Machine: {machine_line(info)}",
        "",
        *([f"Command: `{command}`", ""] if command else []),
        f"Key retrieval ({getattr(args, 'key_digits', 1)}-digit key, exact match), batch {args.batch_size}, "
        f"lr {args.learning_rate} (linear warmup over {args.warmup_steps} "
        f"steps); at most {args.in_window_steps} steps "
        f"in-window and {args.across_steps} across windows; final accuracy per seed, and the step at which each "
        "seed first reached 99%; digits missed: per seed that falls short, the (first) key digits it answers right "
        "less than half the time (1,024 held-out examples).",
        "",
        "| task | model | final accuracy per seed | seeds at 99% | steps to 99% | digits missed |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        accuracies = ", ".join(f"{100 * a:.1f}" for a in row["accuracy"])
        steps = ", ".join(map(str, row["steps_to_99"])) or "-"
        missed = "; ".join(
            f"s{seed}: {','.join(map(str, digits))}"
            for seed, digits, accuracy in zip(row["seeds_run"], row["digits_missed"], row["accuracy"])
            if accuracy < 0.99
        )
        lines.append(
            f"| {row['task']} | {row['model']} | {accuracies} | {row['reached_99']} | {steps} | {missed or '-'} |"
        )
    return "\n".join(lines) + "\n"


def probe_markdown(results: list[RunResult]) -> str:
    """One table per probed run: per key digit, its accuracy, and per layer the write's share on the digit and the
    question's review weight on the key's cell and on the starting cell."""
    lines = []
    for r in (r for r in results if r.probe):
        layers = list(r.probe)
        title = f"Probe of {r.task} {r.model} seed {r.seed} after {r.steps} steps (1,024 held-out examples):"
        lines += ["", title, ""]
        columns = ("write on digit", "review on key cell", "review on start")
        header = ["digit", "accuracy"] + [f"{layer}: {column}" for layer in layers for column in columns]
        lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
        for digit in range(10):
            cells = [str(digit), f"{r.digit_accuracy[digit]:.2f}"]
            for layer in layers:
                probe = r.probe[layer]
                names = ("write_on_digit", "review_on_key_cell", "review_on_initial_cell")
                cells += [f"{probe[name][digit]:.2f}" for name in names]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" if lines else ""


def plot(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [task for task in TASKS if any(r.task == task for r in results)]
    figure, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    colors = {name: f"C{i}" for i, name in enumerate(MODELS)}
    for axis, task in zip(axes[0], tasks):
        for r in (r for r in results if r.task == task):
            steps, _, scores = zip(*r.history)
            label = r.model if r.seed == min(x.seed for x in results if x.model == r.model) else None
            axis.plot(steps, scores, color=colors[r.model], alpha=0.8, label=label)
        axis.set_title(task)
        axis.set_xlabel("training step")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("retrieval accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def default_models(task: str) -> list[str]:
    # Eight windows cost 4.5 times the tokens: there only the causal RAN, the designs before it, and GPT-2.
    if TASKS[task][0] > 128:
        return ["ran", "+plain-projections", "+review-qk-norm", "gpt2"]
    return list(MODELS)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="default: all (fewer on the long tasks)")
    parser.add_argument("--seeds", nargs="+", type=NON_NEGATIVE, default=[0, 1])
    parser.add_argument("--learning_rate", type=POSITIVE_FLOAT, default=2e-3)
    parser.add_argument(
        "--warmup_steps",
        type=NON_NEGATIVE,
        default=300,
        help="linear learning-rate warmup (0: the full rate from step 1)",
    )
    parser.add_argument("--batch_size", type=POSITIVE, default=16)
    parser.add_argument(
        "--key_digits", type=POSITIVE, default=1, help="digits of the key, asked for in order after the question"
    )
    parser.add_argument("--in_window_steps", type=POSITIVE, default=500)
    parser.add_argument("--across_steps", type=POSITIVE, default=2000)
    parser.add_argument("--eval_every", type=POSITIVE, default=50)
    parser.add_argument(
        "--probe", action="store_true", help="after training, where each RAN's key-window write and review look"
    )
    parser.add_argument("--jobs", type=POSITIVE, default=2, help="runs trained at the same time, one process each")
    parser.add_argument("--threads", type=POSITIVE, default=1, help="threads per run")
    parser.add_argument(
        "--output", default="benchmarks/memory_diagnosis/memory_diagnosis", help="path prefix of .json/.md/.png"
    )
    args = parser.parse_args(argv)
    if args.learning_rate <= 0 or args.batch_size < 1 or args.eval_every < 1:
        parser.error("--learning_rate, --batch_size and --eval_every must be positive")
    if args.jobs < 1 or args.threads < 1:
        parser.error("--jobs and --threads must be >= 1")
    if args.warmup_steps < 0:
        parser.error("--warmup_steps must be >= 0")
    if not 1 <= args.key_digits <= 8:
        parser.error("--key_digits must be between 1 and 8")
    if args.in_window_steps < 1 or args.across_steps < 1:
        parser.error("--in_window_steps and --across_steps must be >= 1")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(machine_line(info))
    plan = [
        (task, model, seed)
        for task in sorted(args.tasks, key=lambda task: -TASKS[task][0])  # longest first: the pool ends sooner
        for model in (args.models or default_models(task))
        for seed in args.seeds
    ]
    results = []
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(train_once, task, model, seed, args) for task, model, seed in plan]
        for future in tqdm(futures, desc="runs"):
            result = future.result()
            results.append(result)
            tqdm.write(
                f"{result.task:10s} {result.model:26s} seed {result.seed}: accuracy {result.accuracy:.3f} after "
                f"{result.steps} steps ({result.seconds:.0f} s)"
            )
    rows = summarize(results)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    command = command_line(__file__, argv)
    figures = {"summary": rows, "runs": [r.__dict__ for r in results]}
    payload = result_record(command, vars(args), figures, device="cpu", dtype="float32", info=info)
    write_result(result_path(output, ".json"), json.dumps(payload, indent=1))
    table = markdown(rows, info, args, command) + probe_markdown(results)
    write_result(result_path(output, ".md"), table)
    plot(results, result_path(output, ".png"))
    print(table)
    return rows


if __name__ == "__main__":
    main()
