"""Text in: tokenize plain text and JSONL into a Megatron-LM indexed dataset (`kareus data prepare`).

The tokenizer is a Hugging Face `tokenizers` file (`tokenizer.json`, or a model directory that has
one). Documents follow Megatron-LM's `tools/preprocess_data.py`: a JSONL line is one document (its
`text_key` field); a plain-text line is one document too (the same unit as a JSONL line, so a
corpus exported one-document-per-line reads the same either way; blank lines are skipped), or a
whole plain-text file is one document with `text_documents="file"`. Each document is encoded with
the tokenizer's own special tokens (its post-processor: Llama 3 prepends `<|begin_of_text|>`, as
`transformers`' tokenizer call that Megatron's HuggingFaceTokenizer makes does) and, with
`append_eod`, the end-of-document token is appended after it, as Megatron's `--append-eod` does:
concatenated in the training stream, every document is separated from the next by it.

The end-of-document token is `eos_token` from `tokenizer_config.json` next to the tokenizer when
there is one, else the first of `KNOWN_EOD_TOKENS` the vocabulary has; none is an error (name one
with `eod_token`). The token type is megatron-core's choice: uint16 for a vocabulary under 65500,
else int32.

Memory is bounded: documents are read and encoded `batch_documents` at a time (`encode_batch`
runs them on the library's thread pool, `RAYON_NUM_THREADS` caps it) and written straight to the
`.bin` (`kareus.data.megatron.MegatronWriter`). `PREFIX.json` records the tokenizer (name, path,
vocabulary size, end-of-document id) and the counts; `kareus train` reads it to refuse a
tokenizer larger than the model's vocabulary.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kareus.data.megatron import MegatronWriter, metadata_path, token_dtype
from kareus.errors import EXIT_CONFIG, KareusError

# End-of-document tokens of common tokenizers, in the order they are tried: Llama 3, GPT-2 / Qwen /
# many BPEs, Llama 2 / Mistral / T5 (SentencePiece), Gemma.
KNOWN_EOD_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
TEXT_DOCUMENTS = ("line", "file")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
METADATA_VERSION = 1


@dataclass(frozen=True)
class TokenizerInfo:
    """What a dataset records about the tokenizer that made it."""

    name: str
    path: str
    vocab_size: int  # with added tokens: the ids the model's embedding must have rows for
    eod_token: str
    eod_id: int


@dataclass(frozen=True)
class PrepareSummary:
    """What `prepare` wrote."""

    prefix: str
    documents: int
    skipped_empty: int  # documents with no text (not written)
    tokens: int
    dtype: str
    seconds: float
    tokenizer: TokenizerInfo

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def load_tokenizer(path: str | Path, eod_token: str | None = None):
    """The `tokenizers.Tokenizer` at `path` (a `tokenizer.json` or a directory with one) and its info."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise KareusError(f"--tokenizer {path}: no tokenizer file (a tokenizer.json, or a directory with one)",
                          exit_code=EXIT_CONFIG)
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as error:  # the library raises plain Exceptions for unreadable files
        raise KareusError(f"--tokenizer {file}: not a Hugging Face tokenizers file: {error}",
                          exit_code=EXIT_CONFIG) from None
    config = _tokenizer_config(file.parent)
    token = eod_token or _configured_eos(config) or next(
        (t for t in KNOWN_EOD_TOKENS if tokenizer.token_to_id(t) is not None), None)
    if token is None:
        raise KareusError(f"--tokenizer {path}: no end-of-document token (no eos_token in tokenizer_config.json, "
                          f"none of {', '.join(KNOWN_EOD_TOKENS)} in the vocabulary); name one with --eod-token",
                          exit_code=EXIT_CONFIG)
    eod_id = tokenizer.token_to_id(token)
    if eod_id is None:
        raise KareusError(f"--eod-token {token!r}: not in the vocabulary of {file}", exit_code=EXIT_CONFIG)
    # A model directory is known by its name (`meta-llama/Llama-3.1-8B` → Llama-3.1-8B); a lone file by its own.
    name = config.get("name_or_path") or (file.parent.name if file.name == "tokenizer.json" else file.name)
    info = TokenizerInfo(str(name), str(path), tokenizer.get_vocab_size(with_added_tokens=True), token, eod_id)
    return tokenizer, info


def _tokenizer_config(directory: Path) -> dict:
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return {}
    try:
        return json.loads(config.read_text())
    except ValueError as error:
        raise KareusError(f"--tokenizer: {config} is not JSON: {error}", exit_code=EXIT_CONFIG) from None


