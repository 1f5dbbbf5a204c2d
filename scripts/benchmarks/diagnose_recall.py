"""Why is the causal RAN at chance on multi-query associative recall (MQAR)? Capacity, addressing or learning.

MQAR asks for the value of each of P keys after reading P key-value pairs. A RAN can only answer through memory
review: a query token weighs the cells of earlier windows, one vector per window, and reads a mix of them. Three
things can stop it, and each experiment here removes all but one:

- **capacity**: a cell cannot hold several bindings. `packed` puts all P pairs in one window (Zoology's layout) and
  the oracle hands every query that window's cell: what is left is whether one cell of size D holds P pairs, read
  back by a D x D review. `--hidden_size 128` (a cell of size 2D) says whether capacity grows with the cell.
- **addressing**: memory review cannot match a query key against the right cell. `no-filler` has one pair per
  window and nothing else (windows of 2 tokens: `k v`), so each cell holds exactly one binding; the oracle (`ran-
  oracle`) restricts every query's review to the cell of its pair's window. If the oracle learns and the plain RAN
  does not, the missing piece is finding the cell, not storing the pair.
- **learning**: the gradient never starts. `--gradients` measures, at initialisation, how much gradient reaches
  the cells of the pair windows and memory review's parameters, and how much review weight a query puts on its
  pair's cell compared with a uniform guess.

`one-per-window` is the benchmark's own one-pair-per-window layout (pair i opens window i, random filler fills the
rest, windows of 16), with and without the oracle.

Vocabulary: 64 filler tokens, 64 key and 64 value symbols (chance 1/64). Queries come last, each key asked once in
a random order, the answer teacher-forced after it (Zoology). Tiny models (hidden 64, 2 layers, 4 heads) trained
with AdamW (lr 2e-3 after a linear warmup of 100 steps), batch 32, gradient clipping 1.0, evaluated on 128 held-out
examples every `--eval_every` steps; a run stops once it is at 99% twice in a row. For each RAN run the result also
says where its queries' memory review looks at the end: the mean weight on the pair's cell, per layer.

    python scripts/benchmarks/diagnose_recall.py                  # every experiment below, one after another
    python scripts/benchmarks/diagnose_recall.py --experiments no-filler/ran no-filler/ran-oracle --steps 500
    python scripts/benchmarks/diagnose_recall.py --gradients_only

Writes benchmarks/recall/recall_diagnosis.{json,md,png}.
"""

import argparse
import json
import math
import time
from dataclasses import dataclass, field
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
from causal_baselines import causal_baseline

from ran_hf import RANConfig, RANForCausalLM
from ran_hf.building_blocks import unit_vectors


NUM_SYMBOLS = 64  # filler tokens, keys and values: 64 each
FIRST_FILLER, FIRST_KEY, FIRST_VALUE = 1, 1 + NUM_SYMBOLS, 1 + 2 * NUM_SYMBOLS  # 0 is padding
VOCAB_SIZE = 1 + 3 * NUM_SYMBOLS

# layout -> window size: `no-filler` windows are exactly one pair.
WINDOWS = {"no-filler": 2, "one-per-window": 16, "packed": 16, "spread": 16}
SPREAD_LENGTH = 128  # `spread`'s training length by default (--length): pairs first, queries at the end

# name -> RAN fields that differ from the causal defaults, and the change the diagnosis makes to the model: "oracle"
# hands memory review the pair's cell, "token-keys" scores a cell by its window's tokens (None: GPT-2). The oracle
# model reads no starting cell, so that its query reads exactly one cell: the right one.
MODELS = {
    "ran": ({}, None),
    "ran-oracle": ({"review_initial_cell": False}, "oracle"),
    "ran-token-keys": ({}, "token-keys"),
    "ran-associative": ({"associative_memory": True}, None),  # the change: keys bound to values per head
    "gpt2": None,  # matched-size baselines with a context that holds the whole sequence (causal_baselines.py)
    "llama": None,
    "gla": None,  # a recurrent anchor: gated linear attention
}

