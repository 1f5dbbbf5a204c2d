#!/usr/bin/env python
"""Kernels per training step, counted without a GPU: RAN with each cell scan against a windowed transformer.

    python scripts/benchmarks/benchmark_kernels.py                  # BERT-base shape, 8 x 8K and 2 x 32K, meta device
    python scripts/benchmarks/benchmark_kernels.py --shapes 2x2048 --num_layers 2 --hidden_size 128 --num_heads 4

One masked-LM training step (forward with labels on every token, backward) of a `RANForMaskedLM` with random
weights runs on the `meta` device, which holds shapes and no data, so the full size fits on any machine. A
`TorchDispatchMode` counts every operator that reaches a backend: each one is a kernel launch on a GPU (a
`torch.library.triton_op` is one op, one launch). Memory review is chunked as on a CUDA device of
`--gpu_memory_gib` (80: an H100). Host reads (`.item()`, `.tolist()`) are counted as synchronisations; the
window layout, whose sizes the meta device cannot hold, is built on the CPU inside the count (its one read of the
sizes and the input checks is counted as a synchronisation). Views and allocations (`empty`, `empty_strided`) launch
nothing and are not counted. Each scan is counted alone, and the ops of the Triton scan's kernels (`ran_hf::scan_*`)
are reported per window and layer.

Ops run as CUDA runs them where meta would decompose them: `scaled_dot_product_attention` and training dropout are
one fused kernel each way. The bytes of an op are those of its tensors (a broadcast axis once; only the output of an
op that writes without reading, such as `new_zeros`), summed per operator and per model part (a module, layer
numbers folded, and the function its forward called), the backward's with the forward's that made them: the
`--breakdown` largest of each are printed and written.

The baseline is the same-size transformer encoder most long-document users would train instead: pre-norm layers
whose attention is exact within non-overlapping 256-token blocks (one `scaled_dot_product_attention` call over all
blocks), GELU MLP of 4x width, tied MLM head, no dropout (RAN counts its training dropout, 0.1).

A projected H100 step time is printed from stated assumptions (launch cost, matmul and memory rates): it is a
projection, labelled so, not a measurement. Writes `benchmarks/kernels/kernels_meta.json` and `.md`.
"""

import argparse
import dataclasses
import inspect
import json
import math
import re
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from benchmark_utils import (
    NON_NEGATIVE,
    NON_NEGATIVE_FLOAT,
    POSITIVE,
    TRAINING_DROPOUT,
    command_line,
    machine_info,
    machine_line,
    result_record,
    sized_ran_config,
)
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm.auto import tqdm

from ran_hf import RANConfig, RANForMaskedLM
from ran_hf.input_checks import InputChecks
from ran_hf.kernels import choice as kernel_choice
from ran_hf.memory_review import RANMemoryReview
from ran_hf.window_layout import RANWindowLayout


# Allocations and aliases (`_unsafe_view` is a view that the schema does not mark as one) launch nothing.
NOT_LAUNCHED = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::lift_fresh",
    "aten::_unsafe_view",
}  # fmt: skip
# Ops that only write their output: their tensor argument gives a shape and dtype, or is overwritten unread.
WRITE_ONLY = {
    "aten::new_zeros", "aten::new_ones", "aten::new_full", "aten::zeros_like", "aten::ones_like", "aten::full_like",
    "aten::fill_", "aten::zero_",
}  # fmt: skip
# Projection assumptions (H100 SXM, bf16), stated in every result file.
LAUNCH_SECONDS = 5e-6
MATMUL_FLOPS = 700e12
MEMORY_BYTES_PER_SECOND = 3.0e12
TORCH_FILES = str(Path(torch.__file__).parent)
TOP = 15  # operators and model parts listed by the bytes they move


def footprint(tensor: torch.Tensor) -> int:
    """The bytes a kernel reads or writes of `tensor`: a broadcast (stride-0) axis once, not once per index."""
    if not tensor.numel():
        return 0
    return math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride) * tensor.element_size()


