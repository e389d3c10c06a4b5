"""A collated batch to an augmented batch on the training device: batches and their prefetch,
the JPEG decoder, the resample, policies, erasing, mixing, and the augmentation's memory bound."""