# The experiments run by default: layout / model / pairs, and the question each answers.
EXPERIMENTS = {
    "no-filler/ran-oracle": ("no-filler", "ran-oracle", 8),  # one binding per cell, the right cell handed over
    "no-filler/ran": ("no-filler", "ran", 8),  # ... found by memory review itself: addressing
    "packed/ran-oracle-p2": ("packed", "ran-oracle", 2),  # capacity: 2, 4, 8 pairs in the one cell handed over
    "packed/ran-oracle": ("packed", "ran-oracle", 8),
    "one-per-window/ran-oracle": ("one-per-window", "ran-oracle", 8),  # the benchmark's layout, random filler
    "no-filler/gpt2": ("no-filler", "gpt2", 8),
    "one-per-window/ran": ("one-per-window", "ran", 8),
    "packed/ran": ("packed", "ran", 8),  # Zoology's layout
    "packed/ran-oracle-p4": ("packed", "ran-oracle", 4),
    "no-filler/ran-token-keys": ("no-filler", "ran-token-keys", 8),  # a change the diagnosis points to
    "one-per-window/ran-token-keys": ("one-per-window", "ran-token-keys", 8),
    "no-filler/ran-associative": ("no-filler", "ran-associative", 8),  # the associative memory (config field)
    "one-per-window/ran-associative": ("one-per-window", "ran-associative", 8),
    "packed/ran-associative": ("packed", "ran-associative", 8),
    "packed/gpt2": ("packed", "gpt2", 8),
    "packed/llama": ("packed", "llama", 8),
    "packed/gla": ("packed", "gla", 8),
    # Zoology's layout with filler between pairs and queries: trained at --length, scored at every --eval_lengths
    "spread/ran-associative": ("spread", "ran-associative", 8),
    "spread/ran": ("spread", "ran", 8),
    "spread/gpt2": ("spread", "gpt2", 8),
    "spread/llama": ("spread", "llama", 8),
    "spread/gla": ("spread", "gla", 8),
    "spread/ran-associative-p4": ("spread", "ran-associative", 4),  # fewer and more pairs (16 fill two windows)
    "spread/ran-associative-p16": ("spread", "ran-associative", 16),
    "spread/gpt2-p4": ("spread", "gpt2", 4),
    "spread/gpt2-p16": ("spread", "gpt2", 16),
}


@dataclass
class RunResult:
    experiment: str
    layout: str
    model: str
    pairs: int
    hidden_size: int
    seed: int
    steps: int
    accuracy: float
    steps_to_90: int | None
    history: list  # [step, training loss, held-out accuracy]
    seconds: float
    review_on_pair_cell: list = field(default_factory=list)  # per layer, mean over queries (RAN only)
    length_accuracy: dict = field(default_factory=dict)  # `spread`: held-out accuracy at each evaluation length


# ---- data -----------------------------------------------------------------------------------------------------------


def sequence_length(layout: str, pairs: int, length: int | None = None) -> int:
    """Tokens of an example; `spread` takes its length (by default SPREAD_LENGTH), the other layouts have one."""
    window = WINDOWS[layout]
    if layout == "spread":
        length = length or SPREAD_LENGTH
        if length < shortest_spread(pairs):
            raise ValueError(
                f"`spread` puts {pairs} pairs in the first windows of {window} tokens and queries after: {length} "
                f"tokens are too short (at least {shortest_spread(pairs)})"
            )
        return length
    query_windows = math.ceil(2 * pairs / window)
    if layout == "no-filler":
        return 4 * pairs
    if layout == "one-per-window":
        return (pairs + query_windows) * window
    if 2 * pairs > window:
        raise ValueError(f"`packed` puts every pair in one window of {window} tokens: at most {window // 2} pairs")
    return (1 + query_windows) * window


def shortest_spread(pairs: int) -> int:
    """`spread`'s shortest length: the windows its pairs fill, then the queries."""
    window = WINDOWS["spread"]
    return math.ceil(2 * pairs / window) * window + 2 * pairs


