"""One sample in a loader worker: the datasets keyed by (index, epoch), the RAM and device image
caches, each sample's seeded draws and its sample row, collate, ragged pixels, samplers."""
