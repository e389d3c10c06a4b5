"""A collated batch in, an augmented batch on the training device out."""
