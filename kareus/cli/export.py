"""`kareus export CHECKPOINT_DIR --out DIR [--step N]`: a checkpoint as a Hugging Face model.

Writes config.json, safetensors shards with model.safetensors.index.json and, when the run started
from a Hugging Face directory (`kareus train --init-from`) that had them, its tokenizer files.
Works from a checkpoint of any tensor/pipeline/context/data layout; CHECKPOINT_DIR is a run's
`--checkpoint-dir` (its newest complete checkpoint, or `--step N`) or one `step-N` directory.
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads the result.
"""

from __future__ import annotations

import argparse
import re

from kareus.errors import EXIT_USAGE, KareusError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="write a checkpoint as a Hugging Face model directory",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a run's --checkpoint-dir, or one step-N in it")
    parser.add_argument("--out", metavar="DIR", required=True, help="the Hugging Face directory to write (new or empty)")
    parser.add_argument("--step", type=int, metavar="N", help="the checkpoint after N steps (default: the newest)")
    parser.add_argument("--shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    parser.set_defaults(func=run)


def parse_size(text: str) -> int:
    """Bytes of '5GB', '500MB', '2GiB' or a plain number."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise KareusError(f"--shard-size: {text!r} is not a size; allowed: a positive number with B, KB, MB, GB, "
                          f"KiB, MiB or GiB", exit_code=EXIT_USAGE)
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def run(args: argparse.Namespace) -> int:
    from kareus.runtime.export import export_checkpoint

    if args.step is not None and args.step < 0:
        raise KareusError(f"--step must be >= 0, got {args.step}", exit_code=EXIT_USAGE)
    result = export_checkpoint(args.checkpoint, args.out, step=args.step, shard_bytes=parse_size(args.shard_size))
    tokenizer = f", tokenizer from {result.tokenizer_from}" if result.tokenizer_from else ", no tokenizer files"
    print(f"kareus export: step {result.step} -> {result.out_dir} ({len(result.files)} files, "
          f"{result.total_bytes / 1e6:.1f} MB of weights{tokenizer})")
    return 0
