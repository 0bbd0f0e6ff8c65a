"""Capped decompression: the one way Kareus expands a gzip stream it did not write itself.

A plan ConfigMap's `binaryData` is written by a pod that runs the tenant's image and command, so
the operator (shared by every tenant) and the runtime must treat it as hostile: a 1 MiB gzip can
expand about ×1000. `gunzip` stops as soon as the output passes `max_bytes` and refuses, so
memory stays bounded by the cap whatever the stream claims. The cap for plans is sized from the
largest job the spec admits (`kareus.spec` bounds stages × microbatches; a PP16 × 256 plan is
~3.7 MB of JSON), with room to spare.
"""

from __future__ import annotations

import zlib

from kareus.errors import KareusError

MAX_PLAN_BYTES = 32 << 20  # a plan at the spec's stages × microbatches bound is ~8 MB of JSON
_GZIP_WBITS = 16 + zlib.MAX_WBITS


class DecompressError(KareusError):
    """A compressed document that is malformed or expands past its cap; the message says which."""


def gunzip(data: bytes, *, max_bytes: int, what: str) -> bytes:
    """The gzip stream `data` expanded, refused with DecompressError once it passes `max_bytes`.

    One member only (what `gzip.compress` writes); trailing bytes are an error rather than
    another member to expand, so a stream cannot chain members to get past the cap."""
    inflater = zlib.decompressobj(_GZIP_WBITS)
    try:
        out = inflater.decompress(data, max_bytes + 1)
    except zlib.error as error:
        raise DecompressError(f"{what}: not a valid gzip stream ({error})") from None
    if len(out) > max_bytes:
        raise DecompressError(f"{what}: expands past the {max_bytes >> 20} MiB cap for a decompressed "
                              f"document (refused without expanding it further)")
    if not inflater.eof:
        raise DecompressError(f"{what}: not a valid gzip stream (truncated)")
    if inflater.unused_data:
        raise DecompressError(f"{what}: not a valid gzip stream ({len(inflater.unused_data)} bytes after its end)")
    return out
