"""Checks of user input shared by the apps."""
import re


def contains_nul(value) -> bool:
    """True if a string anywhere in value (keys included) has a NUL character, which
    PostgreSQL cannot store in text or jsonb."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(contains_nul(k) or contains_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(contains_nul(item) for item in value)
    return False


def safe_upload_name(name: str) -> str:
    """An uploaded file's name reduced to a harmless label (its last path part, control
    characters gone, anything but letters, digits and ``._ -`` made ``_``); never used as
    a path. "upload" when nothing is left."""
    base = re.sub(r"[\x00-\x1f\x7f]", "", str(name or "")).replace("\\", "/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._ -]", "_", base).strip(" .")[:200] or "upload"