def mqar_batch(generator: torch.Generator, batch_size: int, layout: str, pairs: int, length: int | None = None):
    """Ids (B, T); the positions (P,) of the query keys, each predicting its value at the next position; the values
    (B, P) asked for; and the window (B, P) that holds each query's pair."""
    window, length = WINDOWS[layout], sequence_length(layout, pairs, length)
    ids = FIRST_FILLER + torch.randint(0, NUM_SYMBOLS, (batch_size, length), generator=generator)
    keys = torch.stack([torch.randperm(NUM_SYMBOLS, generator=generator)[:pairs] for _ in range(batch_size)])
    values = torch.randint(0, NUM_SYMBOLS, (batch_size, pairs), generator=generator)
    spacing = window if layout == "one-per-window" else 2
    starts = torch.arange(pairs) * spacing  # pair i's key position
    ids[:, starts], ids[:, starts + 1] = FIRST_KEY + keys, FIRST_VALUE + values
    order = torch.stack([torch.randperm(pairs, generator=generator) for _ in range(batch_size)])  # (B, P)
    query_positions = length - 2 * pairs + 2 * torch.arange(pairs)
    ids[:, query_positions] = FIRST_KEY + keys.gather(1, order)
    ids[:, query_positions + 1] = FIRST_VALUE + values.gather(1, order)
    return ids, query_positions, values.gather(1, order), starts[order] // window


def oracle_cells(batch_size: int, length: int, query_positions: torch.Tensor, pair_windows: torch.Tensor):
    """(B, T): for each query key, the window whose cell holds its pair; -1 elsewhere (a normal review)."""
    cells = torch.full((batch_size, length), -1, dtype=torch.long)
    cells[:, query_positions] = pair_windows
    return cells


# ---- models ---------------------------------------------------------------------------------------------------------


def build_model(name: str, layout: str, length: int, hidden_size: int = 64) -> torch.nn.Module:
    if MODELS[name] is None:
        return causal_baseline(name, VOCAB_SIZE, hidden_size, num_layers=2, num_heads=4, context=length)
    fields, change = MODELS[name]
    window = WINDOWS[layout]
    config = RANConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
        head_dim=hidden_size // 4, window_size=window, min_window_size=max(1, window // 8), hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, is_causal=True, scan_implementation="reference", **fields,
    )  # fmt: skip
    model = RANForCausalLM(config)
    if change == "oracle":
        install_oracle(model)
    elif change == "token-keys":
        install_token_keys(model)
    return model


def install_token_keys(model: RANForCausalLM) -> None:
    """Memory review scores a cell by the mean of its window's tokens' review queries (unit vectors), instead of a
    key projected from the cell: a query then meets, already at initialisation, the window that holds its own
    token. The cell still gives the value. An experiment for unpadded batches without a cache."""
    for layer in model.model.layers:
        review = layer.memory_review
        plain_project_cells, plain_read = review.project_cells, review.forward

        def read(token_states, raw_cells, initial_cell, layout, *rest, review=review,
                 plain_project_cells=plain_project_cells, plain_read=plain_read):  # fmt: skip
            padded = layout.to_padded(token_states)  # (B, L, D)
            queries = unit_vectors(review.q_proj(review.norm(padded)))  # (B, L, D): as review scores them
            windows = layout.token_window[..., None].expand_as(queries)  # (B, L, D); without a cache cell c = window c

            def project_cells(cells):
                projected = plain_project_cells(cells)
                if projected.dim() == 2:  # the starting cell keeps its own key
                    return projected
                pooled = queries.new_zeros(projected.shape[0], projected.shape[1], queries.shape[-1])
                keys = unit_vectors(pooled.scatter_add(1, windows, queries))  # (B, C, D)
                return torch.cat([keys, projected[..., keys.shape[-1] :]], dim=-1)

            review.project_cells = project_cells
            try:
                return plain_read(token_states, raw_cells, initial_cell, layout, *rest)
            finally:
                del review.project_cells

        review.forward = read


