"""Boolean environment variables, read one way everywhere (TANDEM_* service flags and
TANDEM_TRAIN_* training flags alike)."""

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_flag(var: str) -> bool:
    """A store_true flag's environment fallback. A value that is neither spelling of a boolean
    stops the command naming the variable: silently reading `TANDEM_ENFORCE_EAGER=enabled` as
    off would be worse."""
    raw = os.environ.get(var, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise SystemExit(f"{var}={os.environ[var]!r}: expected one of 1, true, yes, on or 0, false, no, off")
