"""codecs."""
