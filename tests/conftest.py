"""Shared fixtures for the whole suite."""
import pytest


@pytest.fixture(scope="session")
def tiny_model_path():
    """The tiny model folder (built once per machine, then cached)."""
    from workers.tinymodel import ensure_tiny_model

    return str(ensure_tiny_model(progress=False))
