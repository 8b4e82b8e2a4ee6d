"""One training job from queue to score card: what it starts from and trains on (`inputs`),
its phases without a database (`pipeline`), and its row, heartbeat, cancel and errors
(`run`)."""
