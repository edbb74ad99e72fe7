# The API server image: no torch (nodes need it, the server does not).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY registry ./registry
COPY api ./api
COPY cli ./cli
COPY migrations ./migrations
COPY mfsreg ./mfsreg
# gcc builds registry/format/_grouping.c (grouped deltas) and registry/format/_busguard.c (a pushed file cut short
# is refused in one line); setup.py builds them optionally, so the import check fails the image
# instead of letting it write slower, larger deltas (checked from / with -I, so that it imports what
# pip installed, not a copy in /app); gcc goes in the same layer
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install --no-cache-dir ".[server]" \
    && cd / && python -I -c "import mfsreg.registry.format._grouping, mfsreg.registry.format._busguard" && cd /app \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
ENV MFSREG_HOME=/var/lib/mfsreg
EXPOSE 8700
CMD ["mfsreg", "serve", "--host", "0.0.0.0", "--port", "8700"]