def install_oracle(model: RANForCausalLM) -> None:
    """Every layer's memory review reads, for a token with an oracle cell, that cell alone (`set_oracle`)."""
    if model.config.review_initial_cell:
        raise ValueError("the oracle restricts review to one cell: build the model with review_initial_cell=False")
    for layer in model.model.layers:
        review = layer.memory_review
        review.oracle_cells = None
        plain_review = review.review_tokens

        def review_tokens(token_states, cell_states, readable_cells, output_attentions=False, first_readable=None,
                    salient=None, real_tokens=None, *, review=review, plain_review=plain_review):  # fmt: skip
            if review.oracle_cells is not None:  # read cells [target, target + 1): the pair's cell only
                target = review.oracle_cells.to(readable_cells.device)
                handed = target >= 0
                first = torch.zeros_like(readable_cells) if first_readable is None else first_readable
                readable_cells = torch.where(handed, target + 1, readable_cells)
                first_readable = torch.where(handed, target, first)
            return plain_review(
                token_states, cell_states, readable_cells, output_attentions, first_readable, salient, real_tokens
            )

        review.review_tokens = review_tokens


def set_oracle(model, cells: torch.Tensor | None) -> None:
    if not isinstance(model, RANForCausalLM):
        return
    for layer in model.model.layers:
        if hasattr(layer.memory_review, "oracle_cells"):
            layer.memory_review.oracle_cells = cells


def query_logits(model, ids, query_positions, oracle: torch.Tensor | None, **kwargs):
    set_oracle(model, oracle)
    outputs = model(ids, **kwargs)
    return outputs.logits[:, query_positions], outputs


# ---- training -------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, layout: str, pairs: int, examples: int = 128, length: int | None = None, batch: int = 16):
    """Held-out accuracy over all queries, and (RAN) per layer the mean review weight a query puts on its pair's
    cell (the starting cell, where read, is cell 0). Examples are scored `batch` at a time: long ones stay small."""
    model.eval()
    ids, positions, values, windows = mqar_batch(
        torch.Generator().manual_seed(10_000), examples, layout, pairs, length
    )
    is_ran = isinstance(model, RANForCausalLM)
    correct, on_pair_cell = 0.0, None
    for start in range(0, examples, batch):
        part = slice(start, start + batch)
        rows = ids[part].shape[0]
        oracle = oracle_cells(rows, ids.shape[1], positions, windows[part]) if is_ran else None
        logits, outputs = query_logits(model, ids[part], positions, oracle, output_attentions=is_ran)
        correct += (logits.argmax(-1) == FIRST_VALUE + values[part]).float().sum().item()
        if is_ran:
            offset = int(model.config.review_initial_cell)
            weights = [
                w[torch.arange(rows)[:, None], positions, windows[part] + offset].sum().item()
                for w in outputs.memory_attentions
            ]  # fmt: skip  (B, T, C) each
            on_pair_cell = weights if on_pair_cell is None else [a + b for a, b in zip(on_pair_cell, weights)]
    model.train()
    on_pair_cell = [round(total / (examples * pairs), 3) for total in on_pair_cell or []]
    return correct / (examples * pairs), on_pair_cell


