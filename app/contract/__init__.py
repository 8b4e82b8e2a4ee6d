"""What the web app and the worker agree on: one definition of every shape that crosses
the line between them, imported by both sides.

- `tasks`: the Celery task names and queues (one per machine for its train workers);
- `training`: the training methods, the Train form's fields and bounds, the corpus-size
  defaults;
- `scores`: a job's before/after scores (the score card's schema) and the headline rule;
- `verdict`: the score card's verdict in words (the web page, the model card, the CLI);
- `results`: what a finished job leaves besides its scores (dataset stats, training
  figures, export errors);
- `artifacts`: the kinds of download a job makes;
- `machine_profile`: the machine profile's format number and shape;
- `workers`: the hardware a worker registers, its heartbeat and when it counts as offline.

Pure Python and pydantic: no torch, no database, nothing from app.services or app.routes.
"""
