"""The fuzz suite's fixtures: the saved originals of every artifact kind (tiny models, built once per session) and a
fresh folder per hostile example."""

from __future__ import annotations

import itertools

import pytest
from hostile_artifacts import Artifacts


@pytest.fixture(scope="session")
def arts(tmp_path_factory) -> Artifacts:
    return Artifacts.build(tmp_path_factory.mktemp("originals"))


@pytest.fixture(scope="session")
def fresh(tmp_path_factory):
    """``fresh(label)``: a new path (not yet made) for one example, unique across the session."""
    root, counter = tmp_path_factory.mktemp("examples"), itertools.count()
    return lambda label: root / f"{label}-{next(counter)}"
