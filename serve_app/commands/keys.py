"""``meshctl hash-key``: the SHA-256 digest of an API key, what ``tenants[].api_keys_sha256``
stores (:func:`serve_app.tenancy.keys.hash_api_key`)."""

from __future__ import annotations

import argparse
import sys

from serve_app.commands.base import UsageError
from serve_app.tenancy.keys import hash_api_key


def hash_key_command(args: argparse.Namespace) -> int:
    """``meshctl hash-key [KEY]``: print the key's SHA-256 hex digest (the key from stdin
    when not given); 0.

    Raises:
        UsageError: the key is empty, or starts or ends with whitespace.
    """
    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key.strip():
        raise UsageError("the key is empty: pass the API key as the argument, or as one line "
                         "on stdin (`meshctl hash-key < keyfile`)")
    if key != key.strip():
        raise UsageError("the key starts or ends with whitespace, which the router strips "
                         "from `Authorization: Bearer <key>`: hash the key without it")
    print(hash_api_key(key))
    return 0


def add_hash_key(sub) -> None:
    """Add ``hash-key`` to meshctl's subcommands (``sub``: argparse's subparsers)."""
    p = sub.add_parser("hash-key", help="print the SHA-256 digest of an API key")
    p.add_argument("key", nargs="?", help="the key (default: read one line from stdin)")