class KernelCounter(TorchDispatchMode):
    """Counts the operators that launch a kernel, by name; sums the FLOPs of matrix products and the bytes that
    the other operators read and write, by operator and, given the `model`, by the part of it that runs them.

    A part is a module's name with layer numbers folded, and the function its `forward` called that ran the op
    (`model.layers.* (attend_windows)`; `model.layers.*.attention_glu` where the op is the forward's own). A forward
    op belongs to the innermost module running; a backward op to the part whose forward made its autograd node
    (found by the node's sequence number, which the forward op that made it reads as the last one handed out).
    """

    def __init__(self, model: nn.Module | None = None):
        super().__init__()
        self.counts: Counter = Counter()
        self.matmul_flops = 0
        self.other_bytes = 0
        self.host_syncs = 0
        self.bytes_by_op: Counter = Counter()
        self.bytes_by_part: Counter = Counter()
        self.model = model
        self._running: list[tuple] = []  # (part, its forward's codes) of the modules running, innermost last
        self._node_parts: dict[int, str] = {}  # autograd node sequence number -> the part whose forward made it
        self._hooks = []

    def __enter__(self):
        if self.model is not None:
            # Global hooks: the fused and Triton scans refuse modules with hooks of their own (they read weights).
            # A forward is known by its own code, or by the code of what wraps it: the layers' forward is wrapped, and
            # a kernel attached to a module (ran_hf/kernel_hub.py) runs in place of the forward it wraps.
            parts = {
                module: (re.sub(r"\.\d+(?=\.|$)", ".*", name) or type(module).__name__,
                         {inspect.unwrap(type(module).forward).__code__, type(module).forward.__code__})
                for name, module in self.model.named_modules()
            }  # fmt: skip

            def started(module, _):
                self._running.append(parts.get(module))  # None: a module of another model

            def finished(*_):
                self._running.pop()  # (and returns None: a hook's result would replace the module's output)

            self._hooks = [
                register_module_forward_pre_hook(started),
                register_module_forward_hook(finished, always_call=True),
            ]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def part(self) -> str:
        running = next((module for module in reversed(self._running) if module is not None), None)
        if running is not None:  # a forward (or a checkpoint's recomputation in the backward)
            part, forward = running
            frame, called = sys._getframe(2), None  # from the caller of __torch_dispatch__ outwards
            while frame is not None and frame.f_code not in forward:
                code = frame.f_code  # neither torch's Python wrappers, this script's modes, autograd functions nor
                # the dispatch of an op with a kernel attached (the kernel or the plain op it runs names the part)
                skipped = TORCH_FILES in code.co_filename or code.co_name == "kernel_or_plain"
                if not skipped and code.co_name not in ("__torch_function__", "forward"):
                    called = code.co_name
                frame = frame.f_back
            if frame is not None and called is not None:
                part = f"{part} ({called})"
            self._node_parts.setdefault(torch._C._autograd._get_sequence_nr() - 1, part)
            return part
        node = torch._C._current_autograd_node()
        if node is None:
            return "(outside the model)"
        return self._node_parts.get(node._sequence_nr(), f"({node.name()})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        host_read = name == "aten::_local_scalar_dense" or (
            name == "aten::_to_copy" and args[0].is_meta and str((kwargs or {}).get("device", "meta")) == "cpu"
        )
        if name == "aten::_to_copy" and str((kwargs or {}).get("device", "")) == "meta":
            return func(*args, **(kwargs or {}))  # a layout built on the CPU (below) moving to meta: no kernel
        if host_read:  # the host waits for the device here; a meta tensor has no value, so read zeros
            self.host_syncs += 1
            self.counts[name] += 1
            return 0 if name == "aten::_local_scalar_dense" else torch.zeros(args[0].shape, dtype=args[0].dtype)
        part = self.part()
        outputs = func(*args, **(kwargs or {}))
        if name in NOT_LAUNCHED or func.is_view:
            return outputs
        self.counts[name] += 1
        moving = outputs if name in WRITE_ONLY else (args, kwargs, outputs)
        tensors = [t for t in torch.utils._pytree.tree_leaves(moving) if isinstance(t, torch.Tensor)]
        if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
            first, second = (t for t in tensors[-3:-1]) if name in ("aten::mm", "aten::bmm") else tensors[-3:-1]
            self.matmul_flops += 2 * first.numel() * second.shape[-1]
        else:
            moved = sum(footprint(t) for t in tensors)
            self.other_bytes += moved
            self.bytes_by_op[name] += moved
            self.bytes_by_part[part] += moved
        return outputs


