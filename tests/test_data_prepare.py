"""Text in: `kareus data prepare` tokenizes text and JSONL with Hugging Face `tokenizers` into a
Megatron-LM indexed dataset that megatron-core's own reader reads identically (and ours reads
megatron-core's builder's files identically); the runtime refuses a tokenizer larger than the
model's vocabulary and a real model with no data. Tokenizers are built here, never downloaded."""

from __future__ import annotations

import json
import logging
import warnings

import numpy as np
import pytest
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kareus.cli import main as cli_main
from kareus.data import megatron
from kareus.data.megatron import MegatronWriter, read_megatron_index, token_dtype
from kareus.data.prepare import load_tokenizer, prepare
from kareus.errors import EXIT_CONFIG, KareusError
from kareus.runtime import train
from kareus.runtime.data import load_data
from kareus.spec import load_job

SENTENCES = ["the cat sees the red ball today .", "a dog likes energy with care .",
             "my friend builds a new model again .", "the engineer measures the clock at night .",
             "the old man follows the long road .", "a small bird finds a quiet river ."]


@pytest.fixture(scope="module")
def indexed_dataset():
    with warnings.catch_warnings():  # megatron-core warns that Apex/Transformer Engine are absent (CPU)
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def llama_style_tokenizer(directory, eos: str | None = "<|end_of_text|>"):
    """A byte-level BPE with Llama 3's special tokens and post-processor (BOS first), plus a
    tokenizer_config.json naming its eos_token, as a released model directory has."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]  # only the bytes seen: 120 ids, under tiny's 256
    tokenizer.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(vocab_size=120, special_tokens=specials))
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                             special_tokens=[("<|begin_of_text|>", bos)])
    tokenizer.save(str(directory / "tokenizer.json"))
    if eos is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return tokenizer


def word_tokenizer(path, words: int, specials=("<unk>", "</s>")):
    """A word-level tokenizer of `words` words w0, w1, … after `specials` (ids in that order)."""
    vocab = {token: i for i, token in enumerate([*specials, *(f"w{i}" for i in range(words))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return tokenizer


def test_text_and_jsonl_become_documents_each_ended_by_the_eod_token(tmp_path, capsys):
    tokenizer = llama_style_tokenizer(tmp_path / "tok")
    eod, bos = tokenizer.token_to_id("<|end_of_text|>"), tokenizer.token_to_id("<|begin_of_text|>")
    (tmp_path / "a.txt").write_text(f"{SENTENCES[0]}\n\n{SENTENCES[1]}\n")  # the blank line is no document
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"id": i, "body": s}) + "\n" for i, s in enumerate(SENTENCES[2:]))
                                      + json.dumps({"body": ""}) + "\n")
    assert cli_main(["data", "prepare", "--tokenizer", str(tmp_path / "tok"), "--input", str(tmp_path / "a.txt"),
                     str(tmp_path / "b.jsonl"), "--text-key", "body", "--out", str(tmp_path / "out" / "corpus"),
                     "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    index = read_megatron_index(tmp_path / "out" / "corpus")
    documents = [index.sequence(i).tolist() for i in range(len(index.sequence_lengths))]
    assert documents == [[bos, *tokenizer.encode(s, add_special_tokens=False).ids, eod] for s in SENTENCES]
    assert [tokenizer.decode(d) for d in documents] == SENTENCES  # special tokens dropped by decode
    assert summary["documents"] == 6 and summary["skipped_empty"] == 1 and summary["eod_id"] == eod
    assert summary["tokens"] == sum(map(len, documents)) and summary["dtype"] == "uint16"
    assert index.document_indices.tolist() == list(range(7)) and index.dtype == np.uint16
    # The training stream: the documents back to back, so every document is followed by the EOD.
    stream = load_data(tmp_path / "out" / "corpus", 256)
    assert stream.format == "megatron" and stream.tokens.tolist() == [t for d in documents for t in d]
    record = json.loads((tmp_path / "out" / "corpus.json").read_text())
    assert record["tokenizer"]["vocab_size"] == tokenizer.get_vocab_size() and record["documents"] == 6
    # Without the EOD and the tokenizer's BOS; a whole file as one document.
    prepare(tmp_path / "tok" / "tokenizer.json", [tmp_path / "a.txt"], tmp_path / "raw", append_eod=False,
            add_special_tokens=False, text_documents="file")
    raw = read_megatron_index(tmp_path / "raw")
    assert raw.sequence_lengths.size == 1
    assert raw.sequence(0).tolist() == tokenizer.encode((tmp_path / "a.txt").read_text(), add_special_tokens=False).ids


def test_the_eod_token_comes_from_the_config_else_a_known_one_else_an_error(tmp_path):
    llama_style_tokenizer(tmp_path / "plain", eos=None)  # no tokenizer_config.json: a known token
    assert load_tokenizer(tmp_path / "plain")[1].eod_token == "<|end_of_text|>"
    llama_style_tokenizer(tmp_path / "cfg", eos="<|begin_of_text|>")  # the config wins, whatever it names
    assert load_tokenizer(tmp_path / "cfg")[1].eod_token == "<|begin_of_text|>"
    word_tokenizer(tmp_path / "none.json", 5, specials=("<unk>", "<pad>"))
    with pytest.raises(KareusError, match=r"no end-of-document token .* name one with --eod-token") as caught:
        load_tokenizer(tmp_path / "none.json")
    assert caught.value.exit_code == EXIT_CONFIG
    assert load_tokenizer(tmp_path / "none.json", eod_token="<pad>")[1].eod_id == 1
    with pytest.raises(KareusError, match=r"--eod-token '<bos>': not in the vocabulary"):
        load_tokenizer(tmp_path / "none.json", eod_token="<bos>")


def test_bad_inputs_name_the_field(tmp_path, capsys):
    word_tokenizer(tmp_path / "tok.json", 5)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "w1"}) + "\n" + json.dumps({"content": "w2"}) + "\n")
    assert cli_main(["data", "prepare", "--tokenizer", str(tmp_path / "tok.json"), "--input", str(tmp_path / "bad.jsonl"),
                     "--out", str(tmp_path / "x")]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "bad.jsonl:2: no string field --text-key 'text' (fields: content)" in err
    assert not list(tmp_path.glob("x.*"))  # nothing half-written is left behind
    assert cli_main(["data", "prepare", "--tokenizer", str(tmp_path / "nope"), "--input", str(tmp_path / "bad.jsonl"),
                     "--out", str(tmp_path / "x")]) == EXIT_CONFIG
    assert "--tokenizer" in capsys.readouterr().err
    (tmp_path / "latin1.txt").write_bytes("w1\ncaf\xe9 w2\n".encode("latin-1"))
    with pytest.raises(KareusError, match=r"--input .*latin1\.txt:2: not UTF-8 text"):
        prepare(tmp_path / "tok.json", [tmp_path / "latin1.txt"], tmp_path / "y")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_our_writer_and_megatron_cores_builder_make_the_same_files(tmp_path, monkeypatch, indexed_dataset, dtype):
    rng = np.random.default_rng(0)
    high = 65_000 if dtype == np.uint16 else 150_000
    documents = [rng.integers(0, high, int(rng.integers(0, 40))) for _ in range(25)]  # empty ones too
    monkeypatch.setattr(MegatronWriter, "_CHUNK", 4)  # the index assembled in many chunks, as for a big corpus
    monkeypatch.setattr(megatron, "_CHECK_CHUNK", 3)  # and checked in many when read
    writer = MegatronWriter(tmp_path / "ours", dtype)
    for document in documents:
        writer.add_document(document)
    writer.close()
    builder = indexed_dataset.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for document in documents:
        builder.add_document(document, [document.size])
    builder.finalize(str(tmp_path / "theirs.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()
    # Ours through megatron-core's reader, and megatron-core's through ours.
    theirs_reading_ours = indexed_dataset.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs_reading_ours) == len(documents) and theirs_reading_ours.index.dtype == dtype
    assert all(np.array_equal(theirs_reading_ours[i], d) for i, d in enumerate(documents))
    assert theirs_reading_ours.document_indices.tolist() == list(range(len(documents) + 1))
    ours_reading_theirs = read_megatron_index(tmp_path / "theirs")
    assert all(np.array_equal(ours_reading_theirs.sequence(i), d) for i, d in enumerate(documents))
    assert np.array_equal(load_data(tmp_path / "theirs", 200_000).tokens, np.concatenate(documents))
    # Sequences that do not tile the `.bin` in order cannot be read as one stream: refused.
    idx = bytearray((tmp_path / "ours.idx").read_bytes())
    pointer = megatron.HEADER_BYTES + 4 * len(documents) + 8 * 20
    idx[pointer:pointer + 8] = (int.from_bytes(idx[pointer:pointer + 8], "little") + 2).to_bytes(8, "little")
    (tmp_path / "ours.idx").write_bytes(bytes(idx))
    with pytest.raises(KareusError, match=r"ours\.idx: its sequences do not follow each other"):
        load_data(tmp_path / "ours", 200_000)


def test_prepared_dataset_reads_identically_through_megatron_core(tmp_path, indexed_dataset):
    tokenizer = llama_style_tokenizer(tmp_path / "tok")
    (tmp_path / "c.txt").write_text("\n".join(SENTENCES * 3) + "\n")
    summary = prepare(tmp_path / "tok", [tmp_path / "c.txt"], tmp_path / "c")
    theirs = indexed_dataset.IndexedDataset(str(tmp_path / "c"))
    ours = read_megatron_index(tmp_path / "c")
    assert len(theirs) == summary.documents == 18 and theirs.index.dtype == np.uint16
    assert np.array_equal(theirs.sequence_lengths, ours.sequence_lengths)
    assert all(np.array_equal(theirs[i], ours.sequence(i)) for i in range(len(theirs)))
    # megatron-core's token type choice for a vocabulary, as ours.
    for vocab in (tokenizer.get_vocab_size(), 65_499, 65_500, 128_256):
        assert token_dtype(vocab) == np.dtype(indexed_dataset.DType.optimal_dtype(vocab))


def _job(tmp_path, model: dict, name: str = "prep") -> str:
    job = {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": name},
           "spec": {"model": model, "sequenceLength": 16,
                    "parallelism": {"tensor": 1, "pipeline": 1, "context": 1, "data": 1,
                                    "microBatchSize": 2, "numMicroBatches": 1},
                    "objective": {"maxThroughput": {}},
                    "training": {"image": "x", "steps": 2, "gpusPerNode": 1, "nodes": 1}}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_train_names_its_data_and_refuses_a_larger_tokenizer(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="kareus")
    words = " ".join(f"w{i}" for i in range(200))
    (tmp_path / "t.txt").write_text("\n".join([words] * 3) + "\n")
    word_tokenizer(tmp_path / "small.json", 200)  # 202 ids: fits tiny's 256
    word_tokenizer(tmp_path / "large.json", 300)  # 302 ids: the same text has ids < 256, the tokenizer does not
    prepare(tmp_path / "small.json", [tmp_path / "t.txt"], tmp_path / "small")
    prepare(tmp_path / "large.json", [tmp_path / "t.txt"], tmp_path / "large")
    job = _job(tmp_path, {"preset": "tiny"})
    assert cli_main(["train", job, "--steps", "2", "--data", str(tmp_path / "small"), "--out",
                     str(tmp_path / "run"), "--json"]) == 0
    first, second = (json.loads(line) for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines())
    assert first["data_source"] == str(tmp_path / "small") and second["data_source"] is None
    assert "data: " + str(tmp_path / "small") + " (megatron, 603 tokens, tokenizer small.json of vocabulary 202)" \
        in caplog.messages
    capsys.readouterr()
    assert cli_main(["train", job, "--steps", "1", "--data", str(tmp_path / "large")]) == EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert "tokenizer 'large.json' has a vocabulary of 302" in err and "larger than the model's 256" in err
    assert "\n" not in err
    # The built-in corpus is named too.
    result = train(load_job(job), steps=1, out_dir=str(tmp_path / "builtin"))
    assert len(result.losses) == 1
    assert json.loads((tmp_path / "builtin" / "train.jsonl").read_text())["data_source"] == "builtin-corpus"


def test_a_real_model_without_data_is_refused(tmp_path, capsys):
    # Small enough for CPU, but a 512-id vocabulary: the byte corpus is no corpus for it.
    model = {"layers": 2, "hidden": 32, "ffnHidden": 64, "heads": 4, "kvHeads": 2, "vocab": 512}
    job = _job(tmp_path, model, "wordy")
    assert cli_main(["train", job, "--steps", "1"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "has no training data: give --data (spec.training.data in a KareusJob)" in err
    np.save(tmp_path / "ids.npy", np.arange(400) % 512)
    assert len(train(load_job(job), steps=1, data_path=str(tmp_path / "ids.npy")).losses) == 1
