"""Which SQL dialects a test runs on.

The ``db_url`` fixture (tests/conftest.py) runs a test on SQLite and on the Postgres server. A test
whose subject does not depend on the dialect (file formats, pulls, the blob store's faults) takes
``sqlite_only``; the tests of SQL, locks, concurrency and migrations, and the end-to-end round trips,
keep both. Every API test runs on Postgres anyway (tests/server.py).
"""

import pytest

sqlite_only = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
