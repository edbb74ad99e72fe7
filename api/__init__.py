"""The FastAPI app: routes, pydantic schemas, auth and error mapping; thin over registry/."""
