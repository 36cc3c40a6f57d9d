"""Training: the embedded target's pre-training recipe and (later) the draft-head trainer."""
