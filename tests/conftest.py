import os

# The suite's reliability summary: tests record into tests.reliability, this prints it.
from tests.reliability import pytest_terminal_summary  # noqa: F401 (a pytest hook)

# Routers the suite starts as processes (`tandem up`, `tandem router`) open no HTTP port unless a
# test gives one: the default 8000 would collide between routers, or with the machine's own.
os.environ.setdefault("TANDEM_HTTP_PORT", "0")
