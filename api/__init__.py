"""The FastAPI app: routes, auth and error mapping, over the wire documents of registry/documents.py; thin over registry/."""
