"""Alembic environment: runs migrations on the engine the registry hands over (registry/db/schema.py)."""

from alembic import context
from sqlalchemy import create_engine

from mfsreg.registry.db.models import metadata

config = context.config
engine = config.attributes.get("engine")
if engine is None:  # plain `alembic` command line: take the URL from the ini file or MFSREG_DATABASE_URL
    import os

    engine = create_engine(os.environ.get("MFSREG_DATABASE_URL") or config.get_main_option("sqlalchemy.url"))

with engine.connect() as connection:
    # one transaction per migration: one that fails leaves the database at the revision before it
    # (registry/db/schema.py says which), with every migration before it kept
    context.configure(
        connection=connection, target_metadata=metadata, render_as_batch=True, transaction_per_migration=True
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
