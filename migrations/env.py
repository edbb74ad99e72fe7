"""Alembic environment: runs migrations on the engine the registry hands over (registry/db/schema.py)."""

from alembic import context
from sqlalchemy import create_engine

from mfsreg.registry.db.models import metadata

config = context.config
engine = config.attributes.get("engine")
if engine is None:  # plain `alembic` command line: take the URL from the ini file or MFSREG_DATABASE_URL
    import os

    url = os.environ.get("MFSREG_DATABASE_URL") or config.get_main_option("sqlalchemy.url")
    if not url:  # create_engine would refuse it with "Expected string or URL object, got None"
        raise SystemExit("no database to migrate: set MFSREG_DATABASE_URL or sqlalchemy.url in the ini file")
    engine = create_engine(url)

with engine.connect() as connection:
    # one transaction per migration: one that fails leaves the database at the revision before it
    # (registry/db/schema.py says which), with every migration before it kept
    context.configure(
        connection=connection, target_metadata=metadata, render_as_batch=True, transaction_per_migration=True
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
