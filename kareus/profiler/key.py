"""The profile key: one name for "this job configuration measured on this GPU model".

Two jobs with the same key can share a profile (the operator caches profiles by key), so the key
covers everything a measurement depends on: the GPU model, the full model shape (not only its
name: explicit shapes differ), the parallelism, the sequence length, the microbatch size,
activation checkpointing and the Kareus version (a new simulator or profiler invalidates old
profiles), and whether the GPU was simulated: a simulated profile is keyed `sim-…`, so it is
never taken for a real GPU's. The objective, the number of training steps and the profiling
preset are not in it: they change what is chosen, not what is measured.

The key is a readable prefix plus a 10-hex-digit hash of all of the above, lower case, at most 63
characters and made of `[a-z0-9.-]`, so it is a valid Kubernetes label value and file name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

from kareus import __version__
from kareus.job import LABEL_UNSAFE, describe_job, gpu_label, job_spec_of

MAX_KEY_CHARS = 63
_HASH_CHARS = 10


def profile_key(job: Any, *, simulated: bool | None = None, gpu_product: str | None = None,
                software_version: str = __version__) -> str:
    """The stable, label-safe profile key of a `KareusJob` or `JobSpec`.

    `simulated` defaults to what the job asks for (`profiling.backend: sim`); `gpu_product` to the
    job's (the profiler passes the GPU it measured when the job pins none)."""
    spec = job_spec_of(job)
    if simulated is None:
        simulated = getattr(getattr(spec, "profiling", None), "backend", None) == "sim"
    descriptor = describe_job(spec)
    gpu = gpu_label(str(gpu_product or spec.gpu_product))
    identity = {
        "simulated": simulated,
        "gpu": gpu,
        "shape": spec.model_shape().to_dict(),
        "job": asdict(descriptor),
        "version": software_version,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:_HASH_CHARS]
    readable = (
        f"{'sim-' if simulated else ''}{descriptor.model}-{gpu}-tp{descriptor.tp}cp{descriptor.cp}pp{descriptor.pp}"
        f"-s{descriptor.seq_len}-b{descriptor.micro_batch_size}"
    )
    readable = LABEL_UNSAFE.sub("-", readable.lower())[: MAX_KEY_CHARS - _HASH_CHARS - 1].strip("-.")
    return f"{readable}-{digest}" if readable else digest
