# The suite's reliability summary: tests record into tests.reliability, this prints it.
from tests.reliability import pytest_terminal_summary  # noqa: F401 (a pytest hook)
