"""One sample in a loader worker: (index, epoch) in, its pixels, sample row and label out."""