def train_once(experiment: str, args, seed: int) -> RunResult:
    torch.set_num_threads(args.threads)
    layout, model_name, pairs = EXPERIMENTS[experiment]
    torch.manual_seed(seed)
    first_length = sequence_length(layout, pairs, args.length)
    spread = layout == "spread"
    later_length = args.later_length if spread and args.later_length else first_length
    context = max([first_length, later_length, *args.eval_lengths]) if spread else first_length
    model = build_model(model_name, layout, context, args.hidden_size)
    is_ran = isinstance(model, RANForCausalLM)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    warmup = max(1, args.warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: min(1.0, (done + 1) / warmup))
    generator = torch.Generator().manual_seed(seed + 1)
    history, steps_to_90, above, losses, start = [], None, 0, [], time.perf_counter()
    on_pair_cell = []
    for step in range(1, args.steps + 1):
        # `spread` with --later_length: a curriculum over lengths, longer filler from step --later_from on
        length = later_length if step >= args.later_from else first_length
        ids, positions, values, windows = mqar_batch(generator, args.batch_size, layout, pairs, length)
        oracle = oracle_cells(args.batch_size, length, positions, windows) if is_ran else None
        logits, _ = query_logits(model, ids, positions, oracle)
        loss = F.cross_entropy(logits.flatten(0, 1), (FIRST_VALUE + values).flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            score, on_pair_cell = evaluate(model, layout, pairs, length=length)
            history.append([step, round(sum(losses[-args.eval_every :]) / len(losses[-args.eval_every :]), 4), score])
            print(f"  {experiment} step {step}: loss {history[-1][1]:.3f}, accuracy {score:.3f} {on_pair_cell}",
                  flush=True)  # fmt: skip
            above = above + 1 if score >= 0.99 else 0
            if score >= 0.9 and steps_to_90 is None:
                steps_to_90 = step
            if above == 2 and length == later_length:  # (with a curriculum, not before the longer length)
                break
    seconds = time.perf_counter() - start
    by_length = {}
    if layout == "spread":  # the same model on longer filler: does what it stored survive it?
        by_length = {n: round(evaluate(model, layout, pairs, length=n)[0], 4) for n in args.eval_lengths}
    return RunResult(
        experiment, layout, model_name, pairs, args.hidden_size, seed, step, history[-1][2], steps_to_90, history,
        round(seconds, 1), on_pair_cell, by_length,
    )  # fmt: skip


# ---- gradients at initialisation ------------------------------------------------------------------------------------


def gradients_at_init(layout: str, pairs: int, hidden_size: int = 64, seed: int = 0, batch_size: int = 32) -> dict:
    """One batch through the plain causal RAN at initialisation: how much gradient reaches each part, per layer the
    gradient norm of the cells of pair windows against the others, and how much review weight a query puts on its
    pair's cell against a uniform guess over the cells it may read; and how alike the review keys of the cells are
    (mean pairwise cosine)."""
    torch.manual_seed(seed)
    length = sequence_length(layout, pairs)
    model = build_model("ran", layout, length, hidden_size)
    ids, positions, values, windows = mqar_batch(torch.Generator().manual_seed(seed + 1), batch_size, layout, pairs)
    raw_cells = []

    def keep_cells(module, inputs, outputs):
        outputs[1].retain_grad()  # raw cells (N, B, D)
        raw_cells.append(outputs[1])

    hooks = [layer.register_forward_hook(keep_cells) for layer in model.model.layers]
    logits, outputs = query_logits(model, ids, positions, None, output_attentions=True)
    for hook in hooks:
        hook.remove()
    loss = F.cross_entropy(logits.flatten(0, 1), (FIRST_VALUE + values).flatten())
    loss.backward()

    def norm(prefix_test) -> float:
        grads = [p.grad.norm() ** 2 for n, p in model.named_parameters() if p.grad is not None and prefix_test(n)]
        return round(math.sqrt(sum(grads)), 5) if grads else 0.0

    pair_windows = torch.zeros(raw_cells[0].shape[0], dtype=torch.bool)
    pair_windows[windows.unique()] = True
    query_window = positions[0].item() // WINDOWS[layout]
    rows = torch.arange(batch_size)[:, None]
    result = {
        "layout": layout,
        "pairs": pairs,
        "loss": round(loss.item(), 4),
        "chance_loss": round(math.log(NUM_SYMBOLS), 4),
        "gradient_norm": {
            "all": norm(lambda n: True),
            "embeddings": norm(lambda n: "embed" in n),
            "memory_review": norm(lambda n: "memory_review" in n),
            "window_attention_and_cell_write": norm(lambda n: "qkv_proj" in n or ".o_proj" in n and "memory" not in n),
            "lm_head": norm(lambda n: "lm_head" in n),
        },
        "layers": [],
    }
    others = ~pair_windows & (torch.arange(len(pair_windows)) < query_window)  # filler windows before the queries
    for layer_index, (cells, weights) in enumerate(zip(raw_cells, outputs.memory_attentions)):
        grad = cells.grad.norm(dim=-1)  # (N, B): per window and sequence
        readable = (weights[rows, positions] > 0).sum(-1).float()  # (B, P) cells each query may read
        keys = model.model.layers[layer_index].memory_review.project_cells(cells.detach().transpose(0, 1))
        keys = F.normalize(keys[..., :hidden_size], dim=-1)  # (B, N, D) the cells' review keys
        similarity = keys @ keys.transpose(1, 2)
        off_diagonal = ~torch.eye(keys.shape[1], dtype=torch.bool)
        result["layers"].append(
            {
                "cell_gradient_pair_windows": round(grad[pair_windows].mean().item(), 6),
                "cell_gradient_other_windows": round(grad[others].mean().item(), 6) if others.any() else None,
                "review_on_pair_cell": round(weights[rows, positions, windows + 1].mean().item(), 4),
                "uniform_review_weight": round((1 / readable).mean().item(), 4),
                "review_key_cosine": round(similarity[:, off_diagonal].mean().item(), 4),
            }
        )
    return result


# ---- report ---------------------------------------------------------------------------------------------------------


def markdown(results: list[RunResult], gradients: list[dict], info: dict, args, command: str) -> str:
    lines = [f"Machine: {machine_line(info)}", "", f"Command: `{command}`", ""]
    if results:
        lines += [
            (
                f"MQAR through memory review: {args.steps} steps at most, batch {args.batch_size}, lr "
                f"{args.learning_rate} (warmup {args.warmup_steps}); accuracy over all queries of 128 held-out "
                "examples (chance 1.6%); review on pair cell: per layer, the mean memory-review weight a query puts "
                "on the cell of its pair's window at the end."
            ),
            "",
            (
                "| experiment | layout | model | pairs | hidden | tokens | final accuracy | steps to 90% | "
                "final loss | review on pair cell | seconds |"
            ),
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        for r in results:
            lines.append(
                f"| {r.experiment} | {r.layout} | {r.model} | {r.pairs} | {r.hidden_size} | "
                f"{sequence_length(r.layout, r.pairs, args.length)} | {100 * r.accuracy:.1f}% | "
                f"{r.steps_to_90 or '-'} | {r.history[-1][1]:.2f} | "
                f"{', '.join(map(str, r.review_on_pair_cell)) or '-'} | {r.seconds:.0f} |"
            )
    spread = [r for r in results if r.length_accuracy]
    if spread:
        lengths = list(spread[0].length_accuracy)
        trained = f"{args.length} tokens"
        if args.later_length:
            trained += f", then at {args.later_length} from step {args.later_from}"
        lines += [
            "",
            (
                f"`spread`: trained at {trained}, scored on 128 held-out examples at each length (pairs in the first "
                "window, 16 pairs in two; random filler, queries at the end; GPT-2's positions past the training "
                "length are untrained)."
            ),
            "",
            "| model | pairs | " + " | ".join(str(n) for n in lengths) + " |",
            "|---|---:|" + "---:|" * len(lengths),
        ]
        for r in spread:
            scores = " | ".join(f"{100 * r.length_accuracy[n]:.1f}%" for n in lengths)
            lines.append(f"| {r.model} | {r.pairs} | {scores} |")
    if gradients:
        lines += [
            "",
            (
                "At initialisation (plain causal RAN, one batch of 32): gradient norms, and per layer the gradient on "
                "the raw cells of pair windows and of the other windows before the queries, the review weight of a "
                "query on its pair's cell against a uniform guess, and the mean cosine between the cells' review keys."
            ),
            "",
            (
                "| layout | pairs | loss | all | memory review | window attention + cell write | layer | "
                "cell grad, pair windows | cell grad, others | review on pair cell | uniform | key cosine |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for g in gradients:
            norms = g["gradient_norm"]
            for index, layer in enumerate(g["layers"]):
                others = layer["cell_gradient_other_windows"]
                lines.append(
                    f"| {g['layout']} | {g['pairs']} | {g['loss']:.3f} | {norms['all']:.3f} | "
                    f"{norms['memory_review']:.4f} | {norms['window_attention_and_cell_write']:.4f} | {index} | "
                    f"{layer['cell_gradient_pair_windows']:.2e} | "
                    f"{'-' if others is None else f'{others:.2e}'} | "
                    f"{layer['review_on_pair_cell']:.3f} | {layer['uniform_review_weight']:.3f} | "
                    f"{layer['review_key_cosine']:.3f} |"
                )
    return "\n".join(lines) + "\n"


def plot(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = [layout for layout in WINDOWS if any(r.layout == layout for r in results)]
    figure, axes = plt.subplots(1, len(layouts), figsize=(5 * len(layouts), 3.6), squeeze=False)
    for axis, layout in zip(axes[0], layouts):
        for i, r in enumerate(x for x in results if x.layout == layout):
            steps, _, scores = zip(*r.history)
            label = f"{r.model}, {r.pairs} pairs" + (f", hidden {r.hidden_size}" if r.hidden_size != 64 else "")
            axis.plot(steps, scores, f"C{i}", label=label)
        axis.axhline(1 / NUM_SYMBOLS, color="grey", linestyle=":")
        axis.set(title=layout, xlabel="training step", ylim=(0, 1.02))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    axes[0][0].set_ylabel("MQAR accuracy")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", nargs="+", choices=list(EXPERIMENTS), default=list(EXPERIMENTS))
    parser.add_argument("--seeds", nargs="+", type=NON_NEGATIVE, default=[0])
    parser.add_argument(
        "--hidden_size", type=POSITIVE, default=64, help="RAN and GPT-2 width (128: a cell of size 2D)"
    )
    parser.add_argument("--steps", type=POSITIVE, default=600)
    parser.add_argument("--batch_size", type=POSITIVE, default=32)
    parser.add_argument("--learning_rate", type=POSITIVE_FLOAT, default=2e-3)
    parser.add_argument("--warmup_steps", type=NON_NEGATIVE, default=100)
    parser.add_argument("--eval_every", type=POSITIVE, default=100)
    parser.add_argument("--threads", type=POSITIVE, default=1, help="torch threads (the runs go one after another)")
    parser.add_argument("--length", type=POSITIVE, default=SPREAD_LENGTH, help="`spread`: training length in tokens")
    parser.add_argument(
        "--later_length",
        type=POSITIVE,
        default=None,
        help="`spread`: train at this length from step --later_from on (a curriculum over lengths)",
    )
    parser.add_argument("--later_from", type=POSITIVE, default=1, help="the step --later_length starts at")
    parser.add_argument(
        "--eval_lengths",
        nargs="+",
        type=POSITIVE,
        default=[128, 512, 2048],
        help="`spread`: lengths scored at the end",
    )
    parser.add_argument("--gradients_only", action="store_true", help="only the measurements at initialisation")
    parser.add_argument("--output", default="benchmarks/recall/recall_diagnosis", help="path prefix of .json/.md/.png")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "eval_every", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.warmup_steps < 0 or args.learning_rate <= 0:
        parser.error("--warmup_steps must be >= 0 and --learning_rate positive")
    spread_pairs = [EXPERIMENTS[name][2] for name in args.experiments if EXPERIMENTS[name][0] == "spread"]
    shortest = shortest_spread(max(spread_pairs, default=1))
    if spread_pairs and min([args.length, *args.eval_lengths, args.later_length or shortest]) < shortest:
        parser.error(f"--length and --eval_lengths must be >= {shortest} for the `spread` layout")
    if args.hidden_size < 8 or args.hidden_size % 8:
        parser.error("--hidden_size must be a multiple of 8 (4 heads of an even size)")
    return args


def save(results: list[RunResult], gradients: list[dict], info: dict, args, command: str) -> dict:
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figures = {"gradients_at_init": gradients, "runs": [r.__dict__ for r in results]}
    payload = result_record(command, vars(args), figures, device="cpu", dtype="float32", info=info)
    write_result(result_path(output, ".json"), json.dumps(payload, indent=1))
    write_result(result_path(output, ".md"), markdown(results, gradients, info, args, command))
    if results:
        plot(results, result_path(output, ".png"))
    return payload


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(machine_line(info))
    command = command_line(__file__, argv)
    gradients = [gradients_at_init(layout, 8, args.hidden_size) for layout in WINDOWS if layout != "spread"]
    results = []
    save(results, gradients, info, args, command)
    if not args.gradients_only:
        for experiment in args.experiments:
            for seed in args.seeds:
                result = train_once(experiment, args, seed)
                results.append(result)
                print(f"{experiment} seed {seed}: {100 * result.accuracy:.1f}% after {result.steps} steps "
                      f"({result.seconds:.0f} s)", flush=True)  # fmt: skip
                save(results, gradients, info, args, command)  # after every run: a long run keeps its part
    payload = save(results, gradients, info, args, command)
    print(markdown(results, gradients, info, args, command))
    return payload


if __name__ == "__main__":
    main()
