"""Passwords, hashed with argon2id (argon2-cffi's defaults, the RFC 9106 low-memory profile)."""

from __future__ import annotations

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

_hasher = PasswordHasher()
# Verified against when the name is unknown, so that a wrong name takes as long as a
# wrong password and the time of an answer does not say which names exist.
_DUMMY = _hasher.hash("no such user")

MIN_LENGTH = 8


def hash_password(password: str) -> str:
    return _hasher.hash(password)


def verify_password(stored: str | None, password: str) -> bool:
    """Whether `password` matches `stored` (None: the account has no password yet)."""
    try:
        return _hasher.verify(stored or _DUMMY, password) and stored is not None
    except (VerificationError, InvalidHashError):
        return False


def password_problem(password: str) -> str | None:
    """Why a new password is refused, in words; None when it is fine."""
    if len(password) < MIN_LENGTH:
        return f"Choose a password of at least {MIN_LENGTH} characters."
    if len(password) > 1000:
        return "That password is too long."
    return None
