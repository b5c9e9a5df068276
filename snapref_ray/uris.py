"""Paths and URIs as the project's files name them: local paths and s3:// URIs alike.

A spec, a manifest or a model folder may name other files relative to itself; `resolve_relative`
resolves them against `base_of(the naming file)`, for local folders and s3:// key prefixes with the
same rule. Pure string work: nothing here touches a file system or the network.
"""

from __future__ import annotations

import os
import posixpath


def is_remote(path: str | os.PathLike | None) -> bool:
    """Whether `path` is a URI with a scheme (s3://, http://, ...), i.e. not a local path."""
    return path is not None and "://" in os.fspath(path)


def base_of(uri: str) -> str:
    """The folder (local, absolute) or key prefix (s3://bucket/prefix/) of a file."""
    uri = uri.removeprefix("file://")
    if is_remote(uri):
        return uri.rsplit("/", 1)[0] + "/"
    return os.path.dirname(os.path.abspath(os.path.expanduser(uri)))


def resolve_relative(path: str, base: str) -> str:
    """Resolve `path` against `base` (a `base_of`); URIs and absolute paths stay as they are.

    Local results are absolute and normalised; s3:// results are normalised key paths. A relative
    path that climbs above an s3:// bucket's root is an error (there is nothing there).
    """
    if is_remote(path):
        return path
    base = base.removeprefix("file://")
    expanded = os.path.expanduser(path)
    if os.path.isabs(expanded):
        return os.path.normpath(expanded)
    if not is_remote(base):
        return os.path.normpath(os.path.join(base, expanded))
    scheme, rest = base.split("://", 1)
    bucket, _, prefix = rest.partition("/")
    key = posixpath.normpath(posixpath.join(prefix, path))
    if key == ".." or key.startswith("../"):
        raise ValueError(f"relative path {path!r} climbs above the bucket root of {base}")
    return f"{scheme}://{bucket}/{key}"
