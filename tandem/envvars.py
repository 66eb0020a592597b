"""Boolean environment variables, read one way everywhere (TANDEM_* service flags and
TANDEM_TRAIN_* training flags alike)."""

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class BadFlag:
    """A boolean variable of another spelling: false, and reported only by the command that
    reads it (every subcommand's defaults are made when the parser is built; a bad
    TANDEM_TRAIN_QUICK must not stop `tandem health`)."""

    def __init__(self, var: str, raw: str):
        self.message = f"{var}={raw!r}: expected one of 1, true, yes, on or 0, false, no, off"

    def __bool__(self) -> bool:
        return False


def env_flag(var: str) -> bool | BadFlag:
    """A store_true flag's environment fallback (see check_flags)."""
    raw = os.environ.get(var, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return BadFlag(var, raw)


def check_flags(args) -> None:
    """Stops the command if one of its flags fell back to a badly spelt variable: silently
    reading `TANDEM_ENFORCE_EAGER=enabled` as off would be worse."""
    for value in vars(args).values():
        if isinstance(value, BadFlag):
            raise SystemExit(value.message)


def env_default(name: str, default):
    """TANDEM_<NAME> from the environment, cast to the default's type (None: as it is)."""
    raw = os.environ.get(f"TANDEM_{name.upper()}")
    if raw is None:
        return default
    return type(default)(raw) if default is not None else raw
