"""Accounts: people (admin / member / viewer), their sessions, API tokens and one-time
sign-in links. Secrets are random (`secrets.token_urlsafe`) and stored only as hashes;
passwords with argon2. The door (app/accounts/door.py) checks every request."""
