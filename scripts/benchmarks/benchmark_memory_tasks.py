#!/usr/bin/env python
"""State tracking and associative recall far beyond the training length, every model at its best learning rate.

The tasks (memory_tasks.py): bAbI-style state tracking in filler (`qa1`: a name's latest place after overwrites;
`qa2`: where an object is that a person carried; `qa3`: where an object was before a place), trained at
`--train_length` (512) and read at every `--eval_lengths` (512, 2K, 8K; 32K where `--max_eval_length` lets a model
go); and Zoology's multi-query associative recall (`mqar`) on its grid of (length, pairs), trained at each length and
read at 1x and 4x it.

The models, at one width and depth: the causal RAN exactly as `RANConfig(is_causal=True)` builds it with only its sizes
set (vocabulary, hidden size, layers, heads; its defaults otherwise, dropout 0.1 and head size 64 included), or with the
fields `--ran_config` sets as well (a JSON object of RANConfig fields, e.g. '{"hidden_dropout_prob": 0}'); Llama with
the same width, depth, heads and head size and an MLP sized to RAN's parameter count; Mamba-2 (Transformers', its torch
path) with the same width and depth and the inner width (`expand`) that comes closest to RAN's parameter count (the
default RAN's, whatever `--ran_config` sets). Every model trains on the same batches (the data depend on the seed only)
for the same steps, with AdamW, a linear warmup over the first 10% of the steps, then a cosine decay to a tenth; the
loss is the cross-entropy of the answer tokens alone (with `--length_curriculum`, on examples that grow from that
length to the training length over the first half of the steps). Each model is swept over `--learning_rates` and read at the
training length; its best rate is the one with the best accuracy on held-out validation examples at the training length,
and only that rate's model is read at the longer lengths and run again with the `--extra_seeds`. Accuracy: the share of
answers whose token is the argmax over the whole vocabulary, on `--eval_examples` test examples at each length
(validation and test examples are drawn from their own seeds, training batches from the run's seed and step).

    python scripts/benchmarks/benchmark_memory_tasks.py --task qa1 --extra_seeds 1
    python scripts/benchmarks/benchmark_memory_tasks.py --task mqar --grid 64x4 128x8 256x16 512x64

Writes benchmarks/memory_tasks/<task>.{json,md,png} (MQAR: `mqar_<length>x<pairs>...`; `--output`). A run already in
the output file with the same settings is kept, not run again: a stopped sweep resumes, and `--models` or
`--extra_seeds` can be added by later calls (each run records the command and commit that trained it; the file's
`command` and `settings` are the last call's). A call with other settings (`--ran_config` included) starts the file
anew: give it its own `--output`.
"""

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from baseline_models import count_parameters
from benchmark_utils import (
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_FLOAT,
    command_line,
    machine_info,
    machine_line,
    result_path,
    result_record,
    write_json_and_table,
)
from causal_baselines import causal_baseline, matched_llama
from diagnose_recall import shortest_spread
from memory_tasks import (
    DEFAULT_STATE_SETTINGS,
    FIRST_PLACE,
    NUM_PLACES,
    STATE_VOCAB_SIZE,
    ZOOLOGY_GRID,
    mqar_answer_batch,
    mqar_vocab_size,
    state_tracking_batch,
)


MODELS = ("ran", "llama", "mamba2")
VALIDATION_SEED, TEST_SEED = 1_000_000_007, 2_000_000_011  # held-out data; training batches use seed * 10^6 + step
TRAINING_SEED_STRIDE = 1_000_000


# ---- models -----------------------------------------------------------------------------------------------------