def _configured_eos(config: dict) -> str | None:
    eos = config.get("eos_token")
    if isinstance(eos, dict):  # older transformers write the AddedToken's fields
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def iter_documents(inputs: Sequence[str | Path], text_key: str = "text", text_documents: str = "line",
                   on_bytes: Callable[[int], None] | None = None) -> Iterator[str]:
    """Documents of `inputs` in order (JSONL by suffix, else plain text; see the module docstring).
    `on_bytes(n)` is told how many input bytes each document consumed (for a progress bar)."""
    if text_documents not in TEXT_DOCUMENTS:
        raise KareusError(f"--text-documents must be one of {', '.join(TEXT_DOCUMENTS)}, got {text_documents!r}",
                          exit_code=EXIT_CONFIG)
    report = on_bytes or (lambda _n: None)
    for path in map(Path, inputs):
        jsonl = path.suffix.lower() in JSONL_SUFFIXES
        if not jsonl and text_documents == "file":
            text = _utf8(path.read_bytes(), path, None)
            report(path.stat().st_size)
            yield text
            continue
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                report(len(raw))
                line = _utf8(raw, path, number).rstrip("\r\n")
                if not line.strip():
                    continue
                yield _json_text(line, path, number, text_key) if jsonl else line


def _utf8(raw: bytes, path: Path, number: int | None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        where = f"{path}:{number}" if number is not None else str(path)
        raise KareusError(f"--input {where}: not UTF-8 text ({error.reason} at byte {error.start})",
                          exit_code=EXIT_CONFIG) from None


def _json_text(line: str, path: Path, number: int, text_key: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise KareusError(f"--input {path}:{number}: not a JSON object ({error})", exit_code=EXIT_CONFIG) from None
    text = record.get(text_key) if isinstance(record, dict) else None
    if not isinstance(text, str):
        found = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise KareusError(f"--input {path}:{number}: no string field --text-key {text_key!r} (fields: {found})",
                          exit_code=EXIT_CONFIG)
    return text


def prepare(tokenizer_path: str | Path, inputs: Sequence[str | Path], out_prefix: str | Path, *,
            text_key: str = "text", text_documents: str = "line", append_eod: bool = True,
            add_special_tokens: bool = True, eod_token: str | None = None, batch_documents: int = 1024,
            on_bytes: Callable[[int], None] | None = None) -> PrepareSummary:
    """Tokenize `inputs` into the Megatron dataset `out_prefix`.bin/.idx and its `out_prefix`.json."""
    if not inputs:
        raise KareusError("--input: at least one file", exit_code=EXIT_CONFIG)
    missing = [str(p) for p in inputs if not Path(p).is_file()]
    if missing:
        raise KareusError(f"--input: no such file: {', '.join(missing)}", exit_code=EXIT_CONFIG)
    if batch_documents < 1:
        raise KareusError(f"batch_documents must be >= 1, got {batch_documents}", exit_code=EXIT_CONFIG)
    tokenizer, info = load_tokenizer(tokenizer_path, eod_token)
    dtype = token_dtype(info.vocab_size)
    start = time.perf_counter()
    writer = MegatronWriter(out_prefix, dtype)
    skipped = 0
    try:
        batch: list[str] = []
        for text in iter_documents(inputs, text_key, text_documents, on_bytes):
            if not text.strip():
                skipped += 1  # an empty JSON text: no document (Megatron writes none either)
                continue
            batch.append(text)
            if len(batch) >= batch_documents:
                _write_batch(writer, tokenizer, batch, info.eod_id, append_eod, add_special_tokens)
                batch = []
        if batch:
            _write_batch(writer, tokenizer, batch, info.eod_id, append_eod, add_special_tokens)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    summary = PrepareSummary(str(out_prefix), writer.documents, skipped, writer.tokens, dtype.name,
                             time.perf_counter() - start, info)
    record = {"version": METADATA_VERSION, "tokenizer": asdict(info), "documents": summary.documents,
              "tokens": summary.tokens, "dtype": summary.dtype, "append_eod": append_eod,
              "add_special_tokens": add_special_tokens, "text_key": text_key, "text_documents": text_documents,
              "inputs": [str(p) for p in inputs]}
    metadata_path(out_prefix).write_text(json.dumps(record, indent=1) + "\n")
    return summary


def _write_batch(writer: MegatronWriter, tokenizer, texts: list[str], eod_id: int, append_eod: bool,
                 add_special_tokens: bool) -> None:
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens):
        ids = encoding.ids
        # A post-processor that already ends a document with it (some add eos) gets no second one.
        if append_eod and (not ids or ids[-1] != eod_id):
            ids = [*ids, eod_id]
        writer.add_document(np.asarray(ids, dtype=np.int64))
