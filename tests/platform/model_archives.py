"""Model folders as the archives a team uploads (POST /api/models/), built from the
shipped tiny models: the reward model (a classifier) and the policy (a causal LM)."""
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
