"""HTTP routes: `pages` (HTML and htmx fragments) and `api` (a small JSON API)."""
