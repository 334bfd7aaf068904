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