class FusedOpsAsOnGPU(TorchFunctionMode):
    """Ops as CUDA runs them, one fused kernel each way, where the meta device would decompose them:

    - `scaled_dot_product_attention` (the H200 profiles show cuDNN's; a dozen ops on meta): here the memory-efficient
      kernel, which takes any additive mask and dropout (its meta kernels give its shapes, and its backward is one op
      too);
    - training dropout: `native_dropout`, which writes the output and a boolean mask (its backward reads that mask),
      where meta draws a mask of the input's dtype, scales it and multiplies, three ops.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.dropout:
            drop = inspect.signature(F.dropout).bind(*args, **kwargs)
            drop.apply_defaults()
            states, rate, training, inplace = drop.args
            if training and 0 < rate < 1 and not inplace and states.numel():  # ATen's test for the fused kernel
                return torch.native_dropout(states, rate, True)[0]
            return func(*args, **kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, *rest = args
        mask = kwargs.get("attn_mask", rest[0] if rest else None)
        if mask is not None:  # the kernel takes the bias at full size, broadcast with strides
            mask = mask.expand(*query.shape[:-1], key.shape[-2])
        dropout, causal = kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False)
        attention = torch.ops.aten._scaled_dot_product_efficient_attention
        return attention(query, key, value, mask, True, dropout, causal, scale=kwargs.get("scale"))[0]


class BlockAttentionLayer(nn.Module):
    def __init__(self, hidden, heads, block):
        super().__init__()
        self.heads, self.block = heads, block
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, states):
        batch, length, hidden = states.shape
        blocks = length // self.block
        qkv = self.qkv(self.norm1(states)).view(batch * blocks, self.block, 3, self.heads, -1)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B L/W, H, W, d) each
        attended = F.scaled_dot_product_attention(query, key, value)
        attended = attended.transpose(1, 2).reshape(batch, length, hidden)
        states = states + self.out(attended)
        return states + self.mlp(self.norm2(states))


class BlockAttentionMLM(nn.Module):
    """The windowed-transformer baseline: embeddings, pre-norm block-attention layers, a tied MLM head."""

    def __init__(self, vocab, hidden, layers, heads, block):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(BlockAttentionLayer(hidden, heads, block) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, input_ids, labels):
        states = self.embed(input_ids)
        for layer in self.layers:
            states = layer(states)
        logits = self.norm(states) @ self.embed.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def ran_config(args, scan: str) -> RANConfig:
    # Dropout as in training (the config's default), so that its masks are counted.
    return sized_ran_config(args, min_window_size=16, scan_implementation=scan, **TRAINING_DROPOUT)


@contextmanager
def memory_review_sized_for(gib: float):
    """Memory review chunks as on a CUDA device of `gib` GiB (the meta device is not one)."""
    chunk_length = RANMemoryReview.chunk_length

    def sized(self, batch_size, num_cells, device=None):
        budget = max(self.max_chunk_scores, int(gib * 2**30) // (4 * self.device_memory_share))
        return max(1, budget // max(1, batch_size * num_cells))

    RANMemoryReview.chunk_length = sized if gib else chunk_length
    try:
        yield
    finally:
        RANMemoryReview.chunk_length = chunk_length


@contextmanager
def layouts_built_with_values():
    """The window layout reads its sizes (and the forward's input checks) from the device, and a head reads its
    labels' checks, which a meta tensor cannot answer: build the layout from an all-ones CPU mask of the same shape
    (its ops are counted like any other), then move it to meta; read meta check values as zeros. Yields a list that
    gets one entry per layout built and per labels read: each is one host synchronisation."""
    build, read_and_judge = RANWindowLayout.from_attention_mask, InputChecks.read_and_judge
    reads = []

    def from_attention_mask(attention_mask, config, past_lengths=None, read_with_sizes=None, **layout_inputs):
        if not attention_mask.is_meta:
            return build(attention_mask, config, past_lengths, read_with_sizes, **layout_inputs)
        if any(value is not None for value in layout_inputs.values()):
            raise NotImplementedError(f"counting on meta builds the layout of a plain mask only, not {layout_inputs}")
        reads.append(("layout", attention_mask.shape))
        if read_with_sizes is not None:  # the input checks' values: a meta tensor reads as zeros
            read_with_sizes = torch.zeros(read_with_sizes.shape, dtype=read_with_sizes.dtype)
        layout = build(torch.ones(attention_mask.shape, dtype=torch.bool), config, None, read_with_sizes)
        moved = {
            field.name: value.to("meta") if isinstance(value := getattr(layout, field.name), torch.Tensor) else value
            for field in dataclasses.fields(layout)
        }
        return dataclasses.replace(layout, **moved)

    def read_meta_as_zeros(checks: InputChecks) -> None:
        if not checks.values.is_meta:
            return read_and_judge(checks)
        reads.append(("labels", checks.values.shape))
        checks.judge([0] * checks.values.numel())

    RANWindowLayout.from_attention_mask, InputChecks.read_and_judge = from_attention_mask, read_meta_as_zeros
    try:
        yield reads
    finally:
        RANWindowLayout.from_attention_mask, InputChecks.read_and_judge = build, read_and_judge


def count_step(model_name: str, args, batch: int, length: int) -> dict:
    with torch.device("meta"):
        if model_name == "transformer":
            model = BlockAttentionMLM(args.vocab_size, args.hidden_size, args.num_layers, args.num_heads,
                                      args.window_size)  # fmt: skip
        else:
            model = RANForMaskedLM(ran_config(args, model_name.removeprefix("ran-")))
        ids = torch.randint(1, args.vocab_size, (batch, length))
    model.train()
    counter = KernelCounter(model)
    with layouts_built_with_values() as layout_reads, memory_review_sized_for(args.gpu_memory_gib), counter, \
            FusedOpsAsOnGPU():  # fmt: skip
        if model_name == "transformer":
            loss = model(ids, ids)
        else:
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
    windows = batch * -(-length // args.window_size)
    scan_ops = sum(n for name, n in counter.counts.items() if name.startswith("ran_hf::scan_"))
    projected = (
        sum(counter.counts.values()) * LAUNCH_SECONDS
        + counter.matmul_flops / MATMUL_FLOPS
        + counter.other_bytes / 2 / MEMORY_BYTES_PER_SECOND  # counted in float32 on meta; bf16 moves half
    )
    return {
        "model": model_name,
        "shape": f"{batch}x{length}",
        "kernels": sum(counter.counts.values()),
        "host_syncs": counter.host_syncs + len(layout_reads),
        "triton_scan_kernels_per_window_and_layer": (
            scan_ops / (windows / batch * args.num_layers) if scan_ops else None
        ),
        "matmul_tflop": counter.matmul_flops / 1e12,
        "other_gbytes_float32": counter.other_bytes / 1e9,
        "projected_h100_seconds": projected,
        "top_ops": counter.counts.most_common(12),
        "top_bytes": [(name, moved / 1e9) for name, moved in counter.bytes_by_op.most_common(TOP)],
        "top_parts": [(part, moved / 1e9) for part, moved in counter.bytes_by_part.most_common(TOP)],
    }


def bytes_breakdown(result: dict, rows: int) -> str:
    """The operators and the model parts moving the most bytes, side by side."""
    lines = [f"{result['model']} {result['shape']}: {result['other_gbytes_float32']:.1f} GB"]
    lines.append(f"  {'operator':<56}{'GB':>7}    {'model part':<48}{'GB':>7}")
    for (op, op_gb), (part, part_gb) in zip(result["top_bytes"][:rows], result["top_parts"][:rows]):
        lines.append(f"  {op:<56}{op_gb:>7.1f}    {part:<48}{part_gb:>7.1f}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["ran-reference", "ran-fused", "ran-triton", "transformer"])
    parser.add_argument("--shapes", nargs="+", default=["8x8192", "2x32768"], help="BATCHxLENGTH")
    parser.add_argument("--hidden_size", type=POSITIVE, default=768)
    parser.add_argument("--num_layers", type=POSITIVE, default=12)
    parser.add_argument("--num_heads", type=POSITIVE, default=12)
    parser.add_argument("--window_size", type=POSITIVE, default=256)
    parser.add_argument("--vocab_size", type=POSITIVE, default=30522)
    parser.add_argument(
        "--gpu_memory_gib",
        type=NON_NEGATIVE_FLOAT,
        default=80,
        help="memory-review chunks as on a GPU this large (0: a CPU's)",
    )
    parser.add_argument(
        "--pytorch_token_ops",
        action="store_true",
        help="count with the Triton normalisation, gated linear unit, rotary embedding and window projection switched "
        "off (their PyTorch ops instead)",
    )
    parser.add_argument(
        "--breakdown",
        type=NON_NEGATIVE,
        default=8,
        help="print and write the N operators and model parts moving most bytes",
    )
    parser.add_argument("--output_dir", type=Path, default=Path("benchmarks/kernels"))
    args = parser.parse_args()
    shapes = []
    for shape in args.shapes:
        batch, _, length = shape.partition("x")
        if not (batch.isdigit() and length.isdigit()) or int(length) % args.window_size:
            parser.error(f"--shapes takes BATCHxLENGTH with LENGTH a multiple of --window_size, got {shape!r}")
        shapes.append((int(batch), int(length)))

    if args.breakdown < 0 or args.breakdown > TOP:
        parser.error(f"--breakdown takes 0 to {TOP} (the operators and parts kept per result), got {args.breakdown}")
    for op in kernel_choice.TRITON_TOKEN_OPS:
        kernel_choice.TRITON[op] = not args.pytorch_token_ops
    info = machine_info("meta")
    print(machine_line(info))
    results = []
    for batch, length in shapes:
        for name in tqdm(args.models, desc=f"{batch}x{length}", leave=False):
            results.append(count_step(name, args, batch, length))
    header = f"{'model':<15}{'shape':>9}{'kernels':>10}{'scan/window/layer':>19}{'matmul TFLOP':>14}"
    header += f"{'other GB fp32':>15}{'projected H100 s':>18}{'x transformer':>15}"
    lines = [header]
    transformer = {r["shape"]: r for r in results if r["model"] == "transformer"}
    for r in results:
        per_window = r["triton_scan_kernels_per_window_and_layer"]
        per_window = "" if per_window is None else f"{per_window:.1f}"
        baseline = transformer.get(r["shape"])  # bytes and projected time against the transformer's
        ratios = "" if baseline is None else (
            f"{r['other_gbytes_float32'] / baseline['other_gbytes_float32']:.2f} / "
            f"{r['projected_h100_seconds'] / baseline['projected_h100_seconds']:.2f}"
        )  # fmt: skip
        lines.append(
            f"{r['model']:<15}{r['shape']:>9}{r['kernels']:>10,}{per_window:>19}{r['matmul_tflop']:>14.2f}"
            f"{r['other_gbytes_float32']:>15.1f}{r['projected_h100_seconds']:>18.3f}{ratios:>15}"
        )
    table = "\n".join(lines)
    print(table)
    breakdown = "\n\n".join(bytes_breakdown(r, args.breakdown) for r in results) if args.breakdown else ""
    print(breakdown)
    assumptions = (
        f"Projection, not a measurement: {LAUNCH_SECONDS * 1e6:.0f} us per launch + matmul FLOPs at "
        f"{MATMUL_FLOPS / 1e12:.0f} TFLOP/s + other ops' bytes (halved for bf16) at "
        f"{MEMORY_BYTES_PER_SECOND / 1e12:.0f} TB/s."
    )
    print(assumptions)
    command = command_line(__file__)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    settings = {**vars(args), "assumptions": assumptions}
    # Counted on the meta device in float32 (the projection halves the other bytes for bf16).
    report = result_record(command, settings, results, device="meta", dtype="float32", info=info)
    name = "kernels_meta_pytorch_token_ops" if args.pytorch_token_ops else "kernels_meta"
    (args.output_dir / f"{name}.json").write_text(json.dumps(report, indent=2, default=str))
    markdown = f"# Kernels per MLM training step\n\n`{command}`\n\n{machine_line(info)}, {info['date']}\n\n"
    markdown += f"```\n{table}\n```\n\n{assumptions} x transformer: GB / projected time against the transformer's.\n"
    if breakdown:
        markdown += f"\n## Where the bytes go\n\nThe {args.breakdown} operators and model parts that move the most "
        markdown += f"non-matmul bytes (GB, float32), forward and backward together.\n\n```\n{breakdown}\n```\n"
    (args.output_dir / f"{name}.md").write_text(markdown)
    print(f"wrote {args.output_dir}/{name}.json and .md")


if __name__ == "__main__":
    main()
