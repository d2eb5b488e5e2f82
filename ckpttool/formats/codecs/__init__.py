"""Encodings formats share, none a format itself: torch.save archives and the allow-list
unpickler, zstd records, CRC-32 and dtype names."""
