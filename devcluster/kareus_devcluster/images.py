"""The images the dev cluster's nodes run: `make images` (tools/images/build.sh), cached by content."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kareus.errors import KareusError
from kareus_devcluster.controlplane import REPO_ROOT

BUILD_SCRIPT = REPO_ROOT / "tools" / "images" / "build.sh"


def cache_dir() -> Path:
    """Where the images' archives and the nodes' image store live: outside the work tree, kept between runs."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("KAREUS_IMAGE_CACHE") or base / "kareus" / "images")
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


def main() -> int:
    """`make images`: build what changed, then bring the nodes' image store up to date (so a dev cluster's
    nodes start in seconds); prints each image and the store."""
    import sys
    import time

    from kareus_devcluster.node import image_store

    start = time.monotonic()
    try:
        images = node_images()
        store = image_store(images, cache_dir() / "containerd")
    except KareusError as error:
        print(f"make images: {error}", file=sys.stderr)
        return 1
    for reference, archive in images:
        print(f"{reference}  {archive}")
    print(f"image store {store} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
