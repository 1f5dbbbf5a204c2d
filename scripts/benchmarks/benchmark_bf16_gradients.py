#!/usr/bin/env python
"""How far bfloat16 autocast moves every parameter gradient from its float32 value, per head, against
`nn.TransformerEncoder` with the same head and pooling.

    python scripts/benchmarks/benchmark_bf16_gradients.py                      # CPU, about a minute
    python scripts/benchmarks/benchmark_bf16_gradients.py --device cuda        # on a GPU

For each model: one batch (two sequences, one padded), the loss of the head's task, its gradients in float32 and
under `torch.autocast(device, dtype=torch.bfloat16)` from the same float32 weights. Error of a parameter: relative L2,
|g_bf16 - g_fp32| / |g_fp32|. Reported: the largest over the parameters (max), their median, and the error of all
gradients as one vector (total). Writes benchmarks/bf16/bf16_<device>.{json,md}.

Max pooling (sequence classification) sends each feature's gradient to one token; where two tokens nearly tie, bf16
rounding can pick the other one, and the gradient moves to another place entirely. So for that head the largest
error is also measured with the float32 pass's choice of tokens kept under autocast: what is left is arithmetic.
"""

import argparse
import json
import statistics
from pathlib import Path

import torch
from benchmark_utils import NON_NEGATIVE, POSITIVE, command_line, machine_info, machine_line, result_record
from torch import nn


HEADS = ["masked-lm", "sequence-classification", "token-classification", "causal-lm"]
NUM_LABELS = 5


def masked_max(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return states.masked_fill(~mask[..., None], torch.finfo(states.dtype).min).amax(1)


class FirstMaxChoice:
    """Max pooling that keeps the tokens its first call chose (the float32 pass's) for every later call."""

    def __init__(self):
        self.choice = None

    def __call__(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        filled = states.masked_fill(~mask[..., None], torch.finfo(states.dtype).min)
        if self.choice is None:
            self.choice = filled.argmax(1)  # (B, D)
        return filled.gather(1, self.choice[:, None]).squeeze(1)


class EncoderBaseline(nn.Module):
    """`nn.TransformerEncoder` (post-norm, GELU) with the RAN heads' shapes: token logits, or max-pooled tokens into a
    classifier as RAN's pooler does."""

    def __init__(self, args, head: str):
        super().__init__()
        self.head_name = head
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size, padding_idx=0)
        self.position = nn.Embedding(args.length, args.hidden_size)
        layer = nn.TransformerEncoderLayer(
            args.hidden_size, args.num_heads, 4 * args.hidden_size, dropout=0.0, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, args.num_layers, enable_nested_tensor=False)
        outputs = NUM_LABELS if "classification" in head else args.vocab_size
        self.pool = nn.Linear(args.hidden_size, args.hidden_size) if head == "sequence-classification" else None
        self.out = nn.Linear(args.hidden_size, outputs)
        self.pool_tokens = masked_max

    def forward(self, ids, mask, labels):
        length = ids.shape[1]
        states = self.embed(ids) + self.position.weight[:length]
        causal = nn.Transformer.generate_square_subsequent_mask(length) if self.head_name == "causal-lm" else None
        states = self.encoder(states, mask=causal, src_key_padding_mask=~mask.bool(), is_causal=causal is not None)
        if self.pool is not None:
            pooled = self.pool_tokens(states, mask.bool())
            return nn.functional.cross_entropy(self.out(self.pool(pooled)).float(), labels)
        logits = self.out(states).float()
        if self.head_name == "causal-lm":
            logits, labels = logits[:, :-1], labels[:, 1:]
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def ran_model(args, head: str):
    from ran_hf import (
        RANConfig,
        RANForCausalLM,
        RANForMaskedLM,
        RANForSequenceClassification,
        RANForTokenClassification,
    )

    config = RANConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        head_dim=args.hidden_size // args.num_heads,
        window_size=args.window_size,
        min_window_size=args.window_size // 4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=NUM_LABELS,
        scan_implementation=args.scan,
        is_causal=head == "causal-lm",
    )
    classes = {
        "masked-lm": RANForMaskedLM,
        "sequence-classification": RANForSequenceClassification,
        "token-classification": RANForTokenClassification,
        "causal-lm": RANForCausalLM,
    }
    model = classes[head](config)

    def loss(ids, mask, labels):
        return model(ids, attention_mask=mask, labels=labels).loss

    return model, loss


