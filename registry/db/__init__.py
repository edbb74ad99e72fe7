"""Metadata: SQLAlchemy tables (models.py), the engine (engine.py) and one query module per concern."""
