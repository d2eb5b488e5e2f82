"""On-disk formats: one module per format, each turning bytes into frozen dataclasses."""
