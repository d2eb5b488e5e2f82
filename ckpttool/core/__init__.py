"""Operations on checkpoints: pure planning, then execution."""
