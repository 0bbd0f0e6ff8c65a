"""`kareus data prepare` — text in: tokenize text and JSONL into a Megatron-LM indexed dataset.

    kareus data prepare --tokenizer DIR|tokenizer.json --input FILE... --out PREFIX [--text-key text]
        [--text-documents line|file] [--no-append-eod] [--eod-token TOKEN] [--json]

Writes PREFIX.bin, PREFIX.idx (what `kareus train --data PREFIX` and Megatron-LM read) and
PREFIX.json (the tokenizer's name and vocabulary: `kareus train` refuses a model whose vocabulary is
smaller). A JSONL file (.jsonl, .json, .ndjson) has one document per line in its --text-key field;
other files are plain text, one document per line (Megatron-LM's unit), or per file with
--text-documents file. The tokenizer's end-of-document token follows every document. A progress
bar shows on a terminal (stderr); the summary line gives documents, tokens and tokens/s
(`kareus.data.prepare`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kareus.errors import EXIT_CONFIG, KareusError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("prepare", help="tokenize text/JSONL into a Megatron indexed dataset",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, metavar="DIR|tokenizer.json",
                        help="Hugging Face tokenizers file, or a model directory with tokenizer.json "
                             "(and tokenizer_config.json for its eos_token)")
    parser.add_argument("--input", required=True, nargs="+", metavar="FILE", help="text or JSONL files, in order")
    parser.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    parser.add_argument("--text-key", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument("--text-documents", choices=("line", "file"), default="line",
                        help="plain text: one document per line (default) or per file")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="end every document with the end-of-document token (default: on)")
    parser.add_argument("--special-tokens", action=argparse.BooleanOptionalAction, default=True,
                        help="let the tokenizer add its own special tokens, e.g. a BOS (default: on)")
    parser.add_argument("--eod-token", metavar="TOKEN", help="end-of-document token (default: tokenizer_config's "
                        "eos_token, else a known one in the vocabulary)")
    parser.add_argument("--batch-documents", type=int, default=1024, metavar="N",
                        help="documents encoded at once (default 1024): memory grows with it")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kareus.data.prepare import prepare

    if args.batch_documents < 1:
        raise KareusError(f"--batch-documents must be >= 1, got {args.batch_documents}", exit_code=EXIT_CONFIG)
    total_bytes = sum(Path(p).stat().st_size for p in args.input if Path(p).is_file())
    with _progress(total_bytes) as advance:
        summary = prepare(args.tokenizer, args.input, args.out, text_key=args.text_key,
                          text_documents=args.text_documents, append_eod=args.append_eod,
                          add_special_tokens=args.special_tokens, eod_token=args.eod_token,
                          batch_documents=args.batch_documents, on_bytes=advance)
    if args.json:
        print(json.dumps({"prefix": summary.prefix, "documents": summary.documents,
                          "skipped_empty": summary.skipped_empty, "tokens": summary.tokens, "dtype": summary.dtype,
                          "seconds": summary.seconds, "tokens_per_s": summary.tokens_per_s,
                          "tokenizer": summary.tokenizer.name, "vocab_size": summary.tokenizer.vocab_size,
                          "eod_token": summary.tokenizer.eod_token, "eod_id": summary.tokenizer.eod_id}))
    else:
        skipped = f" ({summary.skipped_empty} empty skipped)" if summary.skipped_empty else ""
        print(f"kareus data prepare: {summary.documents} documents{skipped}, {summary.tokens} tokens "
              f"({summary.dtype}) in {summary.seconds:.2f} s, {summary.tokens_per_s:,.0f} tokens/s -> "
              f"{summary.prefix}.bin/.idx (tokenizer {summary.tokenizer.name}, vocabulary "
              f"{summary.tokenizer.vocab_size}, end of document {summary.tokenizer.eod_token!r} = "
              f"{summary.tokenizer.eod_id})")
    return 0


class _progress:
    """A byte-count progress bar on stderr when it is a terminal; a no-op otherwise (logs, CI)."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self._bar = None

    def __enter__(self):
        if not sys.stderr.isatty():
            return lambda _n: None
        from rich import progress
        from rich.console import Console

        self._bar = progress.Progress("{task.description}", progress.BarColumn(), progress.DownloadColumn(),
                                      progress.TransferSpeedColumn(), progress.TimeRemainingColumn(),
                                      console=Console(file=sys.stderr), transient=True)
        self._bar.start()
        task = self._bar.add_task("tokenizing", total=self.total_bytes)
        return lambda n: self._bar.advance(task, n)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
