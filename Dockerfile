# The API server image: no torch (nodes need it, the server does not).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY registry ./registry
COPY api ./api
COPY cli ./cli
COPY migrations ./migrations
RUN pip install --no-cache-dir ".[server]"
ENV MFSREG_HOME=/var/lib/mfsreg
EXPOSE 8700
CMD ["mfsreg", "serve", "--host", "0.0.0.0", "--port", "8700"]
