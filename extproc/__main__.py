"""``python -m extproc``: run the ext_proc service."""

from __future__ import annotations

import asyncio
import logging
import sys

from extproc.service import serve
from extproc.settings import SettingsError, load_settings

QUIET_AT_DEBUG = ("hpack", "h2")  # third-party loggers kept at INFO or above


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except SettingsError as exc:
        print(f"python -m extproc: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # DEBUG is for the service's own lines: the HTTP/2 libraries would log every header
    # they decode (a dozen lines a request).
    for name in QUIET_AT_DEBUG:
        logging.getLogger(name).setLevel(max(logging.INFO, logging.getLogger().level))
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(settings))
    return uvloop.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
