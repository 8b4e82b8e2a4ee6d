"""Random tokens and the hashes they are stored as."""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_token() -> str:
    """A random token for a cookie, an API token or a sign-in link (256 bits)."""
    return secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    """What the database keeps instead of the token: its SHA-256, in hex. A random token of
    256 bits needs no salt or slow hash; a password does (see passwords.py)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def same(a: str, b: str) -> bool:
    """Constant-time comparison, for the CSRF token."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"),
                               b.encode("utf-8", "surrogatepass"))
