"""FSDP2 parity worker, run by `tests/test_fsdp.py` under `torchrun --nproc_per_node 2` (CPU, gloo).

Every rank builds the same tiny RAN, keeps an unsharded copy as the single-process reference, then shards the model
with `fully_shard` on each `RANLayer` and on the root (the unit that holds the embedding and the language models'
decoder: tied to the embedding in the masked LM, its own weight in the causal LM). Each rank trains the sharded
model on its half of a fixed batch, the reference on the whole batch, for a few optimizer steps; the reference's
loss is the mean of the two halves' losses, since FSDP averages gradients over ranks. Rank 0 writes the largest
difference between the gathered parameters and the reference's to `--output` (JSON).

    torchrun --standalone --nproc_per_node 2 tests/fsdp_worker.py --heads masked-lm causal-lm --output parity.json
"""

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ran_hf import RANConfig, RANForCausalLM, RANForMaskedLM, RANForSequenceClassification
from ran_hf.ran_layer import RANLayer


HEADS = {
    "masked-lm": RANForMaskedLM,
    "causal-lm": RANForCausalLM,
    "sequence-classification": RANForSequenceClassification,
}
# Four documents spanning one to four windows of 8 tokens, right-padded to 30: each rank gets two of them.
LENGTHS = (30, 17, 25, 9)
# Clipped as `Trainer` clips by default. Untrained, a RAN has a few very large gradients (the starting cells are zero
# and are standardised first), which would otherwise blow rounding differences up along with the weights.
MAX_GRAD_NORM = 1.0


def tiny_model(head: str) -> torch.nn.Module:
    config = RANConfig(
        vocab_size=96,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=8,
        window_size=8,
        min_window_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        is_causal=head == "causal-lm",
        num_labels=3,
        training_window_sizes=[8],  # one size: each rank would draw its own, the one-process reference another
    )
    torch.manual_seed(0)
    return HEADS[head](config)


def fixed_batch(head: str, vocab_size: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    longest = max(LENGTHS)
    input_ids = torch.randint(1, vocab_size, (len(LENGTHS), longest), generator=generator)
    attention_mask = (torch.arange(longest)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    input_ids = input_ids * attention_mask  # padding id 0
    if head == "sequence-classification":
        labels = torch.tensor([0, 2, 1, 2])
    elif head == "masked-lm":
        masked = (torch.rand(input_ids.shape, generator=generator) < 0.3) & attention_mask.bool()
        labels = torch.where(masked, input_ids, -100)
        input_ids = torch.where(masked, 1, input_ids)  # 1 plays [MASK]
    else:
        labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def half_batch(batch: dict, part: int) -> dict:
    half = len(LENGTHS) // 2
    return {name: tensor[part * half : (part + 1) * half] for name, tensor in batch.items()}


def optimizer_for(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", nargs="+", choices=sorted(HEADS), default=["masked-lm", "causal-lm"])
    parser.add_argument("--optimizers", nargs="+", choices=("sgd", "adamw"), default=["sgd"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 2, "the batch is split in two halves"
    records = [train_and_compare(head, optimizer, args.steps) for head in args.heads for optimizer in args.optimizers]
    if dist.get_rank() == 0:
        with open(args.output, "w") as handle:
            json.dump(records, handle, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def train_and_compare(head: str, optimizer_name: str, steps: int) -> dict:
    """Train the sharded model and the reference side by side; the largest parameter difference at the end."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = tiny_model(head)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world_size,))
    for module in model.modules():
        if isinstance(module, RANLayer):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root unit: embeddings, norms, heads, the tied decoder

    batch = fixed_batch(head, model.config.vocab_size)
    local = half_batch(batch, rank)
    sharded_optimizer = optimizer_for(model, optimizer_name)
    reference_optimizer = optimizer_for(reference, optimizer_name)
    losses = []
    for _ in range(steps):
        loss = model(**local).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)  # a DTensor norm over both ranks' shards
        sharded_optimizer.step()
        sharded_optimizer.zero_grad()

        # The reference reads the whole batch in one forward pass; its loss is the mean of the halves' losses.
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        halves = [half_batch({"logits": logits, "labels": batch["labels"]}, part) for part in (0, 1)]
        reference_loss = sum(reference_loss_of(reference, head, **half) for half in halves) / 2
        reference_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        losses.append(reference_loss.item())

    differences = {}
    reference_parameters = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor), f"{name} was not sharded"
        full = parameter.full_tensor()  # a collective: every rank takes part
        differences[name] = (full - reference_parameters[name]).abs().max().item()
    untrained = dict(tiny_model(head).named_parameters())
    worst = max(differences, key=differences.get)
    return {
        "head": head,
        "optimizer": optimizer_name,
        "steps": steps,
        "world_size": world_size,
        "parameters": len(differences),
        "sharded_layers": sum(isinstance(module, RANLayer) for module in model.modules()),
        "max_abs_difference": differences[worst],
        "worst_parameter": worst,
        # How far training moved the weights: far beyond the tolerance, so the comparison means something.
        "largest_update": max((reference_parameters[name] - untrained[name]).abs().max().item() for name in untrained),
        "reference_losses": losses,
    }


def reference_loss_of(model: torch.nn.Module, head: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if head == "sequence-classification":
        return torch.nn.functional.cross_entropy(logits, labels)
    return model.loss_function(logits, labels, vocab_size=model.config.vocab_size)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
