"""Data for training and benchmarks: the checksummed text corpus (see ``corpus``)."""
