"""Reading an uploaded folder archive (.tar, .tar.gz/.tgz or .zip) member by member, never
extracted as a whole: only regular files with plain relative names; every member's
declared size goes to the caller's budget (``budget.header(name, size)``, which raises past
its limits) before any of its bytes is read; compressed only as its name says. Shared by
the model store (model folders) and datasets (save_to_disk folders); each checks which
files it takes and writes them itself."""
from __future__ import annotations

import re
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path

from fluxrl.errors import field_error

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # one path part; no leading dot


def _refuse(message: str):
    return field_error("file", message)


# An archive is read header by header and member by member, each member written as soon as
# its header is checked: a member's declared size counts toward the upload's byte limit
# before any of its bytes is read or skipped (skipping a compressed member decompresses it),
# and the compression is the one the file's name declares (tarfile's "r:*" would also open
# bz2 and xz, whose members cost far more to skip than to send).

TAR_MODES = {".tar.gz": ("r:gz", "a gzip-compressed tar archive"), ".tgz": ("r:gz", "a gzip-compressed tar archive"),
             ".tar": ("r:", "an uncompressed tar archive")}
META_HEADER_BYTES = 64 * 1024  # a pax or GNU long-name header: a long name, never megabytes
DEFLATE_MAX_RATIO = 1032  # the most deflate expands: a zip entry declaring more lies about its size
# A central directory entry: 46 fixed bytes, then its name, extra fields and comment. An
# uploaded folder's names are short and its extras a few timestamps or zip64 sizes.
ZIP_ENTRY_MAX = 46 + 1024 + 1024 + 1024


def _refuse_sparse(self, *args, **kwargs):
    raise _refuse(f"{self.name}: a sparse file (an uploaded folder has none)")


class CheckedTarInfo(tarfile.TarInfo):
    """tarfile's header parsing, except that the headers whose data tarfile reads into memory
    itself (pax records, GNU long names, sparse maps) are bounded first."""

    def _proc_gnulong(self, tarfile):
        self._bounded()
        return super()._proc_gnulong(tarfile)

    def _proc_pax(self, tarfile):
        self._bounded()
        return super()._proc_pax(tarfile)

    def _bounded(self):
        if self.size > META_HEADER_BYTES:
            raise _refuse(f"a tar header record of {self.size} bytes (at most {META_HEADER_BYTES})")

    # sparse members: their maps are read block by block before any size is known
    _proc_sparse = _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse


def _archive_kind(display: str, kind: str) -> str:
    lower = display.lower()
    if lower.endswith(".zip"):
        return "zip"
    for suffix in TAR_MODES:
        if lower.endswith(suffix):
            return suffix
    raise _refuse(f"{display}: upload the {kind} folder as a .tar, .tar.gz or .zip archive")


def members(path: Path, display: str, budget, kind: str, max_members: int):
    """(name, size, open()) per regular file, one at a time: the caller reads a member before
    the next header is read. Folders are skipped; anything else is refused by name."""
    suffix = _archive_kind(display, kind)
    if suffix == "zip":
        yield from _zip_members(path, display, budget, kind, max_members)
        return
    mode, what = TAR_MODES[suffix]
    try:
        archive = tarfile.open(path, mode, tarinfo=CheckedTarInfo)
    except (tarfile.TarError, OSError, EOFError, zlib.error):
        raise _refuse(f"{display} is not {what}, as its name says (.tar: uncompressed, .tar.gz or .tgz: gzip, "
                      ".zip: zip)") from None
    with archive:
        while True:
            try:
                info = archive.next()  # reads one header; the previous member was read to its end
            except (tarfile.TarError, OSError, EOFError, zlib.error, RecursionError) as exc:
                raise _refuse(f"{display}: damaged after {budget.entries} entries ({type(exc).__name__})") from None
            if info is None:
                return
            budget.header(info.name, info.size)
            if info.isdir():
                continue
            if not info.isfile() or info.issparse():
                raise _refuse(f"{info.name}: not a regular file (links and devices are refused)")
            yield info.name, info.size, lambda i=info: archive.extractfile(i)


