"""``python -m extproc.events.keys DIR NAME``: write a CURVE key pair for the event plane.

Writes ``DIR/NAME.key`` (the public key: copy it to the other side) and
``DIR/NAME.key_secret`` (the secret key, mode 0600: keep it where only this process reads
it). One pair for the extproc (the server), one per publisher or one shared by a fleet;
the extproc admits the publishers whose ``.key`` files are in its publishers directory.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import zmq.auth


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m extproc.events.keys",
        description="Write a ZeroMQ CURVE key pair: DIR/NAME.key (public) and "
        "DIR/NAME.key_secret (secret).",
    )
    parser.add_argument("dir", metavar="DIR", help="directory to write to (created if missing)")
    parser.add_argument("name", metavar="NAME", help="file name without suffix, e.g. extproc")
    args = parser.parse_args(argv)
    name = str(args.name)
    if not name or "/" in name or name.startswith("."):
        parser.error(f"NAME {name!r} must be a plain file name (no '/', not starting with '.')")
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (folder / (name + suffix)).exists():
            parser.error(f"{folder / (name + suffix)} exists; not overwriting a key")
    public, secret = zmq.auth.create_certificates(folder, name)
    os.chmod(secret, 0o600)
    print(f"public key: {public}\nsecret key: {secret}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
