"""Each values case rendered once per session with the real helm binary."""
from __future__ import annotations

import pytest

from tests.helm.chart import CASES, template, values_args


@pytest.fixture(scope="session")
def rendered() -> dict[str, str]:
    return {case: template(*values_args(case)) for case in CASES}
