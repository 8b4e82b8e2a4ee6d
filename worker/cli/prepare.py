"""`python -m worker.cli.prepare`: convert the embedded model once (the launcher runs this)."""

from app.settings import settings
from worker.training.base_model import resolve_base_model

if __name__ == "__main__":
    print(resolve_base_model(settings.base_model, settings.models_dir), flush=True)
