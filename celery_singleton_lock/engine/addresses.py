"""Redis URLs for people: a URL with its passwords masked (:func:`redact_url`), and a ``;``-separated
list of URLs split where a new URL begins (:func:`split_url_list`; a ``;`` inside a password stays).

Engine code: every log line and error that names a server goes through :func:`redact_url`.
"""

from __future__ import annotations

from urllib.parse import unquote_plus


def redact_url(url: str) -> str:
    """The URL with every password replaced by ``***``, for logs and errors.

    Masked: the userinfo password (the user name stays, so an operator can tell
    accounts apart), the ``password``, ``username`` and any other ``*password*``
    query parameter (redis-py reads credentials from the query string too), in
    each part of a ``;``-separated list (Sentinel, failover brokers). A URL that
    no parser reads as its author meant (a raw ``#``, ``?`` or ``/`` in the
    password) is cut to its scheme rather than shown half-masked.
    """
    return ";".join(_redact_one(part) for part in split_url_list(url))


def split_url_list(text: str) -> list[str]:
    """``"a://x;b://y"`` -> ``["a://x", "b://y"]``; a ``;`` not followed by ``scheme://`` stays inside its URL."""
    pieces = text.split(";")
    out = [pieces[0]]
    for piece in pieces[1:]:
        scheme, sep, _ = piece.lstrip().partition("://")
        if sep and scheme and scheme[0].isalpha() and all(c.isalnum() or c in "+-." for c in scheme):
            out.append(piece)
        else:
            out[-1] += ";" + piece
    return out


def _is_secret_query_name(raw_name: str) -> bool:
    name = unquote_plus(raw_name).strip().lower()
    return name == "username" or "password" in name


def _redact_one(url: str) -> str:
    """One URL: mask the userinfo password and the secret query parameters, keep the rest as written."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # the authority ends at the first '/', '?' or '#' (as urlsplit, redis-py and kombu read it)
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    userinfo, at, hostport = authority.rpartition("@")
    path, qmark, query = tail.partition("?")
    if "#" in tail or "@" in path or any("@" in seg.partition("=")[0] for seg in query.split("&")):
        # a password with a raw '#', '/' or '?' in it: the parsers cut the URL there, and the
        # rest of the password lands in the path, query or fragment. Show nothing of it.
        return f"{scheme}://***"
    if at and ":" in userinfo:
        authority = f"{userinfo.partition(':')[0]}:***@{hostport}"
    if qmark:
        segments = []
        for seg in query.split("&"):
            name, eq, _ = seg.partition("=")
            segments.append(f"{name}=***" if eq and _is_secret_query_name(name) else seg)
        query = "&".join(segments)
    return f"{scheme}://{authority}{path}{qmark}{query}"
