"""From extracted text to what a job trains and is scored on: chunks, the hold-out split and
the training examples with their label masks (`build`), fact-bearing sentences and the score
card's probes (`probes`), practice and probe question wording (`questions`), and the shapes
they share (`corpus`). Torch-free: nothing here needs a model (the base model's replayed
answers need one, so they live in worker.training.replay)."""
