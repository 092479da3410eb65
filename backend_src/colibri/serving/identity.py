"""Which checkpoint a server serves: its path, size, modification time, sha256 and whether it is a
synthetic demo (random weights), for Triton's model config and the log. A folder of layer files
(colibri.model_folder) has one identity too: its files' total size and newest modification time,
and the sha256 of the listing `LC_ALL=C sha256sum layer*.colibri.safetensors` prints in the folder,
so `... | sha256sum` there checks it; each file's own identity comes with it.

The sha256 covers the whole file, so it can be compared with `sha256sum` on the machine that packed
it. Hashing is a pass over the file (0.4-2 GB/s on one core), so the digest is kept beside the file in
FILE.sha256, in sha256sum's format (`sha256sum -c FILE.sha256` checks it), and reused while the file
has the size and modification time recorded there. Where that file cannot be written (a read-only
folder), every call hashes again.
"""
import datetime
import hashlib
import os
import re
import time
from typing import NamedTuple, Optional

from colibri import model_folder
from colibri import safetensors_io as st
from colibri._native import invalid

# checkpoint.write_demo's metadata "source" starts with this (`python -m colibri demo` writes it).
DEMO_SOURCE = "colibri demo (seed "
# A hash that took longer is worth a line in the log (with whether the next start pays it again).
NOTABLE_SECONDS = 1.0
_CACHE_KEY = re.compile(r"^# colibri: size (\d+) mtime_ns (\d+)\b")
_CACHE_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


class Identity(NamedTuple):
    path: str          # absolute, as the server opens it
    size: int          # bytes
    mtime_ns: int
    sha256: str        # hex digest of the whole file
    demo: bool         # written by `python -m colibri demo`: random weights
    source: str        # metadata "source": what pack read, or "colibri demo (seed S)"; "" if none
    note: str = ""     # what hashing it cost, when that was notable (empty when it was cached or quick)
    files: tuple = ()  # a folder's: each layer file's Identity, by name

    @property
    def modified(self) -> str:
        return utc(self.mtime_ns)

    def describe(self) -> str:
        """One line: what a person reading the log needs to tell this checkpoint from another."""
        what = "DEMO checkpoint (random weights)" if self.demo else "packed from " + (self.source or "an unknown source")
        if self.files:
            return (f"{self.path} ({len(self.files)} layer files, {self.size} bytes, newest modified {self.modified}, "
                    f"sha256 of their sha256sum listing {self.sha256}): {what}")
        return f"{self.path} ({self.size} bytes, modified {self.modified}, sha256 {self.sha256}): {what}"


def of(path, known: Optional[Identity] = None) -> Identity:
    """The identity of the checkpoint at `path`. `known`, an identity computed before (by the launcher),
    is reused when it names the same file with the same size and modification time."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return _of_folder(path)
    stat = os.stat(path)
    problem = st.not_regular(stat.st_mode)
    if problem:  # hashing a FIFO would wait for a writer forever
        raise invalid(f"{path}: {problem}")
    if known is not None and (known.path, known.size, known.modified) == (path, stat.st_size, utc(stat.st_mtime_ns)):
        return known
    try:
        source = st.SafetensorsFile(path).metadata.get("source", "")
    except st.SafetensorsError:  # not a checkpoint: loading it says why, better than this could
        source = ""
    digest, note = _cached(path, stat), ""
    if digest is None:
        start = time.monotonic()
        digest = _sha256(path)
        seconds, kept = time.monotonic() - start, _keep(path, stat, digest)
        if seconds >= NOTABLE_SECONDS:
            note = f"sha256 of {path} ({stat.st_size} bytes) took {seconds:.1f} s; {kept}"
    return Identity(path, stat.st_size, stat.st_mtime_ns, digest, source.startswith(DEMO_SOURCE), source, note)


def _of_folder(path) -> Identity:
    """The identity of a folder of layer files: each file's, combined. The launcher's is not reused:
    the files' FILE.sha256 digests already spare the instances a second pass."""
    files = sorted(map(str, model_folder.layer_files(path).values()), key=os.path.basename)
    parts = tuple(of(f) for f in files)
    size, mtime_ns = sum(part.size for part in parts), max(part.mtime_ns for part in parts)
    listing = "".join(f"{part.sha256}  {os.path.basename(part.path)}\n" for part in parts)
    sources = list(dict.fromkeys(part.source for part in parts))
    source = sources[0] + (f" (and {len(sources) - 1} other sources)" if len(sources) > 1 else "")
    note = "; ".join(part.note for part in parts if part.note)
    return Identity(path, size, mtime_ns, hashlib.sha256(listing.encode()).hexdigest(),
                    all(part.demo for part in parts), source, note, parts)


def utc(mtime_ns: int) -> str:
    """A modification time in UTC, ISO 8601 to the second."""
    seconds = mtime_ns // 1_000_000_000
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def cache_path(path) -> str:
    return str(path) + ".sha256"


def _sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _cached(path, stat) -> Optional[str]:
    """The digest FILE.sha256 records, if it was made for this size and modification time."""
    try:
        with open(cache_path(path)) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    key = _CACHE_KEY.match(lines[0]) if lines else None
    entry = _CACHE_LINE.match(lines[1]) if len(lines) > 1 else None
    if key and entry and (int(key.group(1)), int(key.group(2))) == (stat.st_size, stat.st_mtime_ns) \
            and entry.group(2) == os.path.basename(path):
        return entry.group(1)
    return None


def _keep(path, stat, digest) -> str:
    """Writes FILE.sha256 (aside, then renamed: a reader never sees half of it); says where it went."""
    target = cache_path(path)
    partial = f"{target}.partial-{os.getpid()}"
    try:
        with open(partial, "w") as f:
            f.write(f"# colibri: size {stat.st_size} mtime_ns {stat.st_mtime_ns} (the file this digest is of)\n"
                    f"{digest}  {os.path.basename(path)}\n")
        os.replace(partial, target)
    except OSError as exc:
        try:
            os.unlink(partial)
        except OSError:
            pass
        return f"not kept ({exc.strerror or exc}: {target}), so each start hashes it again"
    return f"kept in {target} for the next start"
