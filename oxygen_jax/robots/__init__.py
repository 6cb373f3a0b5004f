"""Floor 2: what one robot sends and receives: transforms to and from model space, normalisation, tokenizers."""