RAN_SIZE_FIELDS = ("is_causal", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")  # set here


def ran_config(vocab_size: int, args, overrides: dict | None = None):
    """The causal RAN's config at the benchmark's sizes, its defaults otherwise but for `overrides`."""
    from ran_hf import RANConfig

    sizes = dict(zip(RAN_SIZE_FIELDS, (True, vocab_size, args.hidden_size, args.num_layers, args.num_heads)))
    return RANConfig(**sizes, **(overrides or {}))


def build(name: str, vocab_size: int, args, context: int) -> torch.nn.Module:
    """The model `name` at the benchmark's width and depth, matched to the default causal RAN's parameter count; the
    RAN itself with the fields of `args.ran_config` set."""
    from ran_hf import RANForCausalLM

    if name == "ran":
        return RANForCausalLM(ran_config(vocab_size, args, args.ran_config))
    ran = RANForCausalLM(ran_config(vocab_size, args))  # the baselines' size follows the default RAN
    target = size(ran)
    sizes = (args.hidden_size, args.num_layers, args.num_heads)
    if name == "llama":  # with RAN's head size
        return matched_llama(vocab_size, *sizes, context, head_dim=ran.config.head_dim, target=target, size=size)
    if name == "mamba2":
        options = [e for e in range(1, 33) if e * args.hidden_size % 64 == 0]
        expand = min(
            options, key=lambda e: abs(size(causal_baseline("mamba2", vocab_size, *sizes, context, expand=e)) - target)
        )
        return causal_baseline("mamba2", vocab_size, *sizes, context, expand=expand)
    raise ValueError(f"no model {name!r}: choose from {', '.join(MODELS)}")


def size(model: torch.nn.Module) -> int:
    """Parameters without the embeddings and the output layer (tied in Llama and Mamba-2, not in RAN)."""
    return count_parameters(model, exclude=("embed", "lm_head"))


def describe(model: torch.nn.Module, set_fields=()) -> dict:
    """Its sizes and the config fields that say what it is, with `set_fields` (those `--ran_config` set)."""
    config = model.config
    ran_fields = ("head_dim", "window_size", "min_window_size", "hidden_dropout_prob", "memory_review_cells")
    fields = {"ran": tuple(dict.fromkeys((*ran_fields, *set_fields)))}
    fields["llama"] = ("head_dim", "intermediate_size")
    fields["mamba2"] = ("expand", "num_heads", "head_dim", "state_size", "chunk_size")
    return {
        "parameters_without_embeddings": size(model),
        "parameters": sum(p.numel() for p in model.parameters()),
        **{field: getattr(config, field) for field in fields[config.model_type]},
    }


# ---- one run --------------------------------------------------------------------------------------------------------


def batch_maker(task: str, pairs: int | None):
    if task == "mqar":
        return lambda seed, batch_size, length: mqar_answer_batch(seed, batch_size, length, pairs)
    settings = DEFAULT_STATE_SETTINGS[task]
    return lambda seed, batch_size, length: state_tracking_batch(settings, seed, batch_size, length)


def answer_logits(model, ids: torch.Tensor, answer_positions: torch.Tensor) -> torch.Tensor:
    return model(ids).logits[:, answer_positions - 1]  # (B, Q, V)


@torch.no_grad()
def accuracy(model, make_batch, seed: int, examples: int, length: int, tokens_per_batch: int) -> float:
    model.eval()
    ids, positions, answers = make_batch(seed, examples, length)
    rows = max(1, tokens_per_batch // length)
    correct = sum(
        (answer_logits(model, ids[s : s + rows], positions).argmax(-1) == answers[s : s + rows]).sum().item()
        for s in range(0, examples, rows)
    )
    model.train()
    return correct / answers.numel()


def learning_rate_factor(done: int, steps: int) -> float:
    warmup = max(1, steps // 10)
    if done < warmup:
        return (done + 1) / warmup
    progress = (done - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def curriculum_length(step: int, train_length: int, args, shortest: int) -> int:
    """The training length at `step`: `train_length`, or with `--length_curriculum START` a length that grows
    linearly from START to `train_length` over the first half of the steps (in multiples of 8, never below the task's
    shortest example), so that a model first learns the task within one window and then carries it across windows."""
    start = args.length_curriculum
    if start is None:
        return train_length
    grown = start + (train_length - start) * min(1.0, step / max(1, args.steps // 2))
    return max(shortest, min(train_length, 8 * round(grown / 8)))


def train(model_name: str, task: str, pairs: int | None, train_length: int, context: int, lr: float, seed: int,
          args) -> tuple[torch.nn.Module, dict]:  # fmt: skip
    """Train one model at one rate and seed; its run record holds its validation accuracy at the training length."""
    torch.manual_seed(seed)
    vocab_size = mqar_vocab_size() if task == "mqar" else STATE_VOCAB_SIZE
    model = build(model_name, vocab_size, args, context=context)
    make_batch = batch_maker(task, pairs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: learning_rate_factor(done, args.steps))
    shortest = shortest_spread(pairs) if task == "mqar" else DEFAULT_STATE_SETTINGS[task].shortest()
    losses, history, start = [], [], time.perf_counter()
    model.train()
    for step in range(args.steps):
        length = curriculum_length(step, train_length, args, shortest)
        ids, positions, answers = make_batch(seed * TRAINING_SEED_STRIDE + step, args.batch_size, length)
        loss = F.cross_entropy(answer_logits(model, ids, positions).flatten(0, 1), answers.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        if (step + 1) % args.log_every == 0:
            history.append([step + 1, round(statistics.fmean(losses[-args.log_every :]), 4)])
            print(f"    step {step + 1}: loss {history[-1][1]:.3f}", flush=True)
    train_seconds = time.perf_counter() - start
    validation = accuracy(model, make_batch, VALIDATION_SEED, args.validation_examples, train_length, args.eval_tokens)
    run = {
        "model": model_name,
        "task": task,
        "pairs": pairs,
        "train_length": train_length,
        "learning_rate": lr,
        "seed": seed,
        **({"ran_config": args.ran_config} if model_name == "ran" else {}),
        "command": command_line(__file__),  # the call that trained it (a file may gather several calls' runs)
        "commit": args.commit,
        "model_info": describe(model, args.ran_config if model_name == "ran" else ()),
        "final_loss": round(statistics.fmean(losses[-args.log_every :]), 4),
        "diverged": not math.isfinite(losses[-1]),
        "loss_history": history,
        "validation_accuracy": validation,
        "accuracy": {},
        "train_seconds": round(train_seconds, 1),
        "read_seconds": {},
    }
    return model, run


def read(model: torch.nn.Module, run: dict, lengths: list, args) -> None:
    """Test accuracy at each of `lengths` the run lacks and its model may be read at, into the run."""
    make_batch = batch_maker(run["task"], run["pairs"])
    for length in lengths:
        if str(length) in run["accuracy"] or length > args.max_eval_length.get(run["model"], math.inf):
            continue
        start = time.perf_counter()
        run["accuracy"][str(length)] = accuracy(
            model, make_batch, TEST_SEED + length, args.eval_examples, length, args.eval_tokens
        )
        run["read_seconds"][str(length)] = round(time.perf_counter() - start, 1)
        print(f"    read at {length}: {100 * run['accuracy'][str(length)]:.1f}%", flush=True)


def checkpoint_path(run: dict, args) -> Path:
    name = f"{args.task}_{run['model']}_p{run['pairs']}_n{run['train_length']}_lr{run['learning_rate']}_s{run['seed']}"
    return Path(args.checkpoints) / f"{name}.pt"


# ---- the sweep ------------------------------------------------------------------------------------------------------


def experiments(args) -> list[tuple]:
    """(pairs or None, training length, lengths read) per experiment of the task."""
    if args.task == "mqar":
        return [(pairs, length, [length * m for m in args.mqar_multiples]) for length, pairs in args.grid]
    return [(None, args.train_length, args.eval_lengths)]


def key(run: dict) -> tuple:
    return run["model"], run["pairs"], run["train_length"], run["learning_rate"], run["seed"]


def best_runs(runs: list[dict], model: str, pairs, train_length: int) -> tuple[float | None, list[dict]]:
    """The learning rate with the best mean validation accuracy over its seeds, and its runs."""
    mine = [r for r in runs if r["model"] == model and r["pairs"] == pairs and r["train_length"] == train_length]
    by_rate = {}
    for r in mine:
        by_rate.setdefault(r["learning_rate"], []).append(r)
    if not by_rate:
        return None, []
    first_seed = {lr: [r for r in rs if r["seed"] == min(x["seed"] for x in rs)] for lr, rs in by_rate.items()}
    # chosen on the first seed, so that a rate run with more seeds is not favoured by them
    best = max(by_rate, key=lambda lr: (first_seed[lr][0]["validation_accuracy"], -lr))
    return best, by_rate[best]


def models_run(runs: list[dict], args) -> list[str]:
    """This call's models, then those earlier calls left in the file."""
    return [m for m in MODELS if m in args.models or any(r["model"] == m for r in runs)]


def summary(runs: list[dict], args) -> list[dict]:
    rows = []
    for pairs, train_length, lengths in experiments(args):
        for model in models_run(runs, args):
            lr, chosen = best_runs(runs, model, pairs, train_length)
            if lr is None:
                continue
            row = {"model": model, "pairs": pairs, "train_length": train_length, "best_learning_rate": lr}
            row["seeds"] = [r["seed"] for r in chosen]
            row["parameters_without_embeddings"] = chosen[0]["model_info"]["parameters_without_embeddings"]
            row["accuracy_mean"], row["accuracy_by_seed"] = {}, {}
            for n in map(str, lengths):
                values = [r["accuracy"][n] for r in chosen if n in r["accuracy"]]
                if values:
                    row["accuracy_mean"][n] = round(statistics.fmean(values), 4)
                    row["accuracy_by_seed"][n] = values
            row["swept"] = {
                str(r["learning_rate"]): r["validation_accuracy"]
                for r in runs
                if r["model"] == model and r["pairs"] == pairs and r["train_length"] == train_length
                and r["seed"] == min(chosen, key=lambda x: x["seed"])["seed"]
            }  # fmt: skip
            rows.append(row)
    return rows


def chance(args) -> float:
    return 1 / 64 if args.task == "mqar" else 1 / NUM_PLACES


def markdown(record: dict, args) -> str:
    results = record["results"]
    lines = [
        f"# {args.task}: accuracy by length, each model at its best learning rate",
        "",
        f"Machine: {machine_line({**record['machine_info'], 'git_sha': record['commit']})}",
        "",
        f"Command: `{record['command']}`",
        "",
        results["description"],
        "",
    ]
    for pairs, train_length, lengths in experiments(args):
        label = (
            f"MQAR, {pairs} pairs, trained at {train_length}" if pairs else f"{args.task}, trained at {train_length}"
        )
        lines += [
            f"## {label}",
            "",
            "| model | parameters (no embeddings) | best lr (validation accuracy per lr) | seeds | "
            + " | ".join(f"{n} tokens" for n in lengths)
            + " |",
            "|---|---:|---|---|" + "---:|" * len(lengths),
        ]
        for row in results["summary"]:
            if row["pairs"] != pairs or row["train_length"] != train_length:
                continue
            swept = ", ".join(
                f"{lr}: {100 * a:.0f}%" for lr, a in sorted(row["swept"].items(), key=lambda x: float(x[0]))
            )
            cells = []
            for n in map(str, lengths):
                if n not in row["accuracy_mean"]:
                    cells.append("not run")
                    continue
                seeds = row["accuracy_by_seed"][n]
                spread = f" ({' / '.join(f'{100 * a:.1f}' for a in seeds)})" if len(seeds) > 1 else ""
                cells.append(f"{100 * row['accuracy_mean'][n]:.1f}%{spread}")
            lines.append(
                f"| {row['model']} | {row['parameters_without_embeddings']:,} | {row['best_learning_rate']} "
                f"({swept}) | {', '.join(map(str, row['seeds']))} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    lines += [
        f"Chance: {100 * chance(args):.1f}%. With two seeds, the cell holds their mean and, in brackets, each seed's "
        "figure. 'not run': that model was not read at that length (`--max_eval_length`).",
        "",
        "The calls that trained these runs, with the revision each started from (the command above is the last call):",
        "",
    ]
    calls = dict.fromkeys((r.get("command"), r.get("commit")) for r in results["runs"])
    lines += [f"- `{command}` ({commit})" for command, commit in calls]
    return "\n".join(lines) + "\n"


def plot(record: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = experiments(args)
    figure, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.4), squeeze=False)
    for axis, (pairs, train_length, lengths) in zip(axes[0], groups):
        for i, model in enumerate(models_run(record["results"]["runs"], args)):
            rows = [r for r in record["results"]["summary"] if r["model"] == model and r["pairs"] == pairs
                    and r["train_length"] == train_length]  # fmt: skip
            if not rows:
                continue
            points = [(int(n), a) for n, a in rows[0]["accuracy_mean"].items()]
            axis.plot(*zip(*points), f"C{i}o-", label=f"{model} (lr {rows[0]['best_learning_rate']})")
        axis.axhline(chance(args), color="grey", linestyle=":", label="chance")
        axis.axvline(train_length, color="grey", linestyle="--", linewidth=0.8)
        axis.set_xscale("log", base=2)
        title = f"MQAR {train_length}, {pairs} pairs" if pairs else f"{args.task}, trained at {train_length}"
        axis.set(title=title, xlabel="tokens", ylim=(0, 1.02))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    axes[0][0].set_ylabel("answer accuracy")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def description(args) -> str:
    if args.task == "mqar":
        data = (
            "MQAR (diagnose_recall.py's `spread` layout): vocabulary of 193 tokens (0 padding, 64 filler, 64 key and "
            "64 value symbols); the pairs open the sequence, random filler follows, every key is asked once at the "
            f"end; read at {' and '.join(f'{m}x' for m in args.mqar_multiples)} the training length (more filler)."
        )
    else:
        s = DEFAULT_STATE_SETTINGS[args.task]
        data = (
            f"State tracking `{args.task}` (memory_tasks.py): vocabulary of {STATE_VOCAB_SIZE} tokens (7 markers, 8 "
            f"names, 8 objects, 16 places, 64 filler); {s.facts} facts, {s.names} names or people, {s.objects} "
            f"objects, {s.places} places, {s.questions} questions per example, facts spread evenly over the length."
        )
    return (
        f"{data} Budget, the same for every model and rate: {args.steps} steps of {args.batch_size} examples "
        "(AdamW, weight decay 0.01, warmup 10%, cosine to 10%, gradient clipping 1.0; loss on the answers only); "
        f"best rate chosen on {args.validation_examples} validation examples at the training length; accuracy on "
        f"{args.eval_examples} test examples per length. Width {args.hidden_size}, {args.num_layers} layers, "
        f"{args.num_heads} heads; one CPU thread."
        + (
            f" Length curriculum: from {args.length_curriculum} tokens, growing linearly to the training length over "
            "the first half of the steps."
            if args.length_curriculum
            else ""
        )
        + (f" RAN with the RANConfig fields {json.dumps(args.ran_config)} set." if args.ran_config else "")
    )


def save(runs: list[dict], args, info: dict, command: str) -> dict:
    settings = vars(args).copy()
    settings.pop("commit", None)  # the record says it
    settings["grid"] = [list(g) for g in args.grid]
    if args.task != "mqar":
        settings["generator"] = DEFAULT_STATE_SETTINGS[args.task].as_dict()
        settings["answers"] = f"place tokens {FIRST_PLACE}..{FIRST_PLACE + NUM_PLACES - 1}"
    settings["vocab_size"] = mqar_vocab_size() if args.task == "mqar" else STATE_VOCAB_SIZE
    settings["tokenizer"] = "none: synthetic token ids (memory_tasks.py)"
    results = {"description": description(args), "summary": summary(runs, args), "runs": runs}
    record = result_record(command, settings, results, device="cpu", dtype="float32", info=info)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_json_and_table(output, record, markdown(record, args))
    plot(record, args, result_path(output, ".png"))
    return record


def earlier_runs(args) -> list[dict]:
    """Runs of an earlier call with the same task, budget and sizes: kept and not run again."""
    path = result_path(args.output, ".json")
    if not path.exists():
        return []
    old = json.loads(path.read_text())["settings"]
    same = ("task", "steps", "batch_size", "hidden_size", "num_layers", "num_heads", "train_length", "eval_examples",
            "validation_examples", "grid", "ran_config", "length_curriculum")  # fmt: skip
    now = {**vars(args), "grid": [list(g) for g in args.grid]}
    # Files written before `--ran_config` ran the default; before `--length_curriculum`, none.
    old = {"length_curriculum": None, **old, "ran_config": old.get("ran_config") or {}}
    if any(old.get(name) != now[name] for name in same):
        return []
    return json.loads(path.read_text())["results"]["runs"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=[*DEFAULT_STATE_SETTINGS, "mqar"], default="qa1")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--learning_rates", nargs="+", type=POSITIVE_FLOAT, default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--seed", type=NON_NEGATIVE, default=0, help="the sweep's seed")
    parser.add_argument("--extra_seeds", nargs="*", type=NON_NEGATIVE, default=[], help="run again at the best rate")
    parser.add_argument("--steps", type=POSITIVE, default=300)
    parser.add_argument("--batch_size", type=POSITIVE, default=32)
    parser.add_argument("--log_every", type=POSITIVE, default=50)
    parser.add_argument("--hidden_size", type=POSITIVE, default=64)
    parser.add_argument("--num_layers", type=POSITIVE, default=2)
    parser.add_argument("--num_heads", type=POSITIVE, default=4)
    parser.add_argument("--train_length", type=POSITIVE, default=512, help="state tracking's training length")
    parser.add_argument("--eval_lengths", nargs="+", type=POSITIVE, default=[512, 2048, 8192])
    parser.add_argument(
        "--length_curriculum",
        type=POSITIVE,
        default=None,
        help="train every model from this length, growing linearly to the training length over the first half of "
        "the steps (default: the training length throughout)",
    )
    parser.add_argument(
        "--grid",
        nargs="+",
        type=lambda text: tuple(map(int, text.split("x"))),
        default=list(ZOOLOGY_GRID),
        help="MQAR's (length x pairs), e.g. 256x16",
    )
    parser.add_argument("--mqar_multiples", nargs="+", type=POSITIVE, default=[1, 4])
    parser.add_argument(
        "--max_eval_length",
        nargs="*",
        default=[],
        help="model=length: read that model at no longer length (e.g. llama=8192)",
    )
    parser.add_argument(
        "--ran_config",
        type=json.loads,
        default={},
        help="RANConfig fields to set on the RAN, as a JSON object (e.g. '{\"hidden_dropout_prob\": 0}'); the "
        "baselines keep the default RAN's size",
    )
    parser.add_argument("--eval_examples", type=POSITIVE, default=128)
    parser.add_argument("--validation_examples", type=POSITIVE, default=64)
    parser.add_argument("--eval_tokens", type=POSITIVE, default=16384, help="tokens per evaluation batch")
    parser.add_argument("--threads", type=POSITIVE, default=1)
    parser.add_argument(
        "--checkpoints",
        default="/tmp/memory_tasks_checkpoints",
        help="where each run's weights are kept, to read the best rate's model at every length after the sweep",
    )
    parser.add_argument("--output", default=None, help="prefix of .json/.md/.png (benchmarks/memory_tasks/<task>)")
    args = parser.parse_args(argv)
    args.max_eval_length = {m: int(n) for m, n in (item.split("=") for item in args.max_eval_length)}
    grid = "_".join(f"{length}x{pairs}" for length, pairs in args.grid)
    args.output = args.output or f"benchmarks/memory_tasks/{args.task}" + (f"_{grid}" if args.task == "mqar" else "")
    if args.task != "mqar" and args.train_length < DEFAULT_STATE_SETTINGS[args.task].shortest():
        parser.error(f"--train_length is too short for {args.task}")
    check_ran_config(parser, args)
    return args


def check_ran_config(parser, args) -> None:
    """Refuse, before any training, a `--ran_config` that is not an object of RANConfig fields with valid values, or
    that sets a field this benchmark sets itself."""
    from huggingface_hub.errors import StrictDataclassError

    from ran_hf.configuration_ran import RAN_FIELDS

    if not isinstance(args.ran_config, dict):
        parser.error(f"--ran_config must be a JSON object of RANConfig fields, got {args.ran_config!r}")
    fixed = [name for name in args.ran_config if name in RAN_SIZE_FIELDS]
    if fixed:
        parser.error(
            f"--ran_config: {', '.join(fixed)} set by the benchmark itself (--hidden_size, --num_layers, ...)"
        )
    unknown = [name for name in args.ran_config if name not in RAN_FIELDS]
    if unknown:
        parser.error(f"--ran_config: {', '.join(unknown)} {'is not a' if len(unknown) == 1 else 'are not'} "
                     f"RANConfig field{'s' * (len(unknown) > 1)} (docs/configuration.md lists them)")  # fmt: skip
    try:
        ran_config(mqar_vocab_size(), args, args.ran_config).validate_architecture()
    except (ValueError, TypeError, StrictDataclassError) as error:
        parser.error(f"--ran_config: {error}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info()
    args.commit = info["git_sha"]  # the revision this call started from, recorded with each run it trains
    print(machine_line(info), flush=True)
    command = command_line(__file__, argv)
    runs = earlier_runs(args)
    Path(args.checkpoints).mkdir(parents=True, exist_ok=True)

    def run_of(model, pairs, train_length, lengths, lr, seed, read_lengths):
        found = [r for r in runs if key(r) == (model, pairs, train_length, lr, seed)]
        if found and all(str(n) in found[0]["accuracy"] for n in read_lengths
                         if n <= args.max_eval_length.get(model, math.inf)):  # fmt: skip
            return
        if found:  # trained earlier: read its saved weights at the lengths it lacks
            run = found[0]
            trained = build(model, mqar_vocab_size() if args.task == "mqar" else STATE_VOCAB_SIZE, args, max(lengths))
            trained.load_state_dict(torch.load(checkpoint_path(run, args)))
        else:
            print(f"{args.task} {pairs or ''} {model} lr {lr} seed {seed} at {train_length}", flush=True)
            trained, run = train(model, args.task, pairs, train_length, max(lengths), lr, seed, args)
            torch.save(trained.state_dict(), checkpoint_path(run, args))
            print(f"  validation {100 * run['validation_accuracy']:.1f}%, {run['train_seconds']:.0f} s", flush=True)
            runs.append(run)
        read(trained, run, read_lengths, args)
        save(runs, args, info, command)

    for pairs, train_length, lengths in experiments(args):
        for model in args.models:
            for lr in args.learning_rates:  # the sweep: read at the training length only
                run_of(model, pairs, train_length, lengths, lr, args.seed, [train_length])
            best, _ = best_runs(runs, model, pairs, train_length)
            for seed in [args.seed, *args.extra_seeds]:  # the best rate: read at every length
                run_of(model, pairs, train_length, lengths, best, seed, lengths)
    record = save(runs, args, info, command)
    print(result_path(args.output, ".md").read_text())
    return record


if __name__ == "__main__":
    main()
