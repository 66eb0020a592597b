"""Logging of the services: plain text, or JSON lines (--log-format json) that carry the
service name, the request id (passed with `extra={"request_id": ...}`) and the trace and span
ids of the record's span (`extra=tracing.ids(span)`, else the span current where it was logged)."""

import json
import logging
import sys
from datetime import datetime, timezone

from opentelemetry import trace

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")
_EXTRA_KEYS = ("request_id", "trace_id", "span_id")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "service": self.service,
        }
        line.update(_current_ids())
        line.update({key: getattr(record, key) for key in _EXTRA_KEYS if getattr(record, key, None)})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def _current_ids() -> dict[str, str]:
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x")}


def configure_logging(level: str, log_format: str, service: str) -> None:
    """One stderr handler on the root logger (as logging.basicConfig: a no-op if it has one)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {LOG_FORMATS}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
