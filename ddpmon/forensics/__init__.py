"""The readers that run after training (and rank 0's live goodput): the merged timeline, its
first failure and verdict, goodput, stragglers, ``compare`` and ``report``. They treat every
run-dir file as hostile; the writers that run inside training are ``ddpmon/recorder/``."""