def _zip_members(path: Path, display: str, budget, kind: str, max_members: int):
    if not zipfile.is_zipfile(path):
        raise _refuse(f"{display} is not a zip archive, as its name says")
    _zip_entries(path, max_members)  # before ZipFile reads the whole central directory
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError):
        raise _refuse(f"{display}: the zip archive's central directory is damaged") from None
    with archive:
        infos = archive.infolist()
        for info in infos:  # every declared size, before any entry is read
            budget.header(info.filename, info.file_size)
            if info.is_dir():
                continue
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise _refuse(f"{info.filename}: compression method {info.compress_type} (a {kind} zip is stored "
                              "or deflated)")
            if (info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size) or \
                    info.file_size > DEFLATE_MAX_RATIO * info.compress_size + 1024:
                raise _refuse(f"{info.filename}: declares {info.file_size} bytes from {info.compress_size} "
                              "compressed ones, more than its compression can produce")
            if ((info.external_attr >> 16) & 0o170000) not in (0, 0o100000):  # a symlink or device in a zip
                raise _refuse(f"{info.filename}: not a regular file (links and devices are refused)")
        for info in infos:
            if not info.is_dir():
                yield info.filename, info.file_size, lambda i=info: archive.open(i)


def _zip_entries(path: Path, max_members: int) -> None:
    """Refuse a zip whose central directory could list more than max_members entries, from
    its end record (zip64's included) and its own walk, before zipfile builds one ZipInfo
    per entry: the end record's entry count alone can lie (1 declared, a million listed)."""
    with open(path, "rb") as fh:
        try:
            end = zipfile._EndRecData(fh)  # the end record exactly as ZipFile will read it
        except (OSError, struct.error):
            end = None
        if not end:
            raise _refuse("the zip archive has no end record")
        size, entries = end[zipfile._ECD_SIZE], end[zipfile._ECD_ENTRIES_TOTAL]
        if entries >= max_members:
            raise _refuse(f"the archive holds more than {max_members} files")
        if size > max_members * ZIP_ENTRY_MAX:
            raise _refuse(f"the zip archive's central directory takes {size} bytes, more than {max_members} "
                          "files can need")
        start = end[zipfile._ECD_LOCATION] - size  # where ZipFile reads it from
        if end[zipfile._ECD_SIGNATURE] == zipfile.stringEndArchive64:
            start -= zipfile.sizeEndCentDir64 + zipfile.sizeEndCentDir64Locator
        if start < 0:
            raise _refuse("the zip archive's central directory is damaged")
        fh.seek(start)
        directory = fh.read(size)
    count, at = 0, 0
    while at + 46 <= len(directory) and directory[at:at + 4] == b"PK\x01\x02":
        count += 1
        if count >= max_members:
            raise _refuse(f"the zip archive's central directory lists more than {max_members} files (its end "
                          f"record says {entries})")
        name, extra, comment = struct.unpack("<HHH", directory[at + 28:at + 34])
        at += 46 + name + extra + comment


def clean_name(name: str) -> list[str]:
    """A member name's parts; a name that is absolute, climbs (``..``), hides (``.x``) or
    holds other characters is refused."""
    split = [p for p in name.split("/") if p not in ("", ".")]  # "./config.json" (tar -C dir .) is config.json
    if name.startswith("/") or "\\" in name or not split or not all(_NAME.fullmatch(p) for p in split):
        raise _refuse(f"{name!r}: a file name must be relative, of letters, digits, '.', '_' and '-', "
                      "with no part starting with '.' (no '..', no hidden files)")
    return split



def read_chunk(src, name: str) -> bytes:
    try:
        return src.read(1 << 20)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, OSError) as exc:  # truncated, bad CRC
        raise _refuse(f"{name}: damaged ({type(exc).__name__}: {exc})") from None
