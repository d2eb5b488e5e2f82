"""Encodings formats share, none a format itself: torch.save archives and the allow-list
unpickler, zstd records, CRC-32, dtype names, and where a C-ordered chunk's elements go in
its tensor."""
