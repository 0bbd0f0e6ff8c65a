"""Training data on disk, without the runtime: what `kareus data …` writes and `kareus train --data` reads.

- `megatron`: Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), our reader and writer;
- `prepare`: text and JSONL tokenized with a Hugging Face `tokenizers` file into one (`kareus data prepare`).

Nothing here imports torch: tokenizing a corpus needs no GPU stack. The runtime's token streams and
batches are `kareus.runtime.data`.
"""
