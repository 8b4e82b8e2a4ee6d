"""The web app's logic: routes parse and render, these modules decide.

Services take a Session and model rows, never commit (the session dependency does),
and raise the errors in `app.services.errors` for the routes to turn into responses."""
