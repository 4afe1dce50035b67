"""``ooc trace MODEL --batch N``: record one training step of a zoo model.

Prints a short summary (functions per phase, variables by kind with bytes, in-core peak,
time to trace), or one JSON object with ``--json``, and writes the variable sequence with
``-o``. On ``meta`` (the default) nothing is allocated, so batch 1440 of ResNet-50 is fine.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from typing import Any

# Model options: flag -> builder keyword. A flag is passed only when given, and only to a
# model whose builder takes that keyword (anything else is an error, not silently ignored).
_MODEL_OPTIONS = {
    "seq_len": "--seq-len", "depth": "--depth", "width": "--width", "heads": "--heads",
    "vocab": "--vocab", "num_classes": "--num-classes", "base": "--base",
    "small_input": "--small-input", "batch_norm": "--batch-norm",
}


def register(subparsers: Any) -> None:
    from ooc.cli.args import output_file, positive_int, trace_device, zoo_model

    p = subparsers.add_parser(
        "trace", help="record one training step of a zoo model as a variable sequence",
        description="Record forward, loss, backward and optimizer step of a zoo model "
                    "(on meta by default: no memory used) and summarize or save it.")
    p.add_argument("model", metavar="MODEL", type=zoo_model, help="zoo model name (resnet50, vgg16, densenet121, "
                   "unet, gpt2, small_cnn, tiny_transformer)")
    p.add_argument("--batch", type=positive_int, required=True, help="batch size")
    p.add_argument("--device", default="meta", type=trace_device,
                   help="meta (shapes only, default), cpu or cuda (real run, ops timed)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"),
                   help="sgd (momentum 0.9, default), adam or adamw")
    p.add_argument("--image-size", type=positive_int, help="image side for image models")
    p.add_argument("--seq-len", type=positive_int, help="sequence length (gpt2, tiny_transformer)")
    p.add_argument("--depth", type=positive_int, help="blocks (gpt2, tiny_transformer) or poolings (unet)")
    p.add_argument("--width", type=positive_int, help="model width (gpt2, tiny_transformer, small_cnn)")
    p.add_argument("--heads", type=positive_int, help="attention heads (gpt2, tiny_transformer)")
    p.add_argument("--vocab", type=positive_int, help="vocabulary size (gpt2, tiny_transformer)")
    p.add_argument("--num-classes", type=positive_int, help="classes of classifier and unet outputs")
    p.add_argument("--base", type=positive_int, help="channels at full resolution (unet)")
    p.add_argument("--small-input", action="store_true", default=None,
                   help="vgg16 for 32x32 inputs (NNTrainer's CIFAR variant)")
    p.add_argument("--batch-norm", action="store_true", default=None, help="vgg16 with BatchNorm")
    p.add_argument("--measure", action="store_true",
                   help="time each op (real devices only)")
    p.add_argument("-o", "--output", metavar="FILE", type=output_file(), help="write the sequence as JSON here")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    import ooc
    from ooc import models
    from ooc.trace import summary
    from vmm.errors import OOCError

    builder = models.builder(args.model)  # UnknownModel (exit 2) for a bad name
    takes = inspect.signature(builder).parameters
    kw: dict[str, Any] = {}
    for key, flag in _MODEL_OPTIONS.items():
        value = getattr(args, key)
        if value is None:
            continue
        if key not in takes:
            raise OOCError(f"{flag} does not apply to {args.model} "
                           f"(its options: {', '.join(_MODEL_OPTIONS[k] for k in takes if k in _MODEL_OPTIONS) or 'none'})")
        kw[key] = value
    if args.image_size is not None and "seq_len" in takes:  # a token model: no images
        raise OOCError(f"--image-size does not apply to {args.model} (it reads tokens; see --seq-len)")
    device = torch.device(args.device)  # meta, cpu or an available cuda: checked by the parser
    if args.measure and device.type == "meta":
        raise OOCError("--measure times each op, and on meta nothing runs: add --device cpu (or cuda)")

    t0 = time.perf_counter()
    try:  # options each valid alone may not fit together (a width the heads do not divide)
        with torch.device(device):
            model = models.get(args.model, **kw)
    except ValueError as exc:
        given = " ".join(_MODEL_OPTIONS[k] + ("" if v is True else f" {v}") for k, v in kw.items())
        raise OOCError(f"{args.model} {given}: {exc}") from None
    x, y = models.example_batch(args.model, args.batch, device, image_size=args.image_size, **kw)
    seq = ooc.trace(model, x, y, loss_fn=models.loss_fn(args.model), optimizer=args.optimizer,
                    device=device, measure=args.measure, name=args.model,
                    progress=not args.no_progress and sys.stderr.isatty())
    seconds = time.perf_counter() - t0
    if args.output:
        seq.to_json(args.output)
    info = summary(seq)
    info["seconds"] = round(seconds, 3)
    info["output"] = args.output
    if args.json:
        print(json.dumps(info))
    else:
        print(_table(info))
    return 0


def _table(info: dict[str, Any]) -> str:
    from vmm.units import format_size

    lines = [
        f"{info['model']}  batch {info['batch']}  on {info['device']}: "
        f"traced in {info['seconds']:.2f} s (recording {info['trace_seconds']:.2f} s)",
        f"functions  {info['functions']:>8}   forward+loss {info['forward']}, "
        f"backward {info['backward']}, optimizer {info['optimizer']}",
        "",
        f"{'variables':<16}{'count':>8}{'bytes':>14}",
    ]
    for kind, row in info["variables"].items():
        lines.append(f"  {kind:<14}{row['count']:>8}{format_size(row['bytes']):>14}")
    total = sum(r["count"] for r in info["variables"].values())
    lines.append(f"  {'total':<14}{total:>8}{format_size(info['total_bytes']):>14}")
    lines.append("")
    lines.append(f"in-core peak   {format_size(info['in_core_peak_bytes'])}"
                 f"  ({info['in_core_peak_bytes']} B)")
    lines.append(f"FLOPs          {info['flops'] / 1e9:,.1f} G")
    if info["measured_seconds"] is not None:
        lines.append(f"op time        {info['measured_seconds'] * 1e3:,.1f} ms (sum of measured ops)")
    if info["output"]:
        lines.append(f"wrote {info['output']}")
    return "\n".join(lines)
