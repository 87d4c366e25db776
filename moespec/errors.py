"""Errors that name a setting: in the library's words for a caller, as a flag on the CLI.

The library never names a command-line flag. Where a message must name the setting to
change, it writes `setting("truncate", "left")`; `str(error)` then reads `truncate='left'`
(the keyword a Python caller passes) and `cli_message(error)` reads `--truncate left`.
"""

import re

_MARK = "\x1f"
_SETTING = re.compile(f"{_MARK}([a-z0-9_]+)=?(.*?){_MARK}")


def setting(name: str, value=None) -> str:
    """A setting (and a value of it) inside a message, rendered by whoever shows it."""
    return f"{_MARK}{name}={'' if value is None else value}{_MARK}"


def library_text(text: str) -> str:
    """The message as the library's caller reads it: keyword=value."""

    def keyword(match) -> str:
        if match[2] == "True":  # a switch
            return f"{match[1]}=True"
        return f"{match[1]}={match[2]!r}" if match[2] else match[1]

    return _SETTING.sub(keyword, text)


def cli_text(text: str) -> str:
    """The message as the command line's user reads it: --flag value."""

    def flag(match) -> str:
        name = "--" + match[1].replace("_", "-")
        return f"{name} {match[2]}" if match[2] not in ("", "True") else name

    return _SETTING.sub(flag, text)


class NamesSettings:
    """A mix-in for exceptions whose message may name settings (see `setting`)."""

    def __init__(self, message: str, *args):
        self.template = message
        super().__init__(library_text(message), *args)


class SettingError(NamesSettings, ValueError):
    """A bad value of a setting the caller chose (bad input: exit status 2 on the CLI)."""


def cli_message(error: BaseException) -> str:
    """An error's one line for the command line: its settings named as flags."""
    template = getattr(error, "template", None)
    return cli_text(template) if template is not None else str(error)
