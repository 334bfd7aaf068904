"""Model folders as the archives a team uploads (POST /api/models/), built from the
shipped tiny models: the reward model (a classifier) and the policy (a causal LM)."""
import gzip
import io
import tarfile
import zipfile
from pathlib import Path

from django.core.files.uploadedfile import SimpleUploadedFile

ASSETS = Path(__file__).resolve().parents[2] / "workers" / "assets"
RM, POLICY = ASSETS / "tiny-rm", ASSETS / "tiny"


def folder_files(folder: Path) -> dict[str, bytes]:
    """The folder's files by name (FluxRL's own bootstrap record left out)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "fluxrl_bootstrap.json"}


def tar_gz(files: dict[str, bytes], top: str = "", links: dict[str, str] | None = None) -> bytes:
    """A .tar.gz of ``files`` under ``top``, with symlinks ``links`` (name -> target)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body in files.items():
            info = tarfile.TarInfo(top + name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(top + name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def zipped(files: dict[str, bytes], top: str = "") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, body in files.items():
            archive.writestr(top + name, body)
    return buf.getvalue()


def tiny_rm_upload() -> SimpleUploadedFile:
    """The tiny reward model's folder as an uploaded .tar.gz."""
    return SimpleUploadedFile("tiny-rm.tar.gz", tar_gz(folder_files(RM)))


def tar(files: dict[str, bytes], compression: str = "") -> bytes:
    """A tar of ``files``, compressed with ``compression`` ("", "gz", "bz2", "xz")."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compression}") as archive:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            archive.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def zeros_gz(mib: int) -> bytes:
    """``mib`` MiB of zeros as a gzip stream of ~1 KB per MiB: one member, repeated (a gzip
    file may hold many members, read as one stream). Cheap to build, slow to read."""
    one = gzip.compress(bytes(1 << 20), compresslevel=9, mtime=0)
    return one * mib


def declared_member_bomb(mib: int, name: str = "model.safetensors") -> bytes:
    """A .tar.gz whose first header declares a ``mib`` MiB member, and whose stream really
    holds that many zeros: skipping the member decompresses all of them."""
    info = tarfile.TarInfo(name)
    info.size = mib << 20
    return gzip.compress(info.tobuf(format=tarfile.GNU_FORMAT), mtime=0) + zeros_gz(mib)


def pax_header_bomb(mib: int) -> bytes:
    """A .tar.gz whose first header is a pax record declaring ``mib`` MiB (tarfile reads a pax
    record into memory whole), backed by that many zeros."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, mib << 20
    return gzip.compress(info.tobuf(format=tarfile.USTAR_FORMAT), mtime=0) + zeros_gz(mib)
