"""PyTorch Distributed Checkpoint: the verbs and reader, the columnar .metadata reader that must
agree with the allow-list path, and the writer reshard uses."""
