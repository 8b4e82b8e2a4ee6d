"""The score card's measurements: recall probes, questions, held-out and general perplexity,
before and after training (`evaluate`), and the previous version's scores (`previous`). What
the figures mean for the user (the verdict) is decided in `app.contract.verdict`, shared with the web app."""
