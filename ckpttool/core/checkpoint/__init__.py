"""What a checkpoint is, whatever its format: the one recogniser (discover), the part each
key belongs to, canonical names, the Hugging Face files beside it, whole tensors over chunks
and their geometry, whether it is whole (structure), non-tensor entries, and whether its names
fit an architecture."""