def batch(args, head: str, device):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, args.vocab_size, (2, args.length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, : args.length // 5] = 0  # one left-padded row
    ids = ids * mask
    if head == "sequence-classification":
        labels = torch.randint(0, NUM_LABELS, (2,), generator=generator)
    elif head == "token-classification":
        labels = torch.randint(0, NUM_LABELS, ids.shape, generator=generator).masked_fill(mask == 0, -100)
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return ids.to(device), mask.to(device), labels.to(device)


def gradients(model, loss_fn, inputs, device, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        torch.manual_seed(0)  # both passes draw the same training window size (`training_window_sizes`)
        loss = loss_fn(*inputs)
    loss.backward()
    return {name: p.grad.detach().double().clone() for name, p in model.named_parameters() if p.grad is not None}


def gradient_errors(model, loss_fn, inputs, device) -> dict:
    exact = gradients(model, loss_fn, inputs, device, autocast=False)
    mixed = gradients(model, loss_fn, inputs, device, autocast=True)
    errors = {}
    for name, want in exact.items():
        norm = want.norm().item()
        if norm > 0:
            errors[name] = ((mixed[name] - want).norm() / norm).item()
    total = torch.cat([(mixed[n] - exact[n]).flatten() for n in errors]).norm()
    total = (total / torch.cat([exact[n].flatten() for n in errors]).norm()).item()
    worst = max(errors, key=errors.get)
    return {
        "max": errors[worst],
        "max_parameter": worst,
        "median": statistics.median(errors.values()),
        "total": total,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden_size", type=POSITIVE, default=64)
    parser.add_argument("--num_layers", type=POSITIVE, default=2)
    parser.add_argument("--num_heads", type=POSITIVE, default=4)
    parser.add_argument("--window_size", type=POSITIVE, default=32)
    parser.add_argument("--length", type=POSITIVE, default=300)
    parser.add_argument("--vocab_size", type=POSITIVE, default=1000)
    parser.add_argument("--scans", nargs="+", default=["reference", "fused"])
    parser.add_argument("--seeds", type=NON_NEGATIVE, nargs="+", default=[0, 1])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output_dir", type=Path, default=Path("benchmarks/bf16"))
    args = parser.parse_args()
    device = torch.device(args.device)
    info = machine_info(args.device)
    print(machine_line(info))

    results = []
    models = [("transformer-encoder", None)] + [(f"ran-{scan}", scan) for scan in args.scans]
    print(f"{'head':<26}{'model':<22}{'seed':>5}{'max':>9}{'median':>9}{'total':>9}  worst parameter")
    for head in HEADS:
        inputs = batch(args, head, device)
        for name, scan in models:
            for seed in args.seeds:
                torch.manual_seed(seed)
                if scan is None:
                    model = EncoderBaseline(args, head)
                    loss_fn = model
                else:
                    args.scan = scan
                    model, loss_fn = ran_model(args, head)
                model.to(device).train()
                errors = gradient_errors(model, loss_fn, inputs, device)
                if head == "sequence-classification":
                    pooling_owner = model if scan is None else model.model.pooler
                    pooling_owner.pool_tokens = FirstMaxChoice()
                    errors["max_same_choice"] = gradient_errors(model, loss_fn, inputs, device)["max"]
                results.append({"head": head, "model": name, "seed": seed, **errors})
                print(
                    f"{head:<26}{name:<22}{seed:>5}{errors['max']:>9.2%}{errors['median']:>9.2%}"
                    f"{errors['total']:>9.2%}  {errors['max_parameter']}"
                )

    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.output_dir / f"bf16_{device.type}"
    settings = {key: value for key, value in vars(args).items() if key not in ("output_dir", "scan")}
    command = command_line(__file__)
    dtype = "float32 vs bfloat16 autocast"
    record = result_record(command, settings, results, device=device.type, dtype=dtype, info=info)
    with open(f"{stem}.json", "w") as file:
        json.dump(record, file, indent=2)
    lines = [
        f"# Gradient error under bfloat16 autocast ({device.type})",
        "",
        f"`{machine_line(info)}`",
        "",
        f"Command: `{command}`",
        "",
        f"Settings: {settings}. Relative L2 error of each parameter's gradient under `torch.autocast(dtype=bfloat16)`"
        " against float32, same weights and batch; worst over seeds. Ratio: RAN's max error over the encoder's. Same"
        " choice: the max-pooled tokens of the float32 pass kept under autocast (sequence classification only).",
        "",
        "| head | model | max | median | total | ratio (max) | max, same choice | ratio, same choice |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for head in HEADS:
        rows = [row for row in results if row["head"] == head]
        baseline = max(row["max"] for row in rows if row["model"] == "transformer-encoder")
        for name, _ in models:
            mine = [row for row in rows if row["model"] == name]
            worst = {key: max(row[key] for row in mine) for key in ("max", "median", "total")}
            ratio = worst["max"] / baseline
            same_choice = "| – | – |"
            if all("max_same_choice" in row for row in rows):
                same = max(row["max_same_choice"] for row in mine)
                same_baseline = max(row["max_same_choice"] for row in rows if row["model"] == "transformer-encoder")
                same_choice = f"| {same:.2%} | {same / same_baseline:.2f} |"
            lines.append(
                f"| {head} | {name} | {worst['max']:.2%} | {worst['median']:.2%} | {worst['total']:.2%} | {ratio:.2f} "
                + same_choice
            )
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
