"""The images the dev cluster's nodes run: `make images` (tools/images/build.sh), cached by content."""

from __future__ import annotations

import subprocess
from pathlib import Path

from kareus.errors import KareusError
from kareus_devcluster.controlplane import REPO_ROOT

BUILD_SCRIPT = REPO_ROOT / "tools" / "images" / "build.sh"
BUILD_TIMEOUT_S = 3600.0


def node_images() -> list[tuple[str, Path]]:
    """(reference, docker-archive) of every image, built first where an input changed (minutes the
    first time: the runtime image carries the pinned torch; seconds when cached)."""
    try:
        result = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False,
                                timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise KareusError(f"make images: {BUILD_SCRIPT} ran past {BUILD_TIMEOUT_S:.0f} s") from None
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        raise KareusError(f"make images failed (exit {result.returncode}):\n{tail}")
    images = []
    for line in result.stdout.splitlines():
        reference, _, archive = line.partition(" ")
        if reference and archive:
            images.append((reference, Path(archive)))
    if not images:
        raise KareusError(f"make images printed no image: {result.stderr.strip()[-500:]}")
    return images
