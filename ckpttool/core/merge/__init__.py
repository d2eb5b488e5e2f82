"""merge and everything only merges use: the plan (pure, a leaf), the engine that fills
planned files, the operation, optimizer.json, resumable pieces, the several-process machinery
(partition, multihost, distributed) and merge --all (sweep, receipts)."""
