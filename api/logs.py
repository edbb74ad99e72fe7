"""The server's log lines as JSON (`mfsreg serve --log-format json`), and one access line per
request with what an operator searches by: the request id the client saw, the route, the status,
the time taken, the bytes each way, the token's prefix and the family."""

from __future__ import annotations

import json
import logging
import time

access = logging.getLogger("mfsreg.access")

# the fields an access line carries besides its message (LogRecord attributes set through extra=)
FIELDS = ("request_id", "method", "path", "route", "status", "duration_ms", "bytes_in", "bytes_out", "token", "family")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, and an access line's
    FIELDS."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update({k: getattr(record, k) for k in FIELDS if hasattr(record, k)})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def log_request(scope, status: int, seconds: float, bytes_in: int, bytes_out: int) -> None:
    """The access line of one answered request (at INFO; `serve --log-format json` shows it)."""
    if not access.isEnabledFor(logging.INFO):
        return
    from mfsreg.api.state import principal_of

    state = scope.get("state", {})
    who = principal_of(scope)
    fields = dict(
        request_id=state.get("request_id"),
        method=scope.get("method", ""),
        path=scope.get("path", ""),
        route=getattr(scope.get("route"), "path", None),
        status=status,
        duration_ms=round(seconds * 1000, 2),
        bytes_in=bytes_in,
        bytes_out=bytes_out,
        token=getattr(who, "token_prefix", None),
        family=(scope.get("path_params") or {}).get("family"),
    )
    access.info("%s %s %s", fields["method"], fields["path"], status, extra=fields)


def log_config(base: dict, level: str, form: str) -> dict:
    """uvicorn's logging config for ``form``: text keeps uvicorn's lines (and no second access line);
    json writes every line, the access lines included, as JsonFormatter does."""
    config = json.loads(json.dumps(base))  # a deep copy of plain data
    config["loggers"]["mfsreg"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    if form == "json":
        for name in ("default", "access"):
            config["formatters"][name] = {"()": "mfsreg.api.logs.JsonFormatter"}
        config["loggers"]["uvicorn.access"]["level"] = "WARNING"  # mfsreg.access says more, once
        config["loggers"]["mfsreg.access"] = {"handlers": ["access"], "level": "INFO", "propagate": False}
    else:
        config["loggers"]["mfsreg.access"] = {"handlers": [], "level": "WARNING", "propagate": False}
    return config
